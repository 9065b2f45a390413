"""`moe::MoENBits`: moe::MoE over int8/int4 expert stacks given as their codes, the node through
which TensorRT runs a quantized artifact's experts.

The portable artifact feeds moe::MoE float stacks from blocked DequantizeLinear nodes. Parsed as
they are, TensorRT would run those Dequantize layers itself and hand the plugin float weights:
the engine would hold, and every step read, 4 (int8) or 8 (int4) times the expert bytes of
fp32. The TensorRT lowering (runtime/tensorrt_lowering.py) instead hands the plugin the codes and
scales those DequantizeLinear nodes read, and the Triton kernels dequantize tiles in registers
(kernels/dequant.py), exactly as DequantizeLinear computes them. The node exists only in the
graph given to TensorRT's parser: it is not part of the artifact and has no function body.

Inputs, 15, in the order of the fused kernel's pointer arguments (TensorRT passes an AOT
plugin's inputs to its kernel in order):
  X, router_logits                  as moe::MoE's
  w_*, s_*, z_* for gate, up, down  each stack's codes, scales and zero points:
      codes       INT8 (E, N, K * bits / 8), the artifact's INT4 / UINT4 / UINT8 / INT8 codes
                  re-typed as the same bytes (a TensorRT plugin takes no INT4 or UINT8 tensor);
                  4-bit codes pack element 2i in the low nibble of byte i, as ONNX does
      scales      (E, N, K / block_size), X's float type
      zero points unsigned codes: the artifact's zero points as INT8 bytes, flattened (packed
                  two to a byte at 4 bits); signed codes have none and repeat the codes, unread
  b_gate, b_up, b_down, score_bias  as moe::MoE's
Attributes: moe::MoE's, in its order, then `bits` (8 or 4), `block_size`, `symmetric` (1:
signed codes without zero points, format 2's symmetric export), `interleaved` (1: the gate and
up inputs are one (E, 2I, H) stack holding the gate in its even rows and the up in its odd ones,
what a streamed export stores and reads through two strided Slices; each stack input pair then
names it twice).
"""

from __future__ import annotations

import torch

from moedeploy.models.blockquant import PackedWeight, QuantScheme
from moedeploy.plugins.moe import DOMAIN, ExpertActivation, Routing

OP_TYPE = "MoENBits"
STACKS = ("gate", "up", "down")
INPUTS = ("X", "router_logits", *(f"{kind}_{stack}" for stack in STACKS for kind in ("w", "s", "z")),
          "b_gate", "b_up", "b_down", "score_bias")
#: the attributes after moe::MoE's, in node order
ATTRIBUTES = ("bits", "block_size", "symmetric", "interleaved")

__all__ = ["ATTRIBUTES", "DOMAIN", "INPUTS", "OP_TYPE", "STACKS", "packed_stack", "run"]


def packed_stack(codes: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, scheme: QuantScheme) -> PackedWeight:
    """One stack's three plugin inputs (module doc) as the kernels' PackedWeight: the same memory."""
    e, n, row_bytes = codes.shape
    k = scales.shape[-1] * scheme.block_size
    if scales.shape != (e, n, k // scheme.block_size) or row_bytes * 8 != k * scheme.bits:
        raise ValueError(f"moe::MoENBits: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not "
                         f"describe one (E, N, K) stack at {scheme.bits} bits in blocks of {scheme.block_size}")
    zero_point = None if scheme.signed else zero_points.reshape(-1).view(torch.uint8)
    return PackedWeight(codes.view(torch.uint8), scales, zero_point, scheme, (e, n, k))


def run(
    inputs: list[torch.Tensor], routing: Routing, activation: ExpertActivation, scheme: QuantScheme,
    interleaved: bool = False, out: torch.Tensor | None = None, fused: bool = False,
) -> torch.Tensor:
    """The node on its 15 inputs (module doc) through the grouped Triton kernels: what the
    plugin's JIT implementation runs on TensorRT's tensors, and what tests run on CPU tensors
    under Triton's interpreter. `fused`: through the one-kernel MoE the AOT plugin launches."""
    from moedeploy.plugins.kernels import moe
    from moedeploy.plugins.kernels.moe_fused import moe_fused

    if len(inputs) != len(INPUTS):
        raise ValueError(f"moe::MoENBits takes {len(INPUTS)} inputs ({', '.join(INPUTS)}); got {len(inputs)}")
    x, logits = inputs[:2]
    gate, up, down = (packed_stack(*inputs[2 + 3 * i: 5 + 3 * i], scheme) for i in range(3))
    b_gate, b_up, b_down, score_bias = inputs[11:]
    gated = activation.activation == "swiglu" and not interleaved  # interleaved: up holds both
    return (moe_fused if fused else moe)(
        x, logits, gate if gated else None, up, down, routing, activation=activation,
        b_gate=b_gate if activation.activation == "swiglu" else None, b_up=b_up, b_down=b_down,
        score_bias=score_bias, out=out, interleaved=interleaved,
    )
