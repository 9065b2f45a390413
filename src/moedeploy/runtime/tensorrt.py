"""TensorRT engines from artifacts, and a TensorRT runner. TensorRT is imported lazily.

TensorRT cannot be installed on machines without NVIDIA's package index and a GPU; every
entry point says so in one line instead of failing on an import deep inside. The build
follows NVIDIA's documented flow: ONNX parser with our Python plugins registered, one
optimisation profile from the manifest's dynamic ranges, a strongly typed network (the
precision is the graph's), PREFER_AOT (engines that run without Python) or PREFER_JIT.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from pathlib import Path

import onnx

from moedeploy.export.artifact import MANIFEST_DIGEST_KEY, Artifact
from moedeploy.runtime.tensorrt_import import (  # noqa: F401 (tensorrt_available: re-exported for callers)
    TensorRTUnavailable,
    require_tensorrt,
    tensorrt_available,
)
from moedeploy.runtime.tensorrt_lowering import lower_for_tensorrt
from moedeploy.utils.io import atomic_write_bytes, atomic_write_json, atomic_write_text

ENGINES_DIR = "engines"


def require_gpu() -> str:
    import torch

    if not torch.cuda.is_available():
        raise TensorRTUnavailable("TensorRT needs an NVIDIA GPU and none is visible (torch.cuda.is_available() is False)")
    return torch.cuda.get_device_name()


#: a plan's build record (<plan>.json) names the artifact it was built from by its manifest's seal
RECORD_DIGEST_KEY = "artifact_manifest_sha256"


def plan_record(plan: Path) -> dict | None:
    """The build record `moedeploy build` writes beside a plan (<plan>.json), or None."""
    import json

    meta = plan.with_suffix(".json")
    try:
        record = json.loads(meta.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def plan_record_problem(artifact: Artifact, plan: Path) -> str | None:
    """Why `plan` cannot be taken for `artifact`'s graph, or None: its build record must name
    this artifact's manifest seal, which covers every file's sha256, so a plan built from
    another artifact, another export of this one or other weights is refused, never run or
    deployed as this one."""
    rebuild = f"build one with `moedeploy build {artifact.path} --aot`"
    if plan.suffix != ".plan":
        return f"{plan} is not a TensorRT plan (.plan); {rebuild}"
    record = plan_record(plan)
    if record is None:
        return (f"{plan} has no build record ({plan.with_suffix('.json').name}) beside it, so nothing ties it to "
                f"{artifact.path}; {rebuild}")
    if (recorded := record.get(RECORD_DIGEST_KEY)) != artifact.manifest[MANIFEST_DIGEST_KEY]:
        if recorded is None:
            why = "its build record, from before plans recorded their artifact, cannot say what it was built from"
        else:
            built = record.get("artifact")
            of = f" (of {built!r})" if isinstance(built, str) and built != artifact.name else ""
            why = (f"its build record names another manifest{of}, sha256 {str(recorded)[:12]}..., where this "
                   f"artifact's is {artifact.manifest[MANIFEST_DIGEST_KEY][:12]}...")
        return f"{plan} was not built from {artifact.path} as it is now: {why}; {rebuild}"
    return None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def engine_name(gpu: str, trt_version: str, dtype: str, aot: bool) -> str:
    """Plans are specific to a GPU and TensorRT version: both are in the file name."""
    return f"{_slug(gpu)}_trt{trt_version}_{dtype}_{'aot' if aot else 'jit'}.plan"


def profile_shapes(artifact: Artifact) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """min/opt/max shape of every input from the manifest's dynamic ranges."""
    ranges = artifact.manifest["dynamic_ranges"]
    shapes = {}
    for spec in artifact.manifest["inputs"]:
        dims = spec["shape"]
        shapes[spec["name"]] = tuple(
            [d if isinstance(d, int) else ranges[d][key] for d in dims] for key in ("min", "opt", "max")
        )
    return shapes


@dataclass
class BuildResult:
    plan: Path
    log: Path
    metadata: Path


