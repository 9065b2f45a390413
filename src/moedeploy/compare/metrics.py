"""Error statistics of one output against its reference, and the pass/fail rule."""

from __future__ import annotations

import numpy as np

_TINY = 1e-12


def error_stats(reference: np.ndarray, actual: np.ndarray, atol: float, rtol: float) -> dict[str, float | bool]:
    """max/mean/median/p99 of absolute and relative error, cosine similarity, pass/fail.

    Pass means every element satisfies |actual - ref| <= atol + rtol * |ref| (numpy's
    allclose rule), so a tolerance reads the same here as in the tests. `max_tolerance_ratio`
    is the largest |actual - ref| / (atol + rtol * |ref|): how close the worst element comes
    to failing (above 1 it fails), the one number the report's plots can draw the rule with.
    """
    ref = np.asarray(reference, dtype=np.float64)
    act = np.asarray(actual, dtype=np.float64)
    if ref.shape != act.shape:  # before flattening: (2, 3) vs (3, 2) is a mismatch too
        return {"shape_mismatch": True, "passed": False}
    ref, act = ref.ravel(), act.ravel()
    if ref.size == 0:
        return {"max_abs": 0.0, "mean_abs": 0.0, "median_abs": 0.0, "p99_abs": 0.0, "max_rel": 0.0,
                "mean_rel": 0.0, "median_rel": 0.0, "p99_rel": 0.0, "cosine": 1.0, "max_tolerance_ratio": 0.0,
                "nan_or_inf": False,
                "passed": True, "atol": atol, "rtol": rtol, "elements": 0}
    finite = bool(np.isfinite(act).all() and np.isfinite(ref).all())
    abs_err = np.abs(act - ref)
    rel_err = abs_err / np.maximum(np.abs(ref), _TINY)
    denom = np.linalg.norm(ref) * np.linalg.norm(act)
    cosine = float(ref @ act / denom) if denom > 0 else float(np.array_equal(ref, act))
    allowed = atol + rtol * np.abs(ref)
    passed = finite and bool(np.all(abs_err <= allowed))
    with np.errstate(divide="ignore", invalid="ignore"):  # 0/0 is an exact element; x/0 fails (inf)
        ratio = np.where(abs_err == 0, 0.0, abs_err / allowed)
    return {
        "max_abs": float(abs_err.max()),
        "mean_abs": float(abs_err.mean()),
        "median_abs": float(np.median(abs_err)),
        "p99_abs": float(np.quantile(abs_err, 0.99)),
        "max_rel": float(rel_err.max()),
        "mean_rel": float(rel_err.mean()),
        "median_rel": float(np.median(rel_err)),
        "p99_rel": float(np.quantile(rel_err, 0.99)),
        "cosine": cosine,
        "max_tolerance_ratio": float(np.inf) if np.isnan(ratio).any() else float(ratio.max()),
        "nan_or_inf": not finite,
        "passed": passed,
        "atol": atol,
        "rtol": rtol,
        "elements": int(ref.size),
    }
