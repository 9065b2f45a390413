"""moe::MoE lowered to one ONNX If per expert: the CPU fp32 default where plugins/moe_split.py
does not apply (one thread; routings other than renormalised softmax top-k; expert biases), and
the faster of the two in prefill.

com.microsoft::MoE's CPU kernel multiplies each expert's weights unpacked and transposed,
one expert per thread, with the experts split between threads by index; for the one token of
a decode step it reaches about 40-55% of the bandwidth floor (benchmarks/moe_decode_paths.py).
Here each expert is an If, taken when any token routes to it, whose branch gathers that
expert's tokens, runs its SwiGLU as Gemm nodes on the expert's own weights (initializers
ONNX Runtime prepacks at session creation, multi-threaded like any MatMul), scales by the
routing weights and scatters the rows back. An untaken expert costs one If. The routing is
the op's own, computed on its function body by `moe.routing_probe`, so every routing variant
(softmax, sigmoid with a selection bias, groups, scaling, sparsemixer) takes this path.

The per-expert weights are new initializers that point into the artifact's data file at each
expert's offset (no bytes are copied on disk); the interleaved gate/up weight a streamed
export writes is used as one Gemm per expert. Rows with NaN or Inf come out NaN, as in eager
PyTorch (`moe.nan_where_not_finite`).
"""

from __future__ import annotations

import onnx_ir as ir

from moedeploy.plugins.moe import (
    interleaved_source,
    is_zero,
    nan_where_not_finite,
    node_activation,
    node_routing,
    routing_probe,
)
from moedeploy.runtime import quantized

FLOAT = ir.DataType.FLOAT


def experts_eligible(node: ir.Node, provider: str) -> bool:
    """fp32 on the CPU provider, SwiGLU experts, and weights that are constant initializers
    (so each expert's slice can be an initializer of its own), or quantized ones (blocked
    DequantizeLinear over constants: each expert's codes go to MatMulNBits)."""
    if provider != "CPUExecutionProvider" or node.inputs[0].dtype != FLOAT:
        return False
    if node_activation(node).activation != "swiglu":
        return False
    w_gate, w_up, w_down = node.inputs[2:5]
    fused = interleaved_source(w_gate, w_up)
    stacked = [fused, w_down] if fused is not None else [w_gate, w_up, w_down]
    biases = [b for b in node.inputs[5:8] if b is not None and not is_zero(b)]
    return (all(_constant(v) is not None or quantized.blocked_source(v) is not None for v in stacked)
            and all(_constant(b) is not None for b in biases))


def _constant(value: ir.Value | None) -> ir.TensorProtocol | None:
    if value is None or value.const_value is None or value.shape is None:
        return None
    return value.const_value


def expert_slice(value: ir.Value, expert: int) -> ir.Value:
    """Expert `expert`'s slice of a stacked (E, ...) constant, as an initializer of its own:
    a view into the same external data file (offset, length) when the weights live there."""
    assert value.const_value is not None and value.shape is not None
    return quantized.constant_view(value, expert, value.const_value.dtype, [int(d) for d in value.shape][1:],
                                   f"{value.name}.expert{expert}")


def shared_slice(graph: ir.Graph, value: ir.Value, expert: int) -> ir.Value:
    """`expert_slice`, or the initializer of that name already in `graph`: one initializer an
    expert and matrix, whichever lowering (this one, plugins/moe_native.py) made it first."""
    existing = graph.initializers.get(f"{value.name}.expert{expert}")
    return existing if existing is not None else expert_slice(value, expert)


def plain_softmax(node: ir.Node) -> bool:
    """Softmax top-k, optionally renormalised, with no selection bias, groups or scaling."""
    r = node_routing(node)
    score_bias = node.inputs[8] if len(node.inputs) > 8 else None
    return (r.scoring == "softmax" and r.n_group == 1 and r.routed_scaling_factor == 1.0
            and (score_bias is None or is_zero(score_bias)))


