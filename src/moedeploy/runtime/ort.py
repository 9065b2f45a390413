"""ONNX Runtime sessions from an artifact: provider choice, lowering, thread settings."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

import moedeploy
from moedeploy.export.artifact import MODEL_DATA_FILE, MODEL_FILE, Artifact, sha256
from moedeploy.models.config import DecoderConfig
from moedeploy.plugins import moe_split
from moedeploy.runtime.lowering import (
    LOWERING_VERSION,
    AttentionLowering,
    KVCache,
    LogitsLowering,
    MoELowering,
    NormLowering,
    lower_for_ort,
)
from moedeploy.runtime.providers import CPU, CUDA, default_providers, dtype_unsupported  # noqa: F401 (re-exported)
from moedeploy.utils.io import atomic_write_json, normalise_modes

CACHE_DIR = "cache"
CACHE_FORMAT = 2  # 1: the sidecar held only the lowering counts, nothing was verified

log = logging.getLogger(__name__)

#: ONNX Runtime reads the external initializers of a model given as bytes from this folder.
EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"
#: "1": the MatMul/Gemm weights are used as they lie in the artifact's memory-mapped data file
#: instead of being repacked into a copy of the session's own
DISABLE_PREPACKING = "session.disable_prepacking"
#: which path fp32 MoE layers take in a CPU session: "native" (the project's kernel, where it is
#: built here), "split" or "experts" (session_moe, moe_path_and_source)
MOE_PATH_ENV, MOE_PATHS = "MOEDEPLOY_MOE_PATH", ("split", "experts", "native")
#: graph optimizers a session skips, by name (comma-separated)
DISABLED_OPTIMIZERS = "optimization.disable_specified_optimizers"
#: the temporary folders profiling sessions write into (`session_options`, `profile_events`)
PROFILE_FOLDER_PREFIX = "moedeploy-ort-profile-"

#: The oldest ONNX Runtime the lowerings are tested with (pyproject's bound). Older releases load
#: the portable artifact, but refuse contrib nodes the lowerings write: 1.30's GroupQueryAttention
#: takes 16 inputs, not 17, and its QMoE has no accuracy_level (seen on a GPU machine's image).
TESTED_ONNXRUNTIME = (1, 32)


class SessionError(RuntimeError):
    """The artifact cannot run on the requested ONNX Runtime provider."""


def older_than_tested(version: str) -> bool:
    """Whether an ONNX Runtime version string ("1.30.0", "1.33.0.dev20260101") predates TESTED_ONNXRUNTIME."""
    numbers = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers) < TESTED_ONNXRUNTIME


def onnxruntime_distribution() -> str:
    """The pip package this onnxruntime came from: onnxruntime-gpu and its kin install the same
    module, and upgrading "onnxruntime" beside them would install a second, conflicting one."""
    from importlib import metadata

    for name in ("onnxruntime-gpu", "onnxruntime-openvino", "onnxruntime-directml", "onnxruntime-qnn"):
        try:
            metadata.version(name)
            return name
        except metadata.PackageNotFoundError:
            continue
    return "onnxruntime"


def upgrade_hint() -> str:
    """What to add to a session-creation failure on an ONNX Runtime older than the tested one."""
    if not older_than_tested(ort.__version__):
        return ""
    tested = ".".join(map(str, TESTED_ONNXRUNTIME))
    package = onnxruntime_distribution()
    return (f" (this onnxruntime {ort.__version__} is older than the {tested} moedeploy's lowerings need: "
            f"pip install -U '{package}>={tested}')")


@dataclass
class LoweredSession:
    """An InferenceSession plus what lowering did to the graph it runs."""

    session: ort.InferenceSession
    provider: str
    lowering: dict[str, int] = field(default_factory=dict)

    def run(self, feed: dict, output_names: list[str] | None = None) -> list:
        return self.session.run(output_names, feed)


def session_options(threads: int | None = None, profile: bool = False, prepack: bool = True) -> ort.SessionOptions:
    """prepack=False: the weights stay in the artifact's memory-mapped data file, where every
    session of the process (and the page cache) shares them, instead of each session keeping a
    repacked copy: one copy of the weights for any number of sessions, for a slower decode
    (measured 97 against 117 tokens/s on the `small` preset, benchmarks/README.md)."""
    options = ort.SessionOptions()
    if not prepack:
        options.add_session_config_entry(DISABLE_PREPACKING, "1")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if profile:  # ONNX Runtime writes the profile into the working directory unless told where
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tempfile.mkdtemp(prefix=PROFILE_FOLDER_PREFIX)) / "profile")
    options.log_severity_level = 3  # unused-initializer warnings after lowering are expected
    return options


def profile_events(session: ort.InferenceSession) -> list[dict]:
    """End a profiling session's profile and return its events (Chrome trace format). What ONNX
    Runtime writes under `session_options(profile=True)` goes to a temporary folder of ours, never
    the caller's working directory, and is removed once read; a profile written anywhere else (a
    session made with options of its own) is read and left where it is."""
    path = Path(session.end_profiling())
    try:
        return json.loads(path.read_text())
    finally:
        if path.parent.name.startswith(PROFILE_FOLDER_PREFIX):
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                path.parent.rmdir()


def reads_weights_from(options: ort.SessionOptions, artifact: Artifact) -> ort.SessionOptions:
    """Let a graph given as bytes read its external initializers from the artifact's data file
    (ONNX Runtime resolves them against this folder, and memory-maps them there)."""
    if MODEL_DATA_FILE in artifact.model_files():
        options.add_session_config_entry(EXTERNAL_DATA_FOLDER, str(artifact.path))
    return options


def create_session(
    artifact: Artifact | str,
    providers: list[str] | None = None,
    moe_lowering: MoELowering = "auto",
    threads: int | None = None,
    profile: bool = False,
    attention_lowering: AttentionLowering = "graph",
    logits: LogitsLowering = "all",
    norm_lowering: NormLowering = "native",
    kv_cache: KVCache = "copy",
    nbits_accuracy: int = 0,
    prepack: bool = True,
    expert_pieces: int | None = None,
) -> LoweredSession:
    """A session over the artifact's graph with the custom ops (and a decoder's attention)
    lowered for its first provider. logits="last": a decoder's LM head on the last position only.
    prepack=False: the session shares the artifact's memory-mapped weights (`session_options`).
    expert_pieces: how many pieces plugins/moe_split cuts each expert into (1: not at all); by
    default `session_moe`'s."""
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
    if reason := dtype_unsupported(artifact.dtype, provider):
        raise SessionError(f"{reason} for these graphs; run bf16 artifacts on TensorRT or CUDA, or export with --dtype fp32/fp16")
    if expert_pieces is None:  # the session's own MoE path (a caller that gives pieces chose one)
        moe_lowering, expert_pieces = session_moe(provider, threads, moe_lowering, artifact, prepack)
    model, counts = lowered_model(artifact, provider, moe_lowering, attention_lowering, logits, norm_lowering,
                                  kv_cache, nbits_accuracy, expert_pieces, relayout=prepack)
    options = session_options(threads, profile, prepack)
    if not prepack and counts.get("sign_flips"):
        # Signed codes reach the quantized kernels through BitwiseXor. Folded, each mapped session
        # would hold its own flipped copy of the codes, which is what mapping exists to avoid;
        # flipped per run, the session shares the file. `small` int4, private memory after a few
        # steps: 97 MB folded, 55 flipped per run (the flips' scratch), 27 for format 1's unsigned
        # codes; 249 ms a step flipped per run, 243 for format 1 (the mapped path is slow anyway).
        options.add_session_config_entry(DISABLED_OPTIMIZERS, "ConstantFolding")
    if isinstance(model, bytes):
        reads_weights_from(options, artifact)
    try:
        session = load_lowered(model, options, artifact.path, providers)
    except Exception as e:  # onnxruntime raises its own exception types
        raise SessionError(f"ONNX Runtime could not load {artifact.model_path}: {e}{upgrade_hint()}") from e
    lowered_here = len(model) if isinstance(model, bytes) else 0  # a path: cached, or released by write_cache
    del model
    release_freed_memory(lowered_here)
    return LoweredSession(session, provider, counts)


