"""BatchNorm folding with frozen EMA statistics, done in PyTorch before export.

In eval mode a BatchNorm is an affine map per feature, y = x * s + t with
s = gamma / sqrt(running_var + eps) and t = beta - running_mean * s, so it can vanish:
  - into the Linear that feeds it:  W' = s[:, None] * W,  b' = s * b + t
    (also through the transpose pair people write around nn.BatchNorm1d on [B, S, H]),
  - or, with no Linear before it, into one Mul + Add (`ChannelAffine`).
Exporters fold BN into Conv/Gemm only for 2-D Linear inputs, and nobody folds the
transposed-BatchNorm1d pattern (DESIGN.md), hence this pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx
from torch import nn
from torch.nn.utils.fusion import fuse_linear_bn_weights

from moedeploy.models.norms import BatchNorm

BATCHNORM_TYPES = (BatchNorm, nn.BatchNorm1d)


class ChannelAffine(nn.Module):
    """y = x * scale + shift along one feature dim: what a frozen BatchNorm computes."""

    def __init__(self, scale: torch.Tensor, shift: torch.Tensor, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("scale", scale.detach().clone())
        self.register_buffer("shift", shift.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        view = [1] * x.dim()
        view[self.dim] = -1
        return x * self.scale.view(view) + self.shift.view(view)


@dataclass
class FoldReport:
    """Which BatchNorms went where; recorded in the artifact manifest."""

    into_linear: dict[str, str] = field(default_factory=dict)  # bn name -> linear name
    to_affine: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"into_linear": self.into_linear, "to_affine": self.to_affine}

    @property
    def count(self) -> int:
        return len(self.into_linear) + len(self.to_affine)


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, BATCHNORM_TYPES) for m in model.modules())


@torch.no_grad()
def calibrate(model: nn.Module, make_batch: Callable[[int], tuple], batches: int) -> None:
    """Run `batches` batches in train mode so every BatchNorm's EMA sees real data, then freeze."""
    model.train()
    for i in range(batches):
        model(*make_batch(i))
    model.eval()


def _bn_scale_shift(bn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    return scale, bn.bias - bn.running_mean * scale


def _feeding_linear(node: torch.fx.Node, modules: dict[str, nn.Module]) -> torch.fx.Node | None:
    """The Linear call whose output reaches `node` only through this BN (None if there is none).

    Our BatchNorm normalises the last dim, so it must be Linear -> BN directly. nn.BatchNorm1d
    on [B, S, H] is written Linear -> transpose(1, 2) -> BN -> transpose(1, 2).
    """
    bn = modules[str(node.target)]
    src = node.args[0]
    if isinstance(bn, nn.BatchNorm1d):
        if not (
            isinstance(src, torch.fx.Node)
            and src.op == "call_method"
            and src.target == "transpose"
            and sorted(src.args[1:3]) == [1, 2]
            and len(src.users) == 1
        ):
            return None
        src = src.args[0]
    if (
        isinstance(src, torch.fx.Node)
        and src.op == "call_module"
        and isinstance(modules.get(str(src.target)), nn.Linear)
        and len(src.users) == 1
    ):
        return src
    return None


class _BatchNormLeafTracer(torch.fx.Tracer):
    """Keep every BatchNorm (ours too, not only torch.nn's) as one call_module node."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, BATCHNORM_TYPES) or super().is_leaf_module(m, qualname)


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, new)


@torch.no_grad()
def fold_batchnorms(model: nn.Module) -> tuple[nn.Module, FoldReport]:
    """Fold every BatchNorm of an eval-mode model; returns the model to use and where each went.

    Submodules are replaced in place and the model's own forward code is kept: folded BNs
    become nn.Identity, the others a ChannelAffine, so no BatchNormalization node can reach
    the exported graph. A model that *is* a BatchNorm cannot be replaced in place: the
    returned model is then its ChannelAffine.
    """
    if model.training:
        raise ValueError("fold_batchnorms needs an eval-mode model (frozen EMA statistics)")
    report = FoldReport()
    modules = dict(model.named_modules())
    try:
        graph = _BatchNormLeafTracer().trace(model)
        bn_nodes = [
            n for n in graph.nodes
            if n.op == "call_module" and isinstance(modules.get(str(n.target)), BATCHNORM_TYPES)
        ]
    except Exception:  # untraceable model: every BN still folds to an affine below
        bn_nodes = []
    for node in bn_nodes:
        bn_name = str(node.target)
        linear_node = _feeding_linear(node, modules)
        if linear_node is None:
            continue
        linear_name = str(linear_node.target)
        linear = modules[linear_name]
        bias = linear.bias if linear.bias is not None else torch.zeros(linear.out_features)
        bn = modules[bn_name]
        w, b = fuse_linear_bn_weights(
            linear.weight, bias, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias
        )
        linear.weight = w
        linear.bias = b
        _set_submodule(model, bn_name, nn.Identity())
        report.into_linear[bn_name] = linear_name
    for name, module in list(model.named_modules()):
        if isinstance(module, BATCHNORM_TYPES):
            scale, shift = _bn_scale_shift(module)
            affine = ChannelAffine(scale, shift, 1 if isinstance(module, nn.BatchNorm1d) else -1)
            report.to_affine.append(name)
            if not name:  # the model itself
                return affine, report
            _set_submodule(model, name, affine)
    return model, report
