"""The portable artifact's graph as TensorRT's ONNX parser takes it: exact rewrites where
NVIDIA documents a narrower form than ONNX allows.

- A blocked DequantizeLinear over a rank-3 expert stack (E, N, K), the int4 experts that feed
  moe::MoE: TensorRT's Dequantize layer takes blocked scales of rank 2 only. It becomes a
  DequantizeLinear over the same bytes seen as (E * N, K) codes and (E * N, K / block) scales,
  then a Reshape back to (E, N, K). A row of K codes and its scales are the same bytes either
  way (the stack is row-major), so the initializers keep their external data (location,
  offset, length) and only their dims change.

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
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    counts = {"expert_stacks_as_rows": 0}
    nodes = list(graph.node)
    del graph.node[:]
    for node in nodes:
        reshape = _stack_as_rows(node, initializers, readers, graph)  # rewrites the node first:
        graph.node.append(node)  # appending copies it
        if reshape is not None:
            graph.node.append(reshape)
            counts["expert_stacks_as_rows"] += 1
    return lowered, counts


def _stack_as_rows(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto], readers: dict[str, int],
                   graph: onnx.GraphProto) -> onnx.NodeProto | None:
    """Rewrite a blocked DequantizeLinear over a rank-3 stack in place to read (E * N, K) rows;
    returns the Reshape that restores (E, N, K) under the node's old output name, or None when
    the node is not such a DequantizeLinear (or its constants are read elsewhere)."""
    if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        return None
    attrs = {a.name: a for a in node.attribute}
    block = attrs["block_size"].i if "block_size" in attrs else 0
    parts = [initializers.get(name) for name in node.input if name]
    if not block or any(p is None or readers.get(p.name) != 1 for p in parts) or len(parts[0].dims) != 3:
        return None
    e, n, k = parts[0].dims
    axis = attrs["axis"].i if "axis" in attrs else 1
    if axis not in (2, -1) or any(list(p.dims) != [e, n, k // block] for p in parts[1:]):
        return None
    parts[0].ClearField("dims")
    parts[0].dims.extend([e * n, k])
    for part in parts[1:]:
        part.ClearField("dims")
        part.dims.extend([e * n, k // block])
    if "axis" in attrs:
        attrs["axis"].i = 1
    else:
        node.attribute.append(helper.make_attribute("axis", 1))
    stacked = node.output[0]
    node.output[0] = f"{stacked}/rows"
    shape = numpy_helper.from_array(np.array([e, n, k], dtype=np.int64), f"{stacked}/stack_shape")
    graph.initializer.append(shape)
    return helper.make_node("Reshape", [node.output[0], shape.name], [stacked], name=f"{node.name or stacked}/stack")
