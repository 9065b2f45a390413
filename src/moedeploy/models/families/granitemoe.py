"""GraniteMoE: Mixtral's block with four scalings (embedding_multiplier on the embeddings,
attention_multiplier as the softmax scale, residual_multiplier on each branch, logits divided
by logits_scaling). Its router takes top-k of the logits and then a softmax over those k,
which equals renormalised softmax top-k, so it runs on the same op (and ONNX Runtime's MoE)."""

from __future__ import annotations

from typing import Any

from moedeploy.models.config import DecoderConfig
from moedeploy.models.families.base import Family, common


def config(hf: dict[str, Any]) -> DecoderConfig:
    bias = bool(hf.get("attention_bias", False))
    return DecoderConfig(
        **common(hf),
        n_experts=hf["num_local_experts"],
        expert_hidden=hf["intermediate_size"],
        normalize_topk=True,
        qkv_bias=bias,
        o_bias=bias,
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        attention_scale=float(hf.get("attention_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        logits_scaling=float(hf.get("logits_scaling", 1.0)),
    )


FAMILY = Family(
    "granitemoe", "GraniteMoE", config,
    "embedding_multiplier, attention_multiplier, residual_multiplier, logits_scaling, fused input_linear",
)
