"""Plots for the HTML report, rendered to inline PNG data URIs (no external requests).

Both plots show error as a fraction of the element's own tolerance,
|backend - eager| / (atol + rtol * |eager|): that is the pass rule itself (an element passes
when the fraction is at most 1), so the line drawn at 1 is exactly where elements fail. A
single atol line on an absolute-error axis would misplace every element whose |eager| makes
its rtol share count. Exact zeros have no logarithm: they are counted in words, not drawn.
"""

from __future__ import annotations

import base64
import io

import numpy as np

MAX_PANELS = 4  # histograms per comparison; the rest are named as not shown
BLUE, RED, GREEN, GREY = "#4477aa", "#cc3311", "#228833", "#777777"
LIMIT_LABEL = "limit: atol + rtol·|eager| (fails right of it)"
RATIO_LABEL = "log10 of |backend − eager| / (atol + rtol·|eager|)"
EMPTY_RANGE = (-6.0, 1.0)  # x range (log10) of a panel with nothing to bin: the limit line stays in view


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _to_data_uri(fig) -> str:
    """The figure as an inline PNG. Every figure here is laid out by matplotlib's constrained
    layout, which already fits titles, rotated labels and the outside legend inside it; savefig's
    bbox_inches="tight" on top drew each figure twice, a third of a report's rendering time."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    _figure().close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _wide_enough(fig, text, share: int = 1, margin: float = 0.3) -> None:
    """Widen `fig` so that each of `share` equal columns holds `text` (a title) whole, plus
    `margin` inches: the constrained layout fits the axes around a title, never the figure
    around it, so a long title was cut at the canvas's edges. Measuring a text needs no drawing
    of the figure."""
    needed = share * (text.get_window_extent(fig.canvas.get_renderer()).width / fig.dpi + margin)
    if needed > fig.get_figwidth():
        fig.set_figwidth(needed)


def tolerance_fractions(eager: np.ndarray, backend: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    """|backend - eager| / (atol + rtol * |eager|) per element: 0 exact, <= 1 pass, inf when a
    nonzero error meets a zero allowance, NaN when either side is NaN."""
    ref = np.asarray(eager, dtype=np.float64).ravel()
    err = np.abs(np.asarray(backend, dtype=np.float64).ravel() - ref)
    allowed = atol + rtol * np.abs(ref)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(err == 0, 0.0, err / allowed)


def _worst(fractions: np.ndarray) -> float:
    """The largest fraction, NaN counted as the worst (it fails)."""
    return float(np.inf) if np.isnan(fractions).any() else float(fractions.max(initial=0.0))


def _counts_text(fractions: np.ndarray) -> tuple[str, bool]:
    """The elements a log axis cannot show (exact, NaN) and those over the limit, in words."""
    exact = int((fractions == 0).sum())
    nan = int(np.isnan(fractions).sum())
    over = int((fractions > 1).sum())  # inf included; NaN compares False
    lines = [f"{exact:,} of {fractions.size:,} exact (error 0)"] if exact else []
    if exact < fractions.size:
        lines.append(f"worst: {_worst(fractions):.2g} of the limit")
    if over:
        lines.append(f"{over:,} over the limit")
    if nan:
        lines.append(f"{nan:,} NaN")
    return "\n".join(lines), bool(over or nan)


def _histogram_panel(ax, name: str, fractions: np.ndarray, atol: float, rtol: float) -> None:
    drawable = fractions[np.isfinite(fractions) & (fractions > 0)]
    if drawable.size:
        # one filled outline, not 60 bar patches: the same picture, drawn in two thirds of the time
        counts, edges = np.histogram(np.log10(drawable), bins=60)
        ax.stairs(counts, edges, fill=True, color=BLUE)
    else:
        ax.set_xlim(*EMPTY_RANGE)
    ax.axvline(0.0, color=RED, linestyle="--", label=LIMIT_LABEL)
    text, failing = _counts_text(fractions)
    if text:
        ax.text(0.02, 0.97, text, transform=ax.transAxes, ha="left", va="top", fontsize=7,
                color=RED if failing else "#222222", bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
    ax.set_title(f"{name}  (atol {atol:.0e}, rtol {rtol:.0e})", fontsize=9)
    ax.set_xlabel(RATIO_LABEL, fontsize=8)
    ax.set_ylabel("elements", fontsize=8)
    ax.tick_params(labelsize=7)


def chosen_outputs(fractions: dict[str, np.ndarray], limit: int = MAX_PANELS) -> list[str]:
    """At most `limit` outputs, those nearest (or past) their limit, in their original order."""
    ranked = sorted(fractions, key=lambda name: _worst(fractions[name]), reverse=True)[:limit]
    return [name for name in fractions if name in ranked]


def error_histograms(
    pairs: dict[str, tuple[np.ndarray, np.ndarray]], tolerances: dict[str, tuple[float, float]], title: str
) -> str:
    """The histograms of `histogram_figure` as a PNG data URI."""
    return _to_data_uri(histogram_figure(pairs, tolerances, title))


def histogram_figure(pairs: dict[str, tuple[np.ndarray, np.ndarray]], tolerances: dict[str, tuple[float, float]], title: str):
    """Histograms of each element's error as a fraction of its tolerance, one panel per output.

    `pairs`: output -> (eager, backend) values; `tolerances`: output -> (atol, rtol). With more
    than MAX_PANELS outputs, the panels show those nearest their limit and the title says so.
    """
    plt = _figure()
    fractions = {name: tolerance_fractions(eager, backend, *tolerances[name]) for name, (eager, backend) in pairs.items()}
    names = chosen_outputs(fractions)
    fig, axes = plt.subplots(1, len(names), figsize=(4.4 * len(names), 3.4), squeeze=False, layout="constrained")
    for ax, name in zip(axes[0], names, strict=True):
        _histogram_panel(ax, name, fractions[name], *tolerances[name])
    # a panel's title (its output's name) over its column, beside the y axis's labels: 0.9 in
    widest = max((ax.title for ax in axes[0]), key=lambda t: len(t.get_text()))
    _wide_enough(fig, widest, share=len(names), margin=0.9)
    fig.legend(*axes[0][0].get_legend_handles_labels(), fontsize=7, loc="outside lower center")
    shown = ""
    if len(names) < len(fractions):
        shown = f" ({len(names)} of {len(fractions)} outputs shown: those nearest their limit)"
    elif len(names) > 1:
        shown = f" (all {len(names)} outputs)"
    _wide_enough(fig, fig.suptitle(f"{title}: error as a fraction of its tolerance{shown}", fontsize=10))
    return fig


def layer_errors(modules: list[dict], title: str) -> str:
    """The plot of `layer_figure` as a PNG data URI."""
    return _to_data_uri(layer_figure(modules, title))


def layer_figure(modules: list[dict], title: str):
    """Each tracked module's worst error as a fraction of its tolerance, in execution order.

    A module passes when that fraction is at most 1, so the points' colours and the limit
    line agree. Modules whose output is exact are labelled "exact" at the bottom instead of
    being drawn at an invented small value.
    """
    plt = _figure()
    names = [m["module"] for m in modules]
    worst = [m.get("max_tolerance_ratio") for m in modules]
    exact = [m.get("max_abs") == 0 for m in modules]
    drawn = [i for i, w in enumerate(worst) if not exact[i] and w is not None and np.isfinite(w)]
    # the names are written at 70 degrees below the axes: the figure grows with the longest, so the
    # constrained layout always has room for them (18 characters, "layers.0.attn_norm": 3.6 in)
    height = 2.6 + 0.055 * max((len(n) for n in names), default=18)
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(names)), max(3.6, height)), layout="constrained")
    ax.plot(drawn, [worst[i] for i in drawn], color=GREY, linewidth=1)
    ax.scatter(drawn, [worst[i] for i in drawn], c=[GREEN if modules[i]["passed"] else RED for i in drawn], zorder=3, s=18)
    ax.axhline(1.0, color=RED, linestyle="--", linewidth=1, label="limit: atol + rtol·|eager| (fails above it)")
    ax.set_yscale("log")
    values = [worst[i] for i in drawn]
    ax.set_ylim(min([*values, 1e-3]) / 3, max([*values, 1.0]) * 3)  # the limit line always in view
    # the axis spans 4 decades or more, each labelled: its unlabelled minor ticks were a quarter
    # of the figure's drawing time (about 0.2 s a report)
    ax.yaxis.set_minor_locator(_figure().NullLocator())
    for i, is_exact in enumerate(exact):
        if is_exact:
            ax.text(i, 0.02, "exact", transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=7, color=GREEN)
        elif i not in drawn:  # NaN or inf: off any scale, and a failure
            ax.text(i, 0.98, "NaN/inf", transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=7, color=RED)
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("max |backend − eager| /\n(atol + rtol·|eager|)", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    _wide_enough(fig, fig.suptitle(title, fontsize=10))  # centred on the figure, as wide as it needs
    return fig
