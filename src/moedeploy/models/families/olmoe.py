"""OLMoE: softmax top-k (norm_topk_prob, default off), RMSNorm of q and k over the whole
projection, and an optional clamp of q/k/v (clip_qkv)."""

from __future__ import annotations

from typing import Any

from moedeploy.models.config import DecoderConfig
from moedeploy.models.families.base import Family, common


def config(hf: dict[str, Any]) -> DecoderConfig:
    bias = bool(hf.get("attention_bias", False))
    return DecoderConfig(
        **common(hf, eps=1e-5),
        n_experts=hf["num_experts"],
        expert_hidden=hf["intermediate_size"],
        normalize_topk=bool(hf.get("norm_topk_prob", False)),
        qk_norm="full",
        clip_qkv=float(hf.get("clip_qkv") or 0.0),
        qkv_bias=bias,
        o_bias=bias,
    )


FAMILY = Family("olmoe", "OLMoE", config, "q/k RMSNorm over the projection, clip_qkv, norm_topk_prob, attention_bias",
                experts_key="num_experts")
