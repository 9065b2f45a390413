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


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`'s worker count: one more than the cores on a machine of 4 or fewer, so that a
    worker waiting on a server or a subprocess leaves no core idle. On 2 cores the serving and
    compare tests took 208 s with 3 workers against 235 s with 2 (session 21); more cores need
    no extra worker."""
    cores = os.cpu_count() or 1
    return cores + 1 if cores <= 4 else cores
