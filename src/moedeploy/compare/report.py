"""Render report.json's dict as Markdown and as one self-contained HTML page."""

from __future__ import annotations

from importlib import resources
from typing import Any

import numpy as np

from moedeploy.compare import plots


def fmt(value, spec: str = "%.2e") -> str:
    """Numbers for people: NaN/Inf (or a missing value) shown as such, never a crash."""
    if value is None:
        return "n/a"
    return spec % value if np.isfinite(value) else str(value)


def _flips(module: dict) -> str:
    return f"{module['routing_flips']}/{module['routed_tokens']}" if "routing_flips" in module else ""


def routing_note(report: dict[str, Any]) -> str | None:
    """Why an MoE layer diverged, when the cause is tokens routed to other experts."""
    flips = report.get("first_divergent_routing_flips")
    if not flips:
        return None
    return (f"{flips} token(s) took a different top-k expert set in `{report['first_divergent_module']}` "
            "although its router logits agree within tolerance: near-ties that round differently in this "
            "precision. Top-k routing is discontinuous, so such tokens differ by a whole expert's output.")


def _mark(passed: bool) -> str:
    return "pass" if passed else "**FAIL**"


def render_markdown(report: dict[str, Any]) -> str:
    a = report["artifact"]
    lines = [
        f"# Accuracy report: `{a['name']}` — {'PASS' if report['passed'] else 'FAIL'}",
        "",
        f"{a['kind']}, {a['dtype']}, opset {a['opset']}; {report['iterations']} iterations, seed "
        f"{report['seed']}; reference: eager PyTorch. Rule: |backend - eager| <= atol + rtol * |eager|.",
        "",
    ]
    if report.get("first_divergent_layer"):
        lines += [f"First divergent layer: `{report['first_divergent_layer']}` "
                  f"(module `{report['first_divergent_module']}`)", ""]
        if note := routing_note(report):
            lines += [note, ""]
    for c in report["comparisons"]:
        lines += [
            f"## {c['backend']} vs {c['reference']}: {_mark(c['passed'])}",
            "",
            "| output | max abs | mean abs | p99 abs | max rel | cosine | atol | rtol | result |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for name, s in c["outputs"].items():
            if s.get("shape_mismatch"):
                lines.append(f"| `{name}` | shape mismatch | | | | | | | **FAIL** |")
                continue
            lines.append(
                f"| `{name}` | {fmt(s['max_abs'])} | {fmt(s['mean_abs'])} | {fmt(s['p99_abs'])} | {fmt(s['max_rel'])} "
                f"| {fmt(s['cosine'], '%.8f')} | {s['atol']:.0e} | {s['rtol']:.0e} | {_mark(s['passed'])} |"
            )
        if c.get("layerwise"):
            lines += ["", "Layer-wise (first iteration):", "", "| module | max abs | routing flips | result |",
                      "|---|---:|---:|---|"]
            lines += [f"| `{m['module']}` | {fmt(m['max_abs'])} | {_flips(m)} | {_mark(m['passed'])} |"
                      for m in c["layerwise"]["modules"]]
        lines.append("")
    return "\n".join(lines)


def render_html(report: dict[str, Any], errors: dict[str, dict[str, np.ndarray]]) -> str:
    import jinja2

    view = dict(report)
    view["comparisons"] = []
    for c in report["comparisons"]:
        c = dict(c)
        errs = errors.get(c["backend"], {})
        if errs:
            tolerances = {name: max(s["atol"], 1e-12) for name, s in c["outputs"].items()}
            c["histogram"] = plots.error_histograms(errs, tolerances, f"{c['backend']} vs eager PyTorch")
        if c.get("layerwise") and c["layerwise"]["modules"]:
            atol = next(iter(c["outputs"].values()))["atol"]
            c["layer_plot"] = plots.layer_errors(c["layerwise"]["modules"], atol, "max |error| per module, execution order")
        view["comparisons"].append(c)
    template_text = resources.files("moedeploy.compare").joinpath("templates/report.html.j2").read_text()
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    env.undefined = jinja2.ChainableUndefined  # optional keys (histogram, layer_plot) may be absent
    return env.from_string(template_text).render(r=view, fmt=fmt, flips=_flips, routing_note=routing_note(report))
