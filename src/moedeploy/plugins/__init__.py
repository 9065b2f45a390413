"""Custom ops, one module each: eager reference, shape function, ONNX node and function body,
ONNX Runtime lowering (and, in later modules, the TensorRT plugin and its kernels).

CUSTOM_OPS loads the op modules on first use (PEP 562), as moedeploy.models' names do: they
import torch, and `moedeploy version` asks the torch-free `moedeploy.plugins.native` whether
its kernel is built, which imports this package first."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["CUSTOM_OPS", "moe", "rmsnorm"]


def _custom_ops() -> dict[tuple[str, str], ModuleType]:
    """(domain, op_type) -> the module that holds every facet of that op."""
    ops = [importlib.import_module(f"moedeploy.plugins.{name}") for name in ("rmsnorm", "moe")]
    return {(op.DOMAIN, op.OP_TYPE): op for op in ops}


def __getattr__(name: str) -> Any:
    if name == "CUSTOM_OPS":
        value: Any = _custom_ops()
    elif name in ("moe", "rmsnorm"):
        value = importlib.import_module(f"moedeploy.plugins.{name}")
    else:
        raise AttributeError(f"module 'moedeploy.plugins' has no attribute {name!r}")
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
