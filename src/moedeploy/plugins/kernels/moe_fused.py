"""Sparse MoE in ONE Triton kernel, for TensorRT's ahead-of-time plugins (one kernel each).

Grid (N, cdiv(H, BLOCK_H)): a program owns one token and one tile of output features. It
routes its token with the grouped pipeline's `route_token` (every routing variant: softmax,
sigmoid, score_bias, group-limited by either group score, sparsemixer, renormalisation,
scaling) and computes its experts' activation with the same `expert_hidden` (SwiGLU's alpha,
beta, clamp; relu; gelu), then for each of its k experts streams W_gate/W_up in (BLOCK_I x
BLOCK_K) tiles to build the hidden vector tile by tile and immediately folds it into the W_down tile of its outputs. Every expert
weight it touches is read once per (token, output tile): the bandwidth-bound shape of a
decode step, where N is small. Prefill-sized N is better served by the grouped pipeline in
`moe.py`, which reuses each weight tile across the tokens routed to it.

Argument order is TensorRT's AOT launch order: input pointers, then integer scalars, then
output pointers; everything else is constexpr, fixed when the plugin is compiled (the
routing and activation attributes included: routed_scaling_factor, jitter_eps,
activation_alpha, activation_beta and swiglu_limit are constexpr floats).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moedeploy.plugins.kernels.dequant import load_weight
from moedeploy.plugins.kernels.moe import (
    ExpertWeight,
    activation_params,
    as_routing,
    dense_biases,
    dense_score_bias,
    expert_hidden,
    expert_weights,
    interleaved_rows,
    prepare,
    route_token,
    routing_params,
)
from moedeploy.plugins.moe import ExpertActivation, Routing, as_activation


@triton.jit
def fused_moe_program(
    X, LOGITS, WG, SG, ZG, WU, SU, ZU, WD, SD, ZD, BG, BU, BD, SCORE_BIAS, H, I, E, Y,
    TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, SCORING: tl.constexpr, N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, GROUP_SCORING: tl.constexpr, BLOCK_TOPK: tl.constexpr, scale: tl.constexpr,
    two_eps: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, BETA: tl.constexpr, CLAMP: tl.constexpr,
    LIMIT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
    BITS: tl.constexpr, QBLOCK: tl.constexpr, SIGNED: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    """One program's work (module doc), on float weights (BITS 0) or int8/int4 blocked ones,
    whose tiles `load_weight` dequantizes as it reads them; with INTERLEAVED, WG and WU are one
    (E, 2I, H) stack, the gate in its even rows and the up in its odd ones (`interleaved_rows`)."""
    token = tl.program_id(0).to(tl.int64)
    h_cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = h_cols < H
    dtype = Y.dtype.element_ty

    # Routing in fp32, exactly as the grouped pipeline's route_kernel.
    ids, weights = route_token(
        LOGITS + token * E, SCORE_BIAS, E, scale, two_eps,
        TOP_K, NORMALIZE, SCORING, N_GROUP, TOPK_GROUP, GROUP_SCORING, BLOCK_E, BLOCK_TOPK,
    )
    slots = tl.arange(0, BLOCK_TOPK)

    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.sum(tl.where(slots == j, ids, 0), axis=0).to(tl.int64)
        weight = tl.sum(tl.where(slots == j, weights, 0.0), axis=0)
        y = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            i_cols = i0 + tl.arange(0, BLOCK_I)
            i_valid = i_cols < I
            up = tl.zeros((BLOCK_I,), dtype=tl.float32)
            gate = tl.zeros((BLOCK_I,), dtype=tl.float32)
            rows = expert * I + i_cols[:, None]  # (BI, 1) rows of the (E * I, H) gate/up stacks
            up_rows, gate_rows = interleaved_rows(rows, INTERLEAVED)
            for k0 in range(0, H, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_valid = ks < H
                x = tl.load(X + token * H + ks, mask=k_valid, other=0.0).to(tl.float32)
                w_mask = i_valid[:, None] & k_valid[None, :]
                w_up = load_weight(WU, SU, ZU, up_rows, ks[None, :], w_mask, H, BITS, QBLOCK, SIGNED, dtype)
                up += tl.sum(w_up * x[None, :], axis=1)
                if ACT == 0:
                    w_gate = load_weight(WG, SG, ZG, gate_rows, ks[None, :], w_mask, H, BITS, QBLOCK, SIGNED, dtype)
                    gate += tl.sum(w_gate * x[None, :], axis=1)
            up += tl.load(BU + expert * I + i_cols, mask=i_valid, other=0.0).to(tl.float32)
            if ACT == 0:
                gate += tl.load(BG + expert * I + i_cols, mask=i_valid, other=0.0).to(tl.float32)
            hidden = expert_hidden(gate, up, ACT, ALPHA, BETA, CLAMP, LIMIT, dtype)
            hidden = tl.where(i_valid, hidden.to(dtype).to(tl.float32), 0.0)
            d_rows = expert * H + h_cols[:, None]  # (BH, 1) rows of the (E * H, I) down stack
            w_down = load_weight(WD, SD, ZD, d_rows, i_cols[None, :], h_valid[:, None] & i_valid[None, :], I, BITS, QBLOCK, SIGNED, dtype)
            y += tl.sum(w_down * hidden[None, :], axis=1)
        y = (y + tl.load(BD + expert * H + h_cols, mask=h_valid, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        acc += y * weight
    tl.store(Y + token * H + h_cols, acc.to(dtype), mask=h_valid)


@triton.jit
def moe_fused_kernel(
    X, LOGITS, WG, WU, WD, BG, BU, BD, SCORE_BIAS,
    H, I, E,
    Y,
    TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, SCORING: tl.constexpr, N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, GROUP_SCORING: tl.constexpr, BLOCK_TOPK: tl.constexpr, scale: tl.constexpr,
    two_eps: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, BETA: tl.constexpr, CLAMP: tl.constexpr,
    LIMIT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """The moe::MoE plugin's kernel: float expert weights."""
    fused_moe_program(
        X, LOGITS, WG, WG, WG, WU, WU, WU, WD, WD, WD, BG, BU, BD, SCORE_BIAS, H, I, E, Y,
        TOP_K, NORMALIZE, SCORING, N_GROUP, TOPK_GROUP, GROUP_SCORING, BLOCK_TOPK, scale, two_eps,
        ACT, ALPHA, BETA, CLAMP, LIMIT, BLOCK_E, BLOCK_H, BLOCK_I, BLOCK_K, 0, 1, False, INTERLEAVED,
    )


