"""Weight tiles for the MoE kernels: a float weight as it is, or an int8/int4 blocked weight
dequantized in registers.

A quantized weight arrives as the quantized artifact stores it (`models/blockquant.PackedWeight`,
the bytes its DequantizeLinear nodes read): codes, per row of K values K bytes at 8 bits or
K / 2 at 4 bits (element 2i in the low nibble), signed (SIGNED: two's complement, no zero
point) or unsigned; one scale per block of QBLOCK values along K, in the weights' dtype; for
unsigned codes one zero point per block, flattened over all rows and, at 4 bits, packed two to
a byte the same way. A tile is dequantized as DequantizeLinear computes it, (code -
zero_point) * scale in fp32, and rounded to the weights' dtype, so the kernel sees exactly the
float weights the eager reference of a quantized artifact runs on. Reading 1 or 1/2 byte per
weight instead of 4 (fp32) is the point: a decode step is bound by the bytes of weights it reads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_weight(W, S, Z, rows, cols, mask, K, BITS: tl.constexpr, QBLOCK: tl.constexpr, SIGNED: tl.constexpr,
                dtype: tl.constexpr):
    """The tile W[rows, cols] of a row-major (R, K) weight as fp32 (rows and cols broadcast
    against each other; out-of-mask elements are 0). BITS 0: W is the float weight and S, Z
    are not read. BITS 8 or 4: W the codes, S the scales, Z the zero points, not read when
    SIGNED (module doc)."""
    if BITS == 0:
        w = tl.load(W + rows * K + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        block = rows * (K // QBLOCK) + cols // QBLOCK
        scale = tl.load(S + block, mask=mask, other=0.0).to(tl.float32)
        if BITS == 8:
            code = tl.load(W + rows * K + cols, mask=mask, other=0).to(tl.int32)
        else:
            code = (tl.load(W + rows * (K // 2) + cols // 2, mask=mask, other=0).to(tl.int32) >> ((cols % 2) * 4)) & 15
        if SIGNED:
            code = ((code & ((1 << BITS) - 1)) ^ (1 << (BITS - 1))) - (1 << (BITS - 1))  # sign-extended
            zero = 0
        elif BITS == 8:
            zero = tl.load(Z + block, mask=mask, other=0).to(tl.int32)
        else:
            zero = (tl.load(Z + block // 2, mask=mask, other=0).to(tl.int32) >> ((block % 2) * 4)) & 15
        w = ((code - zero).to(tl.float32) * scale).to(dtype).to(tl.float32)
    return w


@triton.jit
def load_weight_t(W, S, Z, rows, n_mask, k0, K, BITS: tl.constexpr, QBLOCK: tl.constexpr, SIGNED: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, dtype: tl.constexpr):
    """The transposed tile W[rows, k0:k0 + BLOCK_K]^T, (BLOCK_K, BLOCK_N) fp32, of a row-major
    (R, K) weight (rows, n_mask: (1, BLOCK_N)), what a GEMM's B operand takes; out-of-range
    elements are 0. The same values as `load_weight`, read for a tile at once: each block's
    scale and zero point once per column (not once per weight), and 4-bit codes a byte per
    lane, split into their two nibbles in registers. k0 is a multiple of BLOCK_K."""
    ks = k0 + tl.arange(0, BLOCK_K)[:, None]  # (BK, 1)
    mask = (ks < K) & n_mask
    if BITS == 0:
        w = tl.load(W + rows * K + ks, mask=mask, other=0.0).to(tl.float32)
    else:
        if BITS == 8:
            code = tl.load(W + rows * K + ks, mask=mask, other=0).to(tl.int32)
        else:
            pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)[:, None]  # (BK / 2, 1) bytes along K
            byte = tl.load(W + rows * (K // 2) + pairs, mask=(pairs * 2 < K) & n_mask, other=0).to(tl.int32)
            # (BK / 2, BN) bytes -> (BK / 2, 2, BN) nibbles, low first -> (BK, BN) in K order
            code = tl.reshape(tl.permute(tl.join(byte & 15, byte >> 4), (0, 2, 1)), (BLOCK_K, BLOCK_N))
        if SIGNED:
            code = ((code & ((1 << BITS) - 1)) ^ (1 << (BITS - 1))) - (1 << (BITS - 1))  # sign-extended
        if BLOCK_K >= QBLOCK:
            blocks = k0 // QBLOCK + tl.arange(0, BLOCK_K // QBLOCK)[:, None]  # (NB, 1)
            index = rows * (K // QBLOCK) + blocks  # (NB, BN)
            block_mask = (blocks < K // QBLOCK) & n_mask
            scale = tl.load(S + index, mask=block_mask, other=0.0).to(tl.float32)
            if SIGNED:
                zero = tl.zeros_like(index)
            elif BITS == 8:
                zero = tl.load(Z + index, mask=block_mask, other=0).to(tl.int32)
            else:
                zero = (tl.load(Z + index // 2, mask=block_mask, other=0).to(tl.int32) >> ((index % 2) * 4)) & 15
            shape: tl.constexpr = (BLOCK_K // QBLOCK, QBLOCK, BLOCK_N)
            scale = tl.reshape(tl.broadcast_to(scale[:, None, :], shape), (BLOCK_K, BLOCK_N))
            zero = tl.reshape(tl.broadcast_to(zero[:, None, :], shape), (BLOCK_K, BLOCK_N))
        else:  # the whole tile lies in one block of each column
            index = rows * (K // QBLOCK) + k0 // QBLOCK  # (1, BN)
            scale = tl.load(S + index, mask=n_mask, other=0.0).to(tl.float32)
            if SIGNED:
                zero = tl.zeros_like(index)
            elif BITS == 8:
                zero = tl.load(Z + index, mask=n_mask, other=0).to(tl.int32)
            else:
                zero = (tl.load(Z + index // 2, mask=n_mask, other=0).to(tl.int32) >> ((index % 2) * 4)) & 15
        w = tl.where(mask, ((code - zero).to(tl.float32) * scale).to(dtype).to(tl.float32), 0.0)
    return w



def codes_chunk(bits: int, block: int) -> int:
    """The K chunk the grouped kernels multiply int8 codes by at once (`dot_codes`), or 0 where
    they dequantize tiles instead (`load_weight_t`): int4, and blocks under 16. A chunk lies
    inside one quantization block (so one scale per column covers it), gives tl.dot at least 16
    along K, and is at most 64, so a block of 128 or 256 is taken in chunks.

    int4 stays on dequantized tiles because it measured slower the other way. On an H100 at
    Mixtral's layer size (benchmarks/moe_kernel_nbits.py, session 19), one token's MoE took
    1,078-1,189 us with int4 codes in tl.dot (their nibbles split and re-interleaved, or two dots
    over the low and high nibbles) against 611-615 us on dequantized tiles; int8 codes in tl.dot
    took 420 us against 441 (and 647 against 698 at 4 tokens, 919 against 965 at 16)."""
    chunk = min(block, 64)
    if bits != 8 or chunk & (chunk - 1) or block % chunk or chunk < 16:
        return 0
    return chunk


@triton.jit
def dot_codes(a_rows, a_mask, W, S, Z, rows, n_mask, k0, K, QBLOCK: tl.constexpr, SIGNED: tl.constexpr,
              CHUNK: tl.constexpr, dtype: tl.constexpr, PRECISION: tl.constexpr):
    """sum over k in [k0, k0 + CHUNK) of A[m, k] * W[rows[n], k], fp32 (BM, BN), for the int8
    codes of a row-major (R, K) weight, the chunk inside one quantization block (`codes_chunk`).

    Why not dequantize the tile (`load_weight_t`): codes minus their zero point are integers of
    at most 9 bits, exact in fp16, bf16 and fp32, so they go into tl.dot as they are and the
    block's scale multiplies the chunk's sums, one multiply per output instead of per weight.
    The sums differ from `load_weight_t`'s only by rounding: the weights are not rounded to
    dtype before the product (at most half an ulp of dtype each).
    a_rows: (BM, 1) pointers to the activation rows (element k at a_rows + k), a_mask (BM, 1);
    rows, n_mask: (1, BN)."""
    index = rows * (K // QBLOCK) + k0 // QBLOCK  # (1, BN): the block of each column
    scale = tl.load(S + index, mask=n_mask, other=0.0).to(tl.float32)
    ks = k0 + tl.arange(0, CHUNK)[:, None]  # (CHUNK, 1)
    code = tl.load(W + rows * K + ks, mask=(ks < K) & n_mask, other=0).to(tl.int32)
    if SIGNED:  # two's complement, stored as int8 or uint8
        code = ((code & 255) ^ 128) - 128
    else:  # zero points are bytes, unsigned (& 255 whether they are stored as int8 or uint8)
        code = (code & 255) - (tl.load(Z + index, mask=n_mask, other=0).to(tl.int32) & 255)
    ks_row = k0 + tl.arange(0, CHUNK)[None, :]  # (1, CHUNK)
    a = tl.load(a_rows + ks_row, mask=a_mask & (ks_row < K), other=0.0).to(dtype)
    return tl.dot(a, code.to(dtype), input_precision=PRECISION) * scale
