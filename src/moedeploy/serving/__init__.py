"""Serving: artifacts on Triton Inference Server (through PyTriton), and model repositories
for a standalone Triton.

    ModelServer       one Triton server for one or more artifacts (KServe v2 HTTP + gRPC,
                      dynamic batching, health, Prometheus metrics)
    write_repository  <repo>/<name>/config.pbtxt + <repo>/<name>/1/model.{onnx,plan}

PyTriton and tritonclient are imported only when a server starts.
"""

from moedeploy.serving.server import (
    BACKENDS,
    ModelServer,
    ServeOptions,
    ServingUnavailable,
    wait_for_signal,
)
from moedeploy.serving.specs import ModelSpec, ServingError, TensorSpec, served_models

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
