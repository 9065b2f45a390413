"""Weight-only round-to-nearest quantization in blocks along the input dimension: int8 and int4.

A weight (..., N, K), as nn.Linear and our experts store it (out, in), is cut into blocks of
`block_size` consecutive values along K; each block gets one float scale and one zero point,
and each value an unsigned code: weight ~ (code - zero_point) * scale.

The codes are unsigned (uint8, uint4) with the zero point stored, because that one layout is
read as it is by both consumers of a quantized artifact on ONNX Runtime:
  - ONNX DequantizeLinear (opset 21, blocked: `axis`, `block_size`), the portable graph:
    y = (x - zero_point) * scale (TensorRT's takes only signed codes with zero point 0);
  - ONNX Runtime's com.microsoft::MatMulNBits, whose B is (N, K / block_size, block_size *
    bits / 8) uint8, codes along K, two 4-bit codes per byte with the lower-index one in the
    low nibble (as ONNX packs uint4), scales (N, K / block_size), and 4-bit zero points packed
    two per byte the same way. A per-expert slice of the artifact's bytes is such a B.

Symmetric schemes are llama.cpp's q8_0 and q4_0, so their accuracy compares like for like:
  int8  scale = max|w| / 127, code = round(w / scale) + 128, in [1, 255];
  int4  scale = max|w| / 8, code = clamp(round(w / scale) + z, 0, 15) with z = 8, or 7 where
        the value of largest magnitude is positive: the full 16 levels with that value exact.
        q4_0 writes the same values as a negative scale times codes 0..15 around 8; here the
        scale stays positive and the zero point moves.
Asymmetric (uint codes, a zero point per block): the block's range widened to include 0 (so 0
stays exact, as ONNX Runtime's blockwise quantizer does), scale = (max - min) / (2^bits - 1),
zero_point = round(-min / scale), code = clamp(round(w / scale) + zero_point, 0, 2^bits - 1).
Rounding is half away from zero (C's roundf, as llama.cpp). An all-zero block has scale 0
and dequantizes to exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 8)


@dataclass(frozen=True)
class QuantScheme:
    """How a weight is quantized: bits per value, values per block, symmetric or not."""

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
    def name(self) -> str:
        return f"int{self.bits}"


@dataclass
class BlockQuantized:
    """A (..., N, K) weight quantized along K: codes (..., N, K) uint8 in [0, 2^bits), unpacked;
    scale and zero_point (..., N, K / block_size), float32 and uint8."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    scheme: QuantScheme

    def dequantize(self) -> torch.Tensor:
        """(code - zero_point) * scale, in float32 (what DequantizeLinear computes)."""
        blocks = self.codes.unflatten(-1, (-1, self.scheme.block_size)).float()
        values = (blocks - self.zero_point.unsqueeze(-1).float()) * self.scale.unsqueeze(-1)
        return values.flatten(-2)

    def packed_codes(self) -> torch.Tensor:
        """The codes as stored: uint8 bytes, (..., N, K * bits / 8)."""
        return pack(self.codes, self.scheme.bits)

    def packed_zero_points(self) -> torch.Tensor:
        """The zero points packed per row, as MatMulNBits takes them: (..., N, ceil(blocks * bits / 8))
        uint8. (An ONNX uint4 tensor packs its values flattened: the same bytes when each row
        has an even number of blocks.)"""
        return pack(self.zero_point, self.scheme.bits)


@dataclass
class PackedWeight:
    """A quantized weight as a quantized artifact stores it, the bytes kernels read in place:
    codes (..., N, K * bits / 8) uint8 packed per row; scale (..., N, K / block_size) in the
    artifact's dtype; zero_point uint8, all of them flattened and packed as ONNX packs a uint4
    tensor (element 2i in the low nibble of byte i; for int8 one byte each). `shape` is the
    float weight's (..., N, K)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    scheme: QuantScheme
    shape: tuple[int, ...]

    @classmethod
    def from_weight(cls, weight: torch.Tensor, scheme: QuantScheme) -> PackedWeight:
        """Quantize `weight` as the export does, the scale kept in the weight's dtype."""
        q = quantize(weight, scheme)
        zero_point = pack(q.zero_point.flatten(), scheme.bits)
        return cls(q.packed_codes(), q.scale.to(weight.dtype), zero_point, scheme, tuple(weight.shape))

    def dequantize(self) -> torch.Tensor:
        """(code - zero_point) * scale in float32, rounded to the scale's dtype: what the
        artifact's DequantizeLinear gives."""
        codes = unpack(self.codes, self.scheme.bits, self.shape[-1])
        zero_point = unpack(self.zero_point, self.scheme.bits, self.scale.numel()).reshape(self.scale.shape)
        return BlockQuantized(codes, self.scale.float(), zero_point, self.scheme).dequantize().to(self.scale.dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The float dtype the weight dequantizes to (its scale's)."""
        return self.scale.dtype

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device: torch.device | str) -> PackedWeight:
        return PackedWeight(self.codes.to(device), self.scale.to(device), self.zero_point.to(device),
                            self.scheme, self.shape)


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
    top = scheme.levels - 1
    if scheme.symmetric:
        half = scheme.levels // 2
        amax = blocks.abs().amax(-1)
        if scheme.bits == 8:  # q8_0: max|w| / 127, codes 1..255 around 128
            scale = amax / (half - 1)
            zero = torch.full_like(scale, half)
        else:  # q4_0's 16 levels, the largest magnitude exact at the far end whatever its sign
            signed_max = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)).squeeze(-1)
            scale = amax / half
            zero = torch.where(signed_max > 0, half - 1, half).to(scale.dtype)
    else:
        low, high = blocks.amin(-1).clamp(max=0.0), blocks.amax(-1).clamp(min=0.0)
        scale = (high - low) / top
        zero = round_half_away(-low / torch.where(scale == 0, torch.ones_like(scale), scale)).clamp(0, top)
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale).unsqueeze(-1)
    codes = (round_half_away(blocks / divisor) + zero.unsqueeze(-1)).clamp(0, top).to(torch.uint8)
    zero_point = zero.to(torch.uint8)
    return BlockQuantized(codes.flatten(-2), scale.float(), zero_point, scheme)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (..., K) -> bytes: 8-bit as they are; 4-bit two per byte, element 2i in the
    low nibble of byte i (ONNX's uint4 packing); an odd K gets a zero high nibble at the end."""
    if bits == 8:
        return codes.to(torch.uint8)
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The inverse of `pack`: (..., bytes) -> (..., count) uint8 codes."""
    if bits == 8:
        return packed[..., :count]
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)[..., :count]
