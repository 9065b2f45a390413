"""How far apart a backend's --repeat runs are, and when that says the machine was busy.

Rule: for decode tokens/s and prefill ms, spread = (max - min) / median over the timed
runs. On an idle machine runs of the same work land within a few percent of each other;
above BUSY_SPREAD (10%) something else was using the cores or the memory bus, and the
medians deserve a second run on a quieter machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

BUSY_SPREAD = 0.10
#: The bandwidth probes of one run (the machine's, then each worker's after its timed runs)
#: further apart than this: "of bound" then measures the probe as much as the backend.
PROBE_SPREAD = 0.20
# The figures whose spread is reported: the raw result's key -> the name users read.
SPREAD_METRICS = {"decode_tokens_per_s": "decode tokens/s", "prefill_ms": "prefill ms"}


@dataclass(frozen=True)
class Spread:
    """Min, median and max of one figure over the timed runs."""

    low: float
    median: float
    high: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        if not samples:
            raise ValueError("a spread needs at least one run")
        return cls(min(samples), statistics.median(samples), max(samples))

    @property
    def relative(self) -> float:
        """(max - min) / median: how far apart the runs are, as a fraction of the reported figure."""
        return (self.high - self.low) / self.median if self.median else 0.0

    def as_dict(self) -> dict[str, float]:
        """Unrounded, so the printed median matches the table's to the last digit."""
        return {"min": self.low, "median": self.median, "max": self.high, "relative": self.relative}


def spreads(result: dict) -> dict[str, Spread]:
    """Each reported figure's spread, from a worker's result (which keeps every run as `<key>_all`)."""
    return {key: Spread.of(result[f"{key}_all"]) for key in SPREAD_METRICS}


def busy_warning(backend: str, figures: dict[str, Spread], runs: int) -> str | None:
    """One line when any figure spread more than BUSY_SPREAD over its runs, else None."""
    wide = [f"{SPREAD_METRICS[key]} {s.relative:.0%}" for key, s in figures.items() if s.relative > BUSY_SPREAD]
    if runs < 2 or not wide:
        return None
    return (f"{backend}: runs spread {', '.join(wide)} ((max - min) / median over {runs} runs, "
            f"above {BUSY_SPREAD:.0%}): the machine was likely busy; rerun when it is idle")


def probes_warning(probes_gbs: Sequence[float], rounds: int) -> str | None:
    """One line when the run's bandwidth probes disagree by more than PROBE_SPREAD. Each row's
    "of bound" divides by its own workers' probe, so on a host whose memory bus other tenants
    share (probes of 31 and 59 GB/s in one run were seen) a backend can read 42% in one run
    and 77% in the next at the same speed: then only backends' ratios to each other mean much,
    and best paired by round (which needs rounds)."""
    if len(probes_gbs) < 2:
        return None
    s = Spread.of(probes_gbs)
    if s.relative <= PROBE_SPREAD:
        return None
    return (f"the run's memory-bandwidth probes read {s.low:.1f} to {s.high:.1f} GB/s (median {s.median:.1f}, "
            f"spread {s.relative:.0%}, above {PROBE_SPREAD:.0%}): 'of bound' moves with each row's own probe; "
            + ("compare backends by their paired decode ratio" if rounds > 1 else
               "rerun with --rounds 3 and compare backends by their paired decode ratio")
            + ", or rerun when the machine is idle")