@triton.jit
def moe_fused_nbits_kernel(
    X, LOGITS, WG, SG, ZG, WU, SU, ZU, WD, SD, ZD, BG, BU, BD, SCORE_BIAS,
    H, I, E,
    Y,
    TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, SCORING: tl.constexpr, N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, GROUP_SCORING: tl.constexpr, BLOCK_TOPK: tl.constexpr, scale: tl.constexpr,
    two_eps: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, BETA: tl.constexpr, CLAMP: tl.constexpr,
    LIMIT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
    BITS: tl.constexpr, QBLOCK: tl.constexpr, SIGNED: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    """The same on int8/int4 blocked expert weights: codes, scale and zero point of each stack
    (`dequant.load_weight`), dequantized in the kernel."""
    fused_moe_program(
        X, LOGITS, WG, SG, ZG, WU, SU, ZU, WD, SD, ZD, BG, BU, BD, SCORE_BIAS, H, I, E, Y,
        TOP_K, NORMALIZE, SCORING, N_GROUP, TOPK_GROUP, GROUP_SCORING, BLOCK_TOPK, scale, two_eps,
        ACT, ALPHA, BETA, CLAMP, LIMIT, BLOCK_E, BLOCK_H, BLOCK_I, BLOCK_K, BITS, QBLOCK, SIGNED, INTERLEAVED,
    )


FUSED_BLOCKS = {"BLOCK_H": 256, "BLOCK_I": 32, "BLOCK_K": 64}


def moe_fused(
    x: torch.Tensor, router_logits: torch.Tensor, w_gate: ExpertWeight | None, w_up: ExpertWeight,
    w_down: ExpertWeight, top_k: int | Routing, normalize_topk: bool = True,
    activation: str | ExpertActivation = "swiglu",
    b_gate: torch.Tensor | None = None, b_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
    score_bias: torch.Tensor | None = None, out: torch.Tensor | None = None, interleaved: bool = False,
) -> torch.Tensor:
    """The single-kernel MoE as a function on torch tensors (what the AOT plugin launches);
    arguments as `moedeploy.plugins.kernels.moe`. The expert stacks are float tensors, or all
    three int8/int4 `PackedWeight`s, dequantized in the kernel."""
    routing = as_routing(top_k, normalize_topk)
    activation = as_activation(activation)
    n, h, e, i, y = prepare(x, router_logits, w_gate, w_up, w_down, routing, activation, out, interleaved)
    if n == 0:
        return y
    stacks, quant = expert_weights(w_gate, w_up, w_down, x.dtype)
    if quant["BITS"] == 0:
        kernel, stacks, extra = moe_fused_kernel, stacks[::3], {}
    else:
        kernel, extra = moe_fused_nbits_kernel, quant
    args = [x.contiguous(), router_logits.contiguous(), *stacks, *dense_biases(w_up, b_gate, b_up, b_down, interleaved),
            dense_score_bias(score_bias, e, x.device)]
    grid = (n, triton.cdiv(h, FUSED_BLOCKS["BLOCK_H"]))
    kernel[grid](
        *args, h, i, e, y, **activation_params(activation), BLOCK_E=triton.next_power_of_2(e),
        **routing_params(routing), **FUSED_BLOCKS, INTERLEAVED=interleaved, **extra,
    )
    return y
