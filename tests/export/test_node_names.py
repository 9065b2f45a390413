"""Custom nodes are named after the module they were traced in, and names stay unique."""

from __future__ import annotations

import onnx
from onnx import helper

from moedeploy.export.onnx_export import SCOPE_KEY, name_custom_nodes


def _node(op_type: str, domain: str, name: str, scopes: list[str] | None) -> onnx.NodeProto:
    node = helper.make_node(op_type, ["x"], [f"{name}_out"], name=name, domain=domain)
    if scopes is not None:
        node.metadata_props.add(key=SCOPE_KEY, value=repr(scopes))
    return node


def test_names_follow_modules_and_clashes_get_a_suffix() -> None:
    nodes = [
        _node("RMSNorm", "moe", "node__symbolic", ["", "decoder", "decoder.layers.0.attn_norm", "_symbolic"]),
        _node("RMSNorm", "moe", "node__symbolic_1", ["", "decoder", "decoder.layers.0.attn_norm", "_symbolic_1"]),
        _node("MoE", "moe", "node__symbolic_2", ["", "_symbolic_2"]),  # traced in the exported module itself
        _node("RMSNorm", "moe", "node__symbolic_3", None),  # no metadata recorded
        _node("Relu", "", "layers.0.attn_norm/1", ["", "decoder", "decoder.layers.0", "relu"]),  # a standard op
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])], [])
    model = helper.make_model(graph)
    name_custom_nodes(model, scope_prefix="decoder.")
    names = [n.name for n in model.graph.node]
    # The Relu already held "layers.0.attn_norm/1" and keeps it: the second norm takes /2.
    assert names == ["layers.0.attn_norm", "layers.0.attn_norm/2", "MoE", "RMSNorm", "layers.0.attn_norm/1"]
    assert len(set(names)) == len(names)
