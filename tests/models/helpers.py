"""Test helpers: random weights that give O(1) activations, tiny Hugging Face Mixtral models."""

from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Overwrite every parameter with seeded random values of a scale that keeps activations O(1).

    Default initialisations (std 0.02) make logits and router logits nearly constant, which
    would let a wrong routing or a missing term hide under the tolerance.
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if p.dim() == 1 and "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        elif p.dim() == 1:
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return module


def tiny_mixtral_config(**overrides):
    """A transformers MixtralConfig for a tiny model: eager attention and experts, no sliding window."""
    from transformers import MixtralConfig

    kwargs = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
    )
    kwargs.update(overrides)
    rope_theta = kwargs.pop("rope_theta")
    config = MixtralConfig(
        **kwargs, rope_parameters={"rope_type": "default", "rope_theta": rope_theta}
    )
    # Plain per-expert loop: transformers' default grouped_mm needs 16-byte-aligned strides,
    # which odd intermediate sizes (33) do not have on CPU.
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def tiny_mixtral(seed: int = 0, **overrides):
    """A randomised, eval-mode transformers MixtralForCausalLM."""
    from transformers import MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(tiny_mixtral_config(**overrides)).eval()
    randomize_(model, seed)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model
