"""gpt-oss: attention sinks, q/k/v/o biases, sliding-window and full layers alternating
(`layer_types`), YaRN RoPE; a router with a bias whose top-k logits are softmaxed (the same
numbers as renormalised softmax top-k); experts with biases and a clamped SwiGLU
(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).

The experts are stored fused and transposed: gate_up_proj (E, H, 2I) with the gate and up
columns interleaved, down_proj (E, I, H); they are split and transposed on read. The released
checkpoints store them as MXFP4 blocks and scales instead (quantization_config "mxfp4"),
unpacked to floats on read, one expert at a time (models/mxfp4.py).
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
    window_layers,
)

EXPERTS = "model.layers.{}.mlp.experts."


def config(hf: dict[str, Any]) -> DecoderConfig:
    base = common(hf, eps=1e-5, scalings=("yarn",), quantizations=("mxfp4",))
    bias = bool(hf.get("attention_bias", True))
    window = hf.get("sliding_window") or 0
    return DecoderConfig(
        **base,
        n_experts=hf["num_local_experts"],
        expert_hidden=hf["intermediate_size"],
        normalize_topk=True,
        qkv_bias=bias,
        o_bias=bias,
        attention_sinks=True,
        sliding_window=window,
        sliding_layers=window_layers(hf) if window else None,
        expert_bias=True,
        router_bias=True,
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_beta=1.0,
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
    )


def derive(shapes: dict[str, tuple[int, ...]], c: DecoderConfig) -> dict[str, Derived]:
    """Our per-expert (E, out, in) weights and biases from the fused, transposed, interleaved
    ones, or from their MXFP4 blocks and scales (the released checkpoints), unpacked to floats."""
    E, H, I = c.n_experts, c.hidden_size, c.expert_hidden  # noqa: E741
    derived: dict[str, Derived] = {}
    for layer in range(c.n_layers):
        experts, ours = EXPERTS.format(layer), f"layers.{layer}.ffn."
        if experts + "gate_up_proj_blocks" in shapes:
            derived.update(_mxfp4_experts(experts, ours, E, H, I))
        elif experts + "gate_up_proj" in shapes:
            gate_up, down = (experts + "gate_up_proj",), (experts + "down_proj",)
            fused, stored_down = ((E, H, 2 * I),), ((E, I, H),)
            derived[ours + "w_gate"] = Derived(gate_up, (E, I, H), lambda w: w[:, 0::2].t(), True, fused)
            derived[ours + "w_up"] = Derived(gate_up, (E, I, H), lambda w: w[:, 1::2].t(), True, fused)
            derived[ours + "w_down"] = Derived(down, (E, H, I), lambda w: w.t(), True, stored_down)
        else:
            continue  # reported as missing by the shape check
        bias, stored = (experts + "gate_up_proj_bias",), ((E, 2 * I),)
        derived[ours + "b_gate"] = Derived(bias, (E, I), lambda b: b[:, 0::2].contiguous(), source_shapes=stored)
        derived[ours + "b_up"] = Derived(bias, (E, I), lambda b: b[:, 1::2].contiguous(), source_shapes=stored)
    return derived


#: the safetensors dtypes of an MXFP4 weight's two tensors: its 4-bit codes packed in bytes and
#: its E8M0 scales, both stored as uint8
CODES = ("U8", "U8")


def _mxfp4_experts(experts: str, ours: str, E: int, H: int, I: int) -> dict[str, Derived]:  # noqa: E741
    """MXFP4 experts: blocks run along the input dim, so one expert's (2I, H/32, 16) blocks
    unpack to its (2I, H) = (out, in) gate_up weight, gate and up rows interleaved."""
    # torch: only once weights are read, never for config.json alone
    from moedeploy.models import mxfp4

    if H % mxfp4.BLOCK or I % mxfp4.BLOCK:
        raise refuse("quantization_config.quant_method", "mxfp4",
                     f"hidden_size ({H}) and intermediate_size ({I}) must be multiples of {mxfp4.BLOCK}")
    pair = lambda name: (experts + name + "_blocks", experts + name + "_scales")  # noqa: E731
    packed = lambda rows, cols: ((E, rows, cols // mxfp4.BLOCK, mxfp4.BLOCK // 2), (E, rows, cols // mxfp4.BLOCK))  # noqa: E731
    gate_up, down = packed(2 * I, H), packed(H, I)
    return {
        ours + "w_gate": Derived(pair("gate_up_proj"), (E, I, H), lambda b, s: mxfp4.dequantize(b, s)[0::2], True,
                                 gate_up, CODES),
        ours + "w_up": Derived(pair("gate_up_proj"), (E, I, H), lambda b, s: mxfp4.dequantize(b, s)[1::2], True,
                               gate_up, CODES),
        ours + "w_down": Derived(pair("down_proj"), (E, H, I), mxfp4.dequantize, True, down, CODES),
    }


NAMES = dataclasses.replace(LLAMA_NAMES, direct=(
    *LLAMA_NAMES.direct,
    (LAYER + r"\.self_attn\.sinks", r"layers.\1.attn.sinks"),
    (LAYER + r"\.mlp\.router\.bias", r"layers.\1.ffn.router.bias"),
    (LAYER + r"\.mlp\.experts\.down_proj_bias", r"layers.\1.ffn.b_down"),
))

FAMILY = Family(
    "gpt_oss", "gpt-oss", config,
    "attention sinks, attention_bias, layer_types (sliding/full), sliding_window, YaRN rope_parameters, "
    "router bias, expert biases, swiglu_alpha, swiglu_limit, MXFP4 experts (unpacked on load)",
    names=NAMES, derive=derive,
)
