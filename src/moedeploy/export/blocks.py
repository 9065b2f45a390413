"""The exportable blocks: each one declared once, with its inputs, dynamic axes and tolerances.

Like Optimum's export configs, but one small record per block: how to build it with seeded
random weights, how to make inputs of any batch/sequence size, which axes are dynamic and
their TensorRT min/opt/max ranges, and how close ONNX Runtime must come to eager PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from moedeploy import names
from moedeploy.models import (
    MLP,
    BatchNorm,
    BatchNormMLP,
    DecoderLayer,
    EncoderLayer,
    FeedForward,
    LayerNorm,
    RMSNorm,
    RotaryEmbedding,
    SparseMoE,
    SwiGLU,
    causal_mask,
)

DIM = 64  # hidden size of every standalone block: small, but not a power-of-two-only path
HEADS = 4

#: Tolerances by dtype for block outputs, ONNX Runtime vs eager PyTorch (atol, rtol).
#: fp16 graphs round every intermediate to 10 mantissa bits where eager CPU math may keep
#: more, so they get ~1e-2; bf16 (7 bits) gets 5e-2.
TOLERANCES = {"fp32": (1e-5, 1e-5), "fp16": (1e-2, 1e-2), "bf16": (5e-2, 5e-2)}
DECODER_TOLERANCES = {"fp32": (1e-4, 1e-4), "fp16": (5e-2, 5e-2), "bf16": (2e-1, 5e-2)}


@dataclass(frozen=True)
class DynamicRange:
    """min/opt/max of one dynamic dim: the TensorRT optimisation profile and the test sizes."""

    min: int
    opt: int
    max: int

    def to_dict(self) -> dict[str, int]:
        return {"min": self.min, "opt": self.opt, "max": self.max}


BATCH = DynamicRange(1, 2, 16)
SEQ = DynamicRange(1, 16, 256)


@dataclass(frozen=True)
class BlockSpec:
    """Everything export needs to know about one block."""

    name: str
    summary: str
    build: Callable[[], nn.Module]
    uses_batchnorm: bool = False
    input_name: str = "x"
    output_name: str = "y"
    dynamic_ranges: dict[str, DynamicRange] = field(default_factory=lambda: {"batch": BATCH, "seq": SEQ})

    def make_inputs(self, batch: int, seq: int, generator: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {self.input_name: torch.randn(batch, seq, DIM, generator=generator).to(dtype)}

    @property
    def input_axes(self) -> dict[str, dict[int, str]]:
        return {self.input_name: {0: "batch", 1: "seq"}}


def _perturb_norm_weights(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """Norm weights start at exactly 1 and biases at 0, which would hide a missing scale or
    shift in an exported graph; give them seeded random values instead."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (LayerNorm, RMSNorm, BatchNorm, nn.BatchNorm1d)):
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=generator))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=generator))
    return module


class TransposedBatchNorm1dMLP(nn.Module):
    """Linear on [B, S, H] -> nn.BatchNorm1d over features via transpose -> ReLU -> Linear.

    The way people write it with torch's BatchNorm1d (which wants [B, C, L]); no existing
    tool folds this pattern, so it is the case BatchNorm folding must prove.
    """

    def __init__(self, dim: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or 4 * dim
        self.up = nn.Linear(dim, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.up(x).transpose(1, 2)).transpose(1, 2)  # (B, S, 4H) -> (B, 4H, S) and back
        return self.down(torch.relu(h))


class CausalDecoderLayer(nn.Module):
    """A DecoderLayer with its RoPE table and causal mask built in, for standalone export."""

    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.layer = DecoderLayer(DIM, HEADS, 2, 96, moe=moe, n_experts=4, top_k=2)
        self.rope = RotaryEmbedding(DIM // HEADS, SEQ.max, theta=10000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        S = x.shape[1]
        positions = torch.arange(S, device=x.device)
        return self.layer(x, causal_mask(0, S, x.device)[None, None], self.rope(positions))  # 4-D mask, as in MoEDecoder


#: How each block of `names.BLOCKS` is built (its seeded weights come from build_block).
_BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "layernorm": lambda: LayerNorm(DIM),
    "rmsnorm": lambda: RMSNorm(DIM),
    "batchnorm": lambda: BatchNorm(DIM),
    "batchnorm_mlp": lambda: BatchNormMLP(DIM),
    "batchnorm1d_transposed_mlp": lambda: TransposedBatchNorm1dMLP(DIM),
    "mlp": lambda: MLP(DIM),
    "ffn_relu": lambda: FeedForward(DIM, activation="relu"),
    "ffn_gelu": lambda: FeedForward(DIM, activation="gelu"),
    "swiglu": lambda: SwiGLU(DIM, bias=True),
    "moe": lambda: SparseMoE(DIM, 96, n_experts=4, top_k=2),
    "encoder_layer_postln": lambda: EncoderLayer(DIM, HEADS, norm_first=False),
    "encoder_layer_preln": lambda: EncoderLayer(DIM, HEADS, norm_first=True),
    "decoder_layer": lambda: CausalDecoderLayer(moe=True),
    "decoder_layer_dense": lambda: CausalDecoderLayer(moe=False),
}


def _registry() -> dict[str, BlockSpec]:
    """The specs, named and described once in moedeploy/names.py (which the CLI reads without torch)."""
    names.check_same_names("blocks", _BUILDERS, names.BLOCKS)
    return {
        name: BlockSpec(name, summary, _BUILDERS[name], uses_batchnorm=name in names.BATCHNORM_BLOCKS)
        for name, summary in names.BLOCKS.items()
    }


BLOCKS: dict[str, BlockSpec] = _registry()


def get_block(name: str) -> BlockSpec:
    try:
        return BLOCKS[name]
    except KeyError:
        raise ValueError(
            f"unknown block {name!r}; run `moedeploy export --list` to see the {len(BLOCKS)} blocks "
            "(or export `decoder`)"
        ) from None


def build_block(spec: BlockSpec, seed: int) -> nn.Module:
    """The block with seeded random weights, in train mode (calibration may follow)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    return _perturb_norm_weights(spec.build(), generator)