def moe_path(artifact: Artifact | None = None, threads: int | None = None) -> str:
    """The fp32 MoE path of a CPU session ("native", "split" or "experts"): `moe_path_and_source`'s."""
    return moe_path_and_source(artifact, threads)[0]


def moe_path_and_source(artifact: Artifact | None = None, threads: int | None = None) -> tuple[str, str]:
    """The fp32 MoE path of a CPU session and what decided it, in words (bench reports it):
    MOEDEPLOY_MOE_PATH where it is set (SessionError naming the choices for anything else, or
    saying why "native" cannot be built here); else the path `moedeploy tune` recorded for
    `artifact` on this machine at `threads` (runtime/moe_tuning.py; a record made with the
    native kernel applies only where the same build of it is here, one made without it only
    where it is not); else "native", the project's own kernel (plugins/native), wherever it is
    built or can be; else "split", the source saying why the kernel is not used."""
    from moedeploy.plugins import native

    value = os.environ.get(MOE_PATH_ENV, "").strip().lower()
    if value and value not in MOE_PATHS:
        raise SessionError(f"{MOE_PATH_ENV}={os.environ[MOE_PATH_ENV]!r} is not a MoE path: set it to native (the "
                           "project's kernel, the default where it builds), split (each expert cut into one piece "
                           "per thread) or experts (one If per expert), or unset it")
    if value == "native":
        try:
            native.library_path()
        except native.NativeUnavailable as e:
            raise SessionError(f"{MOE_PATH_ENV}=native, but the native kernel is not available here: {e}") from None
    if value:
        return value, f"{MOE_PATH_ENV} is set"
    if artifact is not None:  # a record applies only where it timed the paths a session here has (native or not)
        from moedeploy.runtime.moe_tuning import tuned_file, tuned_path

        if tuned := tuned_path(artifact, threads or default_threads()):
            return tuned, f"as `moedeploy tune` recorded for this machine in {tuned_file(artifact)}"
    try:
        native.library_path()
    except native.NativeUnavailable as e:  # why, and what to do: a user who wants the kernel reads it in bench
        return "split", f"the default; the native kernel is not used here: {e}"
    return "native", "the project's native kernel is built on this machine (plugins/native; MOEDEPLOY_NATIVE=0 turns it off)"


