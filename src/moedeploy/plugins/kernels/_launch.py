"""Where a kernel can run: compiled on CUDA tensors, interpreted on CPU tensors."""

from __future__ import annotations

import torch


def interpreter_ready() -> bool:
    """True when Triton's interpreter was on when triton itself was first imported."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.zeros, InterpretedFunction)


def check_device(t: torch.Tensor) -> None:
    """A clear error instead of Triton's 'Cannot call @triton.jit'd outside of a kernel'."""
    if t.device.type == "cpu" and not interpreter_ready():
        raise RuntimeError(
            "Triton kernels on CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (or pass CUDA tensors)"
        )
