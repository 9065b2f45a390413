"""Attention, GQA, RoPE, causal mask, KV cache and EncoderLayer against hand code and torch/transformers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moedeploy.models import Attention, EncoderLayer, RotaryEmbedding, StaticLayerCache, causal_mask
from moedeploy.models.attention import apply_rotary

from .helpers import randomize_, tiny_mixtral_config


def _lin(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return x @ layer.weight.T + (0 if layer.bias is None else layer.bias)


def _hand_attention(
    attn: Attention, x: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Textbook multi-head attention, one head at a time; query head h reads KV head h // groups."""
    hd, nh, nkv = attn.head_dim, attn.n_heads, attn.n_kv_heads
    q, k, v = _lin(x, attn.wq), _lin(x, attn.wk), _lin(x, attn.wv)
    heads = []
    for h in range(nh):
        kv = h // (nh // nkv)
        qh = q[..., h * hd : (h + 1) * hd]  # (B, S, hd)
        kh = k[..., kv * hd : (kv + 1) * hd]
        vh = v[..., kv * hd : (kv + 1) * hd]
        scores = qh @ kh.transpose(1, 2) / math.sqrt(hd)  # (B, S, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ vh)
    return _lin(torch.cat(heads, dim=-1), attn.wo)


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("seq", [1, 6, 33])
@pytest.mark.parametrize(
    ("dim", "n_heads", "head_dim"), [(16, 1, None), (24, 4, None), (24, 3, 10)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_attention_matches_hand_mha(
    seq: int, dim: int, n_heads: int, head_dim: int | None, bias: bool
) -> None:
    attn = randomize_(Attention(dim, n_heads, head_dim=head_dim, bias=bias)).eval()
    assert attn.head_dim == (head_dim or dim // n_heads)
    x = torch.randn(2, seq, dim)
    torch.testing.assert_close(attn(x), _hand_attention(attn, x), atol=1e-5, rtol=1e-5)


def test_attention_with_causal_mask_matches_hand() -> None:
    attn = randomize_(Attention(16, 4)).eval()
    x = torch.randn(2, 9, 16)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    y = attn(x, causal_mask(0, 9))
    torch.testing.assert_close(y, _hand_attention(attn, x, mask), atol=1e-5, rtol=1e-5)
    # The first token attends only to itself: its output is wo(v_0), whatever follows it.
    torch.testing.assert_close(y[:, 0], _lin(_lin(x[:, 0], attn.wv), attn.wo), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 2), (6, 1), (6, 3), (4, 4)])
def test_gqa_equals_mha_with_repeated_kv_heads(n_heads: int, n_kv_heads: int) -> None:
    dim, hd = 24, 8
    gqa = randomize_(Attention(dim, n_heads, n_kv_heads, head_dim=hd)).eval()
    assert gqa.wk.weight.shape == (n_kv_heads * hd, dim)
    # The same layer as plain MHA: KV head j's projection copied to query heads j*g .. j*g+g-1.
    mha = Attention(dim, n_heads, n_heads, head_dim=hd).eval()
    groups = n_heads // n_kv_heads
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for src, dst in ((gqa.wk, mha.wk), (gqa.wv, mha.wv)):
            per_head = src.weight.view(n_kv_heads, hd, dim)
            dst.weight.copy_(per_head.repeat_interleave(groups, dim=0).reshape(n_heads * hd, dim))
    x = torch.randn(3, 7, dim)
    mask = causal_mask(0, 7)
    torch.testing.assert_close(gqa(x, mask), mha(x, mask), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gqa(x, mask), _hand_attention(gqa, x, mask), atol=1e-5, rtol=1e-5)


def test_gqa_rejects_indivisible_heads() -> None:
    with pytest.raises(ValueError, match="multiple"):
        Attention(24, 6, 4)


def test_causal_mask_by_hand() -> None:
    T, F_ = True, False
    assert causal_mask(0, 3).tolist() == [[T, F_, F_], [T, T, F_], [T, T, T]]
    assert causal_mask(2, 2).tolist() == [[T, T, T, F_], [T, T, T, T]]
    assert causal_mask(5, 1).tolist() == [[T] * 6]
    assert causal_mask(0, 1).tolist() == [[T]]
    assert causal_mask(3, 4).dtype == torch.bool
    assert causal_mask(3, 4).shape == (4, 7)


# ---------------------------------------------------------------- RoPE


@pytest.mark.parametrize(("head_dim", "theta"), [(8, 10000.0), (6, 1e6), (16, 500.0)])
def test_rope_tables_by_formula(head_dim: int, theta: float) -> None:
    rope = RotaryEmbedding(head_dim, max_positions=40, theta=theta)
    positions = torch.tensor([0, 1, 5, 39])
    cos, sin = rope(positions)
    half = head_dim // 2
    p = positions.double()[:, None]
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / head_dim)  # (half,)
    angle = torch.cat([p * freq, p * freq], dim=-1)  # half-split layout: i pairs with i + half
    torch.testing.assert_close(cos.double(), angle.cos(), atol=2e-5, rtol=0)
    torch.testing.assert_close(sin.double(), angle.sin(), atol=2e-5, rtol=0)


