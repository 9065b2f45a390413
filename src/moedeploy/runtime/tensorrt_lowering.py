"""The portable artifact's graph as TensorRT's ONNX parser takes it: exact rewrites where
NVIDIA documents a narrower form than ONNX allows.

TensorRT's Dequantize layer takes a scale that is a scalar, per channel (1-D, along one axis),
or blocked (INT4 only, rank 2). The artifact's DequantizeLinear nodes are blocked along the
last axis, and two of their forms fall outside that:
- INT4 over a rank-3 expert stack (E, N, K) -> the same codes and scales read as (E * N, K)
  rows, blocked as before, then a Reshape back to (E, N, K);
- INT8 in blocks of B (any rank) -> the codes read as (numel / B, B), one block a row, and the
  scales as (numel / B,), one per row: per channel along axis 0, then a Reshape back.
Both are the same bytes in the same order (row-major, blocks along the last axis), so the
initializers keep their external data (location, offset, length) and only their dims change.

The graph alone is rewritten, the weights are never read: `build_engine` parses the result
from memory with the artifact's path, against which TensorRT resolves the external data, and
`check --target trt` checks the rewritten graph.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def lower_for_tensorrt(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """A copy of `model` rewritten for TensorRT's parser (module doc), and counts of what changed."""
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    graph = lowered.graph
    initializers = {i.name: i for i in graph.initializer}
    infos = {v.name: v for v in graph.value_info}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    counts = {"int4_stacks_as_rows": 0, "int8_blocks_as_channels": 0}
    nodes = list(graph.node)
    del graph.node[:]
    for node in nodes:
        rewritten = _rewrite(node, initializers, infos, readers, graph)  # rewrites the node first:
        graph.node.append(node)  # appending copies it
        if rewritten is not None:
            kind, reshape = rewritten
            graph.node.append(reshape)
            counts[kind] += 1
    return lowered, counts


def _rewrite(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto], infos: dict[str, onnx.ValueInfoProto],
             readers: dict[str, int], graph: onnx.GraphProto) -> tuple[str, onnx.NodeProto] | None:
    """Rewrite a blocked DequantizeLinear of a form TensorRT does not take (module doc) in place;
    returns (what was done, the Reshape that restores its shape under the node's old output
    name), or None when the node is not one (or its constants are read elsewhere)."""
    if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        return None
    attrs = {a.name: a for a in node.attribute}
    block = attrs["block_size"].i if "block_size" in attrs else 0
    parts = [initializers.get(name) for name in node.input if name]
    if not block or len(parts) != 2 or any(p is None or readers.get(p.name) != 1 for p in parts):
        return None  # not blocked, a zero point (TensorRT takes none anyway), or shared constants
    codes, scale = parts
    shape = list(codes.dims)
    axis = attrs["axis"].i if "axis" in attrs else 1
    if axis not in (len(shape) - 1, -1) or list(scale.dims) != [*shape[:-1], shape[-1] // block]:
        return None
    if codes.data_type == onnx.TensorProto.INT8:
        kind, rows, new_axis = "int8_blocks_as_channels", [int(np.prod(shape)) // block, block], 0
        scale_dims = [rows[0]]
    elif codes.data_type == onnx.TensorProto.INT4 and len(shape) == 3:
        kind, rows, new_axis = "int4_stacks_as_rows", [shape[0] * shape[1], shape[2]], 1
        scale_dims = [rows[0], shape[2] // block]
    else:
        return None
    _set_dims(codes, rows, infos.get(codes.name))
    _set_dims(scale, scale_dims, infos.get(scale.name))
    kept = [a for a in node.attribute if a.name not in ("axis", "block_size")]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.append(helper.make_attribute("axis", new_axis))
    if kind == "int4_stacks_as_rows":  # still blocked; INT8 becomes per channel (no block_size)
        node.attribute.append(helper.make_attribute("block_size", block))
    original = node.output[0]
    node.output[0] = f"{original}/{kind}"
    target = numpy_helper.from_array(np.array(shape, dtype=np.int64), f"{original}/shape")
    graph.initializer.append(target)
    return kind, helper.make_node("Reshape", [node.output[0], target.name], [original], name=f"{node.name or original}/reshape")


def _set_dims(tensor: onnx.TensorProto, dims: list[int], info: onnx.ValueInfoProto | None) -> None:
    """New dims for an initializer, and for the value_info the exporter recorded for it, if any."""
    tensor.ClearField("dims")
    tensor.dims.extend(dims)
    if info is not None:
        shape = info.type.tensor_type.shape
        shape.ClearField("dim")
        for d in dims:
            shape.dim.add().dim_value = d
