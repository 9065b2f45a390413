"""The TensorRT lowering's moe::MoENBits rewrite refuses every graph where it would change what
another reader sees, or hand the plugin a form its kernels do not take: the same graph, once as
a quantized export writes it (rewritten) and once with each such difference (left alone).

The rewrite's numerics are tested on real exports (tests/export/test_quantized_export.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from moedeploy.plugins.moe import DOMAIN, Routing
from moedeploy.runtime.tensorrt_lowering import lower_for_tensorrt

E, INTER, H, BLOCK = 2, 16, 32, 16


def _int4(name: str, dims: list[int]) -> onnx.TensorProto:
    """Signed 4-bit codes, raw bytes as ONNX packs them (values are irrelevant to the rewrite)."""
    count = int(np.prod(dims))
    raw = np.arange((count + 1) // 2, dtype=np.uint8).tobytes()
    return helper.make_tensor(name, TensorProto.INT4, dims, raw, raw=True)


def _graph(block: int = BLOCK, steps: tuple[int, int] = (2, 2), starts: tuple[int, int] = (0, 1),
           end: int = 2 * INTER, axis: int = 1, activation: str = "swiglu",
           dq_attributes: dict | None = None) -> onnx.ModelProto:
    """x -> moe::MoE over an int4 interleaved gate/up stack (two strided Slices of one
    DequantizeLinear) and an int4 down stack, as a quantized decoder export writes them."""
    blocks = H // block
    inits = [
        _int4("gu.codes", [E, 2 * INTER, H]), numpy_helper.from_array(np.ones((E, 2 * INTER, blocks), np.float32), "gu.scale"),
        _int4("down.codes", [E, H, INTER]), numpy_helper.from_array(np.ones((E, H, INTER // block), np.float32), "down.scale"),
        numpy_helper.from_array(np.ones((H, E), np.float32), "router"),
        numpy_helper.from_array(np.zeros((E, INTER), np.float32), "b_i"),
        numpy_helper.from_array(np.zeros((E, H), np.float32), "b_h"),
        numpy_helper.from_array(np.zeros(E, np.float32), "score_bias"),
    ]
    attributes = {"axis": 2, "block_size": block, **(dq_attributes or {})}
    nodes = [
        helper.make_node("DequantizeLinear", ["gu.codes", "gu.scale"], ["gu"], **attributes),
        helper.make_node("DequantizeLinear", ["down.codes", "down.scale"], ["down"], axis=2, block_size=block),
        helper.make_node("MatMul", ["x", "router"], ["logits"]),
    ]
    for name, start, step in (("gate", starts[0], steps[0]), ("up", starts[1], steps[1])):
        consts = {"starts": start, "ends": end, "axes": axis, "steps": step}
        for key, value in consts.items():
            nodes.append(helper.make_node("Constant", [], [f"{name}.{key}"],
                                          value=numpy_helper.from_array(np.array([value], np.int64))))
        nodes.append(helper.make_node("Slice", ["gu", *(f"{name}.{k}" for k in consts)], [name]))
    nodes.append(helper.make_node("MoE", ["x", "logits", "gate", "up", "down", "b_i", "b_i", "b_h", "score_bias"],
                                  ["y"], domain=DOMAIN, name="ffn", **Routing().attributes(),
                                  activation=activation, plugin_namespace=DOMAIN))
    graph = helper.make_graph(nodes, "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", H])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 3)])


def _codes_type(model: onnx.ModelProto) -> int:
    return next(i.data_type for i in model.graph.initializer if i.name == "gu.codes")


def test_a_quantized_moe_node_is_rewritten_onto_its_codes() -> None:
    lowered, counts = lower_for_tensorrt(_graph())
    assert counts["moe_nodes_on_codes"] == 1
    assert [n.op_type for n in lowered.graph.node] == ["MatMul", "MoENBits"]  # DequantizeLinear, Slice, Constant gone
    node = lowered.graph.node[1]
    assert list(node.input[2:8]) == ["gu.codes", "gu.scale", "gu.codes"] * 2
    gate_up = next(i for i in lowered.graph.initializer if i.name == "gu.codes")
    assert (gate_up.data_type, list(gate_up.dims)) == (TensorProto.INT8, [E, 2 * INTER, H // 2])
    assert gate_up.raw_data == _int4("gu.codes", [E, 2 * INTER, H]).raw_data  # the same bytes


def _output_too(model: onnx.ModelProto) -> None:
    model.graph.output.append(helper.make_tensor_value_info("gu", TensorProto.FLOAT, [E, 2 * INTER, H]))


def _input_too(model: onnx.ModelProto) -> None:
    model.graph.input.append(helper.make_tensor_value_info("gu.codes", TensorProto.INT4, [E, 2 * INTER, H]))


def _read_in_a_branch(model: onnx.ModelProto) -> None:
    branch = helper.make_graph([helper.make_node("Identity", ["gate"], ["g"])], "branch", [],
                               [helper.make_tensor_value_info("g", TensorProto.FLOAT, None)])
    cond = numpy_helper.from_array(np.array(True), "cond")
    model.graph.initializer.append(cond)
    model.graph.node.append(helper.make_node("If", ["cond"], ["g_out"], then_branch=branch, else_branch=branch))
    model.graph.output.append(helper.make_tensor_value_info("g_out", TensorProto.FLOAT, None))


def _read_by_another_node(model: onnx.ModelProto) -> None:
    model.graph.node.append(helper.make_node("Identity", ["gu.codes"], ["codes_copy"]))
    model.graph.output.append(helper.make_tensor_value_info("codes_copy", TensorProto.INT4, None))


REFUSED: dict[str, tuple[Callable[[], onnx.ModelProto], Callable[[onnx.ModelProto], None] | None]] = {
    "dequantized stack is a graph output": (_graph, _output_too),
    "codes are a graph input": (_graph, _input_too),
    "a Slice output is read inside an If": (_graph, _read_in_a_branch),
    "codes read by another node": (_graph, _read_by_another_node),
    "gate/up Slice with step 3": (lambda: _graph(steps=(3, 2)), None),
    "gate/up Slices swapped": (lambda: _graph(starts=(1, 0)), None),
    "gate/up Slices stopping halfway": (lambda: _graph(end=INTER), None),
    "gate/up Slices along another axis": (lambda: _graph(axis=2), None),
    "relu experts (no gate to interleave)": (lambda: _graph(activation="relu"), None),
    "blocks of 8 (the kernels take 16 or more)": (lambda: _graph(block=8), None),
    "DequantizeLinear with output_dtype": (lambda: _graph(dq_attributes={"output_dtype": TensorProto.FLOAT}), None),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_rewrite_leaves_alone_what_it_cannot_take_whole(case: str) -> None:
    make, change = REFUSED[case]
    model = make()
    if change is not None:
        change(model)
    lowered, counts = lower_for_tensorrt(model)
    assert counts["moe_nodes_on_codes"] == 0
    assert "MoE" in [n.op_type for n in lowered.graph.node] and _codes_type(lowered) == TensorProto.INT4
