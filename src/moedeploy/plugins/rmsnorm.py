"""The `moe::RMSNorm` op.

Eager semantics (Llama / Mixtral): normalise in fp32, cast back to the input dtype, then
apply the weight, so fp16/bf16 models round exactly where Hugging Face rounds.
"""

from __future__ import annotations

import torch

DOMAIN = "moe"
OP_TYPE = "RMSNorm"
VERSION = 1


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, accumulated in fp32."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The op as the models call it."""
    return rms_norm_reference(x, weight, eps)
