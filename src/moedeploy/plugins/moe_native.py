"""moe::MoE lowered to the project's own ONNX Runtime kernel, moedeploy.cpu::MoEExperts
(plugins/native/moe_experts.cc): the routing on graph ops, the routed experts in one node.

Standard ONNX can pick an expert's weights at run time only by copying them (Gather, Slice)
or with an If per expert (plugins/moe_experts.py), whose subgraphs and row selection cost a
decode step about a tenth of its time (benchmarks/decode_ablation.py's fixed-experts). The
kernel reads each expert's weights in place, for the tokens routed to it only, on ONNX
Runtime's own threads. It is a matrix-vector kernel: right for the one token of a decode
step, slow for a prompt's many (no GEMM blocking). So a layer takes it under an If on the
token count: one token -> the kernel; more -> the per-expert Ifs, which stay for prompts.
Both read the same initializers, one an expert and matrix (views into the artifact's data
file), so ONNX Runtime maps each expert's bytes once; nested one If deeper, the prompt path's
Gemms are not prepacked (no second copy of the experts either: memory is the mapped file).

NaN rows where eager PyTorch gives them (a non-finite input row, a NaN or +Inf routing
weight) come from the kernel itself, so the one-token branch needs no guard nodes.
"""

from __future__ import annotations

import onnx_ir as ir

from moedeploy.plugins.moe import interleaved_source, is_zero, node_activation
from moedeploy.plugins.moe_experts import (
    NodeBuilder,
    dense_routing,
    experts_eligible,
    lower_to_experts,
    shared_slice,
)

DOMAIN, OP_TYPE = "moedeploy.cpu", "MoEExperts"
FLOAT = ir.DataType.FLOAT


def native_eligible(node: ir.Node, provider: str) -> bool:
    """What the per-expert lowering takes (fp32 SwiGLU on CPU, constant weights), with float
    stacks (not quantized codes) and no expert biases: the kernel has neither."""
    if not experts_eligible(node, provider):
        return False
    w_gate, w_up, w_down = node.inputs[2:5]
    fused = interleaved_source(w_gate, w_up)
    stacks = [fused, w_down] if fused is not None else [w_gate, w_up, w_down]
    biases = [b for b in node.inputs[5:8] if b is not None and not is_zero(b)]
    return not biases and all(v.const_value is not None and v.dtype == FLOAT for v in stacks)


def lower_to_native(graph: ir.Graph, node: ir.Node) -> None:
    """Replace one moe::MoE node by If(one token: MoEExperts, else: one If per expert)."""
    x, logits, w_gate, w_up, w_down = node.inputs[:5]
    n_experts = int(w_up.shape[0])
    dim = int(w_up.shape[2])
    prefix = f"{node.name or node.outputs[0].name}/native"
    fused = interleaved_source(w_gate, w_up)
    act = node_activation(node)

    one = NodeBuilder(f"{prefix}/one_token")
    flat_x = one("Reshape", [x, one.ints([-1, dim])])
    dense = dense_routing(one, node, logits, n_experts)
    stacks = [fused, w_down] if fused is not None else [w_gate, w_up, w_down]
    weights = []
    for stack in stacks:  # one initializer an expert, shared with the Ifs below
        for e in range(n_experts):
            sliced = shared_slice(graph, stack, e)
            if sliced.name not in graph.initializers:
                graph.register_initializer(sliced)
            weights.append(sliced)
    y = one("MoEExperts", [flat_x, dense, *weights], domain=DOMAIN, interleaved=int(fused is not None),
            activation_alpha=float(act.activation_alpha), activation_beta=float(act.activation_beta),
            swiglu_limit=float(act.swiglu_limit))
    y = one("Reshape", [y, one("Shape", [x])])
    one_token = ir.Graph([], [y], nodes=one.nodes, name=one.prefix)

    # the general path: the per-expert lowering of a copy of the node, inside the else branch
    many = ir.Graph([], [], nodes=[], name=f"{prefix}/tokens")
    copy = ir.node(node.op_type, list(node.inputs), {k: v for k, v in node.attributes.items()}, domain=node.domain,
                   version=node.version, name=f"{prefix}/tokens/moe", num_outputs=1)
    copy.outputs[0].name = f"{prefix}/tokens/y"
    copy.outputs[0].shape, copy.outputs[0].type = node.outputs[0].shape, node.outputs[0].type
    many.append(copy)
    many.outputs.append(copy.outputs[0])
    lower_to_experts(graph, copy, branch_graph=many)

    add = NodeBuilder(prefix)
    rows = add("ReduceProd", [add("Slice", [add("Shape", [x]), add.ints([0]), add.ints([-1])])], keepdims=0)
    is_one = add("Equal", [rows, add.ints(1)])
    out = add("If", [is_one], then_branch=one_token, else_branch=many)
    name = node.outputs[0].name
    ir.convenience.replace_nodes_and_values(graph, node, [node], add.nodes, [node.outputs[0]], [out])
    out.name = name
    out.shape, out.type = node.outputs[0].shape, node.outputs[0].type
