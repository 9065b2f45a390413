"""The plain-text lines `moedeploy bench` prints beside its table, built from the report alone."""

from __future__ import annotations

import shlex
from typing import Any


def spread_lines(report: dict[str, Any]) -> list[str]:
    """min / median / max of decode tokens/s and prefill ms per backend (one line for a single run)."""
    settings = report["settings"]
    runs = settings["repeat"] * settings.get("rounds", 1)
    if not report["spread"]:
        return []
    if runs < 2:
        return ["one run per backend: no spread to show (--repeat 3 or more shows min / median / max)"]
    rounds = f" ({settings['rounds']} rounds of {settings['repeat']})" if settings.get("rounds", 1) > 1 else ""
    lines = [f"min / median / max over {runs} runs{rounds}:"]
    for name, s in report["spread"].items():
        d, p = s["decode_tokens_per_s"], s["prefill_ms"]
        lines.append(f"  {name}: decode {d['min']:.1f} / {d['median']:.1f} / {d['max']:.1f} tokens/s, "
                     f"prefill {p['min']:.1f} / {p['median']:.1f} / {p['max']:.1f} ms")
    return lines


def paired_text(paired: dict[str, Any]) -> str:
    """A ratio paired by round (bench.api.paired_ratio) as "x0.92, rounds 0.95 / 0.90 / 0.92"."""
    return f"x{paired['median']:.2f}, rounds {' / '.join(f'{r:.2f}' for r in paired['by_round'])}"


def readable_size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def cache_line(report: dict[str, Any]) -> str | None:
    """Where a preset's export is cached, its size, and how to remove or move it (None for a user's folder)."""
    cache = report["cache"]
    if cache is None:
        return None
    done = "exported into" if cache["written"] else "read from"
    quantized = cache.get("quantized", [])
    paths = " ".join(shlex.quote(str(c["path"])) for c in [cache, *quantized])
    beside = (f", its quantized exports beside it ({readable_size(sum(q['bytes'] for q in quantized))})"
              if quantized else "")
    return (f"the {report['settings']['target']!r} decoder was {done} the cache {cache['path']} "
            f"({readable_size(cache['bytes'])}){beside}; remove {'them' if quantized else 'it'} with `rm -r {paths}`, "
            "or set MOEDEPLOY_CACHE to keep it elsewhere")


#: paired speedups this close to 1 are reported as no clear difference
MOE_PATH_TIE = 0.03


def moe_path_line(report: dict[str, Any]) -> str | None:
    """Which fp32 MoE path decoded faster in this run, where bench timed both (ort-gqa with its
    experts cut into pieces, the default, and ort-gqa-experts, the If per expert), and how to make
    it the path: the faster one depends on the machine (runtime/moe_tuning.py)."""
    from moedeploy.bench.api import MOE_PATH_PAIR
    from moedeploy.runtime.ort import MOE_PATH_ENV

    split, experts = MOE_PATH_PAIR
    ratio = report["ratios"].get(f"{split}_vs_{experts}")
    if ratio is None:
        return None
    paired = ratio.get("decode_speedup_paired")
    speedup = paired["median"] if paired else ratio["decode_speedup"]
    how = "paired by round" if paired else "one round: rerun with --rounds 3 before choosing"
    if abs(speedup - 1) < MOE_PATH_TIE:
        return (f"MoE path: no clear difference here between the default split ({split}) and the If per expert "
                f"({experts}): x{speedup:.2f} ({how})")
    if speedup < 1:
        timed = report.get("settings", {}).get("artifact", "ARTIFACT")  # a preset's or checkpoint's: bench's cache
        return (f"MoE path: the If per expert ({experts}) decoded x{1 / speedup:.2f} the default's speed here ({how}); "
                f"`moedeploy tune {timed}` measures it on that artifact and makes the faster its path on this machine "
                f"({MOE_PATH_ENV}=experts: every CPU session's)")
    return (f"MoE path: the default, experts cut into one piece per thread ({split}), decoded x{speedup:.2f} the If "
            f"per expert's speed here ({how}); keep it")
