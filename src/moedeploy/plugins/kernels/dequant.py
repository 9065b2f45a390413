"""Weight tiles for the MoE kernels: a float weight as it is, or an int8/int4 blocked weight
dequantized in registers.

A quantized weight arrives as the quantized artifact stores it (`models/blockquant.PackedWeight`,
the bytes its DequantizeLinear nodes read): codes uint8, per row of K values K bytes at 8 bits
or K / 2 at 4 bits (element 2i in the low nibble); one scale per block of QBLOCK values along K,
in the weights' dtype; one zero point per block, flattened over all rows and, at 4 bits, packed
two to a byte the same way. A tile is dequantized as DequantizeLinear computes it, (code -
zero_point) * scale in fp32, and rounded to the weights' dtype, so the kernel sees exactly the
float weights the eager reference of a quantized artifact runs on. Reading 1 or 1/2 byte per
weight instead of 4 (fp32) is the point: a decode step is bound by the bytes of weights it reads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_weight(W, S, Z, rows, cols, mask, K, BITS: tl.constexpr, QBLOCK: tl.constexpr, dtype: tl.constexpr):
    """The tile W[rows, cols] of a row-major (R, K) weight as fp32 (rows and cols broadcast
    against each other; out-of-mask elements are 0). BITS 0: W is the float weight and S, Z
    are not read. BITS 8 or 4: W the codes, S the scales, Z the zero points (module doc)."""
    if BITS == 0:
        w = tl.load(W + rows * K + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        block = rows * (K // QBLOCK) + cols // QBLOCK
        scale = tl.load(S + block, mask=mask, other=0.0).to(tl.float32)
        if BITS == 8:
            code = tl.load(W + rows * K + cols, mask=mask, other=0).to(tl.int32)
            zero = tl.load(Z + block, mask=mask, other=0).to(tl.int32)
        else:
            code = (tl.load(W + rows * (K // 2) + cols // 2, mask=mask, other=0).to(tl.int32) >> ((cols % 2) * 4)) & 15
            zero = (tl.load(Z + block // 2, mask=mask, other=0).to(tl.int32) >> ((block % 2) * 4)) & 15
        w = ((code - zero).to(tl.float32) * scale).to(dtype).to(tl.float32)
    return w
