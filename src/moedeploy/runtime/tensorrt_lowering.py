"""The portable artifact's graph as TensorRT's ONNX parser takes it: exact rewrites where
NVIDIA documents a narrower form than ONNX allows.

Expert stacks: each moe::MoE whose stacks are blocked DequantizeLinear nodes read by it alone
(the gate and up as the two strided Slices of one interleaved stack, as the streamed export
writes them) becomes a moe::MoENBits node over the codes and scales those nodes read (plugins/
moe_nbits.py), and the DequantizeLinear and Slice nodes go: the plugin's kernels dequantize in registers,
so the engine keeps the experts at 8 or 4 bits instead of in the float type. The codes (and
zero points) are re-typed as INT8 bytes, the only 8-bit type a TensorRT plugin takes: the same
bytes, so only their data_type and dims change.

TensorRT's Dequantize layer takes a scale that is a scalar, per channel (1-D, along one axis),
or blocked (INT4 only, rank 2). The artifact's other DequantizeLinear nodes are blocked along
the last axis, and two of their forms fall outside that:
- INT4 over a rank-3 expert stack (E, N, K) the rewrite above did not take (or with
  `experts_on_codes=False`) -> the same codes and scales read as (E * N, K)
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

from moedeploy.models.blockquant import QuantScheme
from moedeploy.plugins import moe, moe_nbits
from moedeploy.runtime import quantized

TensorProto = onnx.TensorProto
#: the scale types moe::MoENBits takes (X's type)
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def lower_for_tensorrt(model: onnx.ModelProto, experts_on_codes: bool = True) -> tuple[onnx.ModelProto, dict[str, int]]:
    """A copy of `model` rewritten for TensorRT's parser (module doc), and counts of what changed.
    `experts_on_codes=False` leaves moe::MoE on dequantized stacks (the graph ONNX Runtime can
    still run, for tests of the other rewrites)."""
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    graph = lowered.graph
    initializers = {i.name: i for i in graph.initializer}
    infos = {v.name: v for v in graph.value_info}
    readers = _readers(graph)
    counts = {"moe_nodes_on_codes": 0, "int4_stacks_as_rows": 0, "int8_blocks_as_channels": 0}
    if experts_on_codes:
        producers = {out: node for node in graph.node for out in node.output}
        unread: list[str] = []  # the float stacks moe::MoENBits nodes no longer read
        for node in graph.node:
            replaced = _experts_on_codes(node, producers, initializers, infos, readers)
            if replaced:
                unread += replaced
                counts["moe_nodes_on_codes"] += 1
        _drop_dead(graph, unread, producers)
        infos = {v.name: v for v in graph.value_info}  # _drop_dead rebuilt the list
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


def _readers(graph: onnx.GraphProto) -> dict[str, int]:
    """How many places read each value: node inputs, in subgraphs too (an If branch may read an
    outer value), graph outputs, and graph inputs (an initializer that is also an input, whose
    declared type and shape a rewrite must not change). A rewrite only touches values read
    exactly where it expects."""
    readers: dict[str, int] = {}

    def count(name: str) -> None:
        readers[name] = readers.get(name, 0) + 1

    def walk(g: onnx.GraphProto) -> None:
        for node in g.node:
            for name in node.input:
                count(name)
            for attribute in node.attribute:
                for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                    walk(sub)

    walk(graph)
    for value in [*graph.output, *graph.input]:
        count(value.name)
    return readers


def _experts_on_codes(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto],
                      initializers: dict[str, onnx.TensorProto], infos: dict[str, onnx.ValueInfoProto],
                      readers: dict[str, int]) -> list[str]:
    """Turn a moe::MoE over blocked DequantizeLinear stacks into moe::MoENBits in place (module
    doc); returns the float stacks it read (then unread), or nothing when the node is not one.
    The gate and up stacks are either two DequantizeLinear outputs or the strided Slices of one
    interleaved (E, 2I, H) stack (`_interleaved`). Every DequantizeLinear must be read by this
    node alone (through those Slices), as its codes are re-typed in place."""
    if (node.domain, node.op_type) != (moe.DOMAIN, moe.OP_TYPE) or len(node.input) != 9 or not all(node.input):
        return []
    floats = list(node.input[2:5])
    swiglu = next((a.s for a in node.attribute if a.name == "activation"), b"swiglu") == b"swiglu"
    fused = _interleaved(floats[0], floats[1], producers, initializers) if swiglu else None  # relu/gelu: no gate
    sources = [fused, fused, floats[2]] if fused is not None else floats
    for name in set(floats):  # the stacks as this node reads them: by this node alone
        if readers.get(name) != list(node.input).count(name):
            return []
    if fused is not None and readers.get(fused) != 2:  # the two Slices alone
        return []
    stacks = [_blocked_stack(producers.get(name), initializers, readers) for name in sources]
    if any(s is None for s in stacks) or len({s[3:] for s in stacks}) != 1:
        return []
    bits, block, signed = stacks[0][3:]
    inputs = list(node.input[:2])
    for codes, scale, zero_point, *_ in stacks:
        if codes.data_type != TensorProto.INT8:  # (a stack named twice is re-typed once)
            e, n, k = codes.dims
            _retype_bytes(codes, [e, n, k * bits // 8], infos.get(codes.name))
        if zero_point is not None and zero_point.data_type != TensorProto.INT8:
            count = int(np.prod(zero_point.dims))
            _retype_bytes(zero_point, [(count * bits + 7) // 8], infos.get(zero_point.name))
        inputs += [codes.name, scale.name, (codes if zero_point is None else zero_point).name]
    inputs += list(node.input[5:])
    del node.input[:]
    node.input.extend(inputs)
    node.op_type = moe_nbits.OP_TYPE
    values = (bits, block, int(signed), int(fused is not None))
    node.attribute.extend(helper.make_attribute(name, v) for name, v in zip(moe_nbits.ATTRIBUTES, values, strict=True))
    return floats


def _interleaved(gate: str, up: str, producers: dict[str, onnx.NodeProto],
                 initializers: dict[str, onnx.TensorProto]) -> str | None:
    """The (E, 2I, H) value whose even rows `gate` and odd rows `up` are, when both are
    `Slice(fused, start 0 | 1, end >= 2I, axis 1, step 2)` (what a streamed export writes)."""
    sources = []
    for name, start in ((gate, 0), (up, 1)):
        node = producers.get(name)
        if node is None or node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or len(node.input) != 5:
            return None
        consts = [_constant(v, producers, initializers) for v in node.input[1:]]
        if any(c is None for c in consts):
            return None
        codes = _dequantized_codes(producers.get(node.input[0]), initializers)
        if codes is None or len(codes.dims) != 3 or codes.dims[1] % 2 \
                or not moe.takes_strided_half(*(c.tolist() for c in consts), start, codes.dims[1]):
            return None
        sources.append(node.input[0])
    return sources[0] if sources[0] == sources[1] else None


def _constant(name: str, producers: dict[str, onnx.NodeProto],
              initializers: dict[str, onnx.TensorProto]) -> np.ndarray | None:
    """The value of an initializer or a Constant node's `value` (int lists only here), or None."""
    if name in initializers:
        return numpy_helper.to_array(initializers[name])
    node = producers.get(name)
    if node is not None and node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        return None if value is None else numpy_helper.to_array(value)
    return None


