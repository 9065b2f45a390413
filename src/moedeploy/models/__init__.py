"""Eager PyTorch reference models: the ground truth every exported graph and engine is judged by.

The names below load their module on first use (PEP 562): `moedeploy.models.families` and
`moedeploy.models.config` read a checkpoint's config.json without torch, so the command line can
refuse a model it cannot take, or list the families, before torch is imported (5 s)."""

from __future__ import annotations

import importlib
from typing import Any

#: each public name -> the module under moedeploy.models that defines it
_WHERE = {
    "Attention": "attention", "RotaryEmbedding": "attention", "StaticLayerCache": "attention", "causal_mask": "attention",
    "CheckpointError": "checkpoint", "load_decoder": "checkpoint", "save_decoder": "checkpoint",
    "PRESETS": "config", "DecoderConfig": "config", "preset": "config",
    "MoEDecoder": "decoder",
    "MLP": "ffn", "BatchNormMLP": "ffn", "FeedForward": "ffn", "SwiGLU": "ffn", "swiglu_hidden_dim": "ffn",
    "SamplingConfig": "generation", "generate_tokens": "generation",
    "DecoderLayer": "layers", "EncoderLayer": "layers",
    "SparseMoE": "moe",
    "BatchNorm": "norms", "LayerNorm": "norms", "RMSNorm": "norms",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'moedeploy.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"moedeploy.models.{module}"), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})

