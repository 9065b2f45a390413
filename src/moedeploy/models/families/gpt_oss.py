"""gpt-oss: attention sinks, q/k/v/o biases, sliding-window and full layers alternating
(`layer_types`), YaRN RoPE; a router with a bias whose top-k logits are softmaxed (the same
numbers as renormalised softmax top-k); experts with biases and a clamped SwiGLU
(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).

The experts are stored fused and transposed: gate_up_proj (E, H, 2I) with the gate and up
columns interleaved, down_proj (E, I, H); they are split and transposed on read.
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
    window_layers,
)

EXPERTS = "model.layers.{}.mlp.experts."


def config(hf: dict[str, Any]) -> DecoderConfig:
    base = common(hf, eps=1e-5, scalings=("yarn",))
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
    """Our per-expert (E, out, in) weights and biases from the fused, transposed, interleaved ones."""
    E, H, I = c.n_experts, c.hidden_size, c.expert_hidden  # noqa: E741
    derived: dict[str, Derived] = {}
    for layer in range(c.n_layers):
        experts, ours = EXPERTS.format(layer), f"layers.{layer}.ffn."
        if experts + "gate_up_proj" not in shapes:
            continue  # reported as missing by the shape check
        gate_up, down = (experts + "gate_up_proj",), (experts + "down_proj",)
        derived[ours + "w_gate"] = Derived(gate_up, (E, I, H), lambda w: w[:, 0::2].t(), per_expert=True)
        derived[ours + "w_up"] = Derived(gate_up, (E, I, H), lambda w: w[:, 1::2].t(), per_expert=True)
        derived[ours + "w_down"] = Derived(down, (E, H, I), lambda w: w.t(), per_expert=True)
        bias = (experts + "gate_up_proj_bias",)
        derived[ours + "b_gate"] = Derived(bias, (E, I), lambda b: b[:, 0::2].contiguous())
        derived[ours + "b_up"] = Derived(bias, (E, I), lambda b: b[:, 1::2].contiguous())
    return derived


NAMES = dataclasses.replace(LLAMA_NAMES, direct=(
    *LLAMA_NAMES.direct,
    (LAYER + r"\.self_attn\.sinks", r"layers.\1.attn.sinks"),
    (LAYER + r"\.mlp\.router\.bias", r"layers.\1.ffn.router.bias"),
    (LAYER + r"\.mlp\.experts\.down_proj_bias", r"layers.\1.ffn.b_down"),
))

FAMILY = Family(
    "gpt_oss", "gpt-oss", config,
    "attention sinks, attention_bias, layer_types (sliding/full), sliding_window, YaRN rope_parameters, "
    "router bias, expert biases, swiglu_alpha, swiglu_limit",
    names=NAMES, derive=derive,
)
