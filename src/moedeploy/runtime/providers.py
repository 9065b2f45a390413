"""ONNX Runtime's providers on this machine and the dtypes they run, without torch.

Why a module of its own: session creation, `compare`, `all` and `bench` ask the same rule
before any work, and the command line asks it before importing torch (seconds on a small
machine); runtime/ort.py re-exports it.
"""

from __future__ import annotations

import onnxruntime as ort

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


def dtype_unsupported(dtype: str, provider: str) -> str | None:
    """Why ONNX Runtime cannot run an artifact of `dtype` on `provider`, or None when it can.

    The one rule that session creation, `compare`/`all` and `bench` all ask before any work.
    """
    if dtype == "bf16" and provider == CPU:
        return "ONNX Runtime's CPU provider has no bfloat16 kernels"
    return None


def default_providers() -> list[str]:
    """CUDA first when onnxruntime-gpu is installed (it falls back to CPU per node), else CPU."""
    available = ort.get_available_providers()
    return [CUDA, CPU] if CUDA in available else [CPU]
