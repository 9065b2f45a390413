"""Render report.json's dict as Markdown and as one self-contained HTML page."""

from __future__ import annotations

import functools
from collections.abc import Callable
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


Quote = Callable[[str], str]


def backticks(name: str) -> str:
    return f"`{name}`"


def plain(name: str) -> str:
    return name


def first_divergent_stats(report: dict[str, Any]) -> dict[str, Any] | None:
    """The layer-wise statistics of the first divergent module."""
    for c in report["comparisons"]:
        for m in (c.get("layerwise") or {}).get("modules", []):
            if m["module"] == report.get("first_divergent_module"):
                return m
    return None


def divergence_note(report: dict[str, Any], quote: Quote = backticks) -> str | None:
    """What the layer-wise localisation found, in words that fit the verdict.

    On a failing comparison it is where the divergence starts. When the outputs pass, the
    module named is an intermediate value out of its own tolerance that the outputs do not
    inherit beyond theirs; without saying so, a PASS badge above a red layer reads as a
    contradiction.
    """
    module = report.get("first_divergent_module")
    if not module:
        return None
    if not report["passed"]:
        return f"First divergent layer: {quote(report['first_divergent_layer'])} (module {quote(module)})"
    stats = first_divergent_stats(report) or {}
    measured = (f" (max abs {fmt(stats.get('max_abs'))} with atol {stats['atol']:.0e}, rtol {stats['rtol']:.0e})"
                if "atol" in stats else "")
    return (f"Outputs within tolerance. Inside the network, {quote(module)} is the first module out of its own "
            f"tolerance on the first input{measured}; the outputs stay within theirs, so the comparison passes.")


def routing_note(report: dict[str, Any], quote: Quote = backticks) -> str | None:
    """Why the first divergent module diverged, when every token out of tolerance there took
    another top-k expert set at a near-tie (router logits agreeing; see layerwise.routing_explanation)."""
    flips = report.get("first_divergent_routing_flips")
    if not flips:
        return None
    module = report["first_divergent_module"]
    moes = report.get("first_divergent_routing_modules") or [module]
    where = "there" if moes == [module] else f"upstream, in {', '.join(quote(m) for m in moes)},"
    return (f"The {flips} token(s) out of tolerance in {quote(module)} took a different top-k expert set {where} "
            "although the router logits agree within tolerance: near-ties that round differently in this "
            "precision. Top-k routing is discontinuous, so such tokens differ by a whole expert's output.")


def _checkpoint_clause(report: dict[str, Any]) -> str:
    """Where the reference came from when it is not where the manifest says (compare --checkpoint)."""
    moved = report.get("reference_checkpoint")
    return f" from --checkpoint {moved} (weights fingerprint verified)" if moved else ""


def _mark(passed: bool) -> str:
    return "pass" if passed else "**FAIL**"


QUANTIZATION_COLUMNS = ("KL mean", "KL max", "top-1", "max error", "greedy", "prefix")


def quantization_intro(q: dict[str, Any]) -> str:
    """What the quantization section measured and by which thresholds it judged."""
    t = q["thresholds"]
    formats = f"; {q['formats']}" if q.get("formats") else ""  # (reports from before session 17 have none)
    return (f"int{q['bits']} (the narrowest bit width{formats}), against {q['reference']}: next-token distributions on a "
            f"{q['stream_tokens']}-token stream, greedy agreement over {q['greedy_new_tokens']} new tokens from its "
            f"first {q['greedy_prompt_tokens']} (greedy: the fraction that agree; prefix: how many before the first "
            f"difference); max error: the largest logit difference. Each ONNX Runtime backend at accuracy level 0 "
            f"(the dequantized products in float: the format's own cost) and, as '<backend> level 4', with int8 "
            f"activations as `moedeploy serve` runs it. Pass: KL mean <= {t['kl_mean']:g} and top-1 >= {t['top1']:g}.")


def quantization_cells(m: dict[str, Any]) -> list[str]:
    """One backend's row of the quantization table, in QUANTIZATION_COLUMNS order."""
    return [fmt(m["kl_mean"], "%.2e"), fmt(m["kl_max"], "%.2e"), fmt(m["top1"], "%.3f"),
            fmt(m["max_logit_error"], "%.3f"), fmt(m["greedy_agreement"], "%.3f"), str(m["greedy_prefix"])]


