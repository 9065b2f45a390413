"""The report's plots draw the tolerance rule as it is applied, and say what they leave out.

The rule is |backend - eager| <= atol + rtol * |eager| per element; the plots show each
element's error as a fraction of that allowance, so the limit line sits at exactly 1.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moedeploy.compare import plots
from moedeploy.compare.metrics import error_stats

ATOL, RTOL = 1e-2, 1e-1


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def _pair(seed: int, n: int = 1000, exact: int = 0, scale: float = 1e-3):
    """(eager, backend) with `exact` elements equal and the rest off by ~scale."""
    rng = np.random.default_rng(seed)
    eager = rng.standard_normal(n)
    backend = eager + scale * rng.standard_normal(n)
    backend[:exact] = eager[:exact]
    return eager, backend


def test_tolerance_fractions_by_hand():
    eager = np.array([0.0, 2.0, -4.0, 1.0, 0.0])
    backend = np.array([0.0, 2.03, -4.0, 1.5, 0.001])
    fractions = plots.tolerance_fractions(eager, backend, ATOL, RTOL)
    # 0 exact; 0.03 / (0.01 + 0.2) ; exact ; 0.5 / (0.01 + 0.1) ; 0.001 / 0.01
    np.testing.assert_allclose(fractions, [0.0, 0.03 / 0.21, 0.0, 0.5 / 0.11, 0.1], rtol=1e-9)
    # a nonzero error against a zero allowance is over any limit; 0 against 0 is exact
    assert plots.tolerance_fractions(np.zeros(2), np.array([0.0, 1e-9]), 0.0, 0.0).tolist() == [0.0, np.inf]


def test_a_nan_makes_the_worst_fraction_infinite():
    """NaN fails the rule, so the worst-element figure must not hide it (np.max would say NaN, max() 0)."""
    stats = error_stats(np.ones(3), np.array([1.0, np.nan, 1.0]), ATOL, RTOL)
    assert stats["passed"] is False and stats["max_tolerance_ratio"] == np.inf


def test_the_pass_rule_and_the_fraction_agree():
    """An element passes error_stats's rule exactly when its fraction is <= 1 (the drawn limit)."""
    eager, backend = _pair(0, scale=5e-2)
    fractions = plots.tolerance_fractions(eager, backend, ATOL, RTOL)
    for i in range(eager.size):
        passed = error_stats(eager[i:i + 1], backend[i:i + 1], ATOL, RTOL)["passed"]
        assert passed is bool(fractions[i] <= 1), i
    assert 0 < (fractions > 1).sum() < eager.size  # both sides of the line are exercised
    stats = error_stats(eager, backend, ATOL, RTOL)
    by_hand = max(abs(b - e) / (ATOL + RTOL * abs(e)) for e, b in zip(eager, backend, strict=True))
    assert stats["max_tolerance_ratio"] == pytest.approx(by_hand, rel=1e-12)


def test_exact_zeros_are_counted_in_words_not_drawn_at_a_fake_value():
    eager, backend = _pair(1, exact=400)
    fig = plots.histogram_figure({"y": (eager, backend)}, {"y": (ATOL, RTOL)}, "onnxrt vs eager PyTorch")
    (ax,) = fig.axes
    assert any("400 of 1,000 exact" in t for t in _texts(fig))
    (outline,) = ax.patches  # the histogram, drawn as one filled step outline
    counts, edges, _ = outline.get_data()
    assert counts.sum() == 600  # only the nonzero errors are binned
    smallest = np.log10(np.min(np.abs(backend - eager)[400:] / (ATOL + RTOL * np.abs(eager[400:]))))
    assert edges.min() == pytest.approx(smallest)  # no bin near log10(1e-12)
    assert ax.get_ylabel() == "elements"


def test_the_limit_line_is_the_whole_rule():
    eager, backend = _pair(2)
    fig = plots.histogram_figure({"y": (eager, backend)}, {"y": (ATOL, RTOL)}, "t")
    (ax,) = fig.axes
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [0.0, 0.0]  # log10(1): error equal to its allowance
    assert "atol + rtol·|eager|" in line.get_label()
    assert "atol 1e-02, rtol 1e-01" in ax.get_title()


def test_over_the_limit_is_said():
    eager, backend = _pair(3, scale=0.5)
    fig = plots.histogram_figure({"y": (eager, backend)}, {"y": (ATOL, RTOL)}, "t")
    over = int((np.abs(backend - eager) > ATOL + RTOL * np.abs(eager)).sum())  # the rule, by hand
    assert over > 0
    assert any(f"{over:,} over the limit" in t for t in _texts(fig))


