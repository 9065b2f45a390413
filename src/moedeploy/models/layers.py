"""Transformer layers: the encoder layer (post-LN and pre-LN) and the Llama-style decoder layer."""

from __future__ import annotations

import torch
from torch import nn

from moedeploy.models.attention import Attention, LayerCache
from moedeploy.models.config import DecoderConfig
from moedeploy.models.ffn import Activation, FeedForward, SwiGLU
from moedeploy.models.mla import LatentAttention
from moedeploy.models.moe import SparseMoE
from moedeploy.models.norms import LayerNorm, RMSNorm


class EncoderLayer(nn.Module):
    """Bidirectional self-attention + FFN, each wrapped in a residual and a LayerNorm.

    Post-LN (norm_first=False) is "Attention Is All You Need": x = LN(x + f(x)). It is
    what BERT used, but its gradients at init grow with depth, hence warm-up. Pre-LN
    (norm_first=True) normalises the branch input instead, x = x + f(LN(x)), and trains
    stably without warm-up (Xiong et al., 2020). Same layout as nn.TransformerEncoderLayer.
    """

    def __init__(
        self, dim: int, n_heads: int, hidden: int | None = None, activation: Activation = "relu",
        dropout: float = 0.0, norm_first: bool = False, eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.attn = Attention(dim, n_heads, bias=True, dropout=dropout)
        self.ffn = FeedForward(dim, hidden, activation, dropout)
        self.norm1 = LayerNorm(dim, eps)
        self.norm2 = LayerNorm(dim, eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """padding_mask: optional (B, S) bool, True where a token is padding (never attended)."""
        mask = None if padding_mask is None else ~padding_mask[:, None, None, :]  # (B, 1, 1, S)
        if self.norm_first:
            x = x + self.dropout(self.attn(self.norm1(x), mask))
            return x + self.ffn(self.norm2(x))
        x = self.norm1(x + self.dropout(self.attn(x, mask)))
        return self.norm2(x + self.ffn(x))


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """RMSNorm (Llama, Mixtral, most MoE families) or LayerNorm with bias (PhiMoE)."""
    return LayerNorm(dim, eps) if kind == "layer" else RMSNorm(dim, eps)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer (Llama, Mixtral): causal GQA attention with RoPE, then an FFN.

    The FFN is a SparseMoE (`moe=True`) or a dense SwiGLU; both see normalised input and add
    to the residual stream, which itself is never normalised until the final norm.
    GraniteMoE scales each branch by `residual_multiplier` before adding it.
    """

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, head_dim: int | None = None,
        moe: bool = True, n_experts: int = 8, top_k: int = 2, normalize_topk: bool = True,
        eps: float = 1e-5, norm: str = "rms", residual_multiplier: float = 1.0,
        attn: nn.Module | None = None, ffn: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.attn_norm = make_norm(norm, dim, eps)
        self.attn = attn if attn is not None else Attention(dim, n_heads, n_kv_heads, head_dim)
        self.ffn_norm = make_norm(norm, dim, eps)
        if ffn is None:
            ffn = SparseMoE(dim, ffn_hidden, n_experts, top_k, normalize_topk) if moe else SwiGLU(dim, ffn_hidden)
        self.ffn = ffn
        self.residual_multiplier = residual_multiplier

    @classmethod
    def from_config(cls, c: DecoderConfig, layer: int) -> DecoderLayer:
        """Layer `layer` of a decoder: its attention and FFN variant as the config says."""
        attn: nn.Module
        if c.kv_lora_rank:
            attn = LatentAttention(
                c.hidden_size, c.n_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.rotary_dim, c.v_head_dim,
                q_lora_rank=c.q_lora_rank, scale=c.attention_scale or None, bias=c.qkv_bias,
                rope_interleaved=c.rope_interleaved,
            )
        else:
            attn = Attention(
                c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, bias=c.qkv_bias, out_bias=c.o_bias,
                qk_norm=c.qk_norm, norm_eps=c.norm_eps, scale=c.attention_scale or None,
                clip_qkv=c.clip_qkv or None, sinks=c.attention_sinks, rope_interleaved=c.rope_interleaved,
            )
        if c.is_moe_layer(layer):
            ffn: nn.Module = SparseMoE(
                c.hidden_size, c.expert_hidden, c.n_experts, c.routing, bias=c.expert_bias,
                router_bias=c.router_bias, score_bias=c.score_bias,
                shared_hidden=c.shared_expert_hidden, shared_gate=c.shared_expert_gate,
                activation=c.expert_activation,
            )
        else:
            ffn = SwiGLU(c.hidden_size, c.dense_hidden or c.expert_hidden)
        return cls(c.hidden_size, c.n_heads, c.n_kv_heads, 0, eps=c.norm_eps, norm=c.norm,
                   residual_multiplier=c.residual_multiplier, attn=attn, ffn=ffn)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerCache | None = None, start_pos: int | torch.SymInt = 0,
    ) -> torch.Tensor:
        m = self.residual_multiplier
        attn = self.attn(self.attn_norm(x), mask, rope, cache, start_pos)
        h = x + (attn * m if m != 1.0 else attn)
        ffn = self.ffn(self.ffn_norm(h))
        return h + (ffn * m if m != 1.0 else ffn)
