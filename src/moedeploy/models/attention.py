"""Multi-head attention with grouped KV heads, rotary position embedding and a static KV cache."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moedeploy.models.norms import RMSNorm


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling (Peng et al., 2023) as gpt-oss and DeepSeek use it, in Hugging Face's form.

    Frequencies whose wavelength fits the pretraining context many times (fast ones) stay;
    slow ones are divided by `factor`; a linear ramp between the dimensions where a frequency
    turns `beta_fast` and `beta_slow` times over `original_positions` blends the two. cos and
    sin are scaled by `attention_factor` (YaRN's temperature).
    """

    factor: float
    original_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def inverse_frequencies(self, dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        extrapolated = inverse_frequencies(dim, theta, device)
        interpolated = extrapolated / self.factor
        return interpolated * ramp + extrapolated * (1 - ramp)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al.) in the half-split layout of Hugging Face Llama/Mixtral.

    Feature i is paired with feature i + head_dim/2 (not with its neighbour, as in Meta's
    complex-number code), so Hugging Face q/k weights load without a permutation.

    cos/sin are computed from the positions on every call, as Hugging Face does
    (positions x inv_freq in fp32): no [max_positions, head_dim] table is stored, so an
    exported graph does not grow with the context length, and positions are not limited
    by a table's size. `max_positions` is the model's trained context, kept for reference.
    `yarn` rescales the frequencies for a longer context (gpt-oss, DeepSeek).
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float = 10000.0, yarn: Yarn | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.yarn = head_dim, max_positions, theta, yarn
        self.register_buffer("inv_freq", self._frequencies(), persistent=False)

    def _frequencies(self, device: torch.device | str | None = None) -> torch.Tensor:
        if self.yarn is None:
            return inverse_frequencies(self.head_dim, self.theta, device)
        return self.yarn.inverse_frequencies(self.head_dim, self.theta, device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(S,) integer positions -> fp32 cos and sin, (S, head_dim) each."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (S, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.yarn is not None and self.yarn.attention_factor != 1.0:
            return emb.cos() * self.yarn.attention_factor, emb.sin() * self.yarn.attention_factor
        return emb.cos(), emb.sin()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RotaryEmbedding:
        """Keep inv_freq in fp32 whatever `Module.to(dtype)` asks: in half precision it would be
        off by up to 5e-4 relative, and the angle at position p by p times that."""
        super()._apply(fn, recurse)
        self.inv_freq = self._frequencies(self.inv_freq.device)
        return self


def inverse_frequencies(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """theta^(-2i/head_dim) for i < head_dim/2, in fp32: Hugging Face's default RoPE frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta**exponents)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate (B, nh, S, hd) queries or keys by their positions' angles, in x's dtype (as HF does).

    With partial rotary (cos narrower than the head), only the first cos.shape[-1] features
    rotate and the rest pass through, as in GLM-4-MoE and MiniMax-M2. `interleaved`: the
    pairs are neighbours (x0, x1), (x2, x3), ... as DeepSeek lays them out; the result is
    returned with the evens first, then the odds (Hugging Face's DeepSeek-V3 layout), which
    leaves every query-key dot product as the interleaved rotation gives it.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotary = cos.shape[-1]
    x_rot, x_pass = (x[..., :rotary], x[..., rotary:]) if rotary < x.shape[-1] else (x, None)
    if interleaved:
        half_cos, half_sin = cos[..., : rotary // 2], sin[..., : rotary // 2]
        even, odd = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.cat((even * half_cos - odd * half_sin, odd * half_cos + even * half_sin), dim=-1)
    else:
        rotated = x_rot * cos + rotate_half(x_rot) * sin
    return rotated if x_pass is None else torch.cat((rotated, x_pass), dim=-1)


class LayerCache(Protocol):
    """What attention needs from a KV cache: store this step's keys/values, return all so far."""

    def update(
        self, start_pos: int | torch.SymInt, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class StaticLayerCache(nn.Module):
    """Preallocated (B, heads, max_len, features) key and value buffers, written in place at start_pos.

    Allocated once per generation, so decoding never reallocates or copies the history.
    `value_dims` (heads, features) when the value differs from the key: latent attention
    caches a latent and a rotary key of other widths (DecoderConfig.kv_cache_dims).
    """

    def __init__(
        self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
        value_dims: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        v_heads, v_dim = value_dims or (n_kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v", torch.zeros(batch, v_heads, max_len, v_dim, dtype=dtype, device=device),
                             persistent=False)

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
    than 1/sqrt(head_dim) (GraniteMoE), interleaved rotary pairs (DeepSeek), and gpt-oss's
    attention sinks: a learned logit per head that joins every softmax's denominator, so a
    query may attend to "nothing" (see `attention_with_sinks`).
    """

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int | None = None,
        head_dim: int | None = None, bias: bool = False, dropout: float = 0.0,
        out_bias: bool | None = None, qk_norm: str = "none", norm_eps: float = 1e-5,
        scale: float | None = None, clip_qkv: float | None = None, sinks: bool = False,
        rope_interleaved: bool = False,
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
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None
        self.rope_interleaved = rope_interleaved

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
            q, k = apply_rotary(q, cos, sin, self.rope_interleaved), apply_rotary(k, cos, sin, self.rope_interleaved)
        if cache is not None:
            k, v = cache.update(start_pos, k, v)  # (B, nkv, T, hd), T = start_pos + S
        if self.sinks is not None:
            out = attention_with_sinks(q, k, v, mask, self.sinks, self.scale or self.head_dim**-0.5)
            return self.wo(out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))
        drop = self.dropout if self.training else 0.0
        # enable_gqa: each KV head serves n_heads // n_kv_heads query heads without copying
        # K/V; exported as one ONNX Attention with fewer KV heads than query heads.
        gqa = self.n_kv_heads != self.n_heads
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=drop, enable_gqa=gqa, scale=self.scale
        )
        out = out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim)  # (B, S, nh*hd)
        return self.wo(out)


def attention_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, the learned sink, that takes a share
    of the probability and contributes no value (gpt-oss): softmax([scores, sink])[..., :-1] @ v.

    (B, nh, S, hd) queries, (B, nkv, T, hd) keys/values, a (.., S, T) bool mask -> (B, nh, S, hd).
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, nh, S, T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return probs @ v
