"""Is TensorRT here? Asked without importing it, torch or ONNX.

Why a module of its own: `build`, `compare --backend trt`, `all --backend trt` and `bench
--backend trt` refuse to start without TensorRT, and importing runtime/tensorrt.py (which
reads artifacts, so imports torch and onnx) to say so took 5-7 s on a 2-core machine. The
command line asks here first; the library's entry points ask the same functions.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

INSTALL_HINT = (
    "TensorRT is not installed: on a machine with an NVIDIA GPU run "
    "`pip install 'moedeploy[gpu]'` (TensorRT >= 10.9 from NVIDIA's index)"
)


class TensorRTUnavailable(RuntimeError):
    """TensorRT (or a GPU for it) is missing; the message says how to get it."""


def tensorrt_available() -> bool:
    """Whether `import tensorrt` can find the package (find_spec looks without importing it)."""
    return importlib.util.find_spec("tensorrt") is not None


def require_installed() -> None:
    """Raise TensorRTUnavailable with the fix unless TensorRT is installed; imports nothing (the
    command line's check before torch: importing TensorRT first would also change the order in
    which the CUDA libraries load)."""
    if not tensorrt_available():
        raise TensorRTUnavailable(INSTALL_HINT)


def require_tensorrt() -> ModuleType:
    """Import and return the tensorrt module, or raise TensorRTUnavailable with the fix."""
    require_installed()
    import tensorrt

    return tensorrt
