"""Plots for the HTML report, rendered to inline PNG data URIs (no external requests)."""

from __future__ import annotations

import base64
import io

import numpy as np


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _to_data_uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _figure().close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def error_histograms(errors: dict[str, np.ndarray], tolerances: dict[str, float], title: str) -> str:
    """log10 |error| histograms, one panel per output (at most 4), tolerance marked."""
    plt = _figure()
    names = list(errors)[:4]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.0), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        err = np.abs(errors[name].astype(np.float64).ravel())
        finite = err[np.isfinite(err)]
        if finite.size:
            ax.hist(np.log10(np.maximum(finite, 1e-12)), bins=60, color="#4477aa")
        if finite.size < err.size:  # NaN/Inf cannot be binned: say how many there were
            ax.text(0.5, 0.5, f"{err.size - finite.size} NaN/Inf errors", transform=ax.transAxes,
                    ha="center", color="#cc3311", fontsize=9)
        ax.axvline(np.log10(tolerances[name]), color="#cc3311", linestyle="--", label="atol")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("log10 |backend - eager|", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _to_data_uri(fig)


def layer_errors(modules: list[dict], atol: float, title: str) -> str:
    """Max absolute error of every tracked module, in execution order, on a log scale."""
    plt = _figure()
    names = [m["module"] for m in modules]
    values = [max(m.get("max_abs", 0.0), 1e-12) for m in modules]
    colors = ["#228833" if m["passed"] else "#cc3311" for m in modules]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(names)), 3.4))
    ax.plot(range(len(names)), values, color="#777777", linewidth=1)
    ax.scatter(range(len(names)), values, c=colors, zorder=3, s=18)
    ax.axhline(atol, color="#cc3311", linestyle="--", linewidth=1, label="atol")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("max |backend - eager|", fontsize=8)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    return _to_data_uri(fig)
