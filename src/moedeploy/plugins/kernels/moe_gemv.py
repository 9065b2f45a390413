"""The grouped pipeline's experts for a few tokens: one program per routed slot, no tiles of rows.

In a decode step each expert sees a row or two. The grouped GEMMs (`moe.gate_up_kernel`,
`moe.down_kernel`) pad those rows to a 16-row tile for `tl.dot`, and every weight they read
passes through registers into an MMA operand layout; for int8/int4 experts that costs more
than the bytes saved (benchmarks/README.md). Here a program owns one slot (a token's pick) and
a tile of output columns, and multiplies its activation row into the weight tile as a
matrix-vector product: each code is widened, scaled per block and summed where it was loaded.
int4 bytes are never split into K order either: the low nibbles (even k) meet the row's even
activations and the high ones the odd.

    gate_up_gemv_kernel   grid (N * k, cdiv(I, BLOCK_N)): act(x W_gate^T, x W_up^T) per slot
    down_gemv_kernel      grid (N * k, cdiv(H, BLOCK_N)): routing weight * (hidden W_down^T)

An expert taken by r slots is read r times (from L2 when they run together), so this suits
small N (`moe.default_config`). The routing, the combine and the rounding are the grouped
pipeline's: each linear rounded to x's dtype, the sums in fp32, the weights not rounded to
x's dtype before the product (int8/int4: codes times their block's scale, in fp32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moedeploy.plugins.kernels.moe import expert_hidden, interleaved_rows


def gemv_block_k(block_k: int, qblock: int) -> int:
    """K values a program multiplies per loop step: whole quantization blocks, at least `block_k`."""
    return max(block_k, qblock)


@triton.jit
def gemv_step(a_row, W, S, Z, rows, n_valid, k0, K, BITS: tl.constexpr, QBLOCK: tl.constexpr, SIGNED: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """sum over k in [k0, k0 + BLOCK_K) of a[k] * W[rows[n], k], fp32 (BN,), for a row-major
    (R, K) weight: float (BITS 0) or int8/int4 codes with one scale per QBLOCK values of a row
    (the layout of `dequant.load_weight`). a_row points at the activation row; rows, n_valid (BN,).
    Quantized tiles are (blocks, values of a block, columns): each block's sums are scaled once."""
    if BITS == 0:
        ks = k0 + tl.arange(0, BLOCK_K)[:, None]  # (BK, 1)
        w = tl.load(W + rows[None, :] * K + ks, mask=(ks < K) & n_valid[None, :], other=0.0).to(tl.float32)
        a = tl.load(a_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        result = tl.sum(a * w, axis=0)
    else:  # a constexpr branch each: Triton compiles what follows a return
        NB: tl.constexpr = BLOCK_K // QBLOCK
        blocks = k0 // QBLOCK + tl.arange(0, NB)  # (NB,) blocks along the row
        block_valid = blocks < K // QBLOCK
        index = rows[None, :] * (K // QBLOCK) + blocks[:, None]  # (NB, BN): each (block, column)'s scale
        index_mask = block_valid[:, None] & n_valid[None, :]
        scale = tl.load(S + index, mask=index_mask, other=0.0).to(tl.float32)
        mask = index_mask[:, None, :]  # (NB, 1, BN)
        if BITS == 8:
            ks = blocks[:, None, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :, None]  # (NB, QBLOCK, 1)
            code = tl.load(W + rows[None, None, :] * K + ks, mask=mask, other=0).to(tl.int32)
            if SIGNED:
                code = ((code & 255) ^ 128) - 128
            else:
                code = (code & 255) - (tl.load(Z + index, mask=index_mask, other=0).to(tl.int32) & 255)[:, None, :]
            a = tl.load(a_row + ks, mask=block_valid[:, None, None], other=0.0).to(tl.float32)
            sums = tl.sum(a * code.to(tl.float32), axis=1)  # (NB, BN)
        else:
            pairs = blocks[:, None, None] * (QBLOCK // 2) + tl.arange(0, QBLOCK // 2)[None, :, None]  # bytes along the row
            byte = tl.load(W + rows[None, None, :] * (K // 2) + pairs, mask=mask, other=0).to(tl.int32)
            low, high = byte & 15, (byte >> 4) & 15
            if SIGNED:
                low, high = (low ^ 8) - 8, (high ^ 8) - 8
            else:
                zero = ((tl.load(Z + index // 2, mask=index_mask, other=0).to(tl.int32) >> ((index % 2) * 4)) & 15)[:, None, :]
                low, high = low - zero, high - zero
            a_even = tl.load(a_row + 2 * pairs, mask=block_valid[:, None, None], other=0.0).to(tl.float32)
            a_odd = tl.load(a_row + 2 * pairs + 1, mask=block_valid[:, None, None], other=0.0).to(tl.float32)
            sums = tl.sum(a_even * low.to(tl.float32) + a_odd * high.to(tl.float32), axis=1)
        result = tl.sum(sums * scale, axis=0)
    return result


@triton.jit
def gate_up_gemv_kernel(
    X, IDS, WG, SG, ZG, WU, SU, ZU, BG, BU, HBUF,
    H, I, stride_x, stride_be, stride_h,
    TOP_K: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, BETA: tl.constexpr, CLAMP: tl.constexpr,
    LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BITS: tl.constexpr, QBLOCK: tl.constexpr, SIGNED: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    slot = tl.program_id(0).to(tl.int64)
    token = slot // TOP_K
    expert = tl.load(IDS + slot).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = cols < I
    up_rows, gate_rows = interleaved_rows(expert * I + cols, INTERLEAVED)
    a_row = X + token * stride_x
    dtype = HBUF.dtype.element_ty
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        acc_up += gemv_step(a_row, WU, SU, ZU, up_rows, n_valid, k0, H, BITS, QBLOCK, SIGNED, BLOCK_K)
        if ACT == 0:
            acc_gate += gemv_step(a_row, WG, SG, ZG, gate_rows, n_valid, k0, H, BITS, QBLOCK, SIGNED, BLOCK_K)
    if HAS_BIAS:
        acc_up += tl.load(BU + expert * stride_be + cols, mask=n_valid, other=0.0).to(tl.float32)
        if ACT == 0:
            acc_gate += tl.load(BG + expert * stride_be + cols, mask=n_valid, other=0.0).to(tl.float32)
    hidden = expert_hidden(acc_gate, acc_up, ACT, ALPHA, BETA, CLAMP, LIMIT, dtype)
    tl.store(HBUF + slot * stride_h + cols, hidden.to(dtype), mask=n_valid)


@triton.jit
def down_gemv_kernel(
    HBUF, IDS, WD, SD, ZD, BD, WEIGHTS, OUT,
    H, I, stride_h, stride_be, stride_o,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BITS: tl.constexpr, QBLOCK: tl.constexpr, SIGNED: tl.constexpr,
):
    slot = tl.program_id(0).to(tl.int64)
    expert = tl.load(IDS + slot).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = cols < H
    a_row = HBUF + slot * stride_h
    dtype = HBUF.dtype.element_ty
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        acc += gemv_step(a_row, WD, SD, ZD, expert * H + cols, n_valid, k0, I, BITS, QBLOCK, SIGNED, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(BD + expert * stride_be + cols, mask=n_valid, other=0.0).to(tl.float32)
    y = acc.to(dtype).to(tl.float32)  # the expert's output, rounded like eager's linear
    routing = tl.load(WEIGHTS + slot)
    tl.store(OUT + slot * stride_o + cols, y * routing, mask=n_valid)
