"""ONNX Runtime sessions from an artifact: provider choice, lowering, thread settings."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnxruntime as ort

from moedeploy.export.artifact import Artifact
from moedeploy.runtime.lowering import MoELowering, lower_for_ort
from moedeploy.utils.io import atomic_write_json

CACHE_DIR = "cache"

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


class SessionError(RuntimeError):
    """The artifact cannot run on the requested ONNX Runtime provider."""


def default_providers() -> list[str]:
    """CUDA first when onnxruntime-gpu is installed (it falls back to CPU per node), else CPU."""
    available = ort.get_available_providers()
    return [CUDA, CPU] if CUDA in available else [CPU]


@dataclass
class LoweredSession:
    """An InferenceSession plus what lowering did to the graph it runs."""

    session: ort.InferenceSession
    provider: str
    lowering: dict[str, int] = field(default_factory=dict)

    def run(self, feed: dict, output_names: list[str] | None = None) -> list:
        return self.session.run(output_names, feed)


def session_options(threads: int | None = None, profile: bool = False) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.enable_profiling = profile
    options.log_severity_level = 3  # unused-initializer warnings after lowering are expected
    return options


def create_session(
    artifact: Artifact | str,
    providers: list[str] | None = None,
    moe_lowering: MoELowering = "auto",
    threads: int | None = None,
    profile: bool = False,
) -> LoweredSession:
    """A session over the artifact's graph with the custom ops lowered for its first provider."""
    if not isinstance(artifact, Artifact):
        artifact = Artifact.load(artifact)
    providers = providers or default_providers()
    unknown = [p for p in providers if p not in ort.get_available_providers()]
    if unknown:
        raise SessionError(
            f"ONNX Runtime provider {unknown[0]} is not available here "
            f"(available: {', '.join(ort.get_available_providers())}); for CUDA install moedeploy[gpu]"
        )
    provider = providers[0]
    if artifact.dtype == "bf16" and provider == CPU:
        raise SessionError(
            "ONNX Runtime's CPU provider has no bfloat16 kernels for these graphs; run bf16 "
            "artifacts on TensorRT or CUDA, or export with --dtype fp32/fp16"
        )
    try:
        model, counts = lowered_model_path(artifact, provider, moe_lowering)
        model = str(model)
    except OSError:  # a read-only artifact: the cache is an optimisation, never a requirement
        lowered, counts = lower_for_ort(onnx.load(str(artifact.model_path)), provider, moe_lowering)
        model = lowered.SerializeToString()
        del lowered
    try:
        session = ort.InferenceSession(model, session_options(threads, profile), providers=providers)
    except Exception as e:  # onnxruntime raises its own exception types
        raise SessionError(f"ONNX Runtime could not load {artifact.model_path}: {e}") from e
    del model
    release_freed_memory()
    return LoweredSession(session, provider, counts)


def lowered_model_path(artifact: Artifact, provider: str, moe_lowering: MoELowering) -> tuple[Path, dict[str, int]]:
    """The lowered graph as a file with its weights in external data, made once per artifact.

    ONNX Runtime memory-maps external initializers it loads from a path, where a model given
    as bytes is parsed and copied: on the small decoder the session's resident memory is
    half. The file lives in <artifact>/cache/, named by the model's sha256 and the lowering,
    so a re-exported model never meets a stale cache; deleting the folder is always safe.
    """
    digest = artifact.manifest.get("files", {}).get("model.onnx", "unsigned")[:16]
    name = f"ort_{provider.removesuffix('ExecutionProvider').lower()}_{moe_lowering}_{digest}"
    folder = artifact.path / CACHE_DIR
    path, counts_file = folder / f"{name}.onnx", folder / f"{name}.json"
    if path.is_file() and counts_file.is_file():
        return path, json.loads(counts_file.read_text())
    model = onnx.load(str(artifact.model_path))
    lowered, counts = lower_for_ort(model, provider, moe_lowering)
    del model
    folder.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # complete files appear, or none
        staged = Path(tmp) / path.name
        onnx.save_model(lowered, str(staged), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{name}.onnx.data", size_threshold=1024)
        data = Path(tmp) / f"{name}.onnx.data"
        if data.exists():  # absent when every tensor is under the threshold
            os.replace(data, folder / data.name)
        os.replace(staged, path)
    atomic_write_json(counts_file, counts)
    del lowered
    return path, counts


def release_freed_memory() -> None:
    """Hand the heap freed by the model protos (three copies of the weights on the way in)
    back to the OS, so the process keeps only ONNX Runtime's own copy resident."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
