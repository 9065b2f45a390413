"""Sparse MoE in Triton: route, group tokens by expert, grouped GEMMs, combine.

Pipeline (every step a kernel, no host synchronisation, so it can be captured in a CUDA
graph or a TensorRT engine):
  route    one program per token, all in fp32 (`route_token`, shared with the fused kernel):
           every routing variant of the op contract (`moedeploy.plugins.moe.route`) in the
           kernel, none in torch:
             softmax / sigmoid scores; selection on scores + score_bias; with n_group > 1
             the group-limited selection (each group scored by the sum of its two best
             choices, or by its best one for group_scoring "max", the topk_group best groups
             kept, the other experts masked with -inf);
             top-k by repeated argmax; weights = scores of the picks, optionally
             renormalised (sigmoid: sum + 1e-20), times routed_scaling_factor
           or sparsemixer (PhiMoE, top-2): two argmax picks, each weighted by a softmax over
           the logits within 2 * jitter_eps (relative) of its maximum
           -> ids (N, k), weights (N, k). Ties pick the lower expert index (as ONNX TopK).
  count    one program per expert: how many of the N*k slots chose it
  align    one program: each expert's segment, padded to a multiple of BLOCK_M
  scatter  one program per expert: the slots of that expert in ascending order (a stable
           counting sort, as the eager reference's stable argsort), padding = sentinel N*k
  gate_up  grouped GEMM: each BLOCK_M row tile belongs to exactly one expert; it gathers its
           tokens' rows of x and computes swiglu(x W_gate^T, x W_up^T) (with the op's alpha,
           beta and clamp, `swiglu`) or act(x W_up^T) into a sorted buffer
  down     grouped GEMM back to H, scaled by each slot's routing weight, written to slot order
  combine  per token, the sum of its k slots in a fixed order (deterministic, no atomics)

Rounding follows the eager reference (`moedeploy.plugins.moe.moe_reference`): each linear
is rounded to x's dtype, routing and the combine are fp32. fp32 GEMMs use IEEE precision,
not TF32, so fp32 results match eager PyTorch to ~1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moedeploy.models.blockquant import PackedWeight
from moedeploy.plugins.kernels._launch import check_device
from moedeploy.plugins.kernels.dequant import codes_chunk, dot_codes, load_weight_t
from moedeploy.plugins.moe import ExpertActivation, Routing, as_activation

ACTIVATION_IDS = {"swiglu": 0, "relu": 1, "gelu": 2}
SCORING_IDS = {"softmax": 0, "sigmoid": 1, "sparsemixer": 2}
GROUP_SCORING_IDS = {"top2_sum": 0, "max": 1}


@triton.jit
def route_token(
    LOGITS_ROW, SCORE_BIAS, E, scale, two_eps,
    TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, SCORING: tl.constexpr, N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, GROUP_SCORING: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
):
    """One token's routing (see the module docstring) -> (ids int32, weights fp32), each
    (BLOCK_TOPK,): slot j < TOP_K holds pick j. `scale` is routed_scaling_factor, `two_eps`
    sparsemixer's 2 * jitter_eps; both may be runtime scalars or constexprs."""
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    logits = tl.load(LOGITS_ROW + cols, mask=valid, other=-float("inf")).to(tl.float32)
    slots = tl.arange(0, BLOCK_TOPK)
    ids = tl.zeros((BLOCK_TOPK,), dtype=tl.int32)
    weights = tl.zeros((BLOCK_TOPK,), dtype=tl.float32)
    if SCORING == 2:
        # sparsemixer: pick j is the argmax of the logits left; its weight is a softmax over
        # the logits left that lie within two_eps (relative) of it, taken at the pick: 1 / sum.
        remaining = logits
        for j in tl.static_range(2):
            best = tl.max(remaining, axis=0)
            pick = tl.argmax(remaining, axis=0)
            near = tl.where(valid, logits, best)  # padding: no 0/0 (it is -inf in `remaining`)
            far = tl.math.div_rn(best - near, tl.maximum(tl.abs(near), best)) > two_eps
            kept = tl.where(far, -float("inf"), remaining)
            weight = 1.0 / tl.sum(tl.exp(kept - best), axis=0)
            ids = tl.where(slots == j, pick.to(tl.int32), ids)
            weights = tl.where(slots == j, weight, weights)
            remaining = tl.where(cols == pick, -float("inf"), remaining)
    else:
        if SCORING == 1:
            scores = 1.0 / (1.0 + tl.exp(-logits))
        else:
            p = tl.exp(logits - tl.max(logits, axis=0))
            scores = p / tl.sum(p, axis=0)
        scores = tl.where(valid, scores, 0.0)
        choice = scores + tl.load(SCORE_BIAS + cols, mask=valid, other=0.0).to(tl.float32)
        if N_GROUP > 1:
            # Each expert carries its group's score: the sum of the group's two best choices,
            # or (GROUP_SCORING 1, DeepSeek-V2) its best one.
            group_size = E // N_GROUP
            group = cols // group_size
            group_score = tl.zeros((BLOCK_E,), dtype=tl.float32)
            for g in tl.static_range(N_GROUP):
                members = tl.where(valid & (group == g), choice, -float("inf"))
                if GROUP_SCORING == 1:
                    score = tl.max(members, axis=0)
                else:
                    first = tl.argmax(members, axis=0)
                    score = tl.max(members, axis=0) + tl.max(tl.where(cols == first, -float("inf"), members), axis=0)
                group_score = tl.where(group == g, score, group_score)
            group_score = tl.where(valid, group_score, -float("inf"))
            keep = cols < 0
            for _ in tl.static_range(TOPK_GROUP):
                winner = tl.argmax(group_score, axis=0) // group_size
                keep = keep | (group == winner)
                group_score = tl.where(group == winner, -float("inf"), group_score)
            choice = tl.where(keep, choice, -float("inf"))  # as transformers 5: the others never compete
        choice = tl.where(valid, choice, -float("inf"))
        total = 0.0
        for j in tl.static_range(TOP_K):
            pick = tl.argmax(choice, axis=0)
            weight = tl.sum(tl.where(cols == pick, scores, 0.0), axis=0)
            ids = tl.where(slots == j, pick.to(tl.int32), ids)
            weights = tl.where(slots == j, weight, weights)
            total += weight
            choice = tl.where(cols == pick, -float("inf"), choice)
        if NORMALIZE:
            if SCORING == 1:
                total += 1e-20  # HF's guard against a zero sum of sigmoids
            weights = weights / total
        weights = weights * scale
    return ids, weights


