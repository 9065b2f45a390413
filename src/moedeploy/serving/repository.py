"""A Triton model repository for a standalone server: `<repo>/<name>/{config.pbtxt, 1/model.*}`.

  onnxruntime  the artifact's model.onnx as it is (every custom node carries a standard-op
               function body, so any ONNX Runtime that implements its opset runs it)
  tensorrt     an AOT plan from `moedeploy build --aot`: the plugin kernels are compiled into
               the plan, so Triton's TensorRT backend needs no Python and no plugin library.
               A JIT plan calls back into Python and cannot run there. Extra plugin
               libraries (`--plugin-lib`) are copied beside the model and loaded with
               `--backend-config=tensorrt,plugins=<a.so;b.so>`.

The config is written by hand from the same specs the PyTriton server uses (dims without
the batch dim, dynamic batching along dim 0); tests parse it with tritonclient's
`model_config_pb2`. Only the model folder is replaced (atomically): a repository may hold
models of other artifacts.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from moedeploy.export.artifact import MODEL_DATA_FILE, MODEL_FILE, Artifact, model_name_problem
from moedeploy.runtime.tensorrt import plan_record, plan_record_problem
from moedeploy.serving.specs import (
    ModelSpec,
    ServingError,
    TensorSpec,
    default_max_batch_size,
    graph_model,
)
from moedeploy.utils.io import atomic_directory, few_names

REPO_BACKENDS = ("onnxruntime", "tensorrt")
KINDS = {"auto": "KIND_AUTO", "cpu": "KIND_CPU", "gpu": "KIND_GPU"}
VERSION = "1"
PLAN_FILE = "model.plan"
CONFIG_FILE = "config.pbtxt"
PLUGINS_DIR = "plugins"
#: First line of every config.pbtxt moedeploy writes: the model folders it may replace carry it.
CONFIG_MARKER = "# written by `moedeploy triton-repo`; the next run replaces this model folder"


@dataclass
class RepositoryOptions:
    backend: str = "onnxruntime"
    max_batch_size: int | None = None  # None: the manifest's batch max (capped by the plan's profile)
    max_queue_delay_us: int = 100
    dynamic_batching: bool = True
    instances: int = 1
    kind: str = "auto"  # instance kind; TensorRT plans always run on the GPU
    engine: Path | None = None  # which plan, when the artifact holds several
    plugin_libs: list[Path] = field(default_factory=list)


@dataclass
class RepositoryResult:
    model_dir: Path
    config: Path
    model_file: Path
    launch: str  # the tritonserver command line for this repository


def _quote(text: str) -> str:
    return json.dumps(text)  # protobuf text format reads JSON's escapes of ASCII names


def _tensor_block(tensors: tuple[TensorSpec, ...]) -> list[str]:
    lines = []
    for i, t in enumerate(tensors):
        dims = ", ".join(str(d) for d in t.dims)
        lines += ["  {", f"    name: {_quote(t.name)}", f"    data_type: {t.triton_dtype}", f"    dims: [ {dims} ]"]
        if t.optional:
            lines.append("    optional: true")
        lines.append("  }," if i < len(tensors) - 1 else "  }")
    return lines


def config_text(
    spec: ModelSpec, backend: str, options: RepositoryOptions, kind: str, model_file: str
) -> str:
    """config.pbtxt in protobuf text format (the ModelConfig message of Triton's model_config.proto)."""
    engine = 'platform: "tensorrt_plan"' if backend == "tensorrt" else 'backend: "onnxruntime"'
    lines = [CONFIG_MARKER, f"name: {_quote(spec.name)}", engine, f"max_batch_size: {spec.max_batch_size}",
             f"default_model_filename: {_quote(model_file)}", "input ["]
    lines += [*_tensor_block(spec.inputs), "]", "output [", *_tensor_block(spec.outputs), "]"]
    if options.dynamic_batching:
        lines += ["dynamic_batching {", f"  max_queue_delay_microseconds: {options.max_queue_delay_us}", "}"]
    lines += ["instance_group [", "  {", f"    count: {options.instances}", f"    kind: {kind}", "  }", "]"]
    return "\n".join(lines) + "\n"


def _plan_metadata(plan: Path) -> dict:
    return plan_record(plan) or {}


def find_aot_plan(artifact: Artifact, engine: Path | None = None) -> tuple[Path, dict]:
    """The plan to deploy and its build metadata, without importing TensorRT (no GPU needed here).
    A plan is taken only with a build record naming this artifact (`plan_record_problem`)."""
    build_hint = f"build one on the target GPU with `moedeploy build {artifact.path} --aot`"
    if engine is not None:
        if not engine.is_file():
            raise ServingError(f"TensorRT plan {engine} does not exist; {build_hint}")
        candidates = [engine]
    else:
        candidates = [_inside(artifact, p) for p in sorted((artifact.path / "engines").glob("*.plan"))]
        candidates = [p for p in candidates if _plan_metadata(p).get("dtype", artifact.dtype) == artifact.dtype]
    problems = {p: problem for p in candidates if (problem := plan_record_problem(artifact, p))}
    if problems and (engine is not None or len(problems) == len(candidates)):  # none left to choose from
        raise ServingError(next(iter(problems.values())))
    candidates = [p for p in candidates if p not in problems]  # plans of earlier exports stay out of the choice
    aot = [p for p in candidates if _plan_metadata(p).get("aot", p.stem.endswith("_aot"))]
    if not aot:
        if candidates:
            raise ServingError(
                f"{candidates[0].name} is a JIT plan: its plugins call back into Python, which Triton's TensorRT "
                f"backend does not have; {build_hint}"
            )
        raise ServingError(f"no TensorRT plan for {artifact.dtype} under {artifact.path / 'engines'}; {build_hint}")
    if len(aot) > 1:
        names = ", ".join(p.name for p in aot)
        raise ServingError(f"{artifact.path / 'engines'} holds several AOT plans ({names}); choose one with --engine")
    return aot[0], _plan_metadata(aot[0])


def _is_shared_library(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


def _inside(artifact: Artifact, plan: Path) -> Path:
    """A plan found in the artifact's engines/ folder, refused when a symlink leads out of it:
    the repository gets copies of the artifact's files, never of one elsewhere."""
    if artifact.resolve_inside(plan.relative_to(artifact.path).as_posix()) is None:
        raise ServingError(
            f"{plan} leads to {plan.resolve()}, outside the artifact; build the plan into it with "
            f"`moedeploy build {artifact.path} --aot`, or name a plan with --engine"
        )
    return plan


def _profile_max_batch(meta: dict) -> int | None:
    """The largest batch every input's optimisation profile allows (dim 0 of its max shape)."""
    maxima = [shapes["max"][0] for shapes in meta.get("profile", {}).values() if shapes.get("max")]
    return min(maxima) if maxima else None


def is_repository_model(model_dir: Path) -> bool:
    """A model folder `write_repository` wrote (`_has_marker`) holding nothing else
    (`repository_strangers`): the one kind of folder it replaces."""
    return _has_marker(model_dir) and not repository_strangers(model_dir)


def _has_marker(model_dir: Path) -> bool:
    """Its config.pbtxt starts with the line every config.pbtxt moedeploy writes starts with."""
    try:
        with (model_dir / CONFIG_FILE).open() as f:
            return f.readline().rstrip("\n") == CONFIG_MARKER
    except (OSError, UnicodeDecodeError):
        return False


def repository_strangers(model_dir: Path) -> list[str]:
    """What in a model folder `write_repository` did not write: anything but config.pbtxt, the
    version folder's model files and the plugins folder's files. Replacing the folder would
    delete them (another version folder of the user's, notes)."""
    strangers = []
    for entry in sorted(model_dir.iterdir()):
        if entry.name == CONFIG_FILE and entry.is_file():
            continue
        if entry.name in (VERSION, PLUGINS_DIR) and entry.is_dir() and not entry.is_symlink():
            mine = (MODEL_FILE, MODEL_DATA_FILE, PLAN_FILE) if entry.name == VERSION else None
            strangers += [f"{entry.name}/{f.name}" for f in sorted(entry.iterdir())
                          if f.is_symlink() or not f.is_file() or (mine is not None and f.name not in mine)]
            continue
        strangers.append(entry.name)
    return strangers


def write_repository(
    artifact: Artifact | str | Path, out: str | Path, options: RepositoryOptions | None = None, *, force: bool = False
) -> RepositoryResult:
    """Write (or replace) `<out>/<artifact name>/` for a standalone Triton Inference Server.

    An existing model folder of that name is replaced only when moedeploy wrote it (or `force`).
    """
    artifact = artifact if isinstance(artifact, Artifact) else Artifact.load(artifact)
    options = options or RepositoryOptions()
    if options.backend not in REPO_BACKENDS:
        raise ServingError(f"unknown backend {options.backend!r}; choose from: {', '.join(REPO_BACKENDS)}")
    if options.kind not in KINDS:
        raise ServingError(f"unknown instance kind {options.kind!r}; choose from: {', '.join(KINDS)}")
    if options.instances < 1:
        raise ServingError(f"--instances must be >= 1, got {options.instances}")
    if options.max_queue_delay_us < 0:
        raise ServingError(f"--max-queue-delay-us must be >= 0, got {options.max_queue_delay_us}")
    for i, lib in enumerate(options.plugin_libs):
        if not lib.is_file():
            raise ServingError(f"plugin library {lib} does not exist")
        if not _is_shared_library(lib):
            raise ServingError(f"plugin library {lib} is not a shared library (no ELF header); name the .so your "
                               "TensorRT plugins are built into")
        if same := [o for o in options.plugin_libs[:i] if o.name == lib.name]:  # both would be plugins/<name>
            if same[0].resolve() == lib.resolve():
                raise ServingError(f"plugin library {lib} is named twice in --plugin-lib; name it once")
            raise ServingError(f"plugin libraries {same[0]} and {lib} have the same file name, and the model folder "
                               "holds one file of a name; rename one")
    if options.plugin_libs and options.backend != "tensorrt":
        raise ServingError("--plugin-lib is for TensorRT plans; the onnxruntime backend loads no plugins")
    if options.engine is not None and options.backend != "tensorrt":
        raise ServingError("--engine picks a TensorRT plan; the onnxruntime backend serves model.onnx "
                           "(add --backend tensorrt to deploy the plan)")

    kind = KINDS[options.kind]
    max_batch = options.max_batch_size
    if options.backend == "tensorrt":
        if options.kind == "cpu":
            raise ServingError("TensorRT plans run on the GPU; use --kind gpu or auto")
        kind = KINDS["gpu"]
        plan, meta = find_aot_plan(artifact, options.engine)
        limit = _profile_max_batch(meta)
        if max_batch is None:
            max_batch = min(default_max_batch_size(artifact), limit or default_max_batch_size(artifact))
        elif limit is not None and max_batch > limit:
            raise ServingError(f"--max-batch-size {max_batch} exceeds the plan's optimisation profile (batch <= {limit})")
        sources, model_file = [(plan, PLAN_FILE)], PLAN_FILE
    else:
        if max_batch is not None and max_batch > (most := default_max_batch_size(artifact)):
            # moedeploy serve holds requests to the same range: past it nothing was exported or compared
            raise ServingError(f"--max-batch-size {max_batch} exceeds the artifact's batch range (at most {most}, "
                               "the range it was exported and compared for); choose at most that")
        # exactly the files the manifest hashed (Artifact.load checked they lie inside the folder)
        sources = [(artifact.check_inside(name), name) for name in artifact.model_files()]
        model_file = MODEL_FILE
    spec = graph_model(artifact, max_batch)
    if problem := model_name_problem(spec.name):  # the name becomes a folder under `out`
        raise ServingError(f"{artifact.path}: {problem}; re-export the artifact")

    out = Path(out)
    model_dir = out / spec.name
    if model_dir.resolve() == artifact.path.resolve() or model_dir.resolve() in artifact.path.resolve().parents:
        raise ServingError(f"the model folder {model_dir} {'is' if model_dir.resolve() == artifact.path.resolve() else 'holds'} "
                           f"the artifact {artifact.path} it would be made from, and writing it replaces the folder: "
                           "choose another --out")
    if not force and model_dir.is_dir() and not model_dir.is_symlink() and _has_marker(model_dir) \
            and (strangers := repository_strangers(model_dir)):
        raise ServingError(f"{model_dir} is a model folder moedeploy wrote, but it also holds {few_names(strangers)}, "
                           "which moedeploy did not write and would delete; move it out, choose another --out, or "
                           "pass --force")
    with atomic_directory(model_dir, owned=is_repository_model, force=force) as tmp:
        (tmp / VERSION).mkdir()
        for src, name in sources:
            shutil.copyfile(src, tmp / VERSION / name)
        if options.plugin_libs:
            (tmp / PLUGINS_DIR).mkdir()
            for lib in options.plugin_libs:
                shutil.copyfile(lib, tmp / PLUGINS_DIR / lib.name)
        (tmp / CONFIG_FILE).write_text(config_text(spec, options.backend, options, kind, model_file))

    # a shell command to paste: each argument quoted where a path has spaces or quotes
    launch = f"tritonserver {shlex.quote(f'--model-repository={out.resolve()}')}"
    if options.plugin_libs:
        libs = ";".join(str((model_dir / PLUGINS_DIR / lib.name).resolve()) for lib in options.plugin_libs)
        launch += f" {shlex.quote(f'--backend-config=tensorrt,plugins={libs}')}"
    return RepositoryResult(model_dir, model_dir / CONFIG_FILE, model_dir / VERSION / model_file, launch)
