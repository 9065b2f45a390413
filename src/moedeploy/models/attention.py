"""Multi-head attention with grouped KV heads, rotary position embedding and a static KV cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moedeploy.models.norms import RMSNorm


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al.) in the half-split layout of Hugging Face Llama/Mixtral.

    Feature i is paired with feature i + head_dim/2 (not with its neighbour, as in Meta's
    complex-number code), so Hugging Face q/k weights load without a permutation.

    cos/sin are computed from the positions on every call, as Hugging Face does
    (positions x inv_freq in fp32): no [max_positions, head_dim] table is stored, so an
    exported graph does not grow with the context length, and positions are not limited
    by a table's size. `max_positions` is the model's trained context, kept for reference.
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(S,) integer positions -> fp32 cos and sin, (S, head_dim) each."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (S, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RotaryEmbedding:
        """Keep inv_freq in fp32 whatever `Module.to(dtype)` asks: in half precision it would be
        off by up to 5e-4 relative, and the angle at position p by p times that."""
        super()._apply(fn, recurse)
        self.inv_freq = inverse_frequencies(self.head_dim, self.theta, self.inv_freq.device)
        return self


def inverse_frequencies(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """theta^(-2i/head_dim) for i < head_dim/2, in fp32: Hugging Face's default RoPE frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta**exponents)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, nh, S, hd) queries or keys by their positions' angles, in x's dtype (as HF does).

    With partial rotary (cos narrower than the head), only the first cos.shape[-1] features
    rotate and the rest pass through, as in GLM-4-MoE and MiniMax-M2.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        x_rot, x_pass = x[..., :rotary], x[..., rotary:]
        return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
    return x * cos + rotate_half(x) * sin


class LayerCache(Protocol):
    """What attention needs from a KV cache: store this step's keys/values, return all so far."""

    def update(
        self, start_pos: int | torch.SymInt, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class StaticLayerCache(nn.Module):
    """Preallocated (B, n_kv_heads, max_len, head_dim) buffers, written in place at start_pos.

    Allocated once per generation, so decoding never reallocates or copies the history.
    """

    def __init__(
        self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = start_pos + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; step needs {end}")
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


def causal_mask(start_pos: int | torch.SymInt, q_len: int, device=None, window: int = 0) -> torch.Tensor:
    """(q_len, start_pos + q_len) bool mask: query at absolute position p sees keys 0..p, or
    with a sliding window only the last `window` of them, p - window < key <= p (as HF)."""
    q_pos = torch.arange(q_len, device=device) + start_pos
    k_pos = torch.arange(start_pos + q_len, device=device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask = mask & (k_pos[None, :] > q_pos[:, None] - window)
    return mask


class Attention(nn.Module):
    """Scaled dot-product attention; n_kv_heads < n_heads gives grouped-query attention (GQA).

    Each KV head serves n_heads // n_kv_heads query heads, which shrinks the KV cache by
    that factor. `rope` and `cache` are optional, so the same module serves the encoder
    (bidirectional, no RoPE) and the decoder (causal, RoPE, cached).

    Family variants: biases on q/k/v (and o), RMSNorm of q and k per head (Qwen3-MoE,
    GLM-4-MoE) or over the whole projection (OLMoE, MiniMax-M2), OLMoE's clamp of q/k/v,
    partial rotary (the rope tables are narrower than the head) and a softmax scale other
    than 1/sqrt(head_dim) (GraniteMoE).
    """

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int | None = None,
        head_dim: int | None = None, bias: bool = False, dropout: float = 0.0,
        out_bias: bool | None = None, qk_norm: str = "none", norm_eps: float = 1e-5,
        scale: float | None = None, clip_qkv: float | None = None,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.head_dim = head_dim or dim // n_heads
        if n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}")
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=bias if out_bias is None else out_bias)
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, norm_eps), RMSNorm(self.head_dim, norm_eps)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(n_heads * self.head_dim, norm_eps)
            self.k_norm = RMSNorm(self.n_kv_heads * self.head_dim, norm_eps)
        elif qk_norm != "none":
            raise ValueError(f"qk_norm {qk_norm!r} must be 'none', 'head' or 'full'")
        self.scale = scale
        self.clip_qkv = clip_qkv
        self.dropout = dropout

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerCache | None = None,
        start_pos: int | torch.SymInt = 0,
    ) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(B, S, self.n_heads, self.head_dim)
        k = k.view(B, S, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, S, hd), (B, nkv, S, hd)
        v = v.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(start_pos, k, v)  # (B, nkv, T, hd), T = start_pos + S
        drop = self.dropout if self.training else 0.0
        # enable_gqa: each KV head serves n_heads // n_kv_heads query heads without copying
        # K/V; exported as one ONNX Attention with fewer KV heads than query heads.
        gqa = self.n_kv_heads != self.n_heads
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=drop, enable_gqa=gqa, scale=self.scale
        )
        out = out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim)  # (B, S, nh*hd)
        return self.wo(out)