def session_moe(provider: str, threads: int | None, moe_lowering: MoELowering = "auto",
                artifact: Artifact | None = None, prepack: bool = True) -> tuple[MoELowering, int]:
    """The MoE lowering and expert pieces a session of these settings runs, from its MoE path
    (`moe_path`: MOEDEPLOY_MOE_PATH, what `moedeploy tune` measured for `artifact` on this
    machine, the native kernel where it is built, else the split), decided once for both.

    Lowering: "native" where an "auto" CPU session's path is the project's kernel, else
    `moe_lowering` as given. Pieces (plugins/moe_split cuts each fp32 expert into the largest
    divisor of its hidden size up to this, where the experts qualify): the threads
    (`default_threads()` where `threads` is None) on the CPU provider; 1 with prepack=False (the
    re-laid experts would be a private copy per session), on other providers, and for the
    "auto" lowering where the path is "experts" (its If per expert) or "native".

    A `moedeploy tune` record steers prepacked sessions only, the ones it timed: with
    prepack=False (serve's sessions sharing the mapped weights) the split is not cut and the
    kernel reads rows, not panels, and there the kernel's rows decoded 1.33x the unprepacked If
    per expert's speed (benchmarks/README.md, session 46); such a session takes the default.

    Which of split and If per expert decodes faster depends on the machine, not on the model
    alone: in `bench` the split decoded 1.05x and 1.22x the If per expert's tokens/s on a 2-core
    AVX-512 EPYC reading about 53 GB/s, 0.87x, 0.98x and 0.94x (paired) on a 2-core AVX2 EPYC
    reading 14-22 GB/s, and 0.90x on the AVX-512 kind on another day (benchmarks/README.md).
    Each of the op's threads runs MLAS's M = 1 transposed-B kernel alone on its pieces; the If per
    expert's Gemms are prepacked and use every thread. Hence `moedeploy tune`."""
    path = moe_path()  # checked first: a wrong value is refused wherever it is set
    if provider != "CPUExecutionProvider":
        return moe_lowering, 1
    threads = threads or default_threads()
    if moe_lowering == "auto" and artifact is not None and threads > 1 and prepack:  # what tune times
        path = moe_path(artifact, threads)
    lowering: MoELowering = "native" if moe_lowering == "auto" and path == "native" else moe_lowering
    pieces = 1 if not prepack or (moe_lowering == "auto" and path in ("experts", "native")) else threads
    return lowering, pieces


