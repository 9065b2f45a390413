"""What a family module provides, and the config helpers every family shares.

A family maps a Hugging Face `config.json` onto DecoderConfig (refusing, in one line, any
option the shared decoder does not implement) and the checkpoint's tensor names onto ours.
Most families keep Llama's names, so `LLAMA_NAMES` serves them; a family overrides only what
it renames.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moedeploy.models.config import DecoderConfig

if TYPE_CHECKING:  # a family maps config.json without torch: the command line checks a checkpoint before loading it
    import torch


class UnsupportedOption(ValueError):
    """A config.json option the shared decoder does not implement (named in the message)."""


#: The MoE block's module name: Mixtral, GraniteMoE and MiniMax-M2 say block_sparse_moe, the others mlp.
MOE = r"(?:block_sparse_moe|mlp)"
LAYER = r"model\.layers\.(\d+)"


@dataclass(frozen=True)
class TensorNames:
    """Hugging Face tensor names (regexes; group 1 is the layer) and the ones they become.

    direct       one file tensor is one of ours (renamed)
    per_expert   groups (layer, expert, role): one tensor per expert, stacked on read
    fused        gate and up in one (E, 2I, H) tensor, gate rows first
    """

    direct: tuple[tuple[str, str], ...]
    per_expert: str = LAYER + r"\." + MOE + r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight"
    roles: dict[str, str] = field(default_factory=lambda: {
        "w1": "w_gate", "w3": "w_up", "w2": "w_down", "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down",
    })
    fused_gate_up: str = LAYER + r"\." + MOE + r"\.(?:experts\.gate_up_proj|input_linear\.weight)"
    #: Layers past num_hidden_layers are multi-token-prediction modules (GLM-4.5): not part of
    #: the decoder, skipped as transformers skips them. Elsewhere such a tensor is an error.
    skip_extra_layers: bool = False


LLAMA_NAMES = TensorNames(direct=(
    (r"model\.embed_tokens\.weight", "embed.weight"),
    (r"model\.norm\.(weight|bias)", r"norm.\1"),
    (r"lm_head\.(weight|bias)", r"lm_head.\1"),
    (LAYER + r"\.input_layernorm\.(weight|bias)", r"layers.\1.attn_norm.\2"),
    (LAYER + r"\.post_attention_layernorm\.(weight|bias)", r"layers.\1.ffn_norm.\2"),
    (LAYER + r"\.self_attn\.(q|k|v|o)_proj\.(weight|bias)", r"layers.\1.attn.w\2.\3"),
    (LAYER + r"\.self_attn\.(q|k)_norm\.weight", r"layers.\1.attn.\2_norm.weight"),
    # the router: gate (most), router (PhiMoE), router.layer (GraniteMoE)
    (LAYER + r"\." + MOE + r"\.(?:gate|router|router\.layer)\.weight", r"layers.\1.ffn.router.weight"),
    (LAYER + r"\." + MOE + r"\.(?:gate\.)?e_score_correction_bias", r"layers.\1.ffn.score_bias"),
    (LAYER + r"\." + MOE + r"\.(?:experts\.down_proj|output_linear\.weight)", r"layers.\1.ffn.w_down"),
    (LAYER + r"\." + MOE + r"\.shared_experts?\.gate_proj\.weight", r"layers.\1.ffn.shared.w1.weight"),
    (LAYER + r"\." + MOE + r"\.shared_experts?\.up_proj\.weight", r"layers.\1.ffn.shared.w3.weight"),
    (LAYER + r"\." + MOE + r"\.shared_experts?\.down_proj\.weight", r"layers.\1.ffn.shared.w2.weight"),
    (LAYER + r"\." + MOE + r"\.shared_expert_gate\.weight", r"layers.\1.ffn.shared_gate.weight"),
    # a dense layer's SwiGLU
    (LAYER + r"\.mlp\.gate_proj\.weight", r"layers.\1.ffn.w1.weight"),
    (LAYER + r"\.mlp\.up_proj\.weight", r"layers.\1.ffn.w3.weight"),
    (LAYER + r"\.mlp\.down_proj\.weight", r"layers.\1.ffn.w2.weight"),
))


@dataclass(frozen=True)
class Derived:
    """One of our tensors computed from checkpoint tensors rather than renamed: gpt-oss's
    transposed, interleaved (and MXFP4-packed) experts, DeepSeek's kv_b_proj split per head.

    `make(*sources)` returns our tensor; with `per_expert` every source leads with the expert
    dim and `make` gets one expert's slices at a time (the unit of streaming). `source_shapes`,
    where given, are the shapes config.json implies for the sources: the loader checks the
    file headers against them before anything is read, as it does for renamed tensors.
    `source_dtypes`, where given, are the safetensors dtypes the sources are stored in (MXFP4's
    "U8" codes and scales); without them every source is held to a float dtype, as renamed
    tensors are.
    """

    sources: tuple[str, ...]
    shape: tuple[int, ...]
    make: Callable[..., torch.Tensor]
    per_expert: bool = False
    source_shapes: tuple[tuple[int, ...], ...] | None = None
    source_dtypes: tuple[str, ...] | None = None


#: shapes of the checkpoint's tensors (by name), config -> {our name: Derived}
DeriveTensors = Callable[[dict[str, tuple[int, ...]], DecoderConfig], dict[str, Derived]]


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture the shared decoder implements."""

    model_type: str
    title: str  # what users call it, e.g. "Qwen3-MoE"
    config: Callable[[dict[str, Any]], DecoderConfig]
    options: str  # the config.json options it honours, for `moedeploy families`
    names: TensorNames = LLAMA_NAMES
    experts_key: str = "num_local_experts"  # the config.json key of the expert count, for messages
    derive: DeriveTensors | None = None  # tensors that need more than a rename


