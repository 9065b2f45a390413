"""`moedeploy all`'s refusals of its --backend list and --dtype that need neither torch nor an export.

Why a module of its own: the command line makes these checks before importing torch (seconds
on a small machine), and run_all makes the same ones for callers of the library.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from moedeploy.names import DECODER, DECODER_ONLY_BACKENDS
from moedeploy.runtime.tensorrt_import import TensorRTUnavailable, require_installed

#: how `all` starts its refusal of --backend trt (no TensorRT here, or no GPU: compare/suite.py)
TRT_STOPS = "moedeploy all --backend trt stops before exporting"


def all_backends_problem(backends: Sequence[str], targets: Sequence[str]) -> str | None:
    """Why `moedeploy all` cannot compare `targets` on `backends` (one line), or None: TensorRT
    is named and not installed (else every target would be exported, then fail to build), or
    every backend named runs the decoder only and a block is among the targets."""
    if "trt" in backends:
        try:
            require_installed()
        except TensorRTUnavailable as e:
            return f"{TRT_STOPS}: {e}"
    if any(t != DECODER for t in targets) and backends and all(b in DECODER_ONLY_BACKENDS for b in backends):
        return (f"--backend {','.join(backends)} runs the decoder only, and the blocks need a backend too; "
                f"add ort (--backend ort,{','.join(backends)})")
    return None


def not_runnable_here(dtype: str, backends: Iterable[str], unsigned_codes: bool = False) -> str | None:
    """Why `backends` cannot run `dtype` graphs on this machine, or None when they can.

    ONNX Runtime's CPU provider has no bfloat16 kernels (runtime/ort.py refuses such a
    session). Saying so before any work replaces a Polygraphy traceback in `compare` and 15
    failed rows in `moedeploy all`. `unsigned_codes` (an --asymmetric quantized export):
    TensorRT takes none either, so it is not offered.
    """
    # ONNX Runtime's providers, not torch
    from moedeploy.runtime.providers import default_providers, dtype_unsupported

    on_ort = [b for b in backends if b.startswith("ort")]
    if on_ort and (reason := dtype_unsupported(dtype, default_providers()[0])):
        elsewhere = "" if unsigned_codes else "compare them with --backend trt on a GPU, or "
        return (f"{reason}, so {dtype} graphs do not run on --backend {on_ort[0]} on this machine; "
                f"{elsewhere}export with --dtype fp32 or fp16")
    return None