def default_threads() -> int:
    """The intra-op threads ONNX Runtime starts when not told: one per physical core (SMT
    siblings counted once) among the CPUs this process may run on."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def load_lowered(model: str | bytes | onnx.ModelProto, options: ort.SessionOptions, weights_dir: Path | str,
                 providers: list[str] | None = None) -> ort.InferenceSession:
    """An InferenceSession over a lowered graph (a path, bytes or a ModelProto) whose external
    weights live in `weights_dir`: the one way to load a graph that may read moe_split's
    placeholders. The experts it re-lays are supplied, and they belong to the InferenceSession
    itself (ONNX Runtime reads them in place), so they live as long as anyone holds it."""
    split_experts: list[object] = []
    if isinstance(model, onnx.ModelProto):
        proto: onnx.ModelProto | None = model
        model = model.SerializeToString()
    elif isinstance(model, bytes):  # parsed only where a placeholder's mark is in them
        proto = onnx.load_from_string(model) if moe_split.SPLIT_OF.encode() in model else None
    else:  # a file (a cached block graph, one a user saved): its graph without the weights
        proto = onnx.load(str(model), load_external_data=False)
    if proto is not None and moe_split.placeholders(proto):
        split_experts = moe_split.supply(proto, weights_dir, options)
    if _reads_native_ops(model if proto is None else proto):
        from moedeploy.plugins import native
        options.register_custom_ops_library(str(native.library_path()))
    session = ort.InferenceSession(model, options, providers=providers or ["CPUExecutionProvider"])
    if split_experts:
        session.moedeploy_owned_weights = split_experts
    return session


def _reads_native_ops(model: bytes | onnx.ModelProto) -> bool:
    """Whether a lowered graph has nodes of the project's native kernels' domain."""
    from moedeploy.plugins import moe_native

    if isinstance(model, bytes):
        return moe_native.DOMAIN.encode() in model
    return any(o.domain == moe_native.DOMAIN for o in model.opset_import) or \
        any(n.domain == moe_native.DOMAIN for n in model.graph.node)


def lowered_model(
    artifact: Artifact, provider: str, moe_lowering: MoELowering, attention_lowering: AttentionLowering = "graph",
    logits: LogitsLowering = "all", norm_lowering: NormLowering = "native", kv_cache: KVCache = "copy",
    nbits_accuracy: int = 0, expert_pieces: int = 1, relayout: bool = True,
) -> tuple[str | bytes, dict[str, int]]:
    """The lowered graph for ONNX Runtime.

    An artifact with its weights in model.onnx.data (every decoder): the graph alone is
    loaded and lowered here, and its bytes are returned; the session reads the weights from
    the artifact's data file, which the lowering never copies (the streamed export stores the
    experts in the layout com.microsoft::MoE takes), except the experts plugins/moe_split
    re-lays (expert_pieces > 1, count "moe_split") and the native kernel's panels (relayout,
    count "moe_native"): their placeholders are filled by moe_split.supply when `load_lowered`
    loads the bytes. Nothing is cached: lowering a graph
    without its weights takes milliseconds. Otherwise (a block, weights inside model.onnx): a
    verified cache file's path, else the bytes of a graph lowered here (a read-only artifact:
    the cache is an optimisation, never a requirement).
    """
    if MODEL_DATA_FILE in artifact.model_files():
        graph = onnx.load(str(artifact.model_path), load_external_data=False)
        lowered, counts = lower_for_ort(graph, provider, moe_lowering, decoder_config(artifact), attention_lowering,
                                        logits, norm_lowering, kv_cache, weights_dir=str(artifact.path),
                                        nbits_accuracy=nbits_accuracy, expert_pieces=expert_pieces, relayout=relayout)
        return lowered.SerializeToString(), counts
    if logits != "all" or norm_lowering != "native" or kv_cache != "copy" or attention_lowering != "graph":
        raise ValueError(f"the attention, logits, norm and KV-cache lowerings apply to decoder artifacts; "
                         f"{artifact.path} holds a {artifact.kind!r}")
    try:
        path, counts = lowered_model_path(artifact, provider, moe_lowering)
        return str(path), counts
    except OSError:
        lowered, counts = lower_for_ort(onnx.load(str(artifact.model_path)), provider, moe_lowering)
        return lowered.SerializeToString(), counts


def decoder_config(artifact: Artifact) -> DecoderConfig | None:
    """A decoder artifact's config (what the attention lowering needs); None for a block."""
    return DecoderConfig.from_manifest(artifact.manifest["config"]) if artifact.kind == "decoder" else None


