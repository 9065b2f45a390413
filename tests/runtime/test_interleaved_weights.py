"""The lowering reads an interleaved expert weight as it is only when the graph really slices
gate and up as its even and odd rows: any other slicing must get the copying path, or
com.microsoft::MoE would read the wrong rows (a silent wrong answer)."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from moedeploy.plugins.moe import interleaved_source

E, I, H = 3, 4, 5  # noqa: E741


def _slice(fused: ir.Value, start: int, end: int, step: int, axis: int = 1) -> ir.Value:
    consts = [ir.node("Constant", [], {"value": ir.tensor([v], dtype=ir.DataType.INT64)}).outputs[0]
              for v in (start, end, axis, step)]
    out = ir.node("Slice", [fused, *consts]).outputs[0]
    out.shape = ir.Shape([E, I, H])  # as the exporter records it
    return out


def _fused(rows: int = 2 * I) -> ir.Value:
    """An (E, rows, H) expert weight of known shape."""
    return ir.Value(name="w_gate_up", shape=ir.Shape([E, rows, H]), type=ir.TensorType(ir.DataType.FLOAT))


def test_even_and_odd_rows_of_one_weight_are_read_in_place() -> None:
    fused = _fused()
    assert interleaved_source(_slice(fused, 0, 2 * I, 2), _slice(fused, 1, 2 * I, 2)) is fused


@pytest.mark.parametrize(
    "gate_up",
    [
        ((0, I, 1), (I, 2 * I, 1)),  # concatenated halves (transformers' gate_up_proj layout)
        ((1, 2 * I, 2), (0, 2 * I, 2)),  # odd rows as gate: swapped
        ((0, I, 2), (1, 2 * I, 2)),  # the gate slice stops halfway
        ((0, 2 * I, 3), (1, 2 * I, 3)),  # every third row
    ],
)
def test_any_other_slicing_is_not_taken_for_interleaved(gate_up) -> None:
    fused = _fused()
    (gs, ge, gstep), (us, ue, ustep) = gate_up
    assert interleaved_source(_slice(fused, gs, ge, gstep), _slice(fused, us, ue, ustep)) is None


def test_slices_of_two_different_weights_or_another_axis_are_not_interleaved() -> None:
    a, b = _fused(), _fused()
    assert interleaved_source(_slice(a, 0, 2 * I, 2), _slice(b, 1, 2 * I, 2)) is None
    fused = _fused()
    assert interleaved_source(_slice(fused, 0, 2 * I, 2, axis=2), _slice(fused, 1, 2 * I, 2, axis=2)) is None
    plain = ir.Value(name="w_gate", shape=ir.Shape([E, I, H]), type=ir.TensorType(ir.DataType.FLOAT))
    assert interleaved_source(plain, _slice(fused, 1, 2 * I, 2)) is None  # an initializer, not a slice


def test_a_weight_of_unknown_or_other_shape_is_not_taken_whole() -> None:
    unknown = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT))
    assert interleaved_source(_slice(unknown, 0, 2 * I, 2), _slice(unknown, 1, 2 * I, 2)) is None
    longer = _fused(rows=2 * I + 2)  # the slices would not cover it whole
    assert interleaved_source(_slice(longer, 0, 2 * I + 2, 2), _slice(longer, 1, 2 * I + 2, 2)) is None
