"""RMSNorm in one Triton kernel: one program per row, fp32 accumulation, any hidden size."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moedeploy.plugins.kernels._launch import check_device

MAX_BLOCK = 4096  # wider rows loop over chunks of this many columns


@triton.jit
def rms_norm_kernel(X, W, stride_x, stride_y, H, eps, Y, BLOCK: tl.constexpr):
    """Y[r] = (X[r] * rsqrt(mean(X[r]^2) + eps)).to(Y's dtype) * W — Llama's rounding order.

    Arguments in TensorRT's AOT launch order: inputs, scalars, outputs (eps becomes a
    constexpr there: AOT plugins pass integer scalars only).
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < H, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0)
        # Round the normalised row to the output dtype, then multiply in fp32 and round once:
        # a product of two fp16/bf16 values is exact in fp32, so this is bit-identical to a
        # native half-precision multiply (and Triton's CPU interpreter has no bf16 arithmetic).
        normed = (x * rstd).to(Y.dtype.element_ty).to(tl.float32)
        y = (normed * w.to(Y.dtype.element_ty).to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(Y + row * stride_y + cols, y, mask=mask)


def block_size(hidden: int) -> int:
    return min(triton.next_power_of_2(hidden), MAX_BLOCK)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape); output in x's dtype (or into `out`)."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"weight has {weight.shape[-1]} features, x has {x.shape[-1]}")
    check_device(x)
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden).contiguous()
    y = torch.empty_like(x2) if out is None else out.view(-1, hidden)
    if x2.shape[0]:
        rms_norm_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), x2.stride(0), y.stride(0), hidden, float(eps), y, BLOCK=block_size(hidden)
        )
    return y.reshape(x.shape)