#: config.json fields that must be integers (when present and not null), in Hugging Face's names
INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "num_experts_per_tok", "num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts",
    "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "max_position_embeddings",
    "first_k_dense_replace", "n_group", "topk_group", "decoder_sparse_step", "rotary_dim", "sliding_window",
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
)
#: config.json fields that must be at least 1 (when present and not null)
POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
#: config.json fields that must be finite numbers >= 0 (when present and not null)
NUMBER_FIELDS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "partial_rotary_factor", "router_jitter_noise")


def checked_field_types(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` itself, once its numeric fields have the types transformers gives them: a "32" or a
    4.0 for a head count otherwise fails deep inside with a message naming no field, and a
    negative or NaN epsilon or theta exports a model that computes NaN."""
    for key in INT_FIELDS:
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise UnsupportedOption(f"{key} is {value!r}, not an integer; fix it in config.json")
    for key in POSITIVE_FIELDS:  # a head count of 0 is a division by zero in every family's config
        value = hf.get(key)
        if value is not None and value < 1:
            raise UnsupportedOption(f"{key} is {value!r}, not an integer >= 1; fix it in config.json")
    for key in NUMBER_FIELDS:
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0):
            raise UnsupportedOption(f"{key} is {value!r}, not a finite number >= 0; fix it in config.json")
    if (factor := hf.get("routed_scaling_factor")) == 0:  # every expert's weight times 0 (Routing refuses it)
        raise UnsupportedOption(f"routed_scaling_factor is {factor!r}, which weighs every expert by 0; fix it in "
                                "config.json")
    return hf


def refuse(option: str, value: Any, why: str) -> UnsupportedOption:
    return UnsupportedOption(f"{option}={value!r} is not supported: {why}")


#: rope_theta where config.json gives none: each family's default in transformers 5 (its config
#: class's default_theta); 10000 for the others
DEFAULT_ROPE_THETA = {"mixtral": 1e6, "phimoe": 1e6, "minimax_m2": 5e6, "gpt_oss": 150000.0}
#: the families whose transformers rotary embedding applies partial_rotary_factor; the others'
#: rotate the whole head whatever config.json says
PARTIAL_ROTARY_FAMILIES = ("glm4_moe", "minimax_m2")


def rope(hf: dict[str, Any], scalings: tuple[str, ...] = ()) -> tuple[float, float, dict[str, Any]]:
    """(rope_theta, partial_rotary_factor, YaRN fields of DecoderConfig) from rope_parameters
    (transformers 5) or the legacy rope_scaling and top-level fields, read as transformers 5 reads
    them. A RoPE type other than the default, or a scaling the family does not list in
    `scalings`, is refused; so is a config.json whose rope_parameters and rope_scaling disagree
    (transformers would take rope_scaling and drop rope_parameters, its rope_theta with it)."""
    legacy, params = hf.get("rope_scaling"), hf.get("rope_parameters")
    if legacy and params and legacy != params:
        raise UnsupportedOption(
            "config.json has both rope_parameters and the older rope_scaling, and they differ (transformers 5 would "
            "use rope_scaling and ignore rope_parameters, its rope_theta too); put the scaling into rope_parameters "
            "and delete rope_scaling")
    params = params or legacy or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None, *scalings):
        allowed = " and ".join(("the default RoPE", *scalings))
        raise refuse("rope_type", kind, f"only {allowed} is implemented for this family")
    theta = params.get("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA.get(hf.get("model_type"), 10000.0)))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 0):
        raise UnsupportedOption(f"rope_theta is {theta!r}, not a finite number > 0; fix it in config.json")
    theta = float(theta)
    factor = 1.0
    if hf.get("model_type") in PARTIAL_ROTARY_FAMILIES:
        factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    return theta, factor, yarn_fields(hf, params) if kind == "yarn" else {}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times the pretraining one."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_fields(hf: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """DecoderConfig's yarn_* fields from a YaRN rope_parameters, as transformers reads them."""
    original = int(params.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 4096))
    factor = params.get("factor") or hf.get("max_position_embeddings", original) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    return {
        "yarn_factor": float(factor),
        "yarn_original_positions": original,
        "yarn_beta_fast": float(params.get("beta_fast") or 32.0),
        "yarn_beta_slow": float(params.get("beta_slow") or 1.0),
        "yarn_truncate": bool(params.get("truncate", True)),
        "yarn_attention_factor": float(attention_factor),
    }


def common(
    hf: dict[str, Any], eps: float = 1e-6, scalings: tuple[str, ...] = (), quantizations: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The fields every Llama-style config.json names the same way. `eps`: the family's default
    rms_norm_eps in transformers, for a config.json that leaves it out; `scalings`: the RoPE
    scalings the family implements beyond the default (e.g. "yarn"); `quantizations`: the
    quantization_config.quant_method values whose tensors the family unpacks on load."""
    quantized = hf.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else quantized
        if method not in quantizations:
            raise refuse("quantization_config.quant_method", method, "load the unquantized (bf16/fp32) checkpoint")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise refuse("hidden_act", act, "the experts are SwiGLU (silu)")
    theta, factor, yarn = rope(hf, scalings)
    window_layers(hf)  # refuses attention kinds we do not implement
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    fields = {
        "family": hf["model_type"],
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "top_k": hf["num_experts_per_tok"],
        "max_positions": hf.get("max_position_embeddings", 4096),
        "rope_theta": theta,
        "norm_eps": float(hf.get("rms_norm_eps", eps)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "head_dim": head_dim,
        **yarn,
    }
    if factor != 1.0:
        fields["rotary_dim"] = int(head_dim * factor)
    return fields


def sparse_layers(hf: dict[str, Any]) -> list[int]:
    """Qwen's dense layers: those in mlp_only_layers, and those off the decoder_sparse_step."""
    step = hf.get("decoder_sparse_step", 1) or 1
    only = set(hf.get("mlp_only_layers") or [])
    return [i for i in range(hf["num_hidden_layers"]) if i in only or (i + 1) % step]


def window_layers(hf: dict[str, Any]) -> list[int] | None:
    """Layers with sliding-window attention from `layer_types`, None when it does not say."""
    types = hf.get("layer_types")
    if not types:
        return None
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise refuse("layer_types", unknown[0], "only sliding_attention and full_attention layers exist")
    return [i for i, kind in enumerate(types) if kind == "sliding_attention"]
