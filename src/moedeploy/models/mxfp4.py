"""MXFP4 (OCP Microscaling, as gpt-oss's released checkpoints store their experts) unpacked to
floats on load.

A block of 32 weights shares one scale: `*_blocks` holds the 32 E2M1 codes of each block as
16 bytes (element 2i in the low nibble of byte i, element 2i+1 in the high one), `*_scales`
one E8M0 byte per block, the power of two 2**(byte - 127). Weight = e2m1(code) * scale.
E2M1 is 1 sign, 2 exponent and 1 mantissa bit: the 16 codes mean +-{0, .5, 1, 1.5, 2, 3, 4, 6}.
The scale byte 0xFF means NaN in the OCP spec, and so it does here (a broken checkpoint
shows as NaN weights, never as plausible numbers).

The blocks run along the input dimension, so a (rows, in/32, 16) tensor unpacks to a
(rows, in) weight: (out, in) for nn.Linear, the orientation our experts use.
"""

from __future__ import annotations

import torch

BLOCK = 32  # weights per scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
SCALE_NAN = 0xFF


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., G, 16) uint8 blocks and (..., G) uint8 E8M0 scales -> (..., G * 32) weights in `dtype`.

    The product is exact in float32 (a 2-bit significand times a power of two) unless the
    scale leaves float32's range; a narrower `dtype` rounds or overflows only as a cast does.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1:] != (BLOCK // 2,) or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
            f"expected (..., G, {BLOCK // 2}) and (..., G)"
        )
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # low nibble first
    values = table[codes].flatten(-2)  # (..., G, 32)
    exponent = scales.to(torch.int32) - SCALE_BIAS
    weights = torch.ldexp(values, exponent.unsqueeze(-1))
    weights = weights.masked_fill((scales == SCALE_NAN).unsqueeze(-1), float("nan"))
    return weights.flatten(-2).to(dtype)
