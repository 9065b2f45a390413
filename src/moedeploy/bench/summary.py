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