def test_rope_matches_transformers() -> None:
    from transformers.models.mixtral.modeling_mixtral import (
        MixtralRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = tiny_mixtral_config(
        hidden_size=48, num_attention_heads=4, rope_theta=5000.0, max_position_embeddings=64
    )
    hd = 12
    hf_rope = MixtralRotaryEmbedding(config)
    ours = RotaryEmbedding(hd, 64, 5000.0)
    positions = torch.arange(3, 20)
    q, k = torch.randn(2, 4, 17, hd), torch.randn(2, 4, 17, hd)
    hf_cos, hf_sin = hf_rope(q, positions[None])  # (1, S, hd)
    cos, sin = ours(positions)
    torch.testing.assert_close(cos, hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=1e-6, rtol=0)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), hf_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(apply_rotary(k, cos, sin), hf_k, atol=1e-6, rtol=0)


def test_rope_keeps_no_table_and_matches_transformers_at_long_positions() -> None:
    """cos/sin come from positions x inv_freq on each call: the module holds head_dim/2 numbers
    whatever max_positions says (a 131072-position table was 16 MB), and agrees with
    transformers, which computes them the same way, at any position."""
    from transformers.models.mixtral.modeling_mixtral import MixtralRotaryEmbedding

    hd, theta, max_positions = 16, 1e6, 131072
    ours = RotaryEmbedding(hd, max_positions, theta)
    assert sum(b.numel() for b in ours.buffers()) == hd // 2
    config = tiny_mixtral_config(
        hidden_size=64, num_attention_heads=4, rope_theta=theta, max_position_embeddings=max_positions
    )
    hf_rope = MixtralRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 4095, 70000, 131071])
    hf_cos, hf_sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = ours(positions)
    torch.testing.assert_close(cos, hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rope_frequencies_stay_fp32_in_a_half_precision_model(dtype: torch.dtype) -> None:
    """Rounded to half precision, inv_freq would move the angle at position p by p * 5e-4."""
    full = RotaryEmbedding(16, 4096, 10000.0)
    half = RotaryEmbedding(16, 4096, 10000.0).to(dtype)
    assert half.inv_freq.dtype == torch.float32
    positions = torch.tensor([1, 255, 4095])
    assert all(torch.equal(a, b) for a, b in zip(half(positions), full(positions), strict=True))


def test_rope_scores_depend_only_on_relative_position() -> None:
    hd = 8
    rope = RotaryEmbedding(hd, 64, 100.0)
    q, k = torch.randn(hd), torch.randn(hd)

    def score(m: int, n: int) -> torch.Tensor:
        cm, sm = rope(torch.tensor([m]))
        cn, sn = rope(torch.tensor([n]))
        return (apply_rotary(q, cm[0], sm[0]) * apply_rotary(k, cn[0], sn[0])).sum()

    torch.testing.assert_close(score(7, 3), score(40, 36), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        score(0, 0), (q * k).sum(), atol=1e-5, rtol=1e-5
    )  # position 0: no rotation
    assert not torch.allclose(score(7, 3), score(7, 4), atol=1e-3)
    # A rotation keeps the norm.
    c, s = rope(torch.tensor([13]))
    torch.testing.assert_close(apply_rotary(q, c[0], s[0]).norm(), q.norm())


# ---------------------------------------------------------------- KV cache


def test_cached_chunks_equal_full_causal_attention() -> None:
    dim, n_heads, n_kv = 24, 6, 2
    attn = randomize_(Attention(dim, n_heads, n_kv)).eval()
    rope = RotaryEmbedding(attn.head_dim, 32, 10000.0)
    x = torch.randn(2, 11, dim)
    full = attn(x, causal_mask(0, 11), rope(torch.arange(11)))

    cache = StaticLayerCache(2, n_kv, 16, attn.head_dim)
    outs, start = [], 0
    for size in (5, 1, 3, 1, 1):  # a prefill, then single steps and a chunk
        pos = torch.arange(start, start + size)
        outs.append(
            attn(x[:, start : start + size], causal_mask(start, size), rope(pos), cache, start)
        )
        start += size
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)
    # The cache holds the rotated keys of all 11 positions and zeros after them.
    assert cache.k[:, :, :11].abs().sum() > 0
    assert cache.k[:, :, 11:].abs().sum() == 0


