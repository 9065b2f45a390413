"""Triton kernels behind the TensorRT plugins, callable as plain functions on torch tensors.

CUDA tensors run compiled. On a machine without a CUDA GPU, importing this package turns
on Triton's interpreter (TRITON_INTERPRET=1, read when a kernel is decorated, so before
our kernel modules load) and the same kernels run on CPU tensors: that is how CI tests
them. Limits of the interpreter, not of the kernels: it has no bf16 arithmetic or bf16
`tl.dot` (numpy), and it truncates fp32 -> bf16 instead of rounding to nearest.
"""

import os
import sys

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

from moedeploy.plugins.kernels._launch import interpreter_ready
from moedeploy.plugins.kernels.moe import TileConfig, default_config, moe
from moedeploy.plugins.kernels.rmsnorm import rms_norm

__all__ = ["TileConfig", "default_config", "interpreter_ready", "moe", "rms_norm"]
