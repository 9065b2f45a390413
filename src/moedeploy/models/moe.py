"""Sparse mixture of experts: a router picks k of E distinct SwiGLU experts per token."""

from __future__ import annotations

import math

import torch
from torch import nn

from moedeploy.models.ffn import SwiGLU
from moedeploy.plugins.moe import ExpertActivation, Routing, moe


class SparseMoE(nn.Module):
    """Top-k routed MoE FFN (Mixtral / Switch style), with the routing variants of the families.

    Experts are stored stacked, `w_gate`/`w_up` as (E, hidden, dim) and `w_down` as
    (E, dim, hidden): every expert owns its own slice. (The seed notebook put one shared
    SwiGLU in every slot, so its "experts" were a single FFN.) Routing (softmax, sigmoid or
    sparsemixer scores, an optional selection-only `score_bias`, group-limited top-k,
    renormalisation, scaling) and the weighted sum live in `moedeploy.plugins.moe`, which
    export turns into one `moe::MoE` node. A shared expert (Qwen2-MoE, GLM-4-MoE), gated by
    sigmoid(shared_gate x) in Qwen2-MoE, is an ordinary SwiGLU added to the routed output.
    gpt-oss's experts carry biases and a clamped SwiGLU (`activation`).
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        n_experts: int,
        top_k: int | Routing,
        normalize_topk: bool = True,
        bias: bool = False,
        router_bias: bool = False,
        score_bias: bool = False,
        shared_hidden: int = 0,
        shared_gate: bool = False,
        activation: ExpertActivation | None = None,
    ) -> None:
        super().__init__()
        self.activation = activation or ExpertActivation()
        self.routing = top_k if isinstance(top_k, Routing) else Routing(top_k, normalize_topk)
        self.routing.check(n_experts)
        self.top_k = self.routing.top_k
        self.normalize_topk = self.routing.normalize_topk
        self.router = nn.Linear(dim, n_experts, bias=router_bias)
        self.w_gate = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w_up = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w_down = nn.Parameter(torch.empty(n_experts, dim, hidden))
        if bias:
            self.b_gate = nn.Parameter(torch.zeros(n_experts, hidden))
            self.b_up = nn.Parameter(torch.zeros(n_experts, hidden))
            self.b_down = nn.Parameter(torch.zeros(n_experts, dim))
        else:
            self.b_gate = self.b_up = self.b_down = None
        self.score_bias = nn.Parameter(torch.zeros(n_experts)) if score_bias else None
        self.shared = SwiGLU(dim, shared_hidden) if shared_hidden else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if shared_hidden and shared_gate else None
        self.reset_parameters()

    @property
    def n_experts(self) -> int:
        return self.w_up.shape[0]

    def reset_parameters(self) -> None:
        # nn.Linear's default init, drawn independently for every expert.
        for w in (self.w_gate, self.w_up, self.w_down):
            bound = 1.0 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    @classmethod
    def from_experts(
        cls, router: nn.Linear, experts: list[SwiGLU], top_k: int, normalize_topk: bool = True
    ) -> SparseMoE:
        """Stack separately built SwiGLU experts (w1 = gate, w3 = up, w2 = down)."""
        first = experts[0]
        bias = first.w1.bias is not None
        dim, hidden = first.w1.in_features, first.w1.out_features
        moe_ = cls(dim, hidden, len(experts), top_k, normalize_topk, bias, router.bias is not None)
        with torch.no_grad():
            moe_.router.load_state_dict(router.state_dict())
            moe_.w_gate.copy_(torch.stack([e.w1.weight for e in experts]))
            moe_.w_up.copy_(torch.stack([e.w3.weight for e in experts]))
            moe_.w_down.copy_(torch.stack([e.w2.weight for e in experts]))
            if bias:
                moe_.b_gate.copy_(torch.stack([e.w1.bias for e in experts]))
                moe_.b_up.copy_(torch.stack([e.w3.bias for e in experts]))
                moe_.b_down.copy_(torch.stack([e.w2.bias for e in experts]))
        return moe_

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, D): routing is per token
        logits = self.router(x)  # (N, E)
        y = moe(
            x, logits, self.w_gate, self.w_up, self.w_down, self.routing, activation=self.activation,
            b_gate=self.b_gate, b_up=self.b_up, b_down=self.b_down, score_bias=self.score_bias,
        )
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            y = y + shared
        return y.reshape(shape)
