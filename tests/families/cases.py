"""Tiny random configurations of every supported family, made with transformers' own config
classes (nothing downloaded), and the helpers that turn one into a saved checkpoint folder.

Each family has several: odd sizes, GQA and MQA, shared experts, dense-plus-MoE layer mixes,
sliding windows shorter than the prompt, norm_topk_prob off and on, group-limited routing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.helpers import randomize_

PROMPT = 13  # longer than every sliding window below

BASE = dict(vocab_size=72, hidden_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=96, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _family_config(name: str, n_layers: int, **kw):
    import transformers as T

    cls = {
        "mixtral": T.MixtralConfig, "qwen2_moe": T.Qwen2MoeConfig, "qwen3_moe": T.Qwen3MoeConfig,
        "olmoe": T.OlmoeConfig, "granitemoe": T.GraniteMoeConfig, "phimoe": T.PhimoeConfig,
        "glm4_moe": T.Glm4MoeConfig, "minimax_m2": T.MiniMaxM2Config, "gpt_oss": T.GptOssConfig,
        "deepseek_v2": T.DeepseekV2Config, "deepseek_v3": T.DeepseekV3Config,
    }[name]
    args = {**BASE, "num_hidden_layers": n_layers, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            **kw}
    # always a fresh dict: some config classes write into it (GLM-4-MoE its default
    # partial_rotary_factor), which would otherwise change BASE for every later config
    args["rope_parameters"] = {**BASE["rope_parameters"], **kw.get("rope_parameters", {})}
    if "layer_types" in kw:
        args["layer_types"] = (kw["layer_types"] * n_layers)[:n_layers]  # the pattern repeated, then cut
    if name.startswith("deepseek"):  # latent attention expands to every head: no KV-head groups
        args["num_key_value_heads"] = args["num_attention_heads"]
    config = cls(**args)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


#: One case per family for the (slower) export tests: the one that exercises most of it.
EXPORT_CASES = ("mixtral-window", "qwen2_moe-window-mqa", "qwen3_moe-headdim", "olmoe-clip-norm", "granitemoe",
                "phimoe", "glm4_moe-groups", "minimax_m2")


def cases(n_layers: int = 3) -> dict[str, object]:
    """case id -> a transformers config (built lazily: transformers imports slowly)."""
    def _cfg(name: str, **kw):
        return _family_config(name, n_layers, **kw)

    return {
        "mixtral-tied-mqa": _cfg("mixtral", num_key_value_heads=1, intermediate_size=30, num_local_experts=4,
                                 num_experts_per_tok=3, tie_word_embeddings=True),
        "mixtral-window": _cfg("mixtral", intermediate_size=33, num_local_experts=5, num_experts_per_tok=2,
                               sliding_window=5),
        "qwen2_moe-shared-dense": _cfg("qwen2_moe", moe_intermediate_size=18, intermediate_size=44,
                                       shared_expert_intermediate_size=26, num_experts=6, num_experts_per_tok=2,
                                       mlp_only_layers=[1], norm_topk_prob=False),
        "qwen2_moe-window-mqa": _cfg("qwen2_moe", num_key_value_heads=1, moe_intermediate_size=18,
                                     intermediate_size=44, shared_expert_intermediate_size=26, num_experts=4,
                                     num_experts_per_tok=3, norm_topk_prob=True, use_sliding_window=True,
                                     sliding_window=4, max_window_layers=3, decoder_sparse_step=2),
        "qwen3_moe-headdim": _cfg("qwen3_moe", head_dim=14, moe_intermediate_size=18, intermediate_size=44,
                                  num_experts=6, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True),
        "qwen3_moe-window-mqa": _cfg("qwen3_moe", num_key_value_heads=1, moe_intermediate_size=22,
                                     num_experts=5, num_experts_per_tok=3, norm_topk_prob=False,
                                     use_sliding_window=True, sliding_window=6),
        "olmoe": _cfg("olmoe", intermediate_size=22, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False),
        "olmoe-clip-norm": _cfg("olmoe", num_key_value_heads=1, intermediate_size=22, num_experts=5,
                                num_experts_per_tok=3, norm_topk_prob=True, clip_qkv=0.4),
        "granitemoe": _cfg("granitemoe", intermediate_size=26, num_local_experts=5, num_experts_per_tok=2,
                           embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.6,
                           logits_scaling=2.5),
        "granitemoe-mqa": _cfg("granitemoe", num_key_value_heads=1, intermediate_size=18, num_local_experts=6,
                               num_experts_per_tok=3, embedding_multiplier=12.0, attention_multiplier=0.05,
                               residual_multiplier=0.22, logits_scaling=1.5),
        "phimoe-plain": _cfg("phimoe", num_key_value_heads=1, intermediate_size=22, num_local_experts=5,
                             num_experts_per_tok=2, router_jitter_noise=0.01),
        "phimoe": _cfg("phimoe", intermediate_size=26, num_local_experts=6, num_experts_per_tok=2,
                       attention_bias=True, lm_head_bias=True, router_jitter_noise=0.3, sliding_window=6),
        "glm4_moe-groups": _cfg("glm4_moe", head_dim=16, moe_intermediate_size=18, intermediate_size=44,
                                n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
                                first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                                rope_parameters={"partial_rotary_factor": 0.5}),
        "glm4_moe-plain": _cfg("glm4_moe", num_key_value_heads=1, moe_intermediate_size=18, intermediate_size=44,
                               n_routed_experts=5, num_experts_per_tok=2, n_shared_experts=2,
                               first_k_dense_replace=0, norm_topk_prob=False, use_qk_norm=False,
                               rope_parameters={"partial_rotary_factor": 0.6}),
        "minimax_m2-mqa": _cfg("minimax_m2", num_key_value_heads=1, head_dim=10, intermediate_size=18,
                               num_local_experts=5, num_experts_per_tok=3),
        "minimax_m2": _cfg("minimax_m2", head_dim=12, intermediate_size=22, num_local_experts=6,
                           num_experts_per_tok=2, rope_parameters={"partial_rotary_factor": 0.5}),
        # gpt-oss: sinks, alternating sliding (shorter than the prompt) and full layers, YaRN, and a
        # SwiGLU limit low enough that the clamp bites on these activations.
        "gpt_oss": _cfg("gpt_oss", head_dim=12, intermediate_size=18, num_local_experts=5, num_experts_per_tok=2,
                        sliding_window=4, swiglu_limit=0.9,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),
        "gpt_oss-mqa-truncate": _cfg("gpt_oss", num_key_value_heads=1, head_dim=10, intermediate_size=14,
                                     num_local_experts=4, num_experts_per_tok=3, sliding_window=6,
                                     layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                                     rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0,
                                                      "original_max_position_embeddings": 20, "truncate": True}),
        # DeepSeek: latent attention with and without a low-rank query, interleaved rotary, YaRN
        # with mscale, greedy and group-limited routing, shared experts, dense first layers.
        "deepseek_v2-lite": _cfg("deepseek_v2", q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=6,
                                 qk_rope_head_dim=4, v_head_dim=7, moe_intermediate_size=10, intermediate_size=30,
                                 n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1,
                                 first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.5),
        "deepseek_v2-groups": _cfg("deepseek_v2", q_lora_rank=16, kv_lora_rank=10, qk_nope_head_dim=8,
                                   qk_rope_head_dim=6, v_head_dim=5, moe_intermediate_size=12,
                                   intermediate_size=30, n_routed_experts=6, num_experts_per_tok=3,
                                   n_shared_experts=2, first_k_dense_replace=0, topk_method="group_limited_greedy",
                                   n_group=3, topk_group=2, routed_scaling_factor=2.0,
                                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 0.707,
                                                    "mscale_all_dim": 0.707, "original_max_position_embeddings": 24}),
        "deepseek_v3": _cfg("deepseek_v3", q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4,
                            v_head_dim=7, moe_intermediate_size=10, intermediate_size=30, n_routed_experts=8,
                            num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
                            topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                            rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                             "original_max_position_embeddings": 24, "beta_fast": 32.0,
                                             "beta_slow": 1.0}),
        "deepseek_v3-lite-halfsplit": _cfg("deepseek_v3", num_attention_heads=3, q_lora_rank=None, kv_lora_rank=9,
                                           qk_nope_head_dim=5, qk_rope_head_dim=6, v_head_dim=4,
                                           moe_intermediate_size=10, intermediate_size=26, n_routed_experts=5,
                                           num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=0,
                                           n_group=1, topk_group=1, norm_topk_prob=False, rope_interleave=False),
    }


@torch.no_grad()
def make_model(config, seed: int = 0):
    """transformers' own model of `config`, every parameter and selection bias randomised at a
    scale that keeps activations O(1) (default inits would hide a wrong routing)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = randomize_(AutoModelForCausalLM.from_config(config).eval(), seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name, buffer in model.named_buffers():  # a buffer in MiniMax-M2: randomize_ skips it
        if "e_score_correction_bias" in name:
            buffer.copy_(0.3 * torch.randn(buffer.shape, generator=g))
    return model


def save_checkpoint(model, folder: Path) -> Path:
    """save_pretrained in sharded form (the released per-expert tensor names)."""
    model.save_pretrained(folder, max_shard_size="40KB")
    return folder


def prompt(vocab: int, batch: int = 2, length: int = PROMPT, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
