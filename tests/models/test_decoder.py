"""DecoderLayer against a hand composition; MoEDecoder's KV cache against full recomputation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moedeploy.models import (
    DecoderConfig,
    DecoderLayer,
    MoEDecoder,
    RotaryEmbedding,
    causal_mask,
    preset,
)

from .helpers import randomize_


def _lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ref = nn.RMSNorm(x.shape[-1], eps=eps)
    with torch.no_grad():
        ref.weight.copy_(weight)
    return ref(x)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE in the half-split layout written out with angles: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    half = x.shape[-1] // 2
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / x.shape[-1])
    angle = (positions.double()[:, None] * freq).float()  # (S, half)
    c, s = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _hand_decoder_layer(
    layer: DecoderLayer, x: torch.Tensor, theta: float, eps: float
) -> torch.Tensor:
    a = layer.attn
    B, S, _ = x.shape
    hd, nh, nkv = a.head_dim, a.n_heads, a.n_kv_heads
    pos = torch.arange(S)
    h_in = _rms(x, layer.attn_norm.weight, eps)
    q = _lin(h_in, a.wq.weight).view(B, S, nh, hd)
    k = _lin(h_in, a.wk.weight).view(B, S, nkv, hd)
    v = _lin(h_in, a.wv.weight).view(B, S, nkv, hd)
    heads = []
    for h in range(nh):
        qh = _rotate(q[:, :, h], pos, theta)
        kh = _rotate(k[:, :, h // (nh // nkv)], pos, theta)
        scores = qh @ kh.transpose(1, 2) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(torch.softmax(scores, -1) @ v[:, :, h // (nh // nkv)])
    h = x + _lin(torch.cat(heads, -1), a.wo.weight)
    f_in = _rms(h, layer.ffn_norm.weight, eps)
    f = layer.ffn
    gate = _lin(f_in, f.w1.weight)
    return h + _lin(gate * torch.sigmoid(gate) * _lin(f_in, f.w3.weight), f.w2.weight)


@pytest.mark.parametrize("seq", [1, 9])
@pytest.mark.parametrize(
    ("n_heads", "n_kv_heads", "head_dim"), [(4, 2, None), (4, 4, 6), (6, 1, 4)]
)
def test_dense_decoder_layer_by_hand(
    seq: int, n_heads: int, n_kv_heads: int, head_dim: int | None
) -> None:
    dim, theta, eps = 24, 10000.0, 1e-5
    layer = randomize_(
        DecoderLayer(dim, n_heads, n_kv_heads, 40, head_dim, moe=False, eps=eps), seed=seq
    )
    hd = head_dim or dim // n_heads
    rope = RotaryEmbedding(hd, 16, theta)
    x = torch.randn(2, seq, dim)
    y = layer(x, causal_mask(0, seq), rope(torch.arange(seq)))
    torch.testing.assert_close(y, _hand_decoder_layer(layer, x, theta, eps), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- MoEDecoder


def _decoder(seed: int = 0, **overrides) -> MoEDecoder:
    config = preset("tiny")
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return randomize_(MoEDecoder(config), seed).eval()


def test_tiny_decoder_structure() -> None:
    model = MoEDecoder(preset("tiny"))
    c = model.config
    ffn = model.layers[0].ffn
    assert ffn.w_gate.shape == ffn.w_up.shape == (c.n_experts, c.expert_hidden, c.hidden_size)
    assert ffn.w_down.shape == (c.n_experts, c.hidden_size, c.expert_hidden)
    assert model.layers[0].attn.wk.weight.shape == (c.n_kv_heads * c.head_dim, c.hidden_size)
    assert len(model.layers) == c.n_layers
    assert model.lm_head.weight is not model.embed.weight
    tied = MoEDecoder(DecoderConfig(**{**c.to_dict(), "tie_embeddings": True}))
    assert tied.lm_head.weight is tied.embed.weight


@pytest.mark.parametrize("chunks", [(5, *[1] * 27), (1, *[1] * 15), (7, 3, 1, 4, 1)])
def test_cached_forward_equals_full_forward(chunks: tuple[int, ...]) -> None:
    model = _decoder()
    total = sum(chunks)
    ids = torch.randint(0, model.config.vocab_size, (2, total))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, total)
        outs, start = [], 0
        for size in chunks:
            outs.append(model(ids[:, start : start + size], cache, start))
            start += size
    assert full.shape == (2, total, model.config.vocab_size)
    assert full.std() > 0.5  # logits of O(1): the tolerance below is meaningful
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)


def test_full_forward_is_causal() -> None:
    model = _decoder()
    ids = torch.randint(0, 256, (1, 12))
    changed = ids.clone()
    changed[0, 8] = (ids[0, 8] + 1) % 256
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:], atol=1e-3)


def _greedy_by_recomputation(model: MoEDecoder, prompt: torch.Tensor, new: int) -> torch.Tensor:
    ids = prompt
    with torch.no_grad():
        for _ in range(new):
            nxt = model(ids)[:, -1].argmax(-1, keepdim=True)  # no cache: the whole sequence again
            ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.mark.parametrize("prompt_len", [1, 6])
def test_greedy_generation_equals_full_recomputation(prompt_len: int) -> None:
    model = _decoder(seed=prompt_len)
    prompt = torch.randint(0, model.config.vocab_size, (2, prompt_len))
    out = model.generate(prompt, max_new_tokens=32)
    assert out.shape == (2, prompt_len + 32)
    assert torch.equal(out[:, :prompt_len], prompt)
    assert torch.equal(out, _greedy_by_recomputation(model, prompt, 32))
    assert out[:, prompt_len:].unique().numel() > 2  # not a degenerate constant stream


def test_generate_respects_max_positions() -> None:
    model = _decoder(max_positions=16)
    prompt = torch.zeros(1, 10, dtype=torch.long)
    assert model.generate(prompt, max_new_tokens=6).shape == (1, 16)
    with pytest.raises(ValueError, match="max_positions"):
        model.generate(prompt, max_new_tokens=7)


def test_new_cache_shape_and_dtype() -> None:
    model = _decoder().to(torch.bfloat16)
    c = model.config
    cache = model.new_cache(3, 20)
    assert len(cache) == c.n_layers
    assert cache[0].k.shape == (3, c.n_kv_heads, 20, c.head_dim)
    assert cache[0].k.dtype == torch.bfloat16
    assert cache[0].k is not cache[1].k
