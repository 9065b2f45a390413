"""moe::MoE lowered to the project's own ONNX Runtime kernel, moedeploy.cpu::MoEExperts
(plugins/native/moe_experts.cc): the routing on graph ops, the routed experts in one node.

Standard ONNX can pick an expert's weights at run time only by copying them (Gather, Slice)
or with an If per expert (plugins/moe_experts.py), whose subgraphs and row selection cost a
decode step about a tenth of its time (benchmarks/decode_ablation.py's fixed-experts). The
kernel reads each expert's weights in place, once for all the tokens routed to it, on ONNX
Runtime's own threads: a GEMV for a decode step's one token, blocks of rows x tokens for a
prompt. It takes one initializer an expert and matrix: where the weights live in the
artifact's data file and every matrix has a multiple of 16 rows (every decoder we export), a
placeholder over that expert's bytes that plugins/moe_split.supply fills with them re-laid in
16-row panels when the session loads (the kernel's panel GEMV reads as fast as a plain sum;
the row-at-a-time dot read 0.61-0.74x as fast, benchmarks/README.md): the session holds one
copy of the experts, and the mapped file's pages stay unread. Otherwise (weights inside
model.onnx: blocks, whose lowered graphs are cached as files; or a session sharing the mapped
file, relayout=False) views of the stacks as stored.

NaN rows where eager PyTorch gives them (a non-finite input row, a NaN or +Inf routing
weight) come from the kernel itself: no guard nodes after it.
"""

from __future__ import annotations

import onnx_ir as ir

from moedeploy.plugins import moe_split
from moedeploy.plugins.moe import interleaved_source, is_zero, node_activation
from moedeploy.plugins.moe_experts import (
    NodeBuilder,
    dense_routing,
    experts_eligible,
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


def lower_to_native(graph: ir.Graph, node: ir.Node, relayout: bool = True) -> None:
    """Replace one moe::MoE node by its routing on graph ops and one MoEExperts node, in place;
    relayout=False: views of the stored weights even where panels could be made (a session
    sharing the mapped file must not hold a copy of its own)."""
    x, logits, w_gate, w_up, w_down = node.inputs[:5]
    n_experts, dim = int(w_up.shape[0]), int(w_up.shape[2])
    fused = interleaved_source(w_gate, w_up)
    act = node_activation(node)
    add = NodeBuilder(f"{node.name or node.outputs[0].name}/native")
    flat_x = add("Reshape", [x, add.ints([-1, dim])])
    dense = dense_routing(add, node, logits, n_experts)
    stacks = [fused, w_down] if fused is not None else [w_gate, w_up, w_down]
    panels = relayout and all(isinstance(v.const_value, ir.ExternalTensor) and int(v.shape[1]) % moe_split.PANEL == 0
                              for v in stacks)
    weights = []
    for stack in stacks:
        for e in range(n_experts):  # one initializer an expert: a view into the artifact's data file
            sliced = shared_slice(graph, stack, e)
            if panels:  # over the same bytes, re-laid at load
                rows, cols = (int(d) for d in sliced.shape)
                sliced = moe_split.placeholder(graph, sliced, moe_split.PANELS, 1, [rows // moe_split.PANEL, cols,
                                                                                  moe_split.PANEL],
                                               name=f"{sliced.name}.panels")
            elif sliced.name not in graph.initializers:
                graph.register_initializer(sliced)
            weights.append(sliced)
    y = add(OP_TYPE, [flat_x, dense, *weights], domain=DOMAIN, interleaved=int(fused is not None), panels=int(panels),
            activation_alpha=float(act.activation_alpha), activation_beta=float(act.activation_beta),
            swiglu_limit=float(act.swiglu_limit))
    y = add("Reshape", [y, add("Shape", [x])])
    graph.opset_imports.setdefault(DOMAIN, 1)  # a graph saved to a file must name the domain
    name = node.outputs[0].name
    ir.convenience.replace_nodes_and_values(graph, node, [node], add.nodes, [node.outputs[0]], [y])
    y.name = name  # downstream tools (layer-wise compare) look values up by name
    y.shape, y.type = node.outputs[0].shape, node.outputs[0].type
