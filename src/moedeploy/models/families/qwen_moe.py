"""Qwen2-MoE and Qwen3-MoE: softmax top-k (renormalised only with norm_topk_prob), dense
layers by mlp_only_layers / decoder_sparse_step, sliding windows by use_sliding_window.

Qwen2-MoE adds q/k/v biases and a shared expert scaled by sigmoid(shared_expert_gate x);
Qwen3-MoE adds a per-head RMSNorm of q and k and an explicit head_dim.
"""

from __future__ import annotations

from typing import Any

from moedeploy.models.config import DecoderConfig
from moedeploy.models.families.base import Family, common, refuse, sparse_layers, window_layers


def _moe(hf: dict[str, Any]) -> dict[str, Any]:
    # Released checkpoints say num_experts; transformers 5 writes Qwen3-MoE's as num_local_experts.
    n_experts = hf.get("num_experts") or hf.get("num_local_experts")
    if not n_experts:
        raise refuse("num_experts", n_experts, "a Qwen MoE without experts is a dense model")
    fields = {
        "n_experts": n_experts,
        "expert_hidden": hf["moe_intermediate_size"],
        "dense_hidden": hf.get("intermediate_size") or 0,
        "dense_layers": sparse_layers(hf),
        "normalize_topk": bool(hf.get("norm_topk_prob", False)),
    }
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        fields["sliding_window"] = hf["sliding_window"]
    return fields


def qwen2_config(hf: dict[str, Any]) -> DecoderConfig:
    fields = _moe(hf)
    if "sliding_window" in fields:
        layers = window_layers(hf)
        if layers is None:  # transformers' rule when config.json lists no layer_types
            top = hf.get("max_window_layers", 28)
            layers = [i for i in range(hf["num_hidden_layers"]) if (i + 1) % 2 and i < top]
        fields["sliding_layers"] = layers
    shared = hf.get("shared_expert_intermediate_size") or 0
    return DecoderConfig(
        **common(hf), **fields, qkv_bias=bool(hf.get("qkv_bias", True)),
        shared_expert_hidden=shared, shared_expert_gate=bool(shared),
    )


def qwen3_config(hf: dict[str, Any]) -> DecoderConfig:
    bias = bool(hf.get("attention_bias", False))
    return DecoderConfig(**common(hf), **_moe(hf), qk_norm="head", qkv_bias=bias, o_bias=bias)


QWEN2 = Family(
    "qwen2_moe", "Qwen2-MoE", qwen2_config,
    "qkv_bias, shared expert with sigmoid gate, norm_topk_prob, mlp_only_layers, decoder_sparse_step, "
    "use_sliding_window + layer_types", experts_key="num_experts",
)
QWEN3 = Family(
    "qwen3_moe", "Qwen3-MoE", qwen3_config,
    "per-head q/k RMSNorm, head_dim, attention_bias, norm_topk_prob, mlp_only_layers, decoder_sparse_step, "
    "use_sliding_window", experts_key="num_experts",
)