def inflight_text(f: dict[str, Any]) -> str:
    """One paragraph: what the in-flight batching check ran and what it found."""
    if f.get("skipped"):
        return f"Not run: {f['skipped']}."
    lengths = ", ".join(map(str, f["prompt_lengths"]))
    mixed = f.get("steps_with_a_prompt_beside_decoding_rows")
    partial = f.get("prompt_chunks_before_the_last")
    joined = (f"joined one per step, prefilled in {mixed} steps that decoded the running rows"
              if mixed is not None else "joined one per decode step")
    if partial:
        joined += f" ({partial} prompt chunks fed before their prompt's last, chunked prefill)"
    return (f"{f['sequences']} prompts of {lengths} tokens {joined}, each ran {f['decode_steps']} "
            f"steps beside the others at its own position (up to {f['most_rows_in_a_step']} rows in one step; the "
            f"first to finish left and the last row moved into its place), seeded tokens fed; {f['positions']} logit "
            f"rows against eager PyTorch on each whole sequence: max abs error {fmt(f['max_abs_error'])}, "
            f"{100 * f['within_tolerance']:.2f}% within atol {f['atol']:.0e} + rtol {f['rtol']:.0e} * |eager|.")


def _inflight_markdown(f: dict[str, Any] | None) -> list[str]:
    if not f:
        return []
    return [f"## In-flight batching ({f['backend']}): {_mark(f['passed'])}", "", inflight_text(f), ""]


def _quantization_markdown(q: dict[str, Any] | None) -> list[str]:
    if not q:
        return []
    lines = [f"## Quantization accuracy: {_mark(q['passed'])}", "", quantization_intro(q), "",
             "| backend | " + " | ".join(QUANTIZATION_COLUMNS) + " | result |",
             "|---|" + "---:|" * len(QUANTIZATION_COLUMNS) + "---|"]
    for backend, m in q["backends"].items():
        lines.append(f"| {backend} | " + " | ".join(quantization_cells(m)) + f" | {_mark(m['passed'])} |")
    return [*lines, ""]


def render_markdown(report: dict[str, Any]) -> str:
    a = report["artifact"]
    lines = [
        f"# Accuracy report: `{a['name']}` — {'PASS' if report['passed'] else 'FAIL'}",
        "",
        f"{a['kind']}, {a['dtype']}, opset {a['opset']}; {report['iterations']} iterations, seed "
        f"{report['seed']}; reference: eager PyTorch{_checkpoint_clause(report)}. "
        "Rule: |backend - eager| <= atol + rtol * |eager|.",
        "",
    ]
    if note := divergence_note(report):
        lines += [note, ""]
        if why := routing_note(report):
            lines += [why, ""]
    for c in report["comparisons"]:
        lines += [
            f"## {c['backend']} vs {c['reference']}: {_mark(c['passed'])}",
            "",
            *([f"Path: {c['path']}.", ""] if c.get("path") else []),
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
    lines += _inflight_markdown(report.get("inflight"))
    lines += _quantization_markdown(report.get("quantization"))
    return "\n".join(lines)


def render_html(report: dict[str, Any], values: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]) -> str:
    """report.html; `values`: backend -> output -> (eager, backend) arrays, for the histograms."""
    view = dict(report)
    view["comparisons"] = []
    for c in report["comparisons"]:
        c = dict(c)
        pairs = {name: pair for name, pair in values.get(c["backend"], {}).items()
                 if not c["outputs"].get(name, {}).get("shape_mismatch")}
        if pairs:
            tolerances = {name: (c["outputs"][name]["atol"], c["outputs"][name]["rtol"]) for name in pairs}
            c["histogram"] = plots.error_histograms(pairs, tolerances, f"{c['backend']} vs eager PyTorch")
        if c.get("layerwise") and c["layerwise"]["modules"]:
            c["layer_plot"] = plots.layer_errors(
                c["layerwise"]["modules"], "worst error per module relative to its tolerance, execution order (first input)"
            )
        view["comparisons"].append(c)
    return _html_template().render(
        r=view, fmt=fmt, flips=_flips, quantization_intro=quantization_intro, quantization_cells=quantization_cells, inflight_text=inflight_text,
        quantization_columns=QUANTIZATION_COLUMNS, checkpoint_clause=_checkpoint_clause(report), divergence_note=_html_note(divergence_note(report, _code)),
        routing_note=_html_note(routing_note(report, _code)),
    )


@functools.cache
def _html_template():
    """report.html's template, compiled once a process (moedeploy all renders 15 reports)."""
    import jinja2

    template_text = resources.files("moedeploy.compare").joinpath("templates/report.html.j2").read_text()
    env = jinja2.Environment(autoescape=True, undefined=jinja2.ChainableUndefined)  # histogram, layer_plot may be absent
    return env.from_string(template_text)


def _code(name: str) -> str:
    from markupsafe import escape

    return f"<code>{escape(name)}</code>"


def _html_note(text: str | None):
    """A note whose module names are already <code>-quoted and escaped; the rest is our own text."""
    from markupsafe import Markup

    return Markup(text) if text else None
