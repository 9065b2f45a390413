"""Every backend behind Polygraphy's BaseRunner, so compare, bench and serve take any of them.

  torch   our eager runner (Polygraphy's PytRunner calls the module with no arguments and
          casts with its own DataType, see DESIGN.md): the artifact's reference module
  ort     Polygraphy's OnnxrtRunner over our lowered ONNX Runtime session
  trt     Polygraphy's TrtRunner over an engine built with our plugins (when TensorRT exists)
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata
from polygraphy.datatype import DataType

from moedeploy.export.artifact import Artifact, to_numpy
from moedeploy.export.decoder import past_names
from moedeploy.export.reference import load_reference

#: ort-contrib / ort-experts / ort-gqa / ort-skipnorm: ONNX Runtime on another lowering than the
#: default (every MoE on com.microsoft::MoE; every fp32 MoE on one If per expert; a decoder's
#: attention on GroupQueryAttention; residual + RMSNorm on SkipSimplifiedLayerNormalization), so
#: `compare` checks each lowering against eager PyTorch
ORT_LOWERINGS: dict[str, dict[str, str]] = {
    "ort": {},
    "ort-contrib": {"moe_lowering": "contrib"},
    "ort-experts": {"moe_lowering": "experts"},
    "ort-gqa": {"attention_lowering": "gqa"},
    "ort-skipnorm": {"norm_lowering": "skip"},
}
BACKENDS = ("torch", *ORT_LOWERINGS, "trt")
#: lowerings of a decoder's attention and residual norms: nothing to lower in a block
DECODER_ONLY = ("ort-gqa", "ort-skipnorm")
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}


def _flatten(outputs) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    return [t for item in outputs for t in _flatten(item)]


class TorchRunner(BaseRunner):
    """Runs an artifact's eager PyTorch reference on feed dicts keyed by the graph's input names."""

    def __init__(self, artifact: Artifact, name: str = "torch-eager", module_loader: Callable[[], torch.nn.Module] | None = None) -> None:
        super().__init__(name=name, prefix="torch-runner")
        self.artifact = artifact
        self._loader = module_loader or (lambda: load_reference(artifact))
        self.module: torch.nn.Module | None = None

    def activate_impl(self) -> None:
        self.module = self._loader()

    def deactivate_impl(self) -> None:
        self.module = None

    def get_input_metadata_impl(self) -> TensorMetadata:
        meta = TensorMetadata()
        for spec in self.artifact.manifest["inputs"]:
            dims = [d if isinstance(d, int) else -1 for d in spec["shape"]]
            dtype = DataType.BFLOAT16 if spec["dtype"] == "bfloat16" else DataType.from_dtype(np.dtype(spec["dtype"]))
            meta.add(spec["name"], dtype, dims)
        return meta

    def _to_torch(self, name: str, array: np.ndarray) -> torch.Tensor:
        spec = next(i for i in self.artifact.manifest["inputs"] if i["name"] == name)
        return torch.from_numpy(np.ascontiguousarray(array)).to(_TORCH_DTYPES[spec["dtype"]])

    def infer_impl(self, feed_dict: dict[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        inputs = {name: self._to_torch(name, feed_dict[name]) for name in self.artifact.input_names()}
        start = time.perf_counter()
        with torch.inference_mode():
            if self.artifact.kind == "decoder":
                n = self.artifact.manifest["config"]["n_layers"]
                kv = [inputs[name] for name in past_names(n)]
                outputs = self.module(inputs["input_ids"], list(zip(kv[0::2], kv[1::2], strict=True)))
            else:
                outputs = self.module(*inputs.values())
        self.inference_time = time.perf_counter() - start
        tensors = _flatten(outputs)
        return OrderedDict((name, to_numpy(t)) for name, t in zip(self.artifact.output_names(), tensors, strict=True))


def ort_runner(artifact: Artifact, moe_lowering: str = "auto", threads: int | None = None, name: str = "onnxrt",
               attention_lowering: str = "graph", norm_lowering: str = "native", prepack: bool = True,
               nbits_accuracy: int = 0):
    """Polygraphy's OnnxrtRunner over a lowered session (created lazily at activation);
    prepack=False: the session shares the artifact's memory-mapped weights (runtime/ort.py);
    nbits_accuracy: a quantized artifact's MatMulNBits/QMoE level (0: what compare checks).

    The runner's `lowering` dict is filled when the session is made: what the custom ops were
    lowered to (com.microsoft::MoE or the function body), so a report can say which path ran.
    """
    from polygraphy.backend.onnxrt import OnnxrtRunner

    from moedeploy.runtime.ort import create_session

    lowering: dict[str, int] = {}

    def session():
        lowered = create_session(artifact, moe_lowering=moe_lowering, threads=threads,
                                 attention_lowering=attention_lowering, norm_lowering=norm_lowering, prepack=prepack,
                                 nbits_accuracy=nbits_accuracy)
        lowering.clear()
        lowering.update(lowered.lowering)
        return lowered.session

    runner = OnnxrtRunner(session, name=name)
    runner.lowering = lowering
    return runner


def lowering_text(lowering: dict[str, int]) -> str | None:
    """One line on which path the custom ops took on ONNX Runtime, or None when there were none."""
    parts = []
    qmoe = lowering.get("moe_qmoe", 0)
    on = "com.microsoft::QMoE over the quantized bytes" if qmoe else "com.microsoft::MoE"
    if qmoe and qmoe != lowering.get("moe_contrib", 0) + lowering.get("moe_routed", 0):
        on = f"com.microsoft::MoE or QMoE ({qmoe} over quantized bytes)"
    if lowering.get("moe_contrib"):
        parts.append(f"{lowering['moe_contrib']} moe::MoE on {on} (fast path)")
    if lowering.get("moe_routed"):
        parts.append(f"{lowering['moe_routed']} moe::MoE on {on}, routed on graph ops (fast path)")
    if lowering.get("matmul_nbits"):
        parts.append(f"{lowering['matmul_nbits']} quantized Linear(s) on com.microsoft::MatMulNBits")
    if lowering.get("moe_split"):
        parts.append(f"{lowering['moe_split']} moe::MoE on com.microsoft::MoE, each expert cut into one piece "
                     "per thread (fast path)")
    if lowering.get("moe_experts"):
        parts.append(f"{lowering['moe_experts']} moe::MoE on one If per expert over prepacked Gemms (fast path)")
    if lowering.get("moe_native"):
        parts.append(f"{lowering['moe_native']} moe::MoE on moedeploy.cpu::MoEExperts (the native kernel, fast path)")
    if lowering.get("moe_function"):
        parts.append(f"{lowering['moe_function']} moe::MoE on the standard-op function body")
    if lowering.get("rmsnorm_native"):
        parts.append(f"{lowering['rmsnorm_native']} moe::RMSNorm on RMSNormalization-23")
    if lowering.get("rmsnorm_skip"):
        parts.append(f"{lowering['rmsnorm_skip']} residual Add + moe::RMSNorm on SkipSimplifiedLayerNormalization")
    if lowering.get("rmsnorm_function"):
        parts.append(f"{lowering['rmsnorm_function']} moe::RMSNorm on the function body")
    if lowering.get("attention_gqa"):
        parts.append(f"{lowering['attention_gqa']} attention on com.microsoft::GroupQueryAttention")
    if lowering.get("attention_graph"):
        parts.append(f"{lowering['attention_graph']} attention on the traced graph")
    return "; ".join(parts) or None


def make_runner(backend: str, artifact: Artifact, prepack: bool = True, nbits_accuracy: int = 0) -> BaseRunner:
    """The runner for one backend name (torch, ort, trt); prepack=False: an ONNX Runtime session
    over the artifact's shared memory-mapped weights; nbits_accuracy: its level for a quantized
    artifact (0, compare's elementwise check; serving runs at RUN_ACCURACY). The other backends
    ignore both."""
    if backend == "torch":
        return TorchRunner(artifact)
    if backend in ORT_LOWERINGS:  # onnxrt, onnxrt-gqa, ...: the report's name for each
        return ort_runner(artifact, name="onnxrt" + backend.removeprefix("ort"), prepack=prepack,
                          nbits_accuracy=nbits_accuracy, **ORT_LOWERINGS[backend])
    if backend == "trt":
        from moedeploy.runtime.tensorrt import trt_runner

        return trt_runner(artifact)
    raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