@triton.jit
def route_kernel(
    LOGITS, SCORE_BIAS, IDS, WEIGHTS, E, stride_l, scale, two_eps,
    TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, SCORING: tl.constexpr, N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, GROUP_SCORING: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ids, weights = route_token(
        LOGITS + row * stride_l, SCORE_BIAS, E, scale, two_eps,
        TOP_K, NORMALIZE, SCORING, N_GROUP, TOPK_GROUP, GROUP_SCORING, BLOCK_E, BLOCK_TOPK,
    )
    slots = tl.arange(0, BLOCK_TOPK)
    tl.store(IDS + row * TOP_K + slots, ids, mask=slots < TOP_K)
    tl.store(WEIGHTS + row * TOP_K + slots, weights, mask=slots < TOP_K)


@triton.jit
def swiglu(gate, up, ALPHA: tl.constexpr, BETA: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr, dtype: tl.constexpr):
    """The op's SwiGLU on fp32 tiles that hold dtype-rounded linears; the result is rounded to
    dtype where eager rounds its ops (silu, up + beta), the product where the caller stores it:
    (min(up, limit) clamped to -limit + beta) * min(gate, limit) * sigmoid(alpha * min(gate, limit)).
    CLAMP is False for an infinite limit. ALPHA 1 and BETA 0 compute silu(gate) * up exactly."""
    if CLAMP:  # tl.where keeps NaN, as torch's clamp does
        gate = tl.where(gate > LIMIT, LIMIT, gate)
        up = tl.where(up > LIMIT, LIMIT, tl.where(up < -LIMIT, -LIMIT, up))
    glu = (gate / (1.0 + tl.exp(-(gate * ALPHA)))).to(dtype).to(tl.float32)
    return glu * (up + BETA).to(dtype).to(tl.float32)


@triton.jit
def expert_hidden(gate, up, ACT: tl.constexpr, ALPHA: tl.constexpr, BETA: tl.constexpr, CLAMP: tl.constexpr,
                  LIMIT: tl.constexpr, dtype: tl.constexpr):
    """An expert's hidden activation from its fp32 linears (biases added), each linear rounded
    to dtype first as eager rounds it: ACT 0 `swiglu`, 1 relu, 2 gelu (erf); `gate` unused but for
    swiglu. The result is fp32 holding dtype-rounded inputs; the caller rounds it when it stores."""
    up = up.to(dtype).to(tl.float32)
    if ACT == 0:
        hidden = swiglu(gate.to(dtype).to(tl.float32), up, ALPHA, BETA, CLAMP, LIMIT, dtype)
    elif ACT == 1:
        hidden = tl.maximum(up, 0.0)
    else:
        hidden = 0.5 * up * (1.0 + tl.math.erf(up * 0.7071067811865476))
    return hidden


@triton.jit
def count_kernel(IDS, COUNTS, n_slots, BLOCK: tl.constexpr):
    expert = tl.program_id(0)
    count = 0
    for start in range(0, n_slots, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(IDS + offs, mask=offs < n_slots, other=-1)
        count += tl.sum((ids == expert).to(tl.int32), axis=0)
    tl.store(COUNTS + expert, count)


@triton.jit
def align_kernel(COUNTS, STARTS, ENDS, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    counts = tl.load(COUNTS + cols, mask=valid, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(STARTS + cols, ends - padded, mask=valid)
    tl.store(ENDS + cols, ends, mask=valid)


@triton.jit
def scatter_kernel(IDS, STARTS, SORTED, n_slots, BLOCK: tl.constexpr):
    expert = tl.program_id(0)
    position = tl.load(STARTS + expert)
    for start in range(0, n_slots, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mine = (tl.load(IDS + offs, mask=offs < n_slots, other=-1) == expert).to(tl.int32)
        # inclusive prefix count of my slots in this chunk -> their places, in ascending slot order
        places = position + tl.cumsum(mine, axis=0) - 1
        tl.store(SORTED + places, offs, mask=mine != 0)
        position += tl.sum(mine, axis=0)


@triton.jit
def _tile_expert(ENDS, E, row0, BLOCK_E: tl.constexpr):
    """The expert whose padded segment holds row `row0` (E when past the last segment)."""
    cols = tl.arange(0, BLOCK_E)
    ends = tl.load(ENDS + cols, mask=cols < E, other=0)
    return tl.sum(((ends <= row0) & (cols < E)).to(tl.int32), axis=0)


@triton.jit
def interleaved_rows(rows, INTERLEAVED: tl.constexpr):
    """(up rows, gate rows) of the stacks for rows `rows` of an (E * I, H) gate or up stack. With
    INTERLEAVED, WG and WU are one (E, 2I, H) stack holding the gate in its even rows and the up
    in its odd ones (what a streamed export stores, the layout ONNX Runtime's fused SwiGLU takes)."""
    if INTERLEAVED:
        return 2 * rows + 1, 2 * rows
    return rows, rows


@triton.jit
def gate_up_kernel(
    X, WG, SG, ZG, WU, SU, ZU, BG, BU, HBUF, SORTED, ENDS,
    n_slots, H, I, E, stride_x, stride_be, stride_h,
    TOP_K: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, BETA: tl.constexpr, CLAMP: tl.constexpr,
    LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BITS: tl.constexpr, QBLOCK: tl.constexpr, SIGNED: tl.constexpr, QCHUNK: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    row0 = tl.program_id(0) * BLOCK_M
    expert = _tile_expert(ENDS, E, row0, BLOCK_E)
    if expert >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    slots = tl.load(SORTED + rows)
    valid = slots < n_slots
    tokens = (slots // TOP_K).to(tl.int64)
    n_cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n_cols < I
    w_rows = expert.to(tl.int64) * I + n_cols[None, :]  # (1, BN) rows of the (E * I, H) stacks
    up_rows, gate_rows = interleaved_rows(w_rows, INTERLEAVED)
    dtype = HBUF.dtype.element_ty
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if QCHUNK > 0:  # int8 codes straight into tl.dot, scaled per block (dequant.dot_codes)
        a_rows = X + tokens[:, None] * stride_x
        for k0 in range(0, H, QCHUNK):
            acc_up += dot_codes(a_rows, valid[:, None], WU, SU, ZU, up_rows, n_valid[None, :], k0, H, QBLOCK, SIGNED,
                                QCHUNK, dtype, PRECISION)
            if ACT == 0:
                acc_gate += dot_codes(a_rows, valid[:, None], WG, SG, ZG, gate_rows, n_valid[None, :], k0, H, QBLOCK,
                                      SIGNED, QCHUNK, dtype, PRECISION)
    else:
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_valid = ks < H
            a = tl.load(X + tokens[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_valid[None, :], other=0.0)
            wu = load_weight_t(WU, SU, ZU, up_rows, n_valid[None, :], k0, H, BITS, QBLOCK, SIGNED, BLOCK_K, BLOCK_N,
                               dtype).to(dtype)
            acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
            if ACT == 0:
                wg = load_weight_t(WG, SG, ZG, gate_rows, n_valid[None, :], k0, H, BITS, QBLOCK, SIGNED, BLOCK_K,
                                   BLOCK_N, dtype).to(dtype)
                acc_gate = tl.dot(a, wg, acc_gate, input_precision=PRECISION)
    if HAS_BIAS:
        b_off = expert.to(tl.int64) * stride_be + n_cols
        acc_up += tl.load(BU + b_off, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        if ACT == 0:
            acc_gate += tl.load(BG + b_off, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    hidden = expert_hidden(acc_gate, acc_up, ACT, ALPHA, BETA, CLAMP, LIMIT, dtype)
    tl.store(HBUF + rows[:, None].to(tl.int64) * stride_h + n_cols[None, :], hidden.to(dtype), mask=valid[:, None] & n_valid[None, :])


@triton.jit
def down_kernel(
    HBUF, WD, SD, ZD, BD, WEIGHTS, OUT, SORTED, ENDS,
    n_slots, H, I, E, stride_h, stride_be, stride_o,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BITS: tl.constexpr, QBLOCK: tl.constexpr, SIGNED: tl.constexpr, QCHUNK: tl.constexpr,
):
    row0 = tl.program_id(0) * BLOCK_M
    expert = _tile_expert(ENDS, E, row0, BLOCK_E)
    if expert >= E:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    slots = tl.load(SORTED + rows)
    valid = slots < n_slots
    n_cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n_cols < H
    w_rows = expert.to(tl.int64) * H + n_cols[None, :]  # (1, BN) rows of the (E * H, I) stack
    dtype = HBUF.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if QCHUNK > 0:
        a_rows = HBUF + rows[:, None].to(tl.int64) * stride_h
        for k0 in range(0, I, QCHUNK):
            acc += dot_codes(a_rows, valid[:, None], WD, SD, ZD, w_rows, n_valid[None, :], k0, I, QBLOCK, SIGNED,
                             QCHUNK, dtype, PRECISION)
    else:
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_valid = ks < I
            a = tl.load(HBUF + rows[:, None].to(tl.int64) * stride_h + ks[None, :],
                        mask=valid[:, None] & k_valid[None, :], other=0.0)
            w = load_weight_t(WD, SD, ZD, w_rows, n_valid[None, :], k0, I, BITS, QBLOCK, SIGNED, BLOCK_K, BLOCK_N,
                              dtype).to(dtype)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(BD + expert.to(tl.int64) * stride_be + n_cols, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dtype).to(tl.float32)  # the expert's output, rounded like eager's linear
    routing = tl.load(WEIGHTS + slots, mask=valid, other=0.0)
    out_ptrs = OUT + slots[:, None].to(tl.int64) * stride_o + n_cols[None, :]
    tl.store(out_ptrs, y * routing[:, None], mask=valid[:, None] & n_valid[None, :])


@triton.jit
def combine_kernel(OUT, Y, H, stride_o, stride_y, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    valid = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(OUT + (token * TOP_K + j) * stride_o + cols, mask=valid, other=0.0)
    tl.store(Y + token * stride_y + cols, acc.to(Y.dtype.element_ty), mask=valid)


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of the grouped GEMMs. tl.dot needs every dim >= 16. `gemv`: the experts run as
    matrix-vector products per routed slot (`moe_gemv`), for a few tokens. `codes_in_dot`: int8
    experts' codes go into tl.dot and their scales multiply the sums (`dequant.dot_codes`) where
    the block allows it; False dequantizes every tile, as int4 experts' tiles always are
    (`dequant.codes_chunk` says why; kept to compare against)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    codes_in_dot: bool = True
    gemv: bool = False  # one program per slot, no row tiles (moe_gemv); block_m unused then


def default_config(n_tokens: int, top_k: int, n_experts: int, bits: int = 0) -> TileConfig:
    """Small M tiles when each expert sees few rows (decode), larger ones for prefill; int4
    experts (`bits`) at a row per expert or fewer as matrix-vector products (`moe_gemv`).

    Measured on an H100 at Mixtral's layer size (benchmarks/moe_kernel_nbits.py, session 19):
    int4 experts took 257 us on the gemv path against 619 in row tiles for one token, 569 against
    987 for four, but 1,814 against 1,335 for sixteen; fp16 and int8 experts were slower on it
    at every token count (one token: 466 against 325 us, 553 against 418)."""
    rows_per_expert = n_tokens * top_k / max(n_experts, 1)
    if bits == 4 and rows_per_expert <= 1:
        return TileConfig(block_n=32, block_k=128, gemv=True)
    if rows_per_expert <= 16:
        return TileConfig(16, 64, 64, 4)
    if rows_per_expert <= 64:
        return TileConfig(32, 64, 64, 4)
    return TileConfig(64, 64, 32, 4)


def dense_biases(w_up: ExpertWeight, b_gate, b_up, b_down, interleaved: bool = False,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous (E, I), (E, I), (E, H) biases, zeros for the missing ones: kernels take pointers.
    (`interleaved`: w_up is the (E, 2I, H) gate/up stack.)"""
    e, rows, h = w_up.shape
    i = rows // 2 if interleaved else rows
    zeros = lambda *shape: torch.zeros(*shape, dtype=w_up.dtype, device=w_up.device)  # noqa: E731
    return (
        (zeros(e, i) if b_gate is None else b_gate).contiguous(),
        (zeros(e, i) if b_up is None else b_up).contiguous(),
        (zeros(e, h) if b_down is None else b_down).contiguous(),
    )


def as_routing(top_k: int | Routing, normalize_topk: bool = True) -> Routing:
    """`top_k` as the eager reference takes it: a Routing, or the top-k of plain softmax routing."""
    return top_k if isinstance(top_k, Routing) else Routing(int(top_k), bool(normalize_topk))


def routing_params(routing: Routing) -> dict[str, int | float | bool]:
    """`route_token`'s routing arguments (constexprs and the two float scalars `scale`,
    `two_eps`), with the ones a variant ignores at fixed values (fewer specialisations)."""
    mixer = routing.scoring == "sparsemixer"
    return {
        "TOP_K": routing.top_k,
        "NORMALIZE": routing.normalize_topk and not mixer,
        "SCORING": SCORING_IDS[routing.scoring],
        "N_GROUP": 1 if mixer else routing.n_group,
        "TOPK_GROUP": 1 if mixer else routing.topk_group,
        "GROUP_SCORING": GROUP_SCORING_IDS[routing.group_scoring] if routing.n_group > 1 and not mixer else 0,
        "BLOCK_TOPK": triton.next_power_of_2(routing.top_k),
        "scale": 1.0 if mixer else float(routing.routed_scaling_factor),
        "two_eps": 2 * float(routing.jitter_eps) if mixer else 0.0,
    }


def activation_params(activation: ExpertActivation) -> dict[str, int | float | bool]:
    """The expert kernels' activation constexprs: ACT and `swiglu`'s ALPHA, BETA, CLAMP, LIMIT
    (LIMIT 0.0 when CLAMP is off: no infinity in a compiled constant)."""
    return {
        "ACT": ACTIVATION_IDS[activation.activation],
        "ALPHA": float(activation.activation_alpha),
        "BETA": float(activation.activation_beta),
        "CLAMP": activation.clamped,
        "LIMIT": float(activation.swiglu_limit) if activation.clamped else 0.0,
    }


ExpertWeight = torch.Tensor | PackedWeight


def expert_weights(
    w_gate: ExpertWeight | None, w_up: ExpertWeight, w_down: ExpertWeight, dtype: torch.dtype
) -> tuple[list[torch.Tensor], dict[str, int]]:
    """The expert stacks as the kernels take them, three pointers per stack (gate, up, down;
    up again when there is no gate), with the BITS and QBLOCK of `dequant.load_weight`: for
    int8/int4 stacks (all three `PackedWeight`s of one scheme) each one's codes, scale and zero
    point (the codes again for signed codes, which have none), and SIGNED; for float stacks the contiguous weight three times (BITS 0 reads only the first)."""
    stacks = (w_up if w_gate is None else w_gate, w_up, w_down)
    packed = [isinstance(w, PackedWeight) for w in stacks]
    if not any(packed):
        return [t for w in stacks for t in [w.contiguous()] * 3], {"BITS": 0, "QBLOCK": 1, "SIGNED": False}
    if not all(packed) or len({w.scheme for w in stacks}) != 1:
        raise ValueError("quantized experts need W_gate, W_up and W_down all quantized in one scheme")
    if any(w.dtype != dtype for w in stacks):
        raise ValueError(f"quantized experts' scales must be in x's dtype {dtype}; got {[w.dtype for w in stacks]}")
    scheme = stacks[0].scheme
    # signed codes have no zero point: the kernels do not read Z then, and get the codes again
    tensors = [t.contiguous() for w in stacks for t in (w.codes, w.scale, w.codes if w.zero_point is None else w.zero_point)]
    return tensors, {"BITS": scheme.bits, "QBLOCK": scheme.block_size, "SIGNED": scheme.signed}


def dense_score_bias(score_bias: torch.Tensor | None, n_experts: int, device) -> torch.Tensor:
    """The (E,) fp32 contiguous selection bias, zeros when there is none: kernels take a pointer."""
    if score_bias is None:
        return torch.zeros(n_experts, dtype=torch.float32, device=device)
    if score_bias.shape != (n_experts,):
        raise ValueError(f"score_bias must be (E={n_experts},); got {tuple(score_bias.shape)}")
    return score_bias.to(torch.float32).contiguous()


def _check(x, router_logits, w_gate, w_up, w_down, routing: Routing, activation: ExpertActivation,
           interleaved: bool = False) -> None:
    if x.dim() != 2 or router_logits.dim() != 2:
        raise ValueError(f"x must be (N, H) and router_logits (N, E); got {tuple(x.shape)}, {tuple(router_logits.shape)}")
    n, h = x.shape
    e, i, h_up = w_up.shape
    if interleaved:
        if activation.activation != "swiglu" or w_gate is not None or i % 2:
            raise ValueError("interleaved gate/up weights are one (E, 2I, H) stack of swiglu experts, passed as "
                             f"w_up with w_gate None; got w_up {tuple(w_up.shape)} for {activation.activation} experts")
        i //= 2
    if h_up != h or tuple(w_down.shape) != (e, h, i) or router_logits.shape != (n, e):
        raise ValueError(
            f"inconsistent MoE shapes: x {tuple(x.shape)}, router_logits {tuple(router_logits.shape)}, "
            f"w_up {tuple(w_up.shape)}, w_down {tuple(w_down.shape)}"
        )
    if activation.activation == "swiglu" and not interleaved and (w_gate is None or w_gate.shape != w_up.shape):
        raise ValueError("swiglu experts need w_gate with w_up's shape (E, I, H)")
    routing.check(e)


def prepare(
    x, router_logits, w_gate, w_up, w_down, routing: Routing, activation: ExpertActivation, out,
    interleaved: bool = False,
) -> tuple[int, int, int, int, torch.Tensor]:
    """Validate a MoE call and give its sizes (N, H, E, I) and the output tensor."""
    _check(x, router_logits, w_gate, w_up, w_down, routing, activation, interleaved)
    check_device(x)
    n, h = x.shape
    e, _, i = w_down.shape  # I from the down stack: w_up's rows are 2I when interleaved
    y = torch.empty(n, h, dtype=x.dtype, device=x.device) if out is None else out
    return n, h, e, i, y


def _route(router_logits: torch.Tensor, routing: Routing, score_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, e = router_logits.shape
    ids = torch.empty(n, routing.top_k, dtype=torch.int32, device=router_logits.device)
    weights = torch.empty(n, routing.top_k, dtype=torch.float32, device=router_logits.device)
    if n:
        route_kernel[(n,)](router_logits, score_bias, ids, weights, e, router_logits.stride(0),
                           BLOCK_E=triton.next_power_of_2(e), **routing_params(routing))
    return weights, ids


def route(
    router_logits: torch.Tensor,
    top_k: int | Routing,
    normalize_topk: bool = True,
    score_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's routing step alone: fp32 weights (N, k) and int32 expert ids (N, k), as
    `moedeploy.plugins.moe.route` gives them (which returns int64 ids)."""
    routing = as_routing(top_k, normalize_topk)
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be (N, E); got {tuple(router_logits.shape)}")
    routing.check(router_logits.shape[1])
    check_device(router_logits)
    bias = dense_score_bias(score_bias, router_logits.shape[1], router_logits.device)
    return _route(router_logits.contiguous(), routing, bias)


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int | Routing,
    normalize_topk: bool = True,
    activation: str | ExpertActivation = "swiglu",
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    score_bias: torch.Tensor | None = None,
    config: TileConfig | None = None,
    out: torch.Tensor | None = None,
    interleaved: bool = False,
) -> torch.Tensor:
    """y (N, H) = sum over each token's routed experts of weight * expert(x); see the module doc.

    Arguments as `moedeploy.plugins.moe.moe_reference`: `top_k` is a Routing, or the top-k of
    plain softmax routing (with `normalize_topk`); `activation` an ExpertActivation or a name;
    `score_bias` (E,) only selects. `interleaved`: w_up is one (E, 2I, H) stack holding the
    gate in its even rows and the up in its odd ones (what a streamed export stores), w_gate None.
    """
    routing = as_routing(top_k, normalize_topk)
    activation = as_activation(activation)
    n, h, e, i, y = prepare(x, router_logits, w_gate, w_up, w_down, routing, activation, out, interleaved)
    device, dtype = x.device, x.dtype
    if n == 0:
        return y
    top_k = routing.top_k
    x, router_logits = x.contiguous(), router_logits.contiguous()
    stacks, quant = expert_weights(w_gate, w_up, w_down, dtype)
    cfg = config or default_config(n, top_k, e, quant["BITS"])
    quant["QCHUNK"] = codes_chunk(quant["BITS"], quant["QBLOCK"]) if cfg.codes_in_dot else 0
    has_bias = any(b is not None for b in (b_gate, b_up, b_down))
    b_gate, b_up, b_down = dense_biases(w_up, b_gate, b_up, b_down, interleaved)
    precision = "ieee" if dtype == torch.float32 else "tf32"
    weights, ids = _route(router_logits, routing, dense_score_bias(score_bias, e, device))
    if cfg.gemv:
        slot_out = _experts_gemv(x, ids, weights, stacks, quant, (b_gate, b_up, b_down), has_bias, activation, top_k,
                                 cfg, interleaved, i)
    else:
        slot_out = _experts_grouped(x, ids, weights, stacks, quant, (b_gate, b_up, b_down), has_bias, activation, top_k,
                                    cfg, interleaved, i, e, precision)
    block_h = min(triton.next_power_of_2(h), 1024)
    combine_kernel[(n, triton.cdiv(h, block_h))](slot_out, y, h, slot_out.stride(0), y.stride(0), TOP_K=top_k, BLOCK_H=block_h)
    return y


def _experts_gemv(x, ids, weights, stacks, quant, biases, has_bias: bool, activation: ExpertActivation, top_k: int,
                  cfg: TileConfig, interleaved: bool, i: int) -> torch.Tensor:
    """Each slot's weighted expert output (N * k, H) fp32, by `moe_gemv`'s kernels."""
    # imported here: moe_gemv's kernels use this module's swiglu and interleaved_rows
    from moedeploy.plugins.kernels import moe_gemv

    n_slots, h = ids.numel(), x.shape[1]
    b_gate, b_up, b_down = biases
    bits = {name: quant[name] for name in ("BITS", "QBLOCK", "SIGNED")}
    block_k = moe_gemv.gemv_block_k(cfg.block_k, quant["QBLOCK"])
    hidden = torch.empty(n_slots, i, dtype=x.dtype, device=x.device)
    moe_gemv.gate_up_gemv_kernel[(n_slots, triton.cdiv(i, cfg.block_n))](
        x, ids, *stacks[:6], b_gate, b_up, hidden, h, i, x.stride(0), b_up.stride(0), hidden.stride(0),
        TOP_K=top_k, **activation_params(activation), HAS_BIAS=has_bias, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        INTERLEAVED=interleaved, num_warps=cfg.num_warps, **bits,
    )
    slot_out = torch.empty(n_slots, h, dtype=torch.float32, device=x.device)
    moe_gemv.down_gemv_kernel[(n_slots, triton.cdiv(h, cfg.block_n))](
        hidden, ids, *stacks[6:], b_down, weights, slot_out, h, i, hidden.stride(0), b_down.stride(0), slot_out.stride(0),
        HAS_BIAS=has_bias, BLOCK_N=cfg.block_n, BLOCK_K=block_k, num_warps=cfg.num_warps, **bits,
    )
    return slot_out


def _experts_grouped(x, ids, weights, stacks, quant, biases, has_bias: bool, activation: ExpertActivation, top_k: int,
                     cfg: TileConfig, interleaved: bool, i: int, e: int, precision: str) -> torch.Tensor:
    """Each slot's weighted expert output (N * k, H) fp32, by the grouped GEMMs over tiles of
    rows sorted by expert (the module doc's count, align, scatter, gate_up, down)."""
    n_slots, h = ids.numel(), x.shape[1]
    device, dtype = x.device, x.dtype
    b_gate, b_up, b_down = biases
    block_e = triton.next_power_of_2(e)
    scan_block = min(triton.next_power_of_2(n_slots), 1024)
    counts = torch.empty(e, dtype=torch.int32, device=device)
    count_kernel[(e,)](ids, counts, n_slots, BLOCK=scan_block)
    starts = torch.empty(e, dtype=torch.int32, device=device)
    ends = torch.empty(e, dtype=torch.int32, device=device)
    align_kernel[(1,)](counts, starts, ends, e, BLOCK_M=cfg.block_m, BLOCK_E=block_e)
    # Upper bound on padded rows, known without reading `counts` back to the host.
    n_tiles = triton.cdiv(n_slots + e * (cfg.block_m - 1), cfg.block_m)
    sorted_slots = torch.full((n_tiles * cfg.block_m,), n_slots, dtype=torch.int32, device=device)
    scatter_kernel[(e,)](ids, starts, sorted_slots, n_slots, BLOCK=scan_block)

    hidden = torch.empty(n_tiles * cfg.block_m, i, dtype=dtype, device=device)
    gate_up_kernel[(n_tiles, triton.cdiv(i, cfg.block_n))](
        x, *stacks[:6], b_gate, b_up, hidden, sorted_slots, ends,
        n_slots, h, i, e, x.stride(0), b_up.stride(0), hidden.stride(0),
        TOP_K=top_k, **activation_params(activation), HAS_BIAS=has_bias, PRECISION=precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=block_e, num_warps=cfg.num_warps,
        INTERLEAVED=interleaved, **quant,
    )
    slot_out = torch.empty(n_slots, h, dtype=torch.float32, device=device)
    down_kernel[(n_tiles, triton.cdiv(h, cfg.block_n))](
        hidden, *stacks[6:], b_down, weights, slot_out, sorted_slots, ends,
        n_slots, h, i, e, hidden.stride(0), b_down.stride(0), slot_out.stride(0),
        HAS_BIAS=has_bias, PRECISION=precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=block_e, num_warps=cfg.num_warps, **quant,
    )
    return slot_out
