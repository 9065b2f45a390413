"""GLM-4-MoE (GLM-4.5): sigmoid scores with a selection-only e_score_correction_bias,
group-limited top-k (n_group, topk_group), norm_topk_prob and routed_scaling_factor; an
ungated shared expert; the first first_k_dense_replace layers dense; partial rotary; q/k/v
biases (attention_bias) and optional per-head q/k RMSNorm (use_qk_norm)."""

from __future__ import annotations

import dataclasses
from typing import Any

from moedeploy.models.config import DecoderConfig
from moedeploy.models.families.base import LLAMA_NAMES, Family, common


def config(hf: dict[str, Any]) -> DecoderConfig:
    base = common(hf, eps=1e-5)
    if "rotary_dim" not in base and "partial_rotary_factor" not in (hf.get("rope_parameters") or {}):
        base["rotary_dim"] = base["head_dim"] // 2  # GLM-4-MoE's default partial_rotary_factor is 0.5
    moe_hidden = hf["moe_intermediate_size"]
    return DecoderConfig(
        **base,
        n_experts=hf["n_routed_experts"],
        expert_hidden=moe_hidden,
        dense_hidden=hf["intermediate_size"],
        dense_layers=list(range(min(hf.get("first_k_dense_replace", 1), hf["num_hidden_layers"]))),
        shared_expert_hidden=moe_hidden * (hf.get("n_shared_experts") or 0),
        normalize_topk=bool(hf.get("norm_topk_prob", True)),
        scoring="sigmoid",
        score_bias=True,
        n_group=hf.get("n_group", 1) or 1,
        topk_group=hf.get("topk_group", 1) or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        qkv_bias=bool(hf.get("attention_bias", False)),
        qk_norm="head" if hf.get("use_qk_norm") else "none",
    )


FAMILY = Family(
    "glm4_moe", "GLM-4-MoE", config,
    "sigmoid + e_score_correction_bias, n_group/topk_group, routed_scaling_factor, norm_topk_prob, "
    "n_shared_experts, first_k_dense_replace, partial_rotary_factor, attention_bias, use_qk_norm",
    names=dataclasses.replace(LLAMA_NAMES, skip_extra_layers=True),  # its MTP layer follows the decoder's
    experts_key="n_routed_experts",
)
