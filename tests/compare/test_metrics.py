"""moedeploy.compare.metrics.error_stats against numpy computed here."""

from __future__ import annotations

import numpy as np
import pytest

from moedeploy.compare.metrics import error_stats
from tests.compare.helpers import numpy_stats

STAT_KEYS = ("max_abs", "mean_abs", "median_abs", "p99_abs", "max_rel", "mean_rel", "median_rel", "p99_rel", "cosine")


@pytest.mark.parametrize(
    ("shape", "dtype", "scale", "seed"),
    [((1000,), np.float64, 1e-3, 0), ((7, 13, 5), np.float32, 1e-6, 1), ((4, 257), np.float16, 1e-2, 2)],
)
def test_statistics_match_numpy(shape, dtype, scale, seed):
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(shape).astype(dtype)
    act = (ref.astype(np.float64) + scale * rng.standard_normal(shape)).astype(dtype)
    stats = error_stats(ref, act, atol=1e-4, rtol=1e-3)
    expected = numpy_stats(ref, act)
    for key in STAT_KEYS:
        np.testing.assert_allclose(stats[key], expected[key], rtol=1e-10, atol=0, err_msg=key)
    assert stats["elements"] == ref.size
    assert stats["atol"] == 1e-4 and stats["rtol"] == 1e-3
    assert stats["nan_or_inf"] is False
    assert stats["passed"] == bool(np.allclose(act, ref, rtol=1e-3, atol=1e-4))
    # the statistics are really of the errors, not of something degenerate
    assert stats["max_abs"] > stats["p99_abs"] >= stats["median_abs"] > 0


def test_pass_rule_agrees_with_numpy_allclose():
    """|a - r| <= atol + rtol * |r| elementwise: the same verdict as numpy.allclose(a, r)."""
    rng = np.random.default_rng(7)
    verdicts = []
    for _ in range(300):
        ref = rng.standard_normal(50) * 10 ** rng.uniform(-3, 3)
        act = ref + rng.standard_normal(50) * 10 ** rng.uniform(-6, 0)
        atol, rtol = 10 ** rng.uniform(-6, -1), 10 ** rng.uniform(-6, -1)
        got = error_stats(ref, act, atol, rtol)["passed"]
        want = bool(np.allclose(act, ref, rtol=rtol, atol=atol))
        assert got == want, (atol, rtol)
        verdicts.append(got)
    assert any(verdicts) and not all(verdicts)  # both outcomes were exercised


def test_pass_rule_boundary_is_inclusive():
    # dyadic values: atol + rtol * |ref| = 0.25 + 0.125 * 2 = 0.5 exactly
    ref = np.array([2.0, -2.0])
    assert error_stats(ref, ref + np.array([0.5, -0.5]), 0.25, 0.125)["passed"] is True
    assert error_stats(ref, ref + np.array([0.5 + 2**-20, 0.0]), 0.25, 0.125)["passed"] is False
    assert error_stats(ref, ref + np.array([0.0, -(0.5 + 2**-20)]), 0.25, 0.125)["passed"] is False


def test_relative_tolerance_scales_with_the_reference_not_the_actual():
    # |3 - 1| = 2 > 0 + 1 * |ref| = 1, although it is <= 1 * |actual| = 3
    stats = error_stats(np.array([1.0]), np.array([3.0]), atol=0.0, rtol=1.0)
    assert stats["passed"] is False
    assert stats["passed"] == bool(np.allclose([3.0], [1.0], rtol=1.0, atol=0.0))
    assert stats["max_rel"] == pytest.approx(2.0)


def test_relative_error_of_a_zero_reference_is_finite():
    stats = error_stats(np.zeros(4), np.array([0.0, 1e-9, 0.0, 0.0]), atol=1e-6, rtol=0.0)
    assert np.isfinite(stats["max_rel"]) and stats["max_rel"] > 1.0
    assert stats["passed"] is True  # the absolute tolerance covers it


@pytest.mark.parametrize(
    ("ref", "act"),
    [
        ([1.0, 2.0, 3.0], [1.0, np.nan, 3.0]),
        ([1.0, np.nan, 3.0], [1.0, 2.0, 3.0]),
        ([1.0, np.nan, 3.0], [1.0, np.nan, 3.0]),  # NaN == NaN is not a match
        ([1.0, 2.0, 3.0], [1.0, np.inf, 3.0]),
        ([1.0, -np.inf, 3.0], [1.0, -np.inf, 3.0]),
    ],
)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_or_inf_always_fails(ref, act):
    stats = error_stats(np.array(ref), np.array(act), atol=1e30, rtol=1e30)
    assert stats["nan_or_inf"] is True
    assert stats["passed"] is False


def test_cosine_similarity():
    rng = np.random.default_rng(3)
    ref = rng.standard_normal(64)
    assert error_stats(ref, 3 * ref, 0, 0)["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert error_stats(ref, -ref, 0, 0)["cosine"] == pytest.approx(-1.0, abs=1e-12)
    other = rng.standard_normal(64)
    other -= ref * (other @ ref) / (ref @ ref)  # orthogonal to ref
    assert error_stats(ref, other, 0, 0)["cosine"] == pytest.approx(0.0, abs=1e-12)
    assert error_stats(np.zeros(5), np.zeros(5), 0, 0)["cosine"] == 1.0


def test_identical_arrays_pass_with_zero_tolerance():
    ref = np.linspace(-5, 5, 101, dtype=np.float32)
    stats = error_stats(ref, ref.copy(), 0.0, 0.0)
    assert stats["passed"] is True
    assert stats["max_abs"] == 0.0 and stats["max_rel"] == 0.0


def test_empty_arrays():
    stats = error_stats(np.zeros((0, 3)), np.zeros((0, 3)), 1e-5, 1e-5)
    assert stats["elements"] == 0
    assert stats["passed"] is True
    assert stats["nan_or_inf"] is False
    for key in STAT_KEYS:
        assert np.isfinite(stats[key]), key


@pytest.mark.parametrize(("ref_shape", "act_shape"), [((3,), (4,)), ((2, 3), (2, 4)), ((0,), (1,))])
def test_size_mismatch(ref_shape, act_shape):
    stats = error_stats(np.zeros(ref_shape), np.zeros(act_shape), 1.0, 1.0)
    assert stats["shape_mismatch"] is True
    assert stats["passed"] is False


@pytest.mark.parametrize(("ref_shape", "act_shape"), [((2, 3), (3, 2)), ((1, 6), (6,))])
def test_same_size_shape_mismatch(ref_shape, act_shape):
    stats = error_stats(np.zeros(ref_shape), np.zeros(act_shape), 1.0, 1.0)
    assert stats.get("shape_mismatch") is True
    assert stats["passed"] is False
