"""MiniMax-M2: sigmoid scores with a selection-only e_score_correction_bias, always
renormalised; RMSNorm of q and k over the whole projection; partial rotary (rotary_dim)."""

from __future__ import annotations

from typing import Any

from moedeploy.models.config import DecoderConfig
from moedeploy.models.families.base import Family, common


def config(hf: dict[str, Any]) -> DecoderConfig:
    hf = dict(hf)
    if hf.get("rotary_dim") and "partial_rotary_factor" not in (hf.get("rope_parameters") or {}):
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        hf["partial_rotary_factor"] = hf["rotary_dim"] / head_dim  # released checkpoints' legacy field
    return DecoderConfig(
        **common(hf),
        n_experts=hf["num_local_experts"],
        expert_hidden=hf["intermediate_size"],
        normalize_topk=True,
        scoring="sigmoid",
        score_bias=True,
        qk_norm="full",
    )


FAMILY = Family("minimax_m2", "MiniMax-M2", config, "sigmoid + e_score_correction_bias, q/k RMSNorm, rotary_dim")
