"""Tracing raises the garbage collector's threshold for its own duration only, and the caller's
thresholds come back however traces start, end, overlap or fail."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from moedeploy.export.onnx_export import TRACE_GC_THRESHOLD, fewer_collections


@pytest.fixture
def thresholds() -> Iterator[tuple[int, int, int]]:
    """A known starting point, put back afterwards (the process's own may have been tuned)."""
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's defaults
    yield (700, 10, 10)
    gc.set_threshold(*before)


def test_the_threshold_is_raised_inside_and_restored_after(thresholds) -> None:
    with fewer_collections():
        assert gc.get_threshold() == (TRACE_GC_THRESHOLD, 10, 10)
    assert gc.get_threshold() == thresholds


def test_a_failed_trace_restores_the_threshold(thresholds) -> None:
    with pytest.raises(RuntimeError, match="trace failed"), fewer_collections():
        raise RuntimeError("trace failed")
    assert gc.get_threshold() == thresholds


def test_a_callers_higher_threshold_is_kept(thresholds) -> None:
    gc.set_threshold(50_000, 20, 30)
    with fewer_collections():
        assert gc.get_threshold() == (50_000, 20, 30)
    assert gc.get_threshold() == (50_000, 20, 30)


def test_automatic_collection_turned_off_stays_off(thresholds) -> None:
    gc.set_threshold(0, 10, 10)
    with fewer_collections():
        assert gc.get_threshold()[0] == 0
    assert gc.get_threshold() == (0, 10, 10)


def test_overlapping_traces_put_back_the_thresholds_from_before_the_first(thresholds) -> None:
    """Two threads' traces: the first in leaves before the second; the second's exit, the last,
    restores 700 (not the raised value it found when it came in)."""
    first, second = fewer_collections(), fewer_collections()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert gc.get_threshold() == (TRACE_GC_THRESHOLD, 10, 10)  # the second is still tracing
    second.__exit__(None, None, None)
    assert gc.get_threshold() == thresholds
