"""Weight-only round-to-nearest quantization in blocks along the input dimension: int8 and int4.

A weight (..., N, K), as nn.Linear and our experts store it (out, in), is cut into blocks of
`block_size` consecutive values along K; each block gets one float scale and each value a code.

Symmetric schemes (the default) store signed codes and no zero point: weight ~ code * scale,
int8 codes in [-127, 127] and int4 in [-8, 7], scales positive. That is what every consumer of
the artifact reads without conversion but one:
  - ONNX DequantizeLinear (opset 21, blocked: `axis`, `block_size`), y = x * scale, the
    portable graph;
  - TensorRT's Dequantize layer, which takes signed INT8/INT4 codes with a zero point of 0 and
    positive scales (and blocked scales for INT4 only);
  - ONNX Runtime's com.microsoft::MatMulNBits and QMoE read unsigned codes around an implied
    zero point of 2^(bits-1): code + 2^(bits-1), which is the signed code's bits with the top
    bit of each value flipped (XOR 0x80 a byte, 0x88 a byte of two 4-bit codes). The ONNX
    Runtime lowering flips them with a BitwiseXor that ONNX Runtime folds at session creation
    (runtime/quantized.py). Their B is (N, K / block_size, block_size * bits / 8) uint8, codes
    along K, two 4-bit codes per byte with the lower-index one in the low nibble (as ONNX packs
    int4), scales (N, K / block_size): a per-expert slice of the artifact's bytes is such a B.

  int8  llama.cpp's q8_0: scale = max|w| / 127, code = round(w / scale).
  int4  16 levels [-8, 7] with a positive scale cannot hold the block's largest magnitude at
        both ends, as q4_0's signed scale does (its codes 0..15 around 8 times max / -8). So the
        scale is searched: for each divisor d in INT4_DIVISORS, codes q = clamp(round(w * d /
        max|w|), -8, 7) and the least-squares scale for them, s = sum(w q) / sum(q^2); the
        block keeps the (q, s) with the smallest squared error sum((w - q s)^2), the first
        such d on a tie. On Gaussian weights its squared error is within 1% of q4_0's
        (tests/models/test_blockquant.py measures it), where a fixed max / 8 or max / 7
        loses 5-13%.
Asymmetric (uint codes, a zero point per block, read by ONNX Runtime only: TensorRT takes no
zero point): the block's range widened to include 0 (so 0 stays exact, as ONNX Runtime's
blockwise quantizer does), scale = (max - min) / (2^bits - 1), zero_point = round(-min /
scale), code = clamp(round(w / scale) + zero_point, 0, 2^bits - 1).
Rounding is half away from zero (C's roundf, as llama.cpp). An all-zero block dequantizes to
exact zeros: codes 0, and scale 1 when symmetric (TensorRT's parser takes positive scales only),
0 when not. A weight with NaN or infinite values is refused: no scale represents them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 8)
#: int4 symmetric: the divisors of max|w| whose codes' least-squares scale a block may take
INT4_DIVISORS = tuple(6.5 + 0.25 * i for i in range(11))


@dataclass(frozen=True)
class QuantScheme:
    """How a weight is quantized: bits per value, values per block, symmetric (signed codes,
    no zero point) or not (unsigned codes and a zero point per block)."""

    bits: int
    block_size: int = 32
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"{self.bits}-bit quantization is not supported; choose 8 or 4")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            # MatMulNBits takes power-of-two blocks of at least 16
            raise ValueError(f"block size {self.block_size} must be a power of two, at least 16")

    @property
    def levels(self) -> int:
        return 1 << self.bits

    @property
    def signed(self) -> bool:
        """Whether the codes are signed (symmetric: no zero point) or unsigned around a zero point."""
        return self.symmetric

    @property
    def name(self) -> str:
        return f"int{self.bits}"


@dataclass
class BlockQuantized:
    """A (..., N, K) weight quantized along K: codes (..., N, K), unpacked: int8 in [-2^(bits-1),
    2^(bits-1)) when the scheme is signed, else uint8 in [0, 2^bits); scale (..., N, K /
    block_size) float32; zero_point the same shape, uint8, or None for signed codes."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    scheme: QuantScheme

    def dequantize(self) -> torch.Tensor:
        """code * scale, or (code - zero_point) * scale, in float32 (what DequantizeLinear computes)."""
        blocks = self.codes.unflatten(-1, (-1, self.scheme.block_size)).float()
        if self.zero_point is not None:
            blocks = blocks - self.zero_point.unsqueeze(-1).float()
        return (blocks * self.scale.unsqueeze(-1)).flatten(-2)

    def packed_codes(self) -> torch.Tensor:
        """The codes as stored: uint8 bytes, (..., N, K * bits / 8)."""
        return pack(self.codes, self.scheme.bits)

    def packed_zero_points(self) -> torch.Tensor:
        """The zero points packed per row, as MatMulNBits takes them: (..., N, ceil(blocks * bits / 8))
        uint8. (An ONNX uint4 tensor packs its values flattened: the same bytes when each row
        has an even number of blocks.)"""
        assert self.zero_point is not None, "signed codes have no zero point"
        return pack(self.zero_point, self.scheme.bits)


