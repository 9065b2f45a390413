"""Serving: artifacts on Triton Inference Server (through PyTriton), and model repositories
for a standalone Triton.

    ModelServer       one Triton server for one or more artifacts (KServe v2 HTTP + gRPC,
                      dynamic batching, health, Prometheus metrics)
    write_repository  <repo>/<name>/config.pbtxt + <repo>/<name>/1/model.{onnx,plan}

PyTriton and tritonclient are imported only when a server starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and editors see; at run time `__getattr__` imports on first use
    from moedeploy.serving.server import (
        BACKENDS,
        ModelServer,
        ServeOptions,
        ServingUnavailable,
        wait_for_signal,
    )
    from moedeploy.serving.specs import ModelSpec, ServingError, TensorSpec, served_models

#: public name -> the module that defines it, imported on first use: `moedeploy --help` and
#: the serving commands' option errors need none of torch and ONNX, which server.py imports
_EXPORTS = {
    "BACKENDS": "moedeploy.serving.server",
    "ModelServer": "moedeploy.serving.server",
    "ServeOptions": "moedeploy.serving.server",
    "ServingUnavailable": "moedeploy.serving.server",
    "wait_for_signal": "moedeploy.serving.server",
    "ModelSpec": "moedeploy.serving.specs",
    "ServingError": "moedeploy.serving.specs",
    "TensorSpec": "moedeploy.serving.specs",
    "served_models": "moedeploy.serving.specs",
}

__all__ = [
    "BACKENDS",
    "ModelServer",
    "ModelSpec",
    "ServeOptions",
    "ServingError",
    "ServingUnavailable",
    "TensorSpec",
    "served_models",
    "wait_for_signal",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
