"""PhiMoE (Phi-3.5-MoE): LayerNorm with bias instead of RMSNorm, biases on every attention
projection and optionally the LM head, and the sparsemixer router (its inference form: two
arg-max picks, each weighted by a softmax over the logits within router_jitter_noise of it)."""

from __future__ import annotations

from typing import Any

from moedeploy.models.config import DecoderConfig
from moedeploy.models.families.base import Family, common, refuse


def config(hf: dict[str, Any]) -> DecoderConfig:
    if hf["num_experts_per_tok"] != 2:
        raise refuse("num_experts_per_tok", hf["num_experts_per_tok"], "PhiMoE's sparsemixer picks exactly 2")
    bias = bool(hf.get("attention_bias", False))
    return DecoderConfig(
        **common(hf, eps=1e-5),
        n_experts=hf["num_local_experts"],
        expert_hidden=hf["intermediate_size"],
        norm="layer",
        qkv_bias=bias,
        o_bias=bias,
        lm_head_bias=bool(hf.get("lm_head_bias", False)),
        scoring="sparsemixer",
        jitter_eps=float(hf.get("router_jitter_noise", 0.01)),
        sliding_window=hf.get("sliding_window") or 0,
    )


FAMILY = Family(
    "phimoe", "PhiMoE", config,
    "LayerNorm, sparsemixer routing (router_jitter_noise), attention_bias, lm_head_bias, sliding_window",
)