@dataclass
class PackedWeight:
    """A quantized weight as a quantized artifact stores it, the bytes kernels read in place:
    codes (..., N, K * bits / 8) uint8 packed per row (signed codes in two's complement); scale
    (..., N, K / block_size) in the artifact's dtype; zero_point (unsigned codes only, else None)
    uint8, flattened and packed as ONNX packs a uint4 tensor (element 2i in the low nibble of
    byte i; for int8 one byte each). `shape` is the float weight's (..., N, K)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    scheme: QuantScheme
    shape: tuple[int, ...]

    @classmethod
    def from_weight(cls, weight: torch.Tensor, scheme: QuantScheme) -> PackedWeight:
        """Quantize `weight` as the export does, the scale kept in the weight's dtype."""
        q = quantize(weight, scheme)
        zero_point = None if q.zero_point is None else pack(q.zero_point.flatten(), scheme.bits)
        return cls(q.packed_codes(), q.scale.to(weight.dtype), zero_point, scheme, tuple(weight.shape))

    def dequantize(self) -> torch.Tensor:
        """code * scale, or (code - zero_point) * scale, in float32, rounded to the scale's dtype:
        what the artifact's DequantizeLinear gives."""
        codes = unpack(self.codes, self.scheme.bits, self.shape[-1], self.scheme.signed)
        zero_point = None if self.zero_point is None else \
            unpack(self.zero_point, self.scheme.bits, self.scale.numel()).reshape(self.scale.shape)
        return BlockQuantized(codes, self.scale.float(), zero_point, self.scheme).dequantize().to(self.scale.dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The float dtype the weight dequantizes to (its scale's)."""
        return self.scale.dtype

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device: torch.device | str) -> PackedWeight:
        zero_point = None if self.zero_point is None else self.zero_point.to(device)
        return PackedWeight(self.codes.to(device), self.scale.to(device), zero_point, self.scheme, self.shape)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """roundf: 2.5 -> 3, -2.5 -> -3 (torch.round rounds half to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize(weight: torch.Tensor, scheme: QuantScheme) -> BlockQuantized:
    """Round-to-nearest quantization of `weight` (..., N, K) in blocks along K (K a multiple of
    the block size). Computed in float32 whatever the weight's dtype."""
    k = weight.shape[-1]
    if k % scheme.block_size:
        raise ValueError(f"the input dimension {k} is not a multiple of the block size {scheme.block_size}; "
                         f"choose a block size that divides it")
    blocks = weight.float().unflatten(-1, (-1, scheme.block_size))  # (..., N, K / bs, bs)
    if not torch.isfinite(blocks).all():
        raise ValueError("it has NaN or infinite values, which no scale represents: check the checkpoint")
    if scheme.symmetric:
        codes, scale = _symmetric_int8(blocks) if scheme.bits == 8 else _symmetric_int4(blocks)
        return BlockQuantized(codes.to(torch.int8).flatten(-2), scale, None, scheme)
    top = scheme.levels - 1
    low, high = blocks.amin(-1).clamp(max=0.0), blocks.amax(-1).clamp(min=0.0)
    scale = (high - low) / top
    zero = round_half_away(-low / torch.where(scale == 0, torch.ones_like(scale), scale)).clamp(0, top)
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale).unsqueeze(-1)
    codes = (round_half_away(blocks / divisor) + zero.unsqueeze(-1)).clamp(0, top).to(torch.uint8)
    return BlockQuantized(codes.flatten(-2), scale.float(), zero.to(torch.uint8), scheme)


def _positive(scale: torch.Tensor) -> torch.Tensor:
    """An all-zero block's scale 0 as 1 (its codes are 0 either way): TensorRT takes positive scales only."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _symmetric_int8(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q8_0: scale max|w| / 127, codes round(w / scale) in [-127, 127]."""
    scale = _positive(blocks.abs().amax(-1) / 127)
    return round_half_away(blocks / scale.unsqueeze(-1)).clamp(-127, 127), scale


def _symmetric_int4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes in [-8, 7] and a positive scale per block, searched over INT4_DIVISORS (module doc):
    for fixed codes q the least-squares scale is s = sum(wq) / sum(q^2), whose squared error is
    sum(w^2) - sum(wq)^2 / sum(q^2), so the best candidate has the largest sum(wq)^2 / sum(q^2)."""
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax == 0, torch.zeros_like(amax), 1 / amax)
    best_codes = torch.zeros_like(blocks)
    best_gain = torch.full_like(amax[..., 0], -1.0)
    best_scale = torch.zeros_like(amax[..., 0])
    for d in INT4_DIVISORS:
        q = round_half_away(blocks * (inverse * d)).clamp(-8, 7)
        wq, qq = (blocks * q).sum(-1), (q * q).sum(-1).clamp(min=1)  # all-zero codes: wq = 0, so 0 below
        gain = wq * wq / qq
        better = gain > best_gain
        best_gain = torch.where(better, gain, best_gain)
        best_scale = torch.where(better, wq / qq, best_scale)
        best_codes = torch.where(better.unsqueeze(-1), q, best_codes)
    return best_codes, _positive(best_scale)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (..., K), uint8 or int8 (two's complement) -> bytes: 8-bit as they are; 4-bit two per
    byte, element 2i in the low nibble of byte i (ONNX's uint4/int4 packing); an odd K gets a zero
    high nibble at the end."""
    raw = codes.view(torch.uint8) if codes.dtype == torch.int8 else codes.to(torch.uint8)
    if bits == 8:
        return raw
    if raw.shape[-1] % 2:
        raw = torch.nn.functional.pad(raw, (0, 1))
    pairs = (raw & 0x0F).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(packed: torch.Tensor, bits: int, count: int, signed: bool = False) -> torch.Tensor:
    """The inverse of `pack`: (..., bytes) -> (..., count) codes, uint8, or int8 when `signed`."""
    if bits == 8:
        codes = packed[..., :count]
        return codes.view(torch.int8) if signed else codes
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)[..., :count]
    return ((codes ^ 8).to(torch.int8) - 8) if signed else codes