def test_more_outputs_than_panels_says_which_are_shown():
    """Six outputs, four panels: the four nearest their limit, and the title says 4 of 6."""
    pairs = {f"out{i}": _pair(10 + i, scale=10.0 ** (i - 6)) for i in range(6)}  # out5 is worst
    tolerances = {name: (ATOL, RTOL) for name in pairs}
    fig = plots.histogram_figure(pairs, tolerances, "onnxrt vs eager PyTorch")
    shown = [ax.get_title().split()[0] for ax in fig.axes]
    assert shown == ["out2", "out3", "out4", "out5"]
    assert "4 of 6 outputs shown" in fig._suptitle.get_text()


def test_suptitle_does_not_collide_with_panel_titles():
    for n in (1, 3):
        pairs = {f"out{i}": _pair(20 + i) for i in range(n)}
        fig = plots.histogram_figure(pairs, {k: (ATOL, RTOL) for k in pairs}, "onnxrt vs eager PyTorch")
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        top = fig._suptitle.get_window_extent(renderer)
        for ax in fig.axes:
            title = ax.title.get_window_extent(renderer)
            assert title.y1 <= top.y0, (n, ax.get_title())


def _outside(fig) -> list[float]:
    """How far (inches) what a drawn figure shows reaches past each edge (left, bottom, right,
    top): the bounding box bbox_inches="tight" would have grown the picture to, against the
    canvas. Nothing past an edge: all four at most 0."""
    fig.canvas.draw()
    box = fig.get_tightbbox(fig.canvas.get_renderer())  # inches
    return [round(v, 2) for v in (-box.x0, -box.y0, box.x1 - fig.get_figwidth(), box.y1 - fig.get_figheight())]


def test_every_label_and_title_lies_inside_the_saved_picture():
    """The picture is the figure's canvas (no bbox_inches="tight", which drew each figure twice
    to grow the canvas around what stuck out): long titles widen the figure and long module
    names heighten it, so nothing is cut at an edge."""
    long_title = "ort-skipnorm vs eager PyTorch, a backend compared on its one output"
    one = {"y": _pair(1)}
    assert max(_outside(plots.histogram_figure(one, {"y": (ATOL, RTOL)}, long_title))) <= 0.01
    for n in (1, 2, 4):  # outputs of long names: each panel's title over its own column
        named = {f"model.layers.{i}.block_sparse_moe.experts.down_proj.output": _pair(i) for i in range(n)}
        fig = plots.histogram_figure(named, {k: (ATOL, RTOL) for k in named}, "onnxrt vs eager PyTorch")
        assert max(_outside(fig)) <= 0.01, n
        renderer = fig.canvas.get_renderer()
        titles = sorted((ax.title.get_window_extent(renderer) for ax in fig.axes), key=lambda box: box.x0)
        assert all(left.x1 <= right.x0 for left, right in itertools.pairwise(titles)), n  # no overlap
    eager = np.linspace(-1, 1, 50)
    names = ["embed", *(f"model.layers.{i}.block_sparse_moe.experts.gate_up_proj" for i in range(3)), "lm_head"]
    modules = [_module(name, eager, eager + 1e-3 * (i + 1)) for i, name in enumerate(names)]
    title = "worst error per module relative to its tolerance, execution order (first input)"
    assert max(_outside(plots.layer_figure(modules, title))) <= 0.01
    assert max(_outside(plots.layer_figure(modules[:1] + modules[-1:], "t"))) <= 0.01


def _module(name: str, eager: np.ndarray, backend: np.ndarray) -> dict:
    return {"module": name, **error_stats(eager, backend, ATOL, RTOL)}


def test_layer_plot_draws_fractions_and_labels_exact_modules():
    eager = np.linspace(-1, 1, 50)
    modules = [
        _module("embed", eager, eager.copy()),  # exact
        _module("layers.0", eager, eager + 1e-3),
        _module("norm", eager, eager + 0.5),  # fails
    ]
    fig = plots.layer_figure(modules, "t")
    (ax,) = fig.axes
    (points,) = ax.collections
    offsets = points.get_offsets()
    assert offsets[:, 0].tolist() == [1.0, 2.0]  # embed (exact) is not drawn
    expected = [np.max(d / (ATOL + RTOL * np.abs(eager))) for d in (1e-3, 0.5)]
    np.testing.assert_allclose(offsets[:, 1], expected, rtol=1e-12)
    assert "exact" in _texts(fig)
    limit = next(line for line in ax.get_lines() if "limit" in line.get_label())
    assert list(limit.get_ydata()) == [1.0, 1.0]
    assert ax.get_ylim()[0] < min(expected) and ax.get_ylim()[1] > 1.0