def _dequantized_codes(dq: onnx.NodeProto | None, initializers: dict[str, onnx.TensorProto]) -> onnx.TensorProto | None:
    """The codes initializer a DequantizeLinear reads, if `dq` is one over an initializer."""
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx"):
        return None
    return initializers.get(dq.input[0])


def _drop_dead(graph: onnx.GraphProto, values: list[str], producers: dict[str, onnx.NodeProto]) -> None:
    """Remove the nodes (and their value_info) that computed `values`, now read by no node, and
    so on up their inputs: the DequantizeLinear nodes, Slices and Constants moe::MoENBits
    replaced. Nodes whose output is a graph output, or still read, stay."""
    readers = _readers(graph)
    dead: set[str] = set()  # the first output of each removed node
    pending = list(values)
    while pending:
        node = producers.get(pending.pop())
        if node is None or node.output[0] in dead or any(readers.get(o) for o in node.output):
            continue
        dead.add(node.output[0])
        for name in node.input:
            readers[name] -= 1
            pending.append(name)
    outputs = {o for node in graph.node if node.output[0] in dead for o in node.output}
    nodes = [node for node in graph.node if node.output[0] not in dead]
    infos = [info for info in graph.value_info if info.name not in outputs]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    graph.value_info.extend(infos)


def _blocked_stack(dq: onnx.NodeProto | None, initializers: dict[str, onnx.TensorProto], readers: dict[str, int],
                   ) -> tuple[onnx.TensorProto, onnx.TensorProto, onnx.TensorProto | None, int, int, bool] | None:
    """(codes, scale, zero_point or None, bits, block_size, signed) of an (E, N, K) stack given as
    a DequantizeLinear blocked along K over initializers it alone reads, whose bytes are stored
    raw (so re-typing them keeps the bytes); None otherwise."""
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx") or len(dq.input) not in (2, 3):
        return None
    parts = [initializers.get(name) if name else None for name in dq.input]
    codes, scale, zero_point = (*parts, None)[:3]
    if codes is None or scale is None or (len(dq.input) == 3 and zero_point is None):
        return None
    if any(readers.get(p.name) != 1 for p in (codes, scale, zero_point) if p is not None) or len(codes.dims) != 3:
        return None
    if any(t.data_location != TensorProto.EXTERNAL and not t.HasField("raw_data") for t in (codes, zero_point) if t is not None):
        return None
    attrs = {a.name: a.i for a in dq.attribute}
    if set(attrs) - {"axis", "block_size"} or scale.data_type not in FLOAT_TYPES:
        return None  # output_dtype, say: the plugin computes in the scales' (= X's) type
    e, n, k = codes.dims
    block = attrs.get("block_size", 0)
    kind = quantized.blocked_format(codes.data_type, None if zero_point is None else zero_point.data_type,
                                    (e, n, k), attrs.get("axis", 1), block)
    if kind is None or list(scale.dims) != [e, n, k // block]:
        return None
    bits, signed = kind
    try:
        QuantScheme(bits, block, signed)  # the blocks the kernels take: a power of two too
    except ValueError:
        return None
    return codes, scale, zero_point, bits, block, signed


def _retype_bytes(tensor: onnx.TensorProto, dims: list[int], info: onnx.ValueInfoProto | None) -> None:
    """The same stored bytes read as INT8 of `dims` (the initializer and its value_info)."""
    tensor.data_type = TensorProto.INT8
    _set_dims(tensor, dims, info)
    if info is not None:
        info.type.tensor_type.elem_type = TensorProto.INT8


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