def lowered_model_path(artifact: Artifact, provider: str, moe_lowering: MoELowering) -> tuple[Path, dict[str, int]]:
    """The lowered graph as a file with its weights in external data, made once per artifact.

    ONNX Runtime memory-maps external initializers it loads from a path, where a model given
    as bytes is parsed and copied: on the small decoder the session's resident memory is
    half. The files live in <artifact>/cache/, named by the provider, the lowering and what
    they were made from, so a re-exported model never meets a stale cache; deleting the
    folder is always safe. The cache is checked like the artifact: its sidecar records the sha256 of
    every cache file, and a cache that no longer matches is rebuilt, never loaded. Raises
    OSError when the cache must be (re)written and the folder is read-only, or when cache/ is a
    link (it would read and write files outside the artifact).
    """
    origin = cache_origin(artifact)
    name = cache_name(origin, provider, moe_lowering)
    folder = artifact.path / CACHE_DIR
    if problem := cache_link_problem(folder):
        log.warning("%s, so %s is lowered in memory", problem, MODEL_FILE)
        raise NotADirectoryError(problem)  # the caller lowers in memory
    sidecar = folder / f"{name}.json"
    record = read_sidecar(sidecar, origin)
    if record is not None:
        problem = cache_file_problem(folder, record, f"{name}.onnx")
        if problem is None:
            return folder / f"{name}.onnx", record["lowering"]
        log.warning("%s; it is not used: %s is lowered again", problem, MODEL_FILE)
    return write_cache(artifact, folder, name, provider, moe_lowering, origin)


def cache_link_problem(folder: Path) -> str | None:
    """Why moedeploy must not use `folder` (an artifact's cache/) as its cache, or None: a link
    would have it read and write files outside the artifact, in a folder moedeploy did not make."""
    if folder.is_symlink():
        return (f"{folder} is a link (to {folder.resolve()}), and moedeploy keeps its caches inside the artifact only "
                "(remove the link: deleting cache/ is always safe)")
    return None


def cache_name(made_from: dict[str, Any], provider: str, moe_lowering: MoELowering) -> str:
    """Provider, lowering and a digest of what the cache is made from: the sha256 of every
    model file (model.onnx alone does not change when only the weights in model.onnx.data
    do) and the library versions, so processes on different versions never share files."""
    key = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:16]
    return f"ort_{provider.removesuffix('ExecutionProvider').lower()}_{moe_lowering}_{key}"


def cache_origin(artifact: Artifact) -> dict[str, Any]:
    """What a usable cache was made from: this artifact's model files, and the libraries whose
    behaviour the lowering depends on (it probes ONNX Runtime's kernels)."""
    return {
        "format": CACHE_FORMAT,
        "source": {rel: artifact.manifest["files"][rel] for rel in artifact.model_files()},
        "versions": {"moedeploy": moedeploy.__version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__},
        "lowering_version": LOWERING_VERSION,
    }


