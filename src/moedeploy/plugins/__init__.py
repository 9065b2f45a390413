"""Custom ops, one module each: eager reference, shape function, ONNX node and function body,
ONNX Runtime lowering (and, in later modules, the TensorRT plugin and its kernels)."""

from __future__ import annotations

from types import ModuleType

from moedeploy.plugins import moe, rmsnorm

#: (domain, op_type) -> the module that holds every facet of that op
CUSTOM_OPS: dict[tuple[str, str], ModuleType] = {
    (rmsnorm.DOMAIN, rmsnorm.OP_TYPE): rmsnorm,
    (moe.DOMAIN, moe.OP_TYPE): moe,
}

__all__ = ["CUSTOM_OPS", "moe", "rmsnorm"]
