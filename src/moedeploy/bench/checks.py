"""Can every requested backend run here? Asked before any export or timing.

A backend that cannot run would otherwise fail in its worker process only after the
machine was measured and the preset exported (minutes on a small CPU); these checks cost
a file-system look-up each, and each failure names the install command or the step that
is missing.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moedeploy.export.artifact import Artifact

#: ort-gqa: ONNX Runtime with the decoder's attention on com.microsoft::GroupQueryAttention and the
#: KV cache appended to in place (OrtDecoder(kv_cache="inplace"));
#: ort-gqa-experts: ort-gqa with every fp32 MoE on one If per expert (plugins/moe_experts.py, the
#: default before the experts were cut into one piece per thread on com.microsoft::MoE);
#: ort-contrib: with every MoE on com.microsoft::MoE (each expert cut into one piece per thread
#: where plugins/moe_split takes it): so one run shows what each lowering buys on this machine
#: llama.cpp, openvino: peer engines on the same weights (moedeploy.bench.peers)
BACKENDS = ("torch", "torch-compile", "hf", "ort", "ort-gqa", "ort-gqa-experts", "ort-contrib", "trt", "llama.cpp", "openvino")
TRANSFORMERS_HINT = "pip install 'transformers>=4.46' (or pip install 'moedeploy[dev]')"
#: the peer engines (moedeploy.bench.peers), what each imports and how to install it
PEERS = ("llama.cpp", "openvino")
INSTALL = {"llama.cpp": "pip install 'moedeploy[peers]' (llama-cpp-python and gguf)",
           "openvino": "pip install 'moedeploy[peers]' (openvino)"}
_MODULES = {"llama.cpp": ("llama_cpp", "gguf"), "openvino": ("openvino",)}


def parse_backends(names: Iterable[str]) -> list[str]:
    """The requested backends in order; an empty list, an unknown name or a repeat is an error."""
    backends = list(names)
    if not backends:
        raise ValueError(f"--backend needs at least one of: {', '.join(BACKENDS)}")
    for name in backends:
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r} in --backend; choose from: {', '.join(BACKENDS)}")
        if backends.count(name) > 1:
            raise ValueError(f"backend {name!r} is listed twice in --backend")
    return backends


def missing(peer: str) -> str | None:
    """Why `peer` cannot run here (its packages are absent), else None; nothing is imported."""
    absent = [m for m in _MODULES[peer] if importlib.util.find_spec(m) is None]
    if absent:
        return f"backend {peer!r} needs {', '.join(absent)}, which is not installed: {INSTALL[peer]}"
    return None


def require_transformers() -> None:
    """`hf` runs transformers' Mixtral; find_spec looks for the package without importing it."""
    if importlib.util.find_spec("transformers") is None:
        raise ValueError(f"backend 'hf' needs Hugging Face transformers, which is not installed: {TRANSFORMERS_HINT}")


def require_torch_compile() -> None:
    """`torch-compile` needs TorchDynamo on this Python and a C++ compiler for Inductor's CPU code.

    The compiler is looked up by torch's own rule (the CXX variable, else g++), so this
    check and the worker that compiles agree.
    """
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise ValueError("backend 'torch-compile': torch.compile does not support this Python or platform; "
                         "bench the other backends, or use a Python that your torch version's torch.compile supports")
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as e:  # torch raises InvalidCxxCompiler (and, on odd setups, others)
        raise ValueError("backend 'torch-compile' needs a C++ compiler for TorchInductor's CPU kernels and none was "
                         "found (the CXX variable, else g++): install one (e.g. `apt-get install g++`) "
                         f"or set CXX ({type(e).__name__})") from None


def require_tensorrt_installed() -> None:
    """`trt` needs TensorRT: found without importing it (the command line's check before torch)."""
    from moedeploy.runtime.tensorrt_import import TensorRTUnavailable, require_installed

    try:
        require_installed()
    except TensorRTUnavailable as e:
        raise TensorRTUnavailable(f"backend 'trt': {e}") from None


def require_tensorrt_gpu() -> None:
    """`trt` needs TensorRT and a visible NVIDIA GPU (the messages carry the install command)."""
    from moedeploy.runtime.tensorrt import TensorRTUnavailable, require_gpu, require_tensorrt

    try:
        require_tensorrt()
        require_gpu()
    except TensorRTUnavailable as e:
        raise TensorRTUnavailable(f"backend 'trt': {e}") from None


def require_peer(name: str) -> None:
    if reason := missing(name):
        raise ValueError(reason)


def require_installed(backends: Iterable[str]) -> list[str]:
    """The requested backends, parsed, whose packages are all installed: the checks that import
    nothing (find_spec only), which the command line makes before importing torch."""
    checks = {"hf": require_transformers, "trt": require_tensorrt_installed,
              "llama.cpp": lambda: require_peer("llama.cpp"), "openvino": lambda: require_peer("openvino")}
    parsed = parse_backends(backends)
    for name in parsed:
        if name in checks:
            checks[name]()
    return parsed


def require_backends(backends: Iterable[str]) -> list[str]:
    """Every requested backend is known and its packages (and, for trt, GPU; for torch-compile,
    a C++ compiler) are here."""
    parsed = require_installed(backends)
    if "torch-compile" in parsed:
        require_torch_compile()
    if "trt" in parsed:
        require_tensorrt_gpu()
    return parsed


def require_engine(artifact: Artifact | None, target: str) -> None:
    """`trt` times a built engine: the artifact must have one for this GPU and TensorRT version."""
    from moedeploy.runtime.tensorrt import TensorRTUnavailable, find_engine

    if artifact is None:  # a preset not exported yet cannot have an engine
        raise TensorRTUnavailable(
            f"backend 'trt' needs a TensorRT engine: `moedeploy export decoder --preset {target} --out artifacts/dec`, "
            "`moedeploy build artifacts/dec`, then `moedeploy bench artifacts/dec --backend trt`"
        )
    try:
        find_engine(artifact)
    except TensorRTUnavailable as e:
        raise TensorRTUnavailable(f"backend 'trt': {e}") from None


def require_ort_dtype(artifact: Artifact | None) -> None:
    """ONNX Runtime's CPU provider has no bf16 kernels; say so before timing anything."""
    from moedeploy.runtime.ort import default_providers, dtype_unsupported

    if artifact is not None and (reason := dtype_unsupported(artifact.dtype, default_providers()[0])):
        raise ValueError(f"backend 'ort': {artifact.path} is {artifact.dtype} and {reason}; "
                         "bench an fp32 or fp16 export on ort, or bf16 on trt")
