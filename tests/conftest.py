"""Session-wide settings that must be in place before any test module imports a library."""

from __future__ import annotations

import os

# Triton decorates its own standard library when it is first imported (torch's dynamo can
# import it during ONNX export), so its interpreter must be on before that happens for the
# kernel tests to run on CPU tensors. A machine with a GPU runs them compiled instead.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # pragma: no cover - torch is a core dependency
        pass