def dense_routing(add: NodeBuilder, node: ir.Node, logits: ir.Value, n_experts: int) -> ir.Value:
    """Each token's routing weights, (N, E) in fp32, zero off its top-k.

    Plain softmax routing in five nodes: Softmax, TopK (ties to the lower index, as the op),
    the optional renormalisation, ScatterElements. Every other routing on the op's own
    function body (`routing_probe`), which costs more nodes per step.
    """
    if not plain_softmax(node):
        return add("Reshape", [routing_probe(node, add.nodes), add.ints([-1, n_experts])])
    r = node_routing(node)
    probs = add("Softmax", [add("Reshape", [logits, add.ints([-1, n_experts])])], axis=-1)
    top = ir.node("TopK", [probs, add.ints([r.top_k])], {"axis": -1, "largest": 1, "sorted": 1},
                  num_outputs=2, name=f"{add.prefix}/TopK_{len(add.nodes)}")
    add.nodes.append(top)
    for i, value in enumerate(top.outputs):
        value.name = f"{top.name}:{i}"
    weights, experts = top.outputs
    if r.normalize_topk:
        weights = add("Div", [weights, add("ReduceSum", [weights, add.ints([-1])], keepdims=1)])
    return add("ScatterElements", [add("Mul", [probs, add.scalar(0.0)]), experts, weights], axis=1)


class NodeBuilder:
    """Appends nodes to a list and returns their (first) outputs, every value named under
    `prefix` (values of If branches must not share names with each other or the main graph)."""

    def __init__(self, prefix: str) -> None:
        self.nodes: list[ir.Node] = []
        self.prefix = prefix

    def __call__(self, op: str, inputs: list, domain: str = "", **attrs) -> ir.Value:
        node = ir.node(op, inputs, attrs, domain=domain, name=f"{self.prefix}/{op}_{len(self.nodes)}")
        self.nodes.append(node)
        for i, value in enumerate(node.outputs):
            value.name = f"{node.name}:{i}"
        return node.outputs[0]

    def ints(self, values: int | list[int]) -> ir.Value:
        """An int64 constant: a list is 1-D, an int a scalar (Gather by a scalar drops the axis)."""
        return self("Constant", [], value=ir.tensor(values, dtype=ir.DataType.INT64))

    def scalar(self, value: float) -> ir.Value:
        return self("Constant", [], value=ir.tensor(value, dtype=FLOAT))


def lower_to_experts(graph: ir.Graph, node: ir.Node, nbits_accuracy: int = 0) -> None:
    """Replace one moe::MoE node by the routing probe and one If per expert, in place."""
    x, logits, w_gate, w_up, w_down, b_gate, b_up, b_down = (list(node.inputs) + [None] * 3)[:8]
    n_experts, hidden, dim = (int(d) for d in w_up.shape)
    prefix = f"{node.name or node.outputs[0].name}/experts"
    add = NodeBuilder(prefix)
    flat_x = add("Reshape", [x, add.ints([-1, dim])])  # (N, H)
    dense = dense_routing(add, node, logits, n_experts)  # (N, E) weights, 0 off each token's top-k
    zeros = add("ConstantOfShape", [add("Shape", [flat_x])])  # float 0, (N, H)
    zero = add.scalar(0.0)
    fused = interleaved_source(w_gate, w_up)
    initializers: list[ir.Value] = []

    def weight(value: ir.Value | None, expert: int) -> ir.Value | quantized.NBitsWeight | None:
        if value is None or is_zero(value):
            return None
        if (blocked := quantized.blocked_source(value)) is not None:
            return quantized.nbits_weight(graph, blocked, expert)
        sliced = shared_slice(graph, value, expert)
        if sliced.name not in graph.initializers:
            initializers.append(sliced)
        return sliced

    # which experts any token routes to, for all experts at once (a few nodes per layer, not per
    # expert): from the mask, not ReduceMax of the weights, which a NaN row would make NaN
    routed = add("Cast", [add("Greater", [dense, zero])], to=FLOAT)  # (N, E)
    taken = add("Greater", [add("ReduceMax", [routed, add.ints([0])], keepdims=0), zero])  # (E,) bool
    split = ir.node("Split", [taken], {"axis": 0, "num_outputs": n_experts}, num_outputs=n_experts,
                    name=f"{prefix}/Split_{len(add.nodes)}")
    add.nodes.append(split)
    for e, value in enumerate(split.outputs):
        value.name = f"{split.name}:{e}"  # expert e's If condition, one element
    outs = []
    for e in range(n_experts):
        fc1 = (weight(fused, e),) if fused is not None else (weight(w_gate, e), weight(w_up, e))
        branch = _expert_branch(f"{prefix}/expert{e}", flat_x, dense, e, zeros, fc1, weight(w_down, e),
                                (weight(b_gate, e), weight(b_up, e), weight(b_down, e)), hidden, node, nbits_accuracy)
        skip = NodeBuilder(f"{prefix}/expert{e}_skipped")
        none = skip("Identity", [zeros])
        outs.append(add("If", [split.outputs[e]], then_branch=branch,
                        else_branch=ir.Graph([], [none], nodes=skip.nodes, name=skip.prefix)))
    y = add("Sum", outs) if len(outs) > 1 else outs[0]
    # NaN rows where eager gives NaN: a non-finite input, or a routing that is not finite (the
    # probe's weights carry exactly that: a +Inf logit is NaN under softmax, finite under sigmoid)
    y = nan_where_not_finite(add, y, flat_x, dense)
    y = add("Reshape", [y, add("Shape", [x])])
    for value in initializers:
        graph.register_initializer(value)
    name = node.outputs[0].name
    ir.convenience.replace_nodes_and_values(graph, node, [node], add.nodes, [node.outputs[0]], [y])
    y.name = name  # downstream tools (layer-wise compare) look values up by name
    y.shape, y.type = node.outputs[0].shape, node.outputs[0].type  # x's: later lowerings match on it


