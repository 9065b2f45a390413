"""How many onnx_ir graphs a session's creation leaves alive, with Python's automatic collection
off: only create_session's own collection can free the lowering's graph (reference cycles)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest


def graphs_left_by(make: Callable[[], Any], monkeypatch: pytest.MonkeyPatch, large: bool) -> tuple[Any, int]:
    """(what `make()` returned, onnx_ir graphs alive after it less those alive before), with
    RELEASE_ABOVE_BYTES moved to either side of a test's small graph: `large` makes it one."""
    import onnx_ir as ir

    from moedeploy.runtime import ort as ort_sessions

    monkeypatch.setattr(ort_sessions, "RELEASE_ABOVE_BYTES", 1 if large else 1 << 40)

    def graphs() -> int:
        return sum(isinstance(o, ir.Graph) for o in gc.get_objects())

    gc.collect()
    before = graphs()
    gc.disable()
    try:
        made = make()
        return made, graphs() - before
    finally:
        gc.enable()
