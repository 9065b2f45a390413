"""LayerNorm, RMSNorm and BatchNorm against torch built-ins, transformers and hand values."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moedeploy.models import BatchNorm, LayerNorm, RMSNorm

SEED_X = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])


def _copy_affine(dst: nn.Module, src: nn.Module) -> None:
    with torch.no_grad():
        dst.weight.copy_(src.weight)
        if getattr(src, "bias", None) is not None:
            dst.bias.copy_(src.bias)


# ---------------------------------------------------------------- LayerNorm


def test_layernorm_seed_example_by_hand() -> None:
    # Row 1: mean 2.5, biased var 1.25 -> (x - 2.5) / sqrt(1.25); row 2 is row 1 scaled by 10,
    # which LayerNorm cannot see (up to eps).
    y = LayerNorm(4)(SEED_X)
    expected = torch.tensor([-1.3416, -0.4472, 0.4472, 1.3416])
    torch.testing.assert_close(y, expected.expand(2, 4), atol=1e-4, rtol=0)
    exact = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / math.sqrt(1.25 + 1e-5)
    torch.testing.assert_close(y[0], exact, atol=1e-6, rtol=0)


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 33, 24), (3, 7), (5, 1, 2)])
@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_layernorm_matches_torch(shape: tuple[int, ...], eps: float) -> None:
    dim = shape[-1]
    ref = nn.LayerNorm(dim, eps=eps)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = LayerNorm(dim, eps=eps)
    _copy_affine(ours, ref)
    x = 3.0 * torch.randn(shape) + 1.5
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


def test_layernorm_gradients_match_torch() -> None:
    ref = nn.LayerNorm(12)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = LayerNorm(12)
    _copy_affine(ours, ref)
    x = torch.randn(2, 5, 12)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(2, 5, 12)
    (ours(x1) * g).sum().backward()
    (ref(x2) * g).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- RMSNorm


def test_rmsnorm_seed_example_by_hand() -> None:
    # RMS of [1, 2, 3, 4] is sqrt(30 / 4) = sqrt(7.5); the seed notebook "tested" RMSNorm by
    # calling its LayerNorm, whose output [-1.34, ...] is wrong here.
    y = RMSNorm(4, eps=0.0)(SEED_X)
    expected = torch.tensor([1.0, 2.0, 3.0, 4.0]) / math.sqrt(7.5)
    torch.testing.assert_close(y, expected.expand(2, 4), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        y[0], torch.tensor([0.3651, 0.7303, 1.0954, 1.4606]), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 33, 24), (4, 7)])
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rmsnorm_matches_torch_fp32(shape: tuple[int, ...], eps: float) -> None:
    dim = shape[-1]
    ref = nn.RMSNorm(dim, eps=eps)
    with torch.no_grad():
        ref.weight.normal_()
    ours = RMSNorm(dim, eps=eps)
    _copy_affine(ours, ref)
    x = 2.0 * torch.randn(shape) + 0.5
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_half_matches_llama_rule(dtype: torch.dtype) -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm

    dim, eps = 64, 1e-5
    weight = (1.0 + 0.5 * torch.randn(dim)).to(dtype)
    x = (3.0 * torch.randn(3, 33, dim)).to(dtype)
    ours = RMSNorm(dim, eps).to(dtype)
    hf = MixtralRMSNorm(dim, eps).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        hf.weight.copy_(weight)

    y = ours(x)
    assert y.dtype == dtype
    # Bit-exact with transformers: statistic in fp32, cast to the input dtype, then the weight.
    assert torch.equal(y, hf(x))
    x32 = x.float()
    by_hand = (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * weight
    torch.testing.assert_close(y, by_hand, atol=0, rtol=torch.finfo(dtype).eps)
    # The rule matters: applying the weight in fp32 and casting once rounds differently.
    fp32_weight_then_cast = (
        x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    ).to(dtype)
    assert not torch.equal(y, fp32_weight_then_cast)


# ---------------------------------------------------------------- BatchNorm


def _bn_pair(dim: int, momentum: float | None) -> tuple[BatchNorm, nn.BatchNorm1d]:
    ref = nn.BatchNorm1d(dim, eps=1e-5, momentum=momentum)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = BatchNorm(dim, eps=1e-5, momentum=momentum)
    _copy_affine(ours, ref)
    return ours, ref


def _ref_bn(bn: nn.BatchNorm1d, x: torch.Tensor) -> torch.Tensor:
    return bn(x.transpose(1, 2)).transpose(1, 2)  # [B, S, H] -> [B, H, S] -> back


@pytest.mark.parametrize("momentum", [0.1, 0.3, None])
def test_batchnorm_training_and_eval_match_torch(momentum: float | None) -> None:
    dim = 6
    ours, ref = _bn_pair(dim, momentum)
    ours.train()
    ref.train()
    # Different batch and sequence sizes: the pooled count n = B*S changes the unbiased factor.
    for step, (b, s) in enumerate([(4, 3), (1, 33), (2, 1), (3, 5), (7, 2)]):
        x = (step + 1) * torch.randn(b, s, dim) + step
        torch.testing.assert_close(ours(x), _ref_bn(ref, x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.running_mean, ref.running_mean, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ours.running_var, ref.running_var, atol=1e-6, rtol=1e-5)
        assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == step + 1

    ours.eval()
    ref.eval()
    x = torch.randn(3, 9, dim)
    stats = (ours.running_mean.clone(), ours.running_var.clone())
    torch.testing.assert_close(ours(x), _ref_bn(ref, x), atol=1e-5, rtol=1e-5)
    # Eval uses the frozen statistics: nothing changes.
    assert torch.equal(ours.running_mean, stats[0])
    assert torch.equal(ours.running_var, stats[1])
    assert int(ours.num_batches_tracked) == 5


def test_batchnorm_biased_normalisation_unbiased_running_var_by_hand() -> None:
    bn = BatchNorm(1, eps=0.0, momentum=0.1).train()
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 4, 1)  # n = 4 values of one feature
    y = bn(x)
    # Batch: mean 2.5, biased var 5/4 (normalises the batch), unbiased var 5/3 (goes to the EMA).
    torch.testing.assert_close(y.flatten(), torch.tensor([-1.5, -0.5, 0.5, 1.5]) / math.sqrt(1.25))
    # PyTorch's convention: running = (1 - m) * running + m * batch, from mean 0 and var 1.
    torch.testing.assert_close(bn.running_mean, torch.tensor([0.1 * 2.5]))
    torch.testing.assert_close(bn.running_var, torch.tensor([0.9 * 1.0 + 0.1 * 5.0 / 3.0]))


def test_batchnorm_cumulative_average_by_hand() -> None:
    bn = BatchNorm(1, eps=0.0, momentum=None).train()
    bn(torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(2, 2, 1))  # mean 2.5, unbiased var 5/3
    bn(torch.tensor([5.0, 9.0]).reshape(1, 2, 1))  # mean 7, unbiased var 8
    bn(torch.tensor([0.0, 0.0, 3.0]).reshape(3, 1, 1))  # mean 1, unbiased var 3
    # momentum=None is the plain average of the per-batch statistics, not of the values.
    torch.testing.assert_close(bn.running_mean, torch.tensor([(2.5 + 7.0 + 1.0) / 3]))
    torch.testing.assert_close(bn.running_var, torch.tensor([(5.0 / 3 + 8.0 + 3.0) / 3]))
    assert int(bn.num_batches_tracked) == 3


def test_batchnorm_gradients_match_torch() -> None:
    ours, ref = _bn_pair(5, 0.1)
    x = torch.randn(3, 4, 5)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(3, 4, 5)
    (ours.train()(x1) * g).sum().backward()
    (_ref_bn(ref.train(), x2) * g).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, atol=1e-5, rtol=1e-5)


def test_batchnorm_loads_torch_state_dict() -> None:
    ref = nn.BatchNorm1d(8)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ref.train()
    for _ in range(3):
        ref(3.0 * torch.randn(4, 8, 5) + 2.0)
    ref.eval()

    ours = BatchNorm(8)
    ours.load_state_dict(ref.state_dict())  # strict: the names and shapes must all agree
    assert set(ours.state_dict()) == set(ref.state_dict())
    assert int(ours.num_batches_tracked) == 3
    ours.eval()
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(ours(x), _ref_bn(ref, x), atol=1e-5, rtol=1e-5)
