"""moe::MoE on com.microsoft::MoE with every expert cut into one piece per thread: the fp32
decode path on ONNX Runtime's CPU provider.

Why: com.microsoft::MoE's CPU kernel hands each thread a contiguous range of experts and runs
an expert's GEMMs on one thread. A decode step's token takes k of E experts, so on 2 threads
both of its top-2 of 8 land on one thread 3 times in 7 while the other idles. Cut every
expert's hidden dimension into P pieces and order them piece-major (virtual expert j*E + e is
piece j of expert e): with P threads, thread j gets piece j of every expert, so each thread
streams 1/P of each expert a token takes, whichever they are. On the 2-core AMD EPYC of
session 39, greedy generation of the `small` preset took 0.935-0.984x the per-expert If
lowering's step time paired in one process, and `bench` decoded 1.05x and 1.22x its speed, at
1.08x the weights' memory against its 1.03x; prefill took 0.92-1.26x its time
(benchmarks/README.md). Where the thread count has no divisor of the expert hidden size but 1,
nothing is cut (`pieces_for`).

A SwiGLU expert splits exactly along its hidden dimension: piece j holds rows j*I/P.. of gate
and up and the same columns of down, and the expert's output is the sum of its pieces'.

Routing: each token's top-k logits are kept and every other one set to -inf, then repeated P
times. The k are chosen as the eager op chooses them: TopK over the softmax, ties to the lower
index (logits 1 ulp apart often tie there; TopK over the logits would take the larger one).
The op's softmax over the k*P finite entries gives each piece its expert's renormalised top-k
weight / P, and it selects exactly those k*P entries whatever ties they hold (a tie at the k-th
place, left in the logits, could mix pieces of different experts). The output is multiplied
back by P.

Weights: the piece-major order is a permutation of the stored stacks, so it cannot be a view
into the artifact's data file. The graph reads placeholder initializers (external data over
the same bytes as the stacks they re-lay) that `supply` must override with the re-laid
arrays through SessionOptions.add_initializer, which ONNX Runtime reads without a copy: the
session holds one copy of the experts, as the per-expert lowering holds its prepacked ones.
The native kernel's experts re-laid in 16-row panels (plugins/moe_native.py) come the same
way, as placeholders of kind PANELS, one an expert and matrix. `runtime.ort.load_lowered`
supplies them whichever way it is given the lowered graph (a ModelProto, its bytes or a file),
and `runtime.ort.create_session` lowers and loads through it. Loaded without `supply` a graph
would run on the stacks in their stored order, a wrong answer; a placeholder cannot point at a
missing file instead, because ONNX Runtime checks the path even of an initializer it is given.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from moedeploy.plugins.moe import (
    CONTRIB_DOMAIN,
    contrib_activation_attributes,
    contrib_biases,
    contrib_eligible,
    interleaved_source,
    nan_where_not_finite,
    node_activation,
    node_routing,
    routes_from,
)

#: TensorProto.metadata_props keys a placeholder carries: what it re-lays and into how many pieces
SPLIT_OF, PIECES = "moedeploy.split_of", "moedeploy.pieces"
FC1, FC2 = "fc1", "fc2"  # the interleaved gate/up stack (E, 2I, H) and the down stack (E, H, I)
#: one expert's matrix (rows, cols) re-laid as (rows / PANEL, cols, PANEL): plugins/moe_native's
PANELS, PANEL = "panels", 16
_PAGE = 4096


def pieces_for(node: ir.Node, provider: str, threads: int) -> int:
    """How many pieces this node's experts are cut into for `threads` threads: the largest
    divisor of the expert hidden size up to `threads`; 1 where the lowering does not apply.

    It applies to fp32 SwiGLU experts on the CPU provider with softmax routing renormalised
    over the top-k (what the op computes from the masked logits), no biases, and the stacks
    a streamed export writes: the interleaved gate/up stack and the down stack, both in the
    artifact's data file (where the placeholders point)."""
    if threads < 2 or provider != "CPUExecutionProvider" or node.inputs[0].dtype != ir.DataType.FLOAT:
        return 1
    if node_activation(node).activation != "swiglu" or not contrib_eligible(node, provider):
        return 1
    if not node_routing(node).normalize_topk or contrib_biases(node) != (False, False):
        return 1
    fused, w_down = interleaved_source(node.inputs[2], node.inputs[3]), node.inputs[4]
    if not all(v is not None and isinstance(v.const_value, ir.ExternalTensor) for v in (fused, w_down)):
        return 1
    hidden = int(node.inputs[3].shape[1])
    return max(p for p in range(1, threads + 1) if hidden % p == 0)