def read_sidecar(sidecar: Path, origin: dict[str, Any]) -> dict[str, Any] | None:
    """The sidecar's record when it describes a cache made the way this process would make it;
    None for none, a stale one (older format, other libraries) or an unreadable one: rebuilt quietly."""
    if not sidecar.exists():
        return None
    try:
        record = json.loads(sidecar.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or any(record.get(k) != v for k, v in origin.items()):
        return None
    if not isinstance(record.get("files"), dict) or not isinstance(record.get("lowering"), dict):
        return None
    return record


def cache_file_problem(folder: Path, record: dict[str, Any], graph: str) -> str | None:
    """Why the cache files do not match the sha256 the sidecar recorded when it wrote them.

    Hashing reads every byte: the price of never loading a modified cache (size and mtime
    survive an overwrite in place that puts the mtime back). The graph must be among them: the data file is
    reached only through the graph that names it.
    """
    if graph not in record["files"]:
        return f"ONNX Runtime cache {folder / graph} is not among the files its sidecar hashed"
    for file_name, digest in record["files"].items():
        path = folder / str(file_name)
        if path.parent != folder or not path.is_file() or sha256(path) != digest:
            return f"ONNX Runtime cache file {path} does not match the sha256 recorded when it was written"
    return None


def write_cache(
    artifact: Artifact, folder: Path, name: str, provider: str, moe_lowering: MoELowering, origin: dict[str, Any]
) -> tuple[Path, dict[str, int]]:
    """Lower, save the graph and its data, hash them, and write the sidecar last (atomically).

    The old sidecar goes first: until the new one is in place no reader trusts the files,
    and one that reads them half-replaced finds a hash mismatch and rebuilds.
    """
    path, sidecar = folder / f"{name}.onnx", folder / f"{name}.json"
    folder.mkdir(exist_ok=True)  # a read-only artifact fails here, before the lowering's work
    sidecar.unlink(missing_ok=True)
    model = onnx.load(str(artifact.model_path))
    lowered, counts = lower_for_ort(model, provider, moe_lowering)
    del model
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # complete files appear, or none
        staged = Path(tmp) / path.name
        onnx.save_model(lowered, str(staged), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{name}.onnx.data", size_threshold=1024)
        del lowered
        data = Path(tmp) / f"{name}.onnx.data"
        written = [data, staged] if data.exists() else [staged]  # no data when every tensor is small
        files = {f.name: sha256(f) for f in written}
        normalise_modes(Path(tmp))  # onnx writes its data file 0600; follow the umask like the rest
        lowered_here = sum(f.stat().st_size for f in written)
        for f in written:  # the data first: the graph that names it must not appear before it
            os.replace(f, folder / f.name)
    atomic_write_json(sidecar, {**origin, "files": files, "lowering": counts})
    release_freed_memory(lowered_here)
    return path, counts


#: A lowering whose graph is smaller than this leaves its garbage to Python's own collector.
RELEASE_ABOVE_BYTES = 16 << 20


def release_freed_memory(lowered_bytes: int) -> None:
    """Free what a lowering of `lowered_bytes` (its graph with any weights inside) left behind
    and hand the heap back to the OS, so the process keeps only ONNX Runtime's own copy resident.

    The collection is needed for a large graph, not a nicety: the lowering's onnx_ir graph is
    full of reference cycles, and the arrays it made in memory live until a full collection frees
    them: the GroupQueryAttention lowering's rotary tables (about 128 MB in fp32 at 128k
    positions, twice that for a server's ragged cache), a quantized decoder's stacked q/k/v
    codes, and a block's whole weights (its loaded ModelProto). Each of those is inside the
    lowered graph, so its size bounds what is at stake. Below RELEASE_ABOVE_BYTES it is left to
    Python's collector: a full collection walks every object of the process, 0.2 s in a fresh
    one and 0.55 s in `moedeploy all`, which creates 15 sessions over graphs of kilobytes to a
    few MB (8 s of its 55 went to collections that freed those). The heap is trimmed always
    (15 ms in a process holding torch, 140 ms when it hands back much): ONNX Runtime frees
    buffers of its own while it builds a session, whatever the graph's size."""
    import contextlib
    import ctypes
    import gc

    if lowered_bytes >= RELEASE_ABOVE_BYTES:
        gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
