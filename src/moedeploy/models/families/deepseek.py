"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (low-rank queries unless
q_lora_rank is null, as in V2-Lite; keys and values from a cached latent), interleaved rotary
pairs, YaRN with its mscale; shared experts and first_k_dense_replace dense layers. V2 routes
with softmax scores, greedy or group_limited_greedy (groups ranked by their best expert), no
renormalisation; V3 routes with sigmoid scores, a selection-only e_score_correction_bias,
groups ranked by their two best, norm_topk_prob; both scale by routed_scaling_factor.

kv_b_proj (heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank) is split per head into the
key and value up-projections that latent attention absorbs (moedeploy.models.mla).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moedeploy.models.config import DecoderConfig
from moedeploy.models.families.base import (
    LAYER,
    LLAMA_NAMES,
    Derived,
    Family,
    common,
    refuse,
    yarn_mscale,
)


def _config(hf: dict[str, Any], v3: bool) -> DecoderConfig:
    base = common(hf, eps=1e-6, scalings=("yarn",))
    rope_dim, nope = hf["qk_rope_head_dim"], hf["qk_nope_head_dim"]
    base.update(head_dim=nope + rope_dim, rotary_dim=rope_dim, n_kv_heads=base["n_heads"])
    scale = (nope + rope_dim) ** -0.5
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if base.get("yarn_factor") and params.get("mscale_all_dim"):
        scale *= yarn_mscale(base["yarn_factor"], params["mscale_all_dim"]) ** 2  # as transformers' yarn_apply_mscale
    moe_hidden = hf["moe_intermediate_size"]
    fields: dict[str, Any] = dict(
        n_experts=hf["n_routed_experts"],
        expert_hidden=moe_hidden,
        dense_hidden=hf["intermediate_size"],
        dense_layers=list(range(min(hf.get("first_k_dense_replace") or 0, hf["num_hidden_layers"]))),
        shared_expert_hidden=moe_hidden * (hf.get("n_shared_experts") or 0),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        kv_lora_rank=hf["kv_lora_rank"],
        q_lora_rank=hf.get("q_lora_rank") or 0,
        qk_nope_head_dim=nope,
        v_head_dim=hf["v_head_dim"],
        qkv_bias=bool(hf.get("attention_bias", False)),
        rope_interleaved=bool(hf.get("rope_interleave", True)) if v3 else True,  # V2 rotates complex pairs
        attention_scale=scale,
    )
    if hf.get("mlp_bias"):
        raise refuse("mlp_bias", True, "the dense and shared experts have no biases")
    if v3:
        fields.update(scoring="sigmoid", score_bias=True, normalize_topk=bool(hf.get("norm_topk_prob", True)),
                      n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1)
    else:
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise refuse("topk_method", method, "DeepSeek-V2 routes greedy or group_limited_greedy")
        fields.update(scoring="softmax", normalize_topk=False)  # V2's router never renormalises
        if method == "group_limited_greedy":
            fields.update(n_group=hf["n_group"], topk_group=hf["topk_group"], group_scoring="max")
    return DecoderConfig(**base, **fields)


def derive(shapes: dict[str, tuple[int, ...]], c: DecoderConfig) -> dict[str, Derived]:
    """Each layer's kv_b_proj split per head into latent attention's w_uk and w_uv."""
    heads, nope, v, rank = c.n_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    derived: dict[str, Derived] = {}
    for layer in range(c.n_layers):
        source = (f"model.layers.{layer}.self_attn.kv_b_proj.weight",)
        if source[0] not in shapes:
            continue  # reported as missing by the shape check
        derived[f"layers.{layer}.attn.w_uk"] = Derived(
            source, (heads, nope, rank), lambda w: w.reshape(heads, nope + v, rank)[:, :nope].contiguous())
        derived[f"layers.{layer}.attn.w_uv"] = Derived(
            source, (heads, v, rank), lambda w: w.reshape(heads, nope + v, rank)[:, nope:].contiguous())
    return derived


ATTENTION = LAYER + r"\.self_attn\."
NAMES = dataclasses.replace(LLAMA_NAMES, direct=(
    *LLAMA_NAMES.direct,
    (ATTENTION + r"q_a_proj\.(weight|bias)", r"layers.\1.attn.wq_a.\2"),
    (ATTENTION + r"q_a_layernorm\.weight", r"layers.\1.attn.q_norm.weight"),
    (ATTENTION + r"q_b_proj\.weight", r"layers.\1.attn.wq_b.weight"),
    (ATTENTION + r"kv_a_proj_with_mqa\.(weight|bias)", r"layers.\1.attn.wkv_a.\2"),
    (ATTENTION + r"kv_a_layernorm\.weight", r"layers.\1.attn.kv_norm.weight"),
), skip_extra_layers=True)  # V3's multi-token-prediction layer follows the decoder's

OPTIONS = ("q_lora_rank (or null), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, YaRN with "
           "mscale/mscale_all_dim, n_shared_experts, first_k_dense_replace, routed_scaling_factor, ")
V2 = Family("deepseek_v2", "DeepSeek-V2", lambda hf: _config(hf, v3=False),
            OPTIONS + "topk_method greedy/group_limited_greedy, n_group, topk_group",
            names=NAMES, experts_key="n_routed_experts", derive=derive)
V3 = Family("deepseek_v3", "DeepSeek-V3", lambda hf: _config(hf, v3=True),
            OPTIONS + "sigmoid + e_score_correction_bias, n_group, topk_group, norm_topk_prob",
            names=NAMES, experts_key="n_routed_experts", derive=derive)