def lower_to_split(graph: ir.Graph, node: ir.Node, pieces: int, provider: str) -> None:
    """Replace one moe::MoE node (`pieces_for` > 1) by com.microsoft::MoE over its experts cut
    into `pieces`, in place; the graph then reads placeholders that `supply` must fill."""
    x, logits = node.inputs[0], node.inputs[1]
    fused, w_down = interleaved_source(node.inputs[2], node.inputs[3]), node.inputs[4]
    n_experts, hidden, dim = (int(d) for d in node.inputs[3].shape)
    new_nodes: list[ir.Node] = []

    def add(op_type: str, inputs, **attributes) -> ir.Value:
        n = ir.node(op_type, inputs, attributes)
        new_nodes.append(n)
        return n.outputs[0]

    k = node_routing(node).top_k
    probs = add("Softmax", [logits], axis=-1)  # what the eager op ranks
    top = ir.node("TopK", [probs, add("Constant", [], value=ir.tensor([k], dtype=ir.DataType.INT64))],
                  {"axis": -1, "largest": 1, "sorted": 1}, num_outputs=2)
    new_nodes.append(top)
    chosen = top.outputs[1]
    minus_inf = ir.tensor(np.array([-np.inf], np.float32))
    masked = add("ScatterElements", [add("ConstantOfShape", [add("Shape", [logits])], value=minus_inf),
                                     chosen, add("GatherElements", [logits, chosen], axis=-1)], axis=-1)
    fc1 = placeholder(graph, fused, FC1, pieces, [pieces * n_experts, 2 * hidden // pieces, dim])
    fc2 = placeholder(graph, w_down, FC2, pieces, [pieces * n_experts, dim, hidden // pieces])
    attrs = {"k": k * pieces, "normalize_routing_weights": 1, **contrib_activation_attributes(node_activation(node))}
    moe_node = ir.node("MoE", [x, add("Concat", [masked] * pieces, axis=-1), fc1, None, fc2, None], attrs,
                       domain=CONTRIB_DOMAIN)
    new_nodes.append(moe_node)
    y = add("Mul", [moe_node.outputs[0], add("Constant", [], value=ir.tensor(float(pieces), dtype=ir.DataType.FLOAT))])
    x_reaches = provider == "CPUExecutionProvider" and routes_from(x, logits)
    y = nan_where_not_finite(add, y, x, logits, x_reaches)
    name = node.outputs[0].name
    ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, [node.outputs[0]], [y])
    y.name = name  # downstream tools (layer-wise compare) look values up by name
    graph.opset_imports.setdefault(CONTRIB_DOMAIN, 1)


def placeholder(graph: ir.Graph, source: ir.Value, kind: str, pieces: int, shape: list[int],
                name: str | None = None) -> ir.Value:
    """An initializer of `shape` over the same external bytes as `source` (same size), marked
    with what `supply` re-lays into it: the one way the project hands ONNX Runtime re-laid weights."""
    tensor = source.const_value
    assert isinstance(tensor, ir.ExternalTensor)
    name = name or f"{source.name}.split{pieces}"
    if name in graph.initializers:  # another node's lowering made it already
        return graph.initializers[name]
    placeholder = ir.ExternalTensor(tensor.location, tensor.offset, tensor.length, tensor.dtype, shape=ir.Shape(shape),
                                    name=name, base_dir=tensor.base_dir,
                                    metadata_props={SPLIT_OF: kind, PIECES: str(pieces)})
    value = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(tensor.dtype), const_value=placeholder)
    value.metadata_props.update(placeholder.metadata_props)
    graph.register_initializer(value)
    return value


def placeholders(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The initializers of a lowered model that `supply` must fill."""
    return [t for t in model.graph.initializer if any(p.key == SPLIT_OF for p in t.metadata_props)]


def supply(model: onnx.ModelProto, weights_dir: Path | str, options: ort.SessionOptions) -> list[object]:
    """Re-lay every placeholder's source (a stack piece-major, or an expert's matrix in panels)
    into a page-aligned array and hand it to ONNX Runtime (add_initializer: read in place, never
    copied). Returns the arrays and the OrtValues over them, which must live as long as
    `options` and any session made with it.

    The stacks are read expert by expert with plain file reads, never memory-mapped, so the
    process holds one expert's bytes beyond the re-laid arrays while this runs."""
    arrays = []
    for proto in placeholders(model):
        meta = {p.key: p.value for p in proto.metadata_props}
        kind, pieces = meta[SPLIT_OF], int(meta[PIECES])
        external = {e.key: e.value for e in proto.external_data}
        if proto.data_type != onnx.TensorProto.FLOAT or kind not in (FC1, FC2, PANELS):
            raise ValueError(f"placeholder {proto.name!r}: expected a float fc1 or fc2 stack or an expert's panels, "
                             f"got {kind!r}")
        path, offset, length = Path(weights_dir) / external["location"], int(external.get("offset", 0)), \
            int(external["length"])
        out = (_panels if kind == PANELS else _pieces)(proto, kind, pieces, path, offset, length)
        value = ort.OrtValue.ortvalue_from_numpy(out)
        options.add_initializer(proto.name, value)  # keeps a pointer, not a reference: the caller keeps `value`
        arrays += [out, value]
    return arrays


def _pieces(proto: onnx.TensorProto, kind: str, pieces: int, path: Path, offset: int, length: int) -> np.ndarray:
    """The fc1 or fc2 stack stored at `offset` with every expert cut into `pieces`, piece-major."""
    virtual, rows, cols = (int(d) for d in proto.dims)
    n_experts = virtual // pieces
    out = _aligned_empty((virtual, rows, cols))
    per_expert = rows * cols * pieces  # floats of one stored expert
    if length != 4 * per_expert * n_experts:
        raise ValueError(f"split placeholder {proto.name!r}: its source is {length} bytes, "
                         f"not the {4 * per_expert * n_experts} its shape needs")
    with open(path, "rb") as f:
        for e in range(n_experts):
            f.seek(offset + 4 * per_expert * e)
            stored = np.fromfile(f, dtype=np.float32, count=per_expert)
            if stored.size != per_expert:
                raise ValueError(f"{path} ends inside {proto.name!r}'s source stack")
            if kind == FC1:  # (2I, H): piece j is rows j*2I/P.. (gate/up pairs stay together)
                pieces_of = stored.reshape(pieces, rows, cols)
            else:  # (H, I): piece j is columns j*I/P..
                pieces_of = stored.reshape(rows, pieces, cols).transpose(1, 0, 2)
            out[e::n_experts] = pieces_of  # virtual expert j*E + e
    return out


def _panels(proto: onnx.TensorProto, kind: str, pieces: int, path: Path, offset: int, length: int) -> np.ndarray:
    """The (rows, cols) matrix stored at `offset` as (rows / PANEL, cols, PANEL): panel p holds
    rows PANEL p.. column by column (moe_experts.cc's panel_dot reads it)."""
    panels, cols, width = (int(d) for d in proto.dims)
    count = panels * cols * width
    if length != 4 * count:
        raise ValueError(f"placeholder {proto.name!r}: its source is {length} bytes, not the {4 * count} its shape needs")
    with open(path, "rb") as f:
        f.seek(offset)
        stored = np.fromfile(f, dtype=np.float32, count=count)
    if stored.size != count:
        raise ValueError(f"{path} ends inside {proto.name!r}'s source matrix")
    out = _aligned_empty((panels, cols, width))
    out[...] = stored.reshape(panels, width, cols).transpose(0, 2, 1)
    return out


def _aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array starting on a page boundary, as ONNX Runtime aligns what it allocates (a
    large malloc returns a page plus 16 bytes). Defensive, not measured to matter: paired in one
    process, generations with malloc's offset took 0.995x the aligned arrays' step time."""
    count = int(np.prod(shape))
    buffer = np.empty(count * 4 + _PAGE, dtype=np.uint8)
    start = (-buffer.ctypes.data) % _PAGE
    return buffer[start:start + count * 4].view(np.float32).reshape(shape)