def _expert_branch(
    prefix: str, flat_x: ir.Value, dense: ir.Value, expert: int, zeros: ir.Value, fc1: tuple, w_down: ir.Value,
    biases: tuple, hidden: int, node: ir.Node, nbits_accuracy: int = 0,
) -> ir.Graph:
    """The taken branch: expert e on the tokens routed to it, scattered into an (N, H) zero tensor."""
    act = node_activation(node)
    add = NodeBuilder(prefix)
    zero = add.scalar(0.0)
    w_e = add("Gather", [dense, add.ints([expert])], axis=1)  # (N, 1): its routing weights
    routed = add("Squeeze", [add("Greater", [w_e, zero]), add.ints([1])])  # (N,) bool
    rows = add("Reshape", [add("NonZero", [routed]), add.ints([-1])])  # (M,)
    xs = add("Gather", [flat_x, rows], axis=0)  # (M, H)
    def linear(x: ir.Value, w) -> ir.Value:  # x @ w^T: Gemm on a float weight, MatMulNBits on codes
        if isinstance(w, quantized.NBitsWeight):
            return w.matmul(add, x, nbits_accuracy)
        return add("Gemm", [x, w], transB=1)

    if len(fc1) == 1:  # the interleaved (2I, H) weight: one Gemm, then the even and odd columns
        # as the two planes of (M, I, 2) moved outwards: ONNX Runtime's Transpose has a fast path
        # for moving one axis outwards, its Slice with a step of 2 none (a 32-row prefill expert:
        # 162 against 283 us on a 2-core Xeon, benchmarks/README.md)
        both = linear(xs, fc1[0])  # (M, 2I)
        planes = add("Transpose", [add("Reshape", [both, add.ints([0, hidden, 2])])], perm=[2, 0, 1])  # (2, M, I)
        g = add("Gather", [planes, add.ints(0)], axis=0)
        u = add("Gather", [planes, add.ints(1)], axis=0)
    else:
        g, u = linear(xs, fc1[0]), linear(xs, fc1[1])
    b_gate, b_up, b_down = biases
    if b_gate is not None:
        g = add("Add", [g, b_gate])
    if b_up is not None:
        u = add("Add", [u, b_up])
    if act.clamped:
        limit = add.scalar(act.swiglu_limit)
        g = add("Min", [g, limit])
        u = add("Max", [add("Min", [u, limit]), add.scalar(-act.swiglu_limit)])
    gate_in = g if act.activation_alpha == 1.0 else add("Mul", [g, add.scalar(act.activation_alpha)])
    gated = add("Mul", [g, add("Sigmoid", [gate_in])])
    if act.activation_beta != 0.0:
        u = add("Add", [u, add.scalar(act.activation_beta)])
    h = add("Mul", [gated, u])
    y = linear(h, w_down)
    if b_down is not None:
        y = add("Add", [y, b_down])
    y = add("Mul", [y, add("Gather", [w_e, rows], axis=0)])  # times each token's routing weight
    out = add("ScatterND", [zeros, add("Unsqueeze", [rows, add.ints([1])]), y])
    return ir.Graph([], [out], nodes=add.nodes, name=prefix)
