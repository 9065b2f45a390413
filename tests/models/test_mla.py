"""Multi-head latent attention against transformers' DeepSeek attention modules, which expand
the latent into per-head keys and values: our absorbed form over the cached latent must give
the same outputs (1e-5 in fp32), prefill and token-by-token decode over the cache alike."""

from __future__ import annotations

import pytest
import torch

from moedeploy.models.attention import RotaryEmbedding, StaticLayerCache, causal_mask
from moedeploy.models.mla import LatentAttention

from .helpers import randomize_


def _hf_attention(version: str, q_lora_rank: int | None, interleave: bool):
    import transformers as T

    cls, attn = {"v2": (T.DeepseekV2Config, "DeepseekV2Attention"), "v3": (T.DeepseekV3Config, "DeepseekV3Attention")}[version]
    extra = {} if version == "v2" else {"rope_interleave": interleave}
    config = cls(hidden_size=36, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=q_lora_rank, kv_lora_rank=10,
                 qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, max_position_embeddings=64,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **extra)
    config._attn_implementation = "eager"
    module = getattr(__import__(f"transformers.models.deepseek_{version}.modeling_deepseek_{version}",
                                fromlist=[attn]), attn)(config, layer_idx=0)
    return config, randomize_(module.eval(), seed=3)


def _ours_from(hf, q_lora_rank: int | None, interleave: bool) -> LatentAttention:
    ours = LatentAttention(36, 3, 10, 6, 4, 5, q_lora_rank=q_lora_rank or 0, scale=hf.scaling,
                           rope_interleaved=interleave).eval()
    with torch.no_grad():
        if q_lora_rank:
            ours.wq_a.weight.copy_(hf.q_a_proj.weight)
            ours.q_norm.weight.copy_(hf.q_a_layernorm.weight)
            ours.wq_b.weight.copy_(hf.q_b_proj.weight)
        else:
            ours.wq.weight.copy_(hf.q_proj.weight)
        ours.wkv_a.weight.copy_(hf.kv_a_proj_with_mqa.weight)
        ours.kv_norm.weight.copy_(hf.kv_a_layernorm.weight)
        kv_b = hf.kv_b_proj.weight.reshape(3, 6 + 5, 10)  # per head: the key rows, then the value rows
        ours.w_uk.copy_(kv_b[:, :6])
        ours.w_uv.copy_(kv_b[:, 6:])
        ours.wo.weight.copy_(hf.o_proj.weight)
    return ours


def _hf_rope(version: str, hf, config, positions: torch.Tensor):
    """transformers' own position embeddings for its attention module (V2: complex, V3: cos/sin)."""
    module = __import__(f"transformers.models.deepseek_{version}.modeling_deepseek_{version}", fromlist=["x"])
    rotary = getattr(module, f"Deepseek{version.upper()}RotaryEmbedding")(config)
    return rotary(torch.zeros(1, dtype=torch.float32), positions[None])


@pytest.mark.parametrize("version,q_lora_rank,interleave", [("v3", 8, True), ("v3", None, False), ("v2", 8, True),
                                                            ("v2", None, True)])
@torch.no_grad()
def test_absorbed_latent_attention_equals_transformers_expanded_form(version, q_lora_rank, interleave) -> None:
    config, hf = _hf_attention(version, q_lora_rank, interleave)
    ours = _ours_from(hf, q_lora_rank, interleave)
    x = torch.randn(2, 9, 36, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9)
    mask = causal_mask(0, 9)
    additive = torch.zeros(9, 9).masked_fill(~mask, float("-inf"))[None, None]
    expected, _ = hf(x, position_embeddings=_hf_rope(version, hf, config, positions), attention_mask=additive)
    rope = RotaryEmbedding(4, 64, 10000.0)
    full = ours(x, mask[None, None], rope(positions))
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(full, expected, atol=1e-5, rtol=0)

    # decode over the latent cache: prefill 5 tokens, then one at a time
    cache = StaticLayerCache(2, 1, 9, 10, value_dims=(1, 4))
    steps = [ours(x[:, :5], causal_mask(0, 5)[None, None], rope(positions[:5]), cache, 0)]
    for p in range(5, 9):
        steps.append(ours(x[:, p:p + 1], causal_mask(p, 1)[None, None], rope(positions[p:p + 1]), cache, p))
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-5, rtol=0)
    # the cache holds the normalised latent and the rotated shared key, nothing per head
    assert cache.k.shape == (2, 1, 9, 10) and cache.v.shape == (2, 1, 9, 4)
