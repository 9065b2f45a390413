"""The `moe::MoE` op: top-k routed mixture of experts over stacked expert weights.

Semantics (the seed notebook's SMoE, done right):
  probs   = softmax(router_logits)                  over all E experts, in fp32
  w, idx  = top_k(probs)                            k experts per token
  w       = w / sum(w)                              if normalize_topk (Mixtral)
  y[n]    = sum_j w[n, j] * expert_{idx[n, j]}(x[n])
  expert_e(x) = down_e(silu(gate_e x) * up_e x)     activation "swiglu"
              = down_e(act(up_e x))                 activation "relu" / "gelu" (no gate)

Weights are stacked `[E, out, in]` (nn.Linear's layout per expert); biases `[E, out]`.
`x` is `[N, H]`, `router_logits` `[N, E]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DOMAIN = "moe"
OP_TYPE = "MoE"
VERSION = 1
ACTIVATIONS = ("swiglu", "relu", "gelu")


def route(
    router_logits: torch.Tensor, top_k: int, normalize_topk: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the k largest; returns fp32 weights (N, k) and indices (N, k)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if normalize_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def expert_forward(
    x: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert's FFN on the rows routed to it; weights are that expert's `[out, in]` slices."""
    up = F.linear(x, w_up, b_up)
    if activation == "swiglu":
        hidden = F.silu(F.linear(x, w_gate, b_gate)) * up
    elif activation == "relu":
        hidden = F.relu(up)
    elif activation == "gelu":
        hidden = F.gelu(up)
    else:
        raise ValueError(f"unknown MoE activation {activation!r}; choose one of {ACTIVATIONS}")
    return F.linear(hidden, w_down, b_down)


def moe_reference(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    normalize_topk: bool = True,
    activation: str = "swiglu",
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact sparse MoE: each token runs through its k experts only.

    Tokens are grouped by expert with one stable sort, so each expert does a single GEMM
    over its rows (an expert with no rows does an empty one). Eager only: the group sizes
    are data, which is why export emits the `moe::MoE` node instead of tracing this.
    """
    n_tokens, _ = x.shape
    n_experts = w_up.shape[0]
    weights, experts = route(router_logits, top_k, normalize_topk)  # (N, k), (N, k)

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
    slot_weight = weights.reshape(-1)[order].unsqueeze(-1)  # (N*k, 1) fp32
    combined = torch.zeros(n_tokens, expert_out.shape[-1], dtype=torch.float32, device=x.device)
    combined.index_add_(0, token_of_slot, (expert_out * slot_weight).float())
    return combined.to(x.dtype)


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    normalize_topk: bool = True,
    activation: str = "swiglu",
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op as the models call it."""
    return moe_reference(
        x, router_logits, w_gate, w_up, w_down, top_k, normalize_topk, activation, b_gate, b_up, b_down
    )