def test_static_cache_update_and_overflow() -> None:
    cache = StaticLayerCache(1, 2, 4, 3)
    k1, v1 = torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3)
    k, v = cache.update(0, k1, v1)
    assert torch.equal(k, k1) and torch.equal(v, v1)
    k2, v2 = torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 3)
    k, v = cache.update(3, k2, v2)
    assert torch.equal(k, torch.cat([k1, k2], dim=2))
    assert torch.equal(v, torch.cat([v1, v2], dim=2))
    with pytest.raises(ValueError, match="4 positions"):
        cache.update(4, k2, v2)


# ---------------------------------------------------------------- EncoderLayer


def _torch_encoder_from(
    ours: EncoderLayer, dim: int, n_heads: int, hidden: int, activation: str
) -> nn.TransformerEncoderLayer:
    ref = nn.TransformerEncoderLayer(
        dim,
        n_heads,
        hidden,
        dropout=0.0,
        activation=activation,
        batch_first=True,
        norm_first=ours.norm_first,
        layer_norm_eps=1e-5,
    )
    a = ours.attn
    with torch.no_grad():
        # in_proj packs the q, k and v projections row-wise.
        ref.self_attn.in_proj_weight.copy_(torch.cat([a.wq.weight, a.wk.weight, a.wv.weight]))
        ref.self_attn.in_proj_bias.copy_(torch.cat([a.wq.bias, a.wk.bias, a.wv.bias]))
        ref.self_attn.out_proj.weight.copy_(a.wo.weight)
        ref.self_attn.out_proj.bias.copy_(a.wo.bias)
        ref.linear1.weight.copy_(ours.ffn.up.weight)
        ref.linear1.bias.copy_(ours.ffn.up.bias)
        ref.linear2.weight.copy_(ours.ffn.down.weight)
        ref.linear2.bias.copy_(ours.ffn.down.bias)
        for mine, theirs in ((ours.norm1, ref.norm1), (ours.norm2, ref.norm2)):
            theirs.weight.copy_(mine.weight)
            theirs.bias.copy_(mine.bias)
    return ref.eval()


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("seq", [1, 8, 33])
def test_encoder_layer_matches_torch(norm_first: bool, activation: str, seq: int) -> None:
    dim, n_heads, hidden = 16, 4, 40
    ours = randomize_(
        EncoderLayer(dim, n_heads, hidden, activation, norm_first=norm_first), seed=seq
    ).eval()
    ref = _torch_encoder_from(ours, dim, n_heads, hidden, activation)
    x = torch.randn(2, seq, dim)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # also against torch's fused inference fast path
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_padding_mask_matches_torch(norm_first: bool) -> None:
    dim, n_heads, hidden = 16, 4, 24
    ours = randomize_(
        EncoderLayer(dim, n_heads, hidden, "gelu", norm_first=norm_first), seed=1
    ).eval()
    ref = _torch_encoder_from(ours, dim, n_heads, hidden, "gelu")
    lengths = [7, 4, 1]
    x = torch.randn(3, 7, dim)
    padding = torch.arange(7)[None, :] >= torch.tensor(lengths)[:, None]  # True = padding
    y = ours(x, padding)
    expected = ref(x, src_key_padding_mask=padding)
    # Padded positions too: they attend to the real tokens only, in both implementations.
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # torch's fused fast path
        torch.testing.assert_close(y, ref(x, src_key_padding_mask=padding), atol=1e-5, rtol=1e-5)
    # Padding never leaks into real tokens: each sequence alone gives the same outputs.
    for b, n in enumerate(lengths):
        torch.testing.assert_close(y[b, :n], ours(x[b : b + 1, :n])[0], atol=1e-5, rtol=1e-5)
    # And it does matter: without the mask the short sequences' outputs change.
    assert not torch.allclose(ours(x)[1, :4], y[1, :4], atol=1e-3)


def test_encoder_post_ln_and_pre_ln_differ() -> None:
    post = randomize_(EncoderLayer(16, 4, 32, norm_first=False)).eval()
    pre = EncoderLayer(16, 4, 32, norm_first=True).eval()
    pre.load_state_dict(post.state_dict())
    x = torch.randn(2, 5, 16)
    # Post-LN ends in a LayerNorm: with unit weight and zero bias each token is normalised.
    with torch.no_grad():
        post.norm2.weight.fill_(1.0)
        post.norm2.bias.zero_()
    y = post(x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(2, 5), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(2, 5), atol=1e-3, rtol=0)
    assert not torch.allclose(pre(x), F.layer_norm(pre(x), (16,)), atol=1e-2)
