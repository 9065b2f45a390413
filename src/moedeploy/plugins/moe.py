"""The `moe::MoE` op: top-k routed mixture of experts over stacked expert weights.

Semantics (opset "moe" version 3; each version is the next with every attribute it added at
its default: version 2 added the routing variants, version 3 `group_scoring` and the SwiGLU
parameters `activation_alpha`, `activation_beta`, `swiglu_limit`):

  routing, in fp32 (`scoring`):
    softmax      s = softmax(logits)         Mixtral, Qwen2/3-MoE, OLMoE, GraniteMoE, gpt-oss
                                             (whose top-k-then-softmax equals renormalised
                                             softmax top-k), DeepSeek-V2
    sigmoid      s = sigmoid(logits)         GLM-4-MoE, MiniMax-M2, DeepSeek-V3
    sparsemixer  PhiMoE's inference router (top-2 only): each of the two picks is the arg-max
                 of the logits left, weighted by a softmax over the logits within `jitter_eps`
                 (relative) of that maximum
  selection    idx = top_k(s + score_bias)   the bias (zeros for most families) only chooses
               with n_group > 1, only the `topk_group` groups of experts with the best group
               score compete, the others are masked with -inf; the group score
               (`group_scoring`) of (s + bias) over the group's experts is
                 "top2_sum" (default)  the sum of its two best  DeepSeek-V3, GLM-4-MoE
                 "max"                 its best                 DeepSeek-V2 group_limited_greedy
               (transformers masks V2's dropped experts with 0.0 instead: the same picks, as
               softmax scores are positive and top_k <= the kept groups' experts, which
               `Routing.check` requires). Equal values go to the lower index, groups and
               experts alike (ONNX TopK's rule; torch.topk, and so transformers, leaves that
               order unspecified)
  weights      w = s[idx]; w /= sum(w) if normalize_topk; w *= routed_scaling_factor
  y[n]         sum_j w[n, j] * expert_{idx[n, j]}(x[n])
  expert_e(x) = down_e(swiglu(gate_e x, up_e x))   activation "swiglu"
              = down_e(act(up_e x))                activation "relu" / "gelu" (no gate)
  swiglu(g, u) = g' * sigmoid(alpha * g') * (u' + beta), with
              g' = min(g, limit), u' = clamp(u, -limit, limit)
              alpha = activation_alpha (default 1.0), beta = activation_beta (default 0.0),
              limit = swiglu_limit (default +inf: no clamp; it must be > 0). The defaults give
              silu(g) * u; gpt-oss is alpha 1.702, beta 1, limit 7. The names and meaning are
              ONNX Runtime's com.microsoft::MoE attributes' (whose absent limit is no clamp,
              and whose limit 0 clamps everything to 0). relu/gelu take none of them.
  Every linear above carries its bias (b_gate, b_up, b_down; zeros for most families).

Weights are stacked `[E, out, in]` (nn.Linear's layout per expert); biases `[E, out]`;
`score_bias` is `[E]`. `x` is `[N, H]`, `router_logits` `[N, E]`. For relu/gelu experts the
w_gate/b_gate inputs are ignored; they must still have w_up's/b_up's shapes (the exporter passes
w_up and zeros).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript
import torch
import torch.nn.functional as F
from onnxscript import opset23 as op

from moedeploy.moe_attributes import (  # noqa: F401 (the op's attributes, re-exported: moe.Routing, ...)
    ACTIVATIONS,
    GROUP_SCORINGS,
    NO_LIMIT,
    SCORINGS,
    ExpertActivation,
    Routing,
    as_activation,
)

DOMAIN = "moe"
OP_TYPE = "MoE"
#: The "moe" domain's opset version (shared by moe::RMSNorm): 2 added routing variants,
#: 3 DeepSeek-V2's group scoring and gpt-oss's clamped SwiGLU.
VERSION = 3
PLUGIN_NAMESPACE = "moe"


def route(
    router_logits: torch.Tensor,
    top_k: int | Routing,
    normalize_topk: bool = True,
    score_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's experts; returns fp32 weights (N, k) and expert indices (N, k).

    `top_k` is a Routing, or the top-k of plain softmax routing (with `normalize_topk`).
    """
    r = top_k if isinstance(top_k, Routing) else Routing(top_k, normalize_topk)
    logits = router_logits.float()
    if r.scoring == "sparsemixer":
        return _sparsemixer(logits, r.jitter_eps)
    scores = torch.softmax(logits, dim=-1) if r.scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if score_bias is None else scores + score_bias.float()
    if r.n_group > 1:
        n, e = choice.shape
        grouped = choice.view(n, r.n_group, e // r.n_group)
        if r.group_scoring == "max":
            group_scores = grouped.amax(dim=-1)  # (N, G)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
        keep = torch.zeros_like(group_scores).scatter_(1, _top_indices(group_scores, r.topk_group), 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(e // r.n_group, dim=1), float("-inf"))
    experts = _top_indices(choice, r.top_k)
    weights = scores.gather(1, experts)
    if r.normalize_topk:
        # sigmoid scores need not sum to anything; HF's +1e-20 guards a zero sum there
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if r.scoring == "sigmoid" else 0.0))
    if r.routed_scaling_factor != 1.0:
        weights = weights * r.routed_scaling_factor
    return weights, experts


def _top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, ties to the lower index (ONNX TopK's rule).

    torch.topk leaves the order of equal values unspecified (it changes with the tensor's size
    on CPU); a fixed rule keeps the eager reference, the function body and the kernels in step.
    """
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def _sparsemixer(logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's router at inference: two picks, each the arg-max of what is left, weighted by
    a softmax over the logits within 2 * jitter_eps (relative) of that maximum."""

    def pick(remaining: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        best, index = remaining.max(dim=-1, keepdim=True)
        factor = logits.abs().clamp(min=best)
        far = (best - logits) / factor > 2 * jitter_eps
        weight = torch.softmax(remaining.masked_fill(far, float("-inf")), dim=-1).gather(1, index)
        return weight, index

    w1, i1 = pick(logits)
    w2, i2 = pick(logits.scatter(1, i1, float("-inf")))
    return torch.cat([w1, w2], dim=1), torch.cat([i1, i2], dim=1)


def expert_forward(
    x: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str | ExpertActivation,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert's FFN on the rows routed to it; weights are that expert's `[out, in]` slices."""
    act = as_activation(activation)
    up = F.linear(x, w_up, b_up)
    if act.activation == "swiglu":
        hidden = swiglu(F.linear(x, w_gate, b_gate), up, act)
    elif act.activation == "relu":
        hidden = F.relu(up)
    else:
        hidden = F.gelu(up)
    return F.linear(hidden, w_down, b_down)


def swiglu(gate: torch.Tensor, up: torch.Tensor, act: ExpertActivation) -> torch.Tensor:
    """(up' + beta) * gate' * sigmoid(alpha * gate'), in the tensors' dtype (see the module
    docstring); exactly silu(gate) * up at the default parameters."""
    if not act.parametrised:
        return F.silu(gate) * up
    if act.clamped:
        gate = gate.clamp(max=act.swiglu_limit)
        up = up.clamp(-act.swiglu_limit, act.swiglu_limit)
    glu = gate * torch.sigmoid(gate * act.activation_alpha)
    return (up + act.activation_beta) * glu


def moe_reference(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int | Routing,
    normalize_topk: bool = True,
    activation: str | ExpertActivation = "swiglu",
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    score_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact sparse MoE: each token runs through its k experts only.

    `top_k` is a Routing, or the top-k of plain softmax routing (with `normalize_topk`);
    `activation` an ExpertActivation, or the name of one with default parameters.

    Tokens are grouped by expert with one stable sort, so each expert does a single GEMM
    over its rows (an expert with no rows does an empty one). Eager only: the group sizes
    are data, which is why export emits the `moe::MoE` node instead of tracing this.
    """
    n_tokens, _ = x.shape
    n_experts = w_up.shape[0]
    activation = as_activation(activation)
    routing = top_k if isinstance(top_k, Routing) else Routing(top_k, normalize_topk)
    top_k = routing.top_k
    weights, experts = route(router_logits, routing, score_bias=score_bias)  # (N, k), (N, k)

    flat_experts = experts.reshape(-1)  # (N*k,) slot n*k + j -> expert
    order = flat_experts.argsort(stable=True)  # slots grouped by expert
    token_of_slot = order // top_k  # (N*k,) the token each grouped slot came from
    counts = torch.bincount(flat_experts, minlength=n_experts).tolist()

    grouped = x[token_of_slot]  # (N*k, H)
    outputs = []
    for e, rows in enumerate(grouped.split(counts)):
        outputs.append(
            expert_forward(
                rows,
                None if w_gate is None else w_gate[e],
                w_up[e],
                w_down[e],
                activation,
                None if b_gate is None else b_gate[e],
                None if b_up is None else b_up[e],
                None if b_down is None else b_down[e],
            )
        )
    expert_out = torch.cat(outputs)  # (N*k, H), grouped order
    # Back to slot order n*k + j with one gather (every token has exactly k slots), then a
    # fixed-order sum over k: deterministic, and far faster on CPU than index_add_.
    slot_out = expert_out[order.argsort()].float()  # (N*k, H)
    weighted = slot_out.view(n_tokens, top_k, -1) * weights.unsqueeze(-1)  # (N, k, H) fp32
    return weighted.sum(1).to(x.dtype)


def output_spec(x: torch.Tensor) -> tuple[torch.dtype, tuple]:
    """The shape function: Y has X's shape (N, H) and dtype."""
    return x.dtype, tuple(x.shape)


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int | Routing,
    normalize_topk: bool = True,
    activation: str | ExpertActivation = "swiglu",
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    score_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op as the models call it: eager math, or one `moe::MoE` node under ONNX export.

    The node always takes the three bias inputs and the score bias (zeros when the model has
    none), so the function body needs no optional-input plumbing; lowerings drop zero biases.
    `activation` is an ExpertActivation (gpt-oss: ExpertActivation("swiglu", 1.702, 1.0, 7.0)),
    or the name of one with default parameters.
    """
    activation = as_activation(activation)
    routing = top_k if isinstance(top_k, Routing) else Routing(top_k, normalize_topk)
    routing.check(w_up.shape[0])
    if torch.onnx.is_in_onnx_export():
        n_experts, hidden, dim = w_up.shape
        dt = x.dtype
        if w_gate is None:
            # relu/gelu experts have no gate; the input is ignored but must type-check in the
            # function body's (untaken) swiglu branch, so it carries w_up itself (no new data).
            w_gate, b_gate = w_up, None
        b_gate = w_up.new_zeros(n_experts, hidden) if b_gate is None else b_gate
        b_up = w_up.new_zeros(n_experts, hidden) if b_up is None else b_up
        b_down = w_up.new_zeros(n_experts, dim) if b_down is None else b_down
        score_bias = w_up.new_zeros(n_experts, dtype=torch.float32) if score_bias is None else score_bias
        dtype, shape = output_spec(x)
        return torch.onnx.ops.symbolic(
            f"{DOMAIN}::{OP_TYPE}",
            (*(t.to(dt) for t in (x, router_logits, w_gate, w_up, w_down, b_gate, b_up, b_down)),
             score_bias.float()),
            {**routing.attributes(), **activation.attributes(), "plugin_namespace": PLUGIN_NAMESPACE},
            dtype=dtype,
            shape=shape,
            version=VERSION,
        )
    return moe_reference(
        x, router_logits, w_gate, w_up, w_down, routing, activation=activation,
        b_gate=b_gate, b_up=b_up, b_down=b_down, score_bias=score_bias,
    )


_opset = onnxscript.values.Opset(DOMAIN, VERSION)


@onnxscript.script(_opset, default_opset=op)
def MoE(
    X, router_logits, w_gate, w_up, w_down, b_gate, b_up, b_down, score_bias,
    top_k: int = 2, normalize_topk: int = 1, activation: str = "swiglu", scoring: str = "softmax",
    n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0, jitter_eps: float = 0.01,
    group_scoring: str = "top2_sum", activation_alpha: float = 1.0, activation_beta: float = 0.0,
    swiglu_limit: float = float("inf"),
):
    # Routing in fp32 (see the module docstring): scores, selection, weights.
    logits = op.Cast(router_logits, to=1)  # (N, E)
    last = op.Constant(value_ints=[-1])
    score_kind = op.Constant(value_string=scoring)
    if op.Equal(score_kind, op.Constant(value_string="sparsemixer")):
        # PhiMoE: two arg-max picks, each weighted by a softmax over the logits near it.
        two_eps = op.Constant(value_float=jitter_eps) * op.Constant(value_float=2.0)
        best1 = op.ReduceMax(logits, last, keepdims=1)
        pick1 = op.ArgMax(logits, axis=-1, keepdims=1)
        far1 = op.Greater(op.Div(best1 - logits, op.Max(op.Abs(logits), best1)), two_eps)
        minus_inf = op.CastLike(op.Constant(value_float=float("-inf")), logits)
        weight1 = op.GatherElements(op.Softmax(op.Where(far1, minus_inf, logits), axis=-1), pick1, axis=-1)
        rest = op.ScatterElements(logits, pick1, op.Expand(minus_inf, op.Shape(pick1)), axis=-1)
        best2 = op.ReduceMax(rest, last, keepdims=1)
        pick2 = op.ArgMax(rest, axis=-1, keepdims=1)
        far2 = op.Greater(op.Div(best2 - logits, op.Max(op.Abs(logits), best2)), two_eps)
        weight2 = op.GatherElements(op.Softmax(op.Where(far2, minus_inf, rest), axis=-1), pick2, axis=-1)
        top_w = op.Concat(weight1, weight2, axis=-1)
        top_i = op.Concat(pick1, pick2, axis=-1)
        # Dense (N, E) routing weights: zero for every expert outside a token's top-k.
        dense = op.ScatterElements(op.Mul(logits, op.Constant(value_float=0.0)), top_i, top_w, axis=-1)
    else:
        # sigmoid or softmax scores, and HF's guard against a zero sum of sigmoids (each If of
        # these bodies has one output: onnxscript orders several by string hash, per process)
        sigmoid = op.Equal(score_kind, op.Constant(value_string="sigmoid"))
        scores = op.Where(sigmoid, op.Sigmoid(logits), op.Softmax(logits, axis=-1))
        guard = op.Where(sigmoid, op.Constant(value_float=1e-20), op.Constant(value_float=0.0))
        choice = scores + op.Unsqueeze(op.Cast(score_bias, to=1), op.Constant(value_ints=[0]))
        if op.Greater(op.Constant(value_int=n_group), op.Constant(value_int=1)):
            # Group-limited: only the topk_group groups with the best group scores compete.
            n_experts = op.Shape(choice, start=1, end=2)
            groups = op.Reshape(op.Constant(value_int=n_group), op.Constant(value_ints=[1]))
            grouped = op.Reshape(choice, op.Concat(op.Constant(value_ints=[0]), groups, last, axis=0), allowzero=0)
            if op.Equal(op.Constant(value_string=group_scoring), op.Constant(value_string="max")):
                group_scores = op.ReduceMax(grouped, last, keepdims=0)  # (N, G): DeepSeek-V2
            else:
                # min(2, group size): the same 2 whenever this branch runs (groups hold >= 2
                # experts), but not a constant, so shape inference of an untaken branch accepts 1
                two = op.Min(op.Constant(value_ints=[2]), op.Shape(grouped, start=-1))
                best2, _ = op.TopK(grouped, two, axis=-1)
                group_scores = op.ReduceSum(best2, last, keepdims=0)  # (N, G): sum of the two best
            kept_k = op.Reshape(op.Constant(value_int=topk_group), op.Constant(value_ints=[1]))
            _, kept = op.TopK(group_scores, kept_k, axis=-1)
            zeros = op.Mul(group_scores, op.Constant(value_float=0.0))
            ones = op.Add(op.Mul(op.Cast(kept, to=1), op.Constant(value_float=0.0)), op.Constant(value_float=1.0))
            keep = op.ScatterElements(zeros, kept, ones, axis=-1)  # (N, G) 1 for kept groups
            keep_e = op.Reshape(op.Expand(op.Unsqueeze(keep, last), op.Shape(grouped)),
                                op.Concat(op.Constant(value_ints=[0]), n_experts, axis=0))
            minus_inf = op.CastLike(op.Constant(value_float=float("-inf")), choice)
            choice = op.Where(op.Cast(keep_e, to=9), choice, minus_inf)
        k = op.Reshape(op.Constant(value_int=top_k), op.Constant(value_ints=[1]))
        _, top_i = op.TopK(choice, k, axis=-1)  # (N, k)
        top_w = op.GatherElements(scores, top_i, axis=-1)
        sums = op.ReduceSum(top_w, last, keepdims=1) + guard
        top_w = op.Where(op.Cast(op.Constant(value_int=normalize_topk), to=9), top_w / sums, top_w)
        top_w = top_w * op.Constant(value_float=routed_scaling_factor)
        dense = op.ScatterElements(op.Mul(scores, op.Constant(value_float=0.0)), top_i, top_w, axis=-1)
    # Every expert on every token (E/k times the sparse work): exact and runs anywhere.
    x = op.Unsqueeze(X, op.Constant(value_ints=[0]))  # (1, N, H)
    one = op.Constant(value_ints=[1])
    up = op.MatMul(x, op.Transpose(w_up, perm=[0, 2, 1])) + op.Unsqueeze(b_up, one)  # (E, N, I)
    act = op.Constant(value_string=activation)
    if op.Equal(act, op.Constant(value_string="swiglu")):
        gate = op.MatMul(x, op.Transpose(w_gate, perm=[0, 2, 1])) + op.Unsqueeze(b_gate, one)
        # gate' = min(gate, limit), up' = clamp(up, -limit, limit) (Where keeps NaN, as torch's
        # clamp; an infinite limit changes nothing), then gate' * sigmoid(alpha gate') * (up' + beta)
        limit = op.CastLike(op.Constant(value_float=swiglu_limit), gate)
        gate = op.Where(op.Greater(gate, limit), limit, gate)
        up = op.Where(op.Greater(up, limit), limit, op.Where(op.Less(up, op.Neg(limit)), op.Neg(limit), up))
        alpha = op.CastLike(op.Constant(value_float=activation_alpha), gate)
        beta = op.CastLike(op.Constant(value_float=activation_beta), up)
        hidden = gate * op.Sigmoid(gate * alpha) * (up + beta)
    else:
        if op.Equal(act, op.Constant(value_string="gelu")):
            hidden = op.Gelu(up)
        else:
            hidden = op.Relu(up)
    y = op.MatMul(hidden, op.Transpose(w_down, perm=[0, 2, 1])) + op.Unsqueeze(b_down, one)  # (E, N, H)
    weights = op.Unsqueeze(op.Transpose(dense, perm=[1, 0]), op.Constant(value_ints=[-1]))  # (E, N, 1)
    out = op.ReduceSum(op.Cast(y, to=1) * weights, op.Constant(value_ints=[0]), keepdims=0)  # (N, H)
    return op.CastLike(out, X)


def function_proto() -> onnx.FunctionProto:
    """The dense standard-op body attached to every exported model (imports ai.onnx 23)."""
    return MoE.to_function_proto()


# --- ONNX Runtime lowering ------------------------------------------------------------------
# com.microsoft::MoE takes router *logits* (softmax + top-k inside), weights (E, out, in),
# and SwiGLU only in the fused interleaved form on CPU: fc1 rows alternate gate_i, up_i.
# Its SwiGLU is G * sigmoid(alpha * G) * (L + beta) with G = min(g, limit) and
# L = clamp(l, -limit, limit): ours, attribute for attribute (activation_alpha,
# activation_beta, swiglu_limit). Without swiglu_limit it clamps nothing (as our +inf); a
# limit of 0 clamps everything to 0 (ONNX Runtime 1.32, CPU: test_onnxruntime_swiglu_limit_semantics
# in tests/plugins/test_swiglu_clamp.py).
CONTRIB_DOMAIN = "com.microsoft"
CONTRIB_KERNELS = {
    # provider -> element types its com.microsoft::MoE kernel takes
    "CPUExecutionProvider": {ir.DataType.FLOAT},
    "CUDAExecutionProvider": {ir.DataType.FLOAT, ir.DataType.FLOAT16},
}
CONTRIB_ACTIVATIONS = ("swiglu", "relu")


def node_routing(node: ir.Node) -> Routing:
    """The Routing a moe::MoE node's attributes describe (nodes of every version)."""
    return Routing.from_attributes({name: attr.value for name, attr in node.attributes.items()})


def node_activation(node: ir.Node) -> ExpertActivation:
    """The ExpertActivation a moe::MoE node's attributes describe (nodes of every version)."""
    return ExpertActivation.from_attributes({name: attr.value for name, attr in node.attributes.items()})


def contrib_eligible(node: ir.Node, provider: str) -> bool:
    """Whether com.microsoft::MoE on `provider` computes exactly what this node means, routing
    included.

    Its router is softmax, top-k, optional renormalisation: sigmoid or sparsemixer scoring,
    group-limited selection, a scaling factor or a selection bias it cannot express (those
    take `lower_to_contrib(..., routed=True)`). Its SwiGLU takes our activation_alpha,
    activation_beta and swiglu_limit as they are.
    """
    r = node_routing(node)
    plain_routing = r.scoring == "softmax" and r.n_group == 1 and r.routed_scaling_factor == 1.0
    score_bias = node.inputs[8] if len(node.inputs) > 8 else None
    plain_routing = plain_routing and (score_bias is None or is_zero(score_bias))
    return contrib_experts_eligible(node, provider) and plain_routing


def contrib_experts_eligible(node: ir.Node, provider: str) -> bool:
    """Whether com.microsoft::MoE on `provider` computes this node's experts (dtype, activation),
    whatever its routing."""
    dtype = node.inputs[0].dtype
    return dtype in CONTRIB_KERNELS.get(provider, set()) and node_activation(node).activation in CONTRIB_ACTIVATIONS


def is_zero(value: ir.Value) -> bool:
    """Whether `value` is all zeros by construction: a constant, or ConstantOfShape of zero
    (what torch's exporter emits for `new_zeros`)."""
    if value.const_value is not None and isinstance(value.const_value, ir.ExternalTensor):
        return False  # real weights in the data file (gpt-oss's expert biases): never read to decide
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is not None:
        return not tensor.numpy().any()
    node = value.producer()
    if node is None or node.op_type != "ConstantOfShape" or node.domain not in ("", "ai.onnx"):
        return False
    fill = node.attributes.get("value")
    return fill is None or not fill.as_tensor().numpy().any()


def lower_to_contrib(graph: ir.Graph, node: ir.Node, routed: bool = False, nbits_accuracy: int = 0,
                     provider: str = "CPUExecutionProvider") -> tuple[str, bool]:
    """Replace one moe::MoE node by com.microsoft::MoE, in place; quantized experts (blocked
    DequantizeLinear over the artifact's codes) by com.microsoft::QMoE on those bytes, where it
    computes what the node means (`qmoe_stacks`). Returns the op type used and whether the
    routing runs on graph ops before it.

    The interleaved fc1 weight is built with graph ops (Unsqueeze, Concat, Reshape) over the
    original initializers; ONNX Runtime constant-folds them at session creation.
    `provider`: where the session runs; on the CPU the NaN guard after the op is the shorter one
    where the logits are x @ W (`nan_where_not_finite`).

    `routed`: for a routing com.microsoft::MoE cannot compute (sigmoid or sparsemixer scores, a
    selection bias, groups, scaling), the routing runs before it on graph ops (`routing_probe`)
    and the contrib op gets logits log(w) (-inf off each token's top-k), whose softmax is
    w / sum(w); its output is scaled back by sum(w) per token. The experts still run sparsely.
    """
    x, logits, w_gate, w_up, w_down, b_gate, b_up, b_down = (list(node.inputs) + [None] * 3)[:8]
    attrs = node.attributes
    act = node_activation(node)
    activation = act.activation
    biases = contrib_biases(node)
    new_nodes: list[ir.Node] = []

    def add(op_type: str, inputs, **attributes) -> ir.Value:
        n = ir.node(op_type, inputs, attributes)
        new_nodes.append(n)
        return n.outputs[0]

    normalize = attrs["normalize_topk"].as_int()
    fc1_source = interleaved_source(w_gate, w_up) if activation == "swiglu" else w_up
    if not normalize and qmoe_takes(fc1_source, w_down, nbits_accuracy, act, biases):
        # QMoE's CPU kernel renormalises the top-k weights whatever normalize_routing_weights
        # says (ONNX Runtime 1.32; tests/plugins/test_qmoe_semantics.py): routed, its softmax of
        # log(w) renormalised is w / sum(w), and the output is scaled back by sum(w)
        routed = True
    route_scale = None
    if routed:
        dense = routing_probe(node, new_nodes)  # (N, E): each token's weights, 0 off its top-k
        route_scale = add("ReduceSum", [dense, add("Constant", [], value=ir.tensor([-1], dtype=ir.DataType.INT64))],
                          keepdims=1)
        minus_inf = add("Constant", [], value=ir.tensor(float("-inf"), dtype=ir.DataType.FLOAT))
        zero = add("Constant", [], value=ir.tensor(0.0, dtype=ir.DataType.FLOAT))
        logits = add("Where", [add("Greater", [dense, zero]), add("Log", [dense]), minus_inf])
        normalize = 0  # the softmax of log(w) is already w / sum(w)

    def const(values: list[int]) -> ir.Value:
        return add("Constant", [], value=ir.tensor(values, dtype=ir.DataType.INT64))

    def interleave(gate: ir.Value, up: ir.Value, target_shape: list[int]) -> ir.Value:
        # (E, I, ...) pair -> (E, I, 2, ...) -> (E, 2I, ...): rows alternate gate, up.
        g = add("Unsqueeze", [gate, const([2])])
        u = add("Unsqueeze", [up, const([2])])
        both = add("Concat", [g, u], axis=2)
        return add("Reshape", [both, const(target_shape)])

    def nonzero(value: ir.Value | None) -> ir.Value | None:
        if value is None:
            return None
        return None if is_zero(value) else value

    if activation == "swiglu":
        n_experts, hidden, dim = (int(d) for d in w_up.shape)  # expert weights are static
        # A streamed decoder export stores gate and up interleaved already: use that weight as
        # it is (no copy at session creation); anything else is interleaved by graph ops.
        fc1 = fc1_source or interleave(w_gate, w_up, [n_experts, 2 * hidden, dim])
        fc1_bias = interleave(b_gate, b_up, [n_experts, 2 * hidden]) if biases[0] else None
    else:
        fc1, fc1_bias = w_up, nonzero(b_up)
    contrib_attrs = {"k": attrs["top_k"].as_int(), "normalize_routing_weights": normalize,
                     **contrib_activation_attributes(act)}
    stacks = qmoe_stacks(graph, fc1, w_down, nbits_accuracy, act, biases)
    if stacks is None:
        moe_node = ir.node("MoE", [x, logits, fc1, fc1_bias, w_down, nonzero(b_down)], contrib_attrs,
                           domain=CONTRIB_DOMAIN)
    else:
        q1, q2 = stacks
        moe_node = ir.node(
            "QMoE",
            [x, logits, q1.codes, q1.scales, fc1_bias, q2.codes, q2.scales, nonzero(b_down), None, None, None,
             q1.zero_points, q2.zero_points],
            {**contrib_attrs, **qmoe_attributes(q1.bits, q1.block_size, nbits_accuracy)},
            domain=CONTRIB_DOMAIN,
        )
    new_nodes.append(moe_node)
    # the routing's softmax carries a non-finite x through where the logits are x @ W: relied on
    # on the CPU, where tests/runtime/test_lowering.py holds ONNX Runtime's Softmax to it
    x_reaches = provider == "CPUExecutionProvider" and routes_from(x, logits)
    y = nan_where_not_finite(add, moe_node.outputs[0], x, logits, x_reaches)
    if route_scale is not None:
        y = add("Mul", [y, route_scale])
    name = node.outputs[0].name
    ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, [node.outputs[0]], [y])
    y.name = name  # downstream tools (layer-wise compare) look values up by name
    graph.opset_imports.setdefault(CONTRIB_DOMAIN, 1)
    return moe_node.op_type, routed


def contrib_activation_attributes(act: ExpertActivation) -> dict[str, object]:
    """com.microsoft::MoE's and QMoE's activation attributes for `act` (SwiGLU on interleaved fc1
    rows: gate even, up odd; no swiglu_limit attribute for no clamp, since ONNX Runtime's limit 0
    would clamp to 0)."""
    attributes: dict[str, object] = {"activation_type": act.activation}
    if act.activation == "swiglu":
        attributes.update(swiglu_fusion=1, activation_alpha=act.activation_alpha, activation_beta=act.activation_beta)
        if act.clamped:
            attributes["swiglu_limit"] = act.swiglu_limit
    return attributes


def qmoe_attributes(bits: int, block_size: int, accuracy_level: int) -> dict[str, int]:
    """QMoE's attributes beyond MoE's: its experts' blocked format and accuracy level."""
    return {"expert_weight_bits": bits, "block_size": block_size, "accuracy_level": accuracy_level,
            "weights_prepacked": 0}


def contrib_biases(node: ir.Node) -> tuple[bool, bool]:
    """Whether the contrib lowering gives this moe::MoE node's experts an fc1 and an fc2 bias
    (a bias that is zero by construction is left out)."""
    b_gate, b_up, b_down = (list(node.inputs) + [None] * 3)[5:8]
    def given(value: ir.Value | None) -> bool:
        return value is not None and not is_zero(value)
    fc1 = given(b_up) or (node_activation(node).activation == "swiglu" and given(b_gate))
    return fc1, given(b_down)


def qmoe_takes(fc1: ir.Value | None, fc2: ir.Value | None, nbits_accuracy: int, act: ExpertActivation,
               biases: tuple[bool, bool]) -> bool:
    """Whether com.microsoft::QMoE computes these expert stacks as the graph does at this
    accuracy level: both blocked int8/int4 in one scheme. QMoE's CPU kernel has no float path for
    8-bit experts (int8 activations at every level), so int8 qualifies only at level 4, where
    int8 activations were asked for; int4 at level 0 computes the dequantized products (to rounding).
    And only where this ONNX Runtime's QMoE runs such a node as the lowering writes it, checked
    once per process against the dequantized weights (`runtime/qmoe_check`)."""
    from moedeploy.runtime.qmoe_check import QMoENode, qmoe_refusal
    from moedeploy.runtime.quantized import blocked_source

    w1, w2 = blocked_source(fc1), blocked_source(fc2)
    if w1 is None or w2 is None or (w1.bits, w1.block_size, w1.signed) != (w2.bits, w2.block_size, w2.signed) \
            or len(w1.shape) != 3:
        return False
    if w1.bits != 4 and nbits_accuracy != 4:
        return False
    return qmoe_refusal(QMoENode(w1.bits, w1.block_size, not w1.signed, nbits_accuracy, act, *biases)) is None


def qmoe_eligible(node: ir.Node, provider: str, nbits_accuracy: int) -> bool:
    """Whether this node's experts are quantized stacks com.microsoft::QMoE takes on `provider`
    (the contrib lowering then runs them on QMoE over the artifact's bytes)."""
    if provider != "CPUExecutionProvider" or not contrib_experts_eligible(node, provider):
        return False
    w_gate, w_up, w_down = node.inputs[2], node.inputs[3], node.inputs[4]
    act = node_activation(node)
    fc1 = interleaved_source(w_gate, w_up) if act.activation == "swiglu" else w_up
    return qmoe_takes(fc1, w_down, nbits_accuracy, act, contrib_biases(node))


def qmoe_stacks(graph: ir.Graph, fc1: ir.Value, fc2: ir.Value, nbits_accuracy: int, act: ExpertActivation,
                biases: tuple[bool, bool]):
    """com.microsoft::QMoE's (fc1, fc2) stacks, registered in `graph`, where `qmoe_takes`; else None."""
    from moedeploy.runtime.quantized import qmoe_stack

    if not qmoe_takes(fc1, fc2, nbits_accuracy, act, biases):
        return None
    return qmoe_stack(graph, fc1), qmoe_stack(graph, fc2)


def routing_probe(node: ir.Node, new_nodes: list[ir.Node]) -> ir.Value:
    """Each token's dense routing weights (N, E) in fp32, computed by the op itself.

    A second moe::MoE node with the node's own routing attributes and inputs, but E one-hot
    "experts" (relu(0 x + 1) = 1, projected onto e_j), outputs exactly sum_j w_j e_j = the
    dense weights: the op's routing, whatever it is, on its standard-op function body, with
    nothing of it written twice. Its experts cost E tiny matmuls.
    """
    x, logits = node.inputs[0], node.inputs[1]
    n_experts, _, dim = (int(d) for d in node.inputs[3].shape)
    score_bias = node.inputs[8] if len(node.inputs) > 8 else None

    def const(name: str, array) -> ir.Value:
        value = ir.node("Constant", [], {"value": ir.tensor(array, name=name)})
        new_nodes.append(value)
        return value.outputs[0]

    one_hot = np.eye(n_experts, dtype=np.float32)[:, :, None]  # expert j writes 1 at output j
    inputs = [
        x, logits,
        const("probe_w_gate", np.zeros((n_experts, 1, dim), np.float32)),
        const("probe_w_up", np.zeros((n_experts, 1, dim), np.float32)),
        const("probe_w_down", one_hot),
        const("probe_b_gate", np.zeros((n_experts, 1), np.float32)),
        const("probe_b_up", np.ones((n_experts, 1), np.float32)),
        const("probe_b_down", np.zeros((n_experts, n_experts), np.float32)),
        score_bias if score_bias is not None else const("probe_score_bias", np.zeros(n_experts, np.float32)),
    ]
    routing = {k: v.value for k, v in node.attributes.items()
               if k not in ("activation", "activation_alpha", "activation_beta", "swiglu_limit")}
    probe = ir.node(OP_TYPE, inputs, {**routing, "activation": "relu"}, domain=DOMAIN,
                    name=f"{node.name}/routing" if node.name else None)
    new_nodes.append(probe)
    return probe.outputs[0]


def interleaved_source(w_gate: ir.Value, w_up: ir.Value) -> ir.Value | None:
    """The (E, 2I, H) weight that w_gate and w_up are the even and odd rows of, if they are.

    True when both come from `Slice(fused, start, 2I, axis 1, step 2)` with starts 0 and 1
    (what `export.streaming` writes), so com.microsoft::MoE can read `fused` directly.
    """
    sources = []
    for value, start in ((w_gate, 0), (w_up, 1)):
        node = value.producer()
        if node is None or node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 5:
            return None
        consts = [ir.convenience.get_const_tensor(v) for v in node.inputs[1:]]
        if any(c is None for c in consts):
            return None
        fused = node.inputs[0]
        shape = fused.shape if fused is not None else None
        if shape is None or len(shape) != 3 or not all(isinstance(d, int) for d in shape):
            return None  # only a weight of known static shape can be proven whole
        half = w_up.shape[1] if w_up.shape is not None and len(w_up.shape) == 3 else None
        if not takes_strided_half(*(c.numpy().tolist() for c in consts), start, shape[1]) or shape[1] != 2 * (half or -1):
            return None
        sources.append(fused)
    return sources[0] if sources[0] is sources[1] else None


def takes_strided_half(starts: list[int], ends: list[int], axes: list[int], steps: list[int], start: int,
                       rows: int) -> bool:
    """Whether a Slice's (starts, ends, axes, steps) take every other row of axis 1, from
    `start` (0: the gate's even rows, 1: the up's odd ones), to the end of its `rows` rows."""
    return (starts, axes, steps) == ([start], [1], [2]) and ends[0] >= rows


def nan_where_not_finite(add: Callable[..., ir.Value], y: ir.Value, x: ir.Value, logits: ir.Value,
                         x_reaches_logits: bool = False) -> ir.Value:
    """Y with NaN rows where eager PyTorch gives NaN, bit-identical elsewhere.

    com.microsoft::MoE returns an all-zero row for a token whose input holds NaN or +-Inf, or
    whose routing softmax is NaN (a NaN or +Inf router logit): a silent wrong answer. The row
    sum of softmax(logits) is NaN for exactly the tokens of the second kind (a -Inf logit alone
    is a valid mask: its softmax and the eager result stay finite), and the row sum of x - x (0
    for a finite v, NaN otherwise) for the first. `x_reaches_logits` (the caller checked
    `routes_from`, on a provider whose Softmax a test holds to it) leaves the check of x out: a
    non-finite x then makes its row's softmax NaN already. That halves the guard that runs every
    decode step (4 nodes a layer that run, instead of 8).
    `add(op_type, inputs, **attributes)` appends a node and returns its output.
    """

    def row_sum(v: ir.Value) -> ir.Value:  # (N, 1)
        return add("ReduceSum", [v, add("Constant", [], value=ir.tensor([-1], dtype=ir.DataType.INT64))], keepdims=1)

    flags = row_sum(add("Softmax", [logits], axis=-1))  # NaN where the routing is, about 1 elsewhere
    if not x_reaches_logits:
        flags = add("Add", [row_sum(add("Sub", [x, x])), flags])
    return add("Where", [add("IsNaN", [flags]), flags, y])  # NaN rows take the (NaN) flag


def routes_from(x: ir.Value, logits: ir.Value) -> bool:
    """Whether `logits` is x @ W (+ C), row for row: a MatMul of x, or a Gemm of x without transA
    at alpha 1. Then a NaN or +-Inf in a row of x makes every logit of that row NaN or +-Inf,
    whatever W and C hold (NaN * w and Inf * 0 are NaN, Inf * w is +-Inf, and a sum with one of
    them is not finite), and a softmax over such a row is NaN (Inf - Inf, -Inf - -Inf)."""
    node = logits.producer()
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm"):
        return False
    if node.inputs[0] is not x:
        return False
    if node.op_type == "MatMul":
        return True
    attrs = node.attributes
    return attrs.get_int("transA", 0) == 0 and attrs.get_float("alpha", 1.0) == 1.0