def build_engine(
    artifact: Artifact | str,
    aot: bool = True,
    workspace_mb: int | None = None,
    timing_cache: str | Path | None = None,
    experts_on_codes: bool = True,
) -> BuildResult:
    """Parse the artifact with our plugins registered and build a plan under <artifact>/engines/.
    `experts_on_codes=False`: a quantized artifact's experts reach the moe::MoE plugin
    dequantized by TensorRT instead of on their codes through moe::MoENBits (the lowering's
    fallback; the engine then holds float expert weights)."""
    artifact = artifact if isinstance(artifact, Artifact) else Artifact.load(artifact)
    trt = require_tensorrt()
    gpu = require_gpu()
    from moedeploy.plugins.tensorrt_plugins import register_plugins

    register_plugins()
    log_lines: list[str] = []

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity, msg) -> None:
            log_lines.append(f"[{severity.name}] {msg}")

    logger = _Logger()
    builder = trt.Builder(logger)
    flag = trt.NetworkDefinitionCreationFlag
    flags = 1 << int(flag.PREFER_AOT_PYTHON_PLUGINS if aot else flag.PREFER_JIT_PYTHON_PLUGINS)
    if hasattr(flag, "STRONGLY_TYPED"):  # TensorRT 10; always on (and deprecated) in 11
        flags |= 1 << int(flag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    # the artifact's graph through the TensorRT lowering, parsed from memory; the path resolves
    # its external data (the weights, unchanged) against the artifact's folder
    lowered, counts = lower_for_tensorrt(onnx.load(str(artifact.model_path), load_external_data=False),
                                         experts_on_codes)
    if not parser.parse(lowered.SerializeToString(), str(artifact.model_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        fallback = (" (its experts went on their codes: `moedeploy build --experts-dequantized` hands TensorRT "
                    "dequantized experts instead)") if counts["moe_nodes_on_codes"] else ""
        raise RuntimeError(f"TensorRT's ONNX parser rejected {artifact.model_path} as moedeploy's TensorRT lowering "
                           f"rewrote it (runtime/tensorrt_lowering.py){fallback}: {errors}")

    config = builder.create_builder_config()
    if workspace_mb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile_shapes(artifact).items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    cache_path = Path(timing_cache) if timing_cache else None
    if cache_path is not None:
        cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
        config.set_timing_cache(cache, ignore_mismatch=False)

    started = datetime.datetime.now(datetime.timezone.utc)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT failed to build the engine:\n" + "\n".join(log_lines[-20:]))
    engines = artifact.path / ENGINES_DIR
    engines.mkdir(exist_ok=True)
    name = engine_name(gpu, trt.__version__, artifact.dtype, aot)
    plan_path = engines / name
    atomic_write_bytes(plan_path, bytes(plan))
    log_path = plan_path.with_suffix(".log")
    atomic_write_text(log_path, "\n".join(log_lines) + "\n")
    if cache_path is not None:
        atomic_write_bytes(cache_path, bytes(config.get_timing_cache().serialize()))
    meta_path = plan_path.with_suffix(".json")
    atomic_write_json(meta_path, {
        "artifact": artifact.name, "dtype": artifact.dtype, "gpu": gpu, "tensorrt": trt.__version__,
        "aot": aot, RECORD_DIGEST_KEY: artifact.manifest[MANIFEST_DIGEST_KEY],
        "profile": {k: dict(zip(("min", "opt", "max"), v, strict=True)) for k, v in profile_shapes(artifact).items()},
        "workspace_mb": workspace_mb, "built": started.isoformat(timespec="seconds"),
        "build_seconds": (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(),
    })
    return BuildResult(plan_path, log_path, meta_path)


def find_engine(artifact: Artifact) -> Path:
    """The plan built for this GPU, TensorRT version and dtype (AOT preferred)."""
    trt = require_tensorrt()
    gpu = require_gpu()
    problem = None
    for aot in (True, False):
        plan = artifact.path / ENGINES_DIR / engine_name(gpu, trt.__version__, artifact.dtype, aot)
        if plan.is_file() and (problem := plan_record_problem(artifact, plan)) is None:
            return plan
    if problem is not None:  # plans there, none built from this artifact as it is
        raise TensorRTUnavailable(problem)
    raise TensorRTUnavailable(
        f"no TensorRT engine for {gpu} / TensorRT {trt.__version__} under {artifact.path / ENGINES_DIR}; "
        f"build one with `moedeploy build {artifact.path}`"
    )


def trt_runner(artifact: Artifact, name: str = "tensorrt"):
    """Polygraphy's TrtRunner over the artifact's engine (plugins registered for JIT plans)."""
    from polygraphy.backend.common import BytesFromPath
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    from moedeploy.plugins.tensorrt_plugins import register_plugins

    plan = find_engine(artifact)
    register_plugins()  # a JIT plan calls back into Python; an AOT plan needs nothing
    return TrtRunner(EngineFromBytes(BytesFromPath(str(plan))), name=name)
