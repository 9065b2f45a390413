"""MLP, FeedForward, SwiGLU and BatchNormMLP against hand formulas; swiglu_hidden_dim by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moedeploy.models import MLP, BatchNormMLP, FeedForward, SwiGLU, swiglu_hidden_dim


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    y = x @ layer.weight.T
    return y if layer.bias is None else y + layer.bias


def _relu(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x, torch.zeros_like(x))


def _gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 33, 24), (5, 7)])
def test_mlp_by_hand(shape: tuple[int, ...]) -> None:
    dim = shape[-1]
    mlp = MLP(dim)
    assert mlp.w1.weight.shape == (4 * dim, dim)
    assert mlp.w2.weight.shape == (dim, 4 * dim)
    x = torch.randn(shape)
    expected = _linear(_relu(_linear(x, mlp.w1)), mlp.w2)
    torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("hidden", [None, 17])
def test_feedforward_eval_by_hand(activation: str, hidden: int | None) -> None:
    dim = 12
    ffn = FeedForward(dim, hidden, activation, dropout=0.5).eval()
    assert ffn.up.weight.shape == (hidden or 4 * dim, dim)
    act = _relu if activation == "relu" else _gelu_erf
    x = torch.randn(3, 33, dim)
    expected = _linear(act(_linear(x, ffn.up)), ffn.down)
    # In eval mode the dropout is the identity, even at p = 0.5.
    torch.testing.assert_close(ffn(x), expected, atol=1e-5, rtol=1e-5)


def test_feedforward_gelu_is_not_relu() -> None:
    # A negative pre-activation separates the two: relu gives 0, exact gelu does not.
    ffn_relu, ffn_gelu = FeedForward(4, 4, "relu"), FeedForward(4, 4, "gelu")
    ffn_gelu.load_state_dict(ffn_relu.state_dict())
    for ffn in (ffn_relu, ffn_gelu):
        with torch.no_grad():
            ffn.up.weight.copy_(-torch.eye(4))
            ffn.up.bias.zero_()
            ffn.down.weight.copy_(torch.eye(4))
            ffn.down.bias.zero_()
    x = torch.ones(1, 4)
    torch.testing.assert_close(ffn_relu(x), torch.zeros(1, 4))
    torch.testing.assert_close(
        ffn_gelu(x), torch.full((1, 4), -0.5 * (1 - math.erf(1 / math.sqrt(2))))
    )


def test_feedforward_dropout_active_in_train() -> None:
    p = 0.5
    ffn = FeedForward(16, 32, "gelu", dropout=p)
    x = torch.randn(4, 50, 16)
    y_eval = ffn.eval()(x)
    torch.manual_seed(1)
    y_train = ffn.train()(x)
    dropped = y_train == 0
    # Inverted dropout: each output is either dropped or scaled by 1 / (1 - p).
    torch.testing.assert_close(y_train[~dropped], y_eval[~dropped] / (1 - p), atol=1e-5, rtol=1e-5)
    assert 0.4 < dropped.float().mean().item() < 0.6  # 3200 draws of p = 0.5
    assert not (y_eval == 0).any()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 24), (2, 33, 24), (3, 10)])
def test_swiglu_by_hand(bias: bool, shape: tuple[int, ...]) -> None:
    dim = shape[-1]
    ffn = SwiGLU(dim, hidden=40, bias=bias)
    assert (ffn.w1.bias is None) == (not bias)
    x = torch.randn(shape)
    expected = _linear(_silu(_linear(x, ffn.w1)) * _linear(x, ffn.w3), ffn.w2)
    torch.testing.assert_close(ffn(x), expected, atol=1e-5, rtol=1e-5)


def test_swiglu_gate_and_up_are_not_interchangeable() -> None:
    # w1 is the gate (goes through silu), w3 the up projection; swapping them changes the output.
    ffn = SwiGLU(8, hidden=16)
    swapped = SwiGLU(8, hidden=16)
    swapped.load_state_dict(
        {"w1.weight": ffn.w3.weight, "w3.weight": ffn.w1.weight, "w2.weight": ffn.w2.weight}
    )
    x = torch.randn(5, 8)
    assert not torch.allclose(ffn(x), swapped(x), atol=1e-3)


@pytest.mark.parametrize(
    ("dim", "multiple_of", "multiplier", "expected"),
    [
        (24, 64, None, 64),  # int(2 * 96 / 3) = 64, already a multiple
        (512, 256, None, 1536),  # 1365 -> next multiple of 256
        (48, 128, None, 128),  # exactly 128: no extra round-up
        (10, 16, None, 32),  # int(80 / 3) = 26 -> 32
        (3, 1, None, 8),  # multiple_of 1 keeps int(2 * 12 / 3) = 8
        (4096, 256, None, 11008),  # Llama-2 7B
        (5120, 256, None, 13824),  # Llama-2 13B
        (4096, 1024, 1.3, 14336),  # Llama-3 8B: int(1.3 * 10922) = 14198 -> 14336
        (8192, 4096, 1.3, 28672),  # Llama-2 70B: int(1.3 * 21845) = 28398 -> 28672
        (96, 64, 0.5, 128),  # int(0.5 * 256) = 128
    ],
)
def test_swiglu_hidden_dim_by_hand(
    dim: int, multiple_of: int, multiplier: float | None, expected: int
) -> None:
    assert swiglu_hidden_dim(dim, multiple_of, multiplier) == expected


@pytest.mark.parametrize(
    ("dim", "multiple_of", "expected"), [(24, 64, 64), (10, 16, 32), (33, 8, 88)]
)
def test_swiglu_default_hidden_is_rounded(dim: int, multiple_of: int, expected: int) -> None:
    ffn = SwiGLU(dim, multiple_of=multiple_of)
    assert ffn.hidden == expected
    assert ffn.w1.weight.shape == ffn.w3.weight.shape == (expected, dim)
    assert ffn.w2.weight.shape == (dim, expected)


def test_batchnorm_mlp_matches_torch_composition() -> None:
    dim, hidden = 6, 10
    ours = BatchNormMLP(dim, hidden)
    ref_bn = nn.BatchNorm1d(hidden)
    with torch.no_grad():
        ours.bn.weight.normal_()
        ours.bn.bias.normal_()
        ref_bn.weight.copy_(ours.bn.weight)
        ref_bn.bias.copy_(ours.bn.bias)

    def reference(x: torch.Tensor) -> torch.Tensor:
        h = ref_bn(_linear(x, ours.up).transpose(1, 2)).transpose(1, 2)
        return _linear(F.relu(h), ours.down)

    ours.train()
    ref_bn.train()
    for b, s in [(2, 5), (1, 33), (4, 1)]:
        x = torch.randn(b, s, dim)
        torch.testing.assert_close(ours(x), reference(x), atol=1e-5, rtol=1e-5)
    ours.eval()
    ref_bn.eval()
    x = torch.randn(3, 4, dim)
    torch.testing.assert_close(ours(x), reference(x), atol=1e-5, rtol=1e-5)


def test_unknown_activation_raises() -> None:
    with pytest.raises(ValueError, match="tanh"):
        FeedForward(4, activation="tanh")  # type: ignore[arg-type]
