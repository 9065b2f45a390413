"""Position-wise feed-forward blocks: MLP, FeedForward (ReLU/GELU), SwiGLU, and an MLP with BatchNorm."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from moedeploy.models.norms import BatchNorm

Activation = Literal["relu", "gelu"]


def activation_fn(name: str):
    """The element-wise activation behind a name used in configs and ONNX attributes."""
    table = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(table)}") from None


def swiglu_hidden_dim(dim: int, multiple_of: int = 64, ffn_dim_multiplier: float | None = None) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim (three matrices cost what two 4x ones did),
    optionally scaled, then rounded *up* to a multiple of `multiple_of` for fast GEMM tiles.

    ceil(h / m) * m is written (h + m - 1) // m * m.
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class MLP(nn.Module):
    """Linear(d, 4d) -> ReLU -> Linear(4d, d), the original transformer FFN."""

    def __init__(self, dim: int, expansion: int = 4) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, expansion * dim)
        self.w2 = nn.Linear(expansion * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)))


class FeedForward(nn.Module):
    """Linear -> ReLU or GELU -> Linear -> Dropout (GPT/BERT style FFN)."""

    def __init__(
        self, dim: int, hidden: int | None = None, activation: Activation = "relu", dropout: float = 0.0
    ) -> None:
        super().__init__()
        hidden = hidden or 4 * dim
        self.act = activation_fn(activation)
        self.activation = activation
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(self.act(self.up(x))))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): a gated FFN (Shazeer 2020), Llama's naming.

    w1 is the gate, w3 the up projection, w2 the down projection.
    """

    def __init__(
        self,
        dim: int,
        hidden: int | None = None,
        multiple_of: int = 64,
        bias: bool = False,
    ) -> None:
        super().__init__()
        hidden = hidden or swiglu_hidden_dim(dim, multiple_of)
        self.hidden = hidden
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class BatchNormMLP(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Linear on [B, S, H]: the pattern BatchNorm folding targets."""

    def __init__(self, dim: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or 4 * dim
        self.up = nn.Linear(dim, hidden)
        self.bn = BatchNorm(hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.bn(self.up(x))))
