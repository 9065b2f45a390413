"""Normalisation layers: LayerNorm, RMSNorm, and BatchNorm over the features of [B, S, H]."""

from __future__ import annotations

import torch
from torch import nn

from moedeploy.plugins.rmsnorm import rms_norm


class LayerNorm(nn.Module):
    """Normalise each token over its features: zero mean, unit (biased) variance, then affine."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)  # biased, as in the paper and torch
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class RMSNorm(nn.Module):
    """LayerNorm without the mean: scale each token by 1 / RMS(x) (Llama, Mixtral).

    The statistic is computed in fp32 and the weight applied in the input dtype, as
    Llama does, so half-precision models match their reference implementations.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class BatchNorm(nn.Module):
    """Batch normalisation of the feature dim H of a [B, S, H] tensor.

    Training normalises with the statistics of the current batch, pooled over B and S,
    and updates exponential moving averages (EMA) of them; eval uses the frozen EMA.

    Momentum follows PyTorch's convention, the reverse of TensorFlow's:
        running = (1 - momentum) * running + momentum * batch_stat      (momentum=0.1)
    `momentum=None` gives the cumulative average over all batches seen, as in PyTorch.
    Like PyTorch, the EMA of the variance uses the *unbiased* batch variance (n / (n - 1)),
    while the batch itself is normalised with the *biased* one.

    Buffers and parameters carry nn.BatchNorm1d's names, so torch's fusion utilities
    (`fuse_linear_bn_eval`) and state dicts of nn.BatchNorm1d work with it unchanged.
    """

    def __init__(self, dim: int, eps: float = 1e-5, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.eps = eps
        self.momentum = momentum
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            flat = x.reshape(-1, x.shape[-1])  # (B*S, H): statistics pool batch and sequence
            if flat.shape[0] < 2:  # as nn.BatchNorm1d: one value has no variance to learn from
                raise ValueError(f"BatchNorm needs more than 1 value per feature in training, got {tuple(x.shape)}")
            mean = flat.mean(0)
            var = flat.var(0, unbiased=False)
            self._update_running_stats(mean, var, n=flat.shape[0])
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, biased_var: torch.Tensor, n: int) -> None:
        self.num_batches_tracked += 1
        m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased_var = biased_var * n / (n - 1)
        self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
        self.running_var.mul_(1 - m).add_(unbiased_var.detach(), alpha=m)
