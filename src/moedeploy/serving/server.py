"""Artifacts on a real Triton Inference Server, through PyTriton (which bundles the server).

Triton speaks KServe v2 over HTTP and gRPC, batches requests dynamically, answers health
and readiness probes and exports Prometheus metrics; PyTriton runs our Python callables as
its models. Each model instance gets its own backend runner (a Polygraphy runner: torch,
ONNX Runtime or TensorRT), because a TensorRT execution context serves one thread at a time.

Triton itself rejects a request with an unknown input, a wrong dtype or rank, or a batch
over `max_batch_size`, before it reaches a model, and keeps serving. What Triton's config
cannot say (a dim's upper bound, a byte limit, an empty tensor) is checked in Triton's
Python-backend stub before a request's tensors are copied on (`stub_guard`); what depends on
values (token ids, options, positions) is checked by our callables, per request. Either way a
refused request gets its own one-line error with a client status (HTTP 400, gRPC
INVALID_ARGUMENT) and the rest of its batch runs.

The models are written into PyTriton's workspace before Triton starts, so Triton loads them
at start-up: its endpoints (health included) open only once every model is loaded.

Triton listens on loopback only, on private ports; the user's HTTP and gRPC ports belong to
moedeploy's front (`front`), which refuses a request over `--max-request-mb` before Triton reads
it and cancels the generation of an HTTP client that went away. The front opens once Triton is
ready and closes first when the server stops. The metrics port is moedeploy's too: Triton's
Prometheus metrics (from its private port) and the generation metrics of `metrics.py` (tokens,
time to first token, inter-token latency, running and queued sequences).

A decoder's `<name>_stream` on ONNX Runtime runs in-flight batching when its attention can run
on GroupQueryAttention (serving/inflight.py): concurrent streams share each decode step, at
most --max-sequences run, --max-queued wait, and a request beyond that is answered "busy"
(HTTP 503 / gRPC UNAVAILABLE). Its rows hold --max-context positions each. The rows of a
`<name>_generate` request join that batch too where they are independent of each other (see
serving/decoder.py); the rest, and every request while the scheduler is busy, run on the
generate model's own runner.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import shutil
import signal
import socket
import sysconfig
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moedeploy.export.artifact import Artifact, quiet_polygraphy
from moedeploy.runtime.quantized import ACCURACY_LEVELS, RUN_ACCURACY
from moedeploy.runtime.text import TextCodec
from moedeploy.serving import stub_guard, triton_output
from moedeploy.serving.batching import LOGGER, BatchedModel, PerRequest, first_line
from moedeploy.serving.decoder import DecoderShape, GenerationModel, RunnerDecoder, logits_prepare
from moedeploy.serving.front import TRITON_FORWARD_PATTERN, CancelledRequests, GrpcFront, HttpFront
from moedeploy.serving.generate_body import generate_body_limit
from moedeploy.serving.inflight import InflightScheduler
from moedeploy.serving.metrics import GenerationMetrics, MetricsFront
from moedeploy.serving.openai_api import OpenAIFront, served_models_of
from moedeploy.serving.specs import (
    GENERATE_SUFFIX,
    STREAM_SUFFIX,
    ModelSpec,
    ServingError,
    request_limits,
    served_models,
)
from moedeploy.serving.streaming import InflightTokens, SerialTokens, StreamModel, TokenSource

BACKENDS = ("ort", "trt", "torch")
#: --packed-weights: which of a decoder's ONNX Runtime sessions repack the weights (ModelServer._packs)
PACKED_WEIGHTS = ("stream", "all")
UNLOAD_TIMEOUT_S = 10  # how long tritonserver may take to unload every model when it stops
INSTALL_HINT = "serving needs nvidia-pytriton, tritonclient and prometheus-client: pip install 'moedeploy[serve]'"
TRITON_HOST = "127.0.0.1"  # Triton's HTTP and gRPC endpoints: loopback only, behind the front


class ServingUnavailable(RuntimeError):
    """PyTriton is not installed; the message says how to get it."""


def require_pytriton() -> None:
    if importlib.util.find_spec("pytriton") is None or importlib.util.find_spec("prometheus_client") is None:
        raise ServingUnavailable(INSTALL_HINT)


@dataclass
class ServeOptions:
    """How `moedeploy serve` runs; ports and batching as Triton names them."""

    backend: str = "ort"
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    max_batch_size: int | None = None  # None: the manifest's batch range max
    max_queue_delay_us: int = 100
    dynamic_batching: bool = True
    instances: int = 1
    exit_timeout_s: int = 5  # how long shutdown waits for in-flight requests
    max_request_mb: float = 64.0  # the most tensor bytes one request may carry, in MiB
    log_file: Path | None = None  # Triton's own log; None prints it to stdout, less known-harmless lines
    openai_port: int | None = None  # the OpenAI-compatible API (serving/openai_api.py); None: not served
    max_sequences: int = 32  # in-flight batching: the most generations one decoder's stream model runs at once
    max_queued: int = 128  # ... and the most that wait for a row; beyond: "busy" (503)
    max_context: int = 4096  # ... positions (prompt + new tokens) each row holds, at most the model's max_positions
    stream_interval: int = 1  # tokens per streamed response after the first (vLLM's --stream-interval)
    prefill_chunk: int = 32  # in-flight batching: prompt tokens a step takes while sequences decode; 0: whole prompts
    packed_weights: str = "stream"  # which decoder sessions repack the weights: "stream" (in flight only) or "all"
    accuracy_level: int = RUN_ACCURACY  # a quantized artifact's MatMulNBits/QMoE level: 4 int8 activations, 0 float

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ServingError(f"unknown backend {self.backend!r}; choose from: {', '.join(BACKENDS)}")
        ports = {"http": self.http_port, "grpc": self.grpc_port, "metrics": self.metrics_port}
        if self.openai_port is not None:
            ports["openai"] = self.openai_port
        for label, port in ports.items():
            if not 0 < port < 65536:
                raise ServingError(f"--{label}-port must lie in 1..65535, got {port}")
        if len(set(ports.values())) != len(ports):
            labels = list(ports)
            raise ServingError(f"the {', '.join(labels[:-1])} and {labels[-1]} ports must differ, "
                               f"got {', '.join(map(str, ports.values()))}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ServingError(f"--max-batch-size must be >= 1 (Triton batches along dim 0), got {self.max_batch_size}")
        if self.max_queue_delay_us < 0:
            raise ServingError(f"--max-queue-delay-us must be >= 0, got {self.max_queue_delay_us}")
        if self.instances < 1:
            raise ServingError(f"--instances must be >= 1, got {self.instances}")
        if not self.max_request_mb > 0:
            raise ServingError(f"--max-request-mb must be > 0, got {self.max_request_mb}")
        if self.exit_timeout_s < 0:
            raise ServingError(f"the exit timeout must be >= 0 s, got {self.exit_timeout_s}")
        if self.max_sequences < 1:
            raise ServingError(f"--max-sequences must be >= 1, got {self.max_sequences}")
        if self.max_queued < 0:
            raise ServingError(f"--max-queued must be >= 0, got {self.max_queued}")
        if self.max_context < 2:
            raise ServingError(f"--max-context must be >= 2 (a prompt token and a new one), got {self.max_context}")
        if self.packed_weights not in PACKED_WEIGHTS:
            raise ServingError(f"unknown --packed-weights {self.packed_weights!r}; choose from: {', '.join(PACKED_WEIGHTS)}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise ServingError(f"--accuracy-level must be one of {', '.join(map(str, ACCURACY_LEVELS))} "
                               f"(4: int8 activations, fast; 0: float), got {self.accuracy_level}")
        if self.prefill_chunk < 0:
            raise ServingError(f"--prefill-chunk must be >= 0 (prompt tokens a step takes; 0: whole prompts), "
                               f"got {self.prefill_chunk}")
        if self.stream_interval < 1:
            raise ServingError(f"--stream-interval must be >= 1 (tokens per streamed response), got {self.stream_interval}")


def check_port_free(host: str, port: int, label: str) -> None:
    """Fail in one line before start-up: Triton on a taken port would only time out."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # like Triton: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            raise ServingError(f"cannot listen on {host}:{port} for {label} ({e.strerror}); choose another --{label}-port") from None


@contextlib.contextmanager
def python_library_first() -> Iterator[None]:
    """Put this interpreter's libpython first on LD_LIBRARY_PATH while Triton starts.

    PyTriton's python-backend stub links libpython dynamically; with a pyenv (or any
    non-system) Python the loader would find the system's libpython, which then runs
    against this interpreter's standard library and crashes. Triton and the stubs it
    spawns inherit the environment at start, so it is restored right after.
    """
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if not (libdir and soname and (Path(libdir) / soname).is_file()):
        yield
        return
    old = os.environ.get("LD_LIBRARY_PATH")
    os.environ["LD_LIBRARY_PATH"] = libdir + (f":{old}" if old else "")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LD_LIBRARY_PATH", None)
        else:
            os.environ["LD_LIBRARY_PATH"] = old


def activated_runner(backend: str, artifact: Artifact, prepack: bool = True, accuracy_level: int = RUN_ACCURACY):
    """An activated Polygraphy runner; errors (no TensorRT, no engine, bf16 on CPU) surface here.
    prepack=False: on ONNX Runtime, the session shares the artifact's memory-mapped weights;
    accuracy_level: a quantized artifact's MatMulNBits/QMoE level there."""
    from moedeploy.runtime.runners import make_runner as runtime_runner

    quiet_polygraphy()
    runner = runtime_runner(backend, artifact, prepack, accuracy_level)
    runner.activate()
    return runner


def model_callable(artifact: Artifact, spec: ModelSpec, runner: Any, cancel_dir: Path | None = None,
                   cancelled: CancelledRequests | None = None,
                   scheduler: InflightScheduler | None = None,
                   metrics: GenerationMetrics | None = None, stream_interval: int = 1) -> PerRequest | StreamModel:
    """The PyTriton callable of one served model over one runner; generation stops early once
    stub_guard marks its requests cancelled in `cancel_dir` (gRPC) or the HTTP front marks them
    in `cancelled`. A stream model runs on `scheduler` when there is one (in-flight batching),
    else a request at a time on `runner`; a generate model sends the rows it can to `scheduler`
    and runs the others on `runner`."""
    run = runner.infer
    required = [t.name for t in spec.inputs if not t.optional]
    if artifact.kind != "decoder":
        model: Any = BatchedModel(run, [t.name for t in spec.outputs])
    elif spec.name.endswith(GENERATE_SUFFIX):
        model = GenerationModel(RunnerDecoder(run, DecoderShape.of(artifact)), cancel_dir, cancelled, scheduler)
    elif spec.name.endswith(STREAM_SUFFIX):  # a generator answering token by token: its own answers
        codec = TextCodec.from_artifact(artifact) if artifact.manifest.get("tokenizer") else None
        shape = DecoderShape.of(artifact)
        source: TokenSource = (InflightTokens(scheduler, stream_interval) if scheduler is not None
                               else SerialTokens(run, shape))
        return StreamModel(spec.name, source, shape, codec, cancel_dir, cancelled, metrics, stream_interval)
    else:
        model = BatchedModel(run, [t.name for t in spec.outputs], prepare=logits_prepare(DecoderShape.of(artifact)))
    return PerRequest(spec.name, model, required)


#: What stub_guard.install replaces in PyTriton's proxy model.py (as PyTriton 0.7 spells it).
PROXY_HOOKS = ("def _wrap_response(", "class TritonRequestsServer", "def _wrap_request(", "class TritonPythonModel",
               "def execute(", "class DecoupledResponsesHandler", "async def handle_responses(",
               "PyTritonResponseFlags")


def install_guard(version_dir: Path, limits: dict) -> None:
    """Put stub_guard beside PyTriton's proxy model.py in a model's folder and make model.py install it."""
    proxy = (version_dir / "model.py").read_text()
    missing = [hook for hook in PROXY_HOOKS if hook not in proxy]
    if missing:
        raise ServingError(
            f"this PyTriton's proxy model.py has no {missing[0].rstrip('(')!r}: moedeploy's per-request errors "
            "and request limits are written for PyTriton 0.7; install nvidia-pytriton 0.7"
        )
    (version_dir / f"{stub_guard.MODULE_NAME}.py").write_text(Path(stub_guard.__file__).read_text())
    with (version_dir / "model.py").open("a") as f:
        f.write(f"\n\nfrom . import {stub_guard.MODULE_NAME} as _moedeploy_guard  # noqa: E402\n"
                f"_moedeploy_guard.install(globals(), {json.dumps(json.dumps(limits))})\n")


CANCEL_DIR = "cancelled"  # in the workspace: stub_guard marks cancelled requests here
OWNER_FILE = "moedeploy-owner"  # in a PyTriton workspace moedeploy made: "<pid> <start time>"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a reused pid from the original)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def claim(workspace: Path) -> None:
    """Mark a PyTriton workspace as this process's, so a later start can tell it is left over."""
    (workspace / OWNER_FILE).write_text(f"{os.getpid()} {_start_time(os.getpid())}")


def _owner_alive(workspace: Path) -> bool:
    try:
        pid, started = (workspace / OWNER_FILE).read_text().split()
    except (OSError, ValueError):
        return True  # not ours, or being written: leave it
    return _start_time(int(pid)) == started


def sweep_stale_workspaces(shm: Path = Path("/dev/shm")) -> list[Path]:
    """Remove what servers killed with SIGKILL left behind: moedeploy's PyTriton workspaces
    (model store, sockets, Triton's copy, ~22 MB each) whose owner is gone, and the
    Python-backend shared-memory regions (`pytrtion<pid>-*`) of processes that no longer run.
    Other tools' workspaces (no owner file) and live servers' files are left alone."""
    from pytriton.constants import PYTRITON_HOME

    removed: list[Path] = []
    for workspace in Path(PYTRITON_HOME).glob("workspace_*"):
        if (workspace / OWNER_FILE).is_file() and not _owner_alive(workspace):
            shutil.rmtree(workspace, ignore_errors=True)
            removed.append(workspace)
    for region in shm.glob("pytrtion*-*"):
        pid = region.name.removeprefix("pytrtion").split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                region.unlink()
                removed.append(region)
    return removed


def _children(pid: int) -> list[int]:
    """Child process ids (Linux /proc; Triton runs on Linux only)."""
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def loopback_ports(n: int, avoid: Sequence[int] = ()) -> list[int]:
    """n distinct ports free on loopback a moment ago (the kernel's picks), none of `avoid`."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < n:
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((TRITON_HOST, 0))
            if (port := s.getsockname()[1]) not in avoid:
                ports.append(port)
        return ports


def _is_tritonserver(pid: int, http_port: int) -> bool:
    """Whether `pid` is the tritonserver listening on `http_port` (not another server of this process)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    pairs = set(itertools.pairwise(argv))
    return exe.endswith("/tritonserver") and (("--http-port", str(http_port)) in pairs or f"--http-port={http_port}" in argv)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child stays a zombie until PyTriton reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _from_triton(error: BaseException) -> bool:
    module = type(error).__module__
    return module.startswith(("pytriton", "tritonclient")) or isinstance(error, TimeoutError)


class ModelServer:
    """One Triton server for one or more artifacts: `start()`, infer with any KServe v2 client, `stop()`."""

    def __init__(self, artifacts: Sequence[Artifact | str | Path], options: ServeOptions | None = None) -> None:
        self.options = options or ServeOptions()
        self.options.validate()
        self.artifacts = [a if isinstance(a, Artifact) else Artifact.load(a) for a in artifacts]
        if not self.artifacts:
            raise ServingError("name at least one artifact to serve")
        self.specs: list[tuple[Artifact, ModelSpec]] = []
        for artifact in self.artifacts:
            if artifact.dtype == "bf16":
                raise ServingError(
                    f"{artifact.path} is bf16: NumPy, and so PyTriton, has no bfloat16; export fp32 or fp16 to serve it "
                    "(`moedeploy triton-repo --backend tensorrt` deploys bf16 plans on a standalone Triton)"
                )
            self.specs += [(artifact, spec) for spec in served_models(artifact, self.options.max_batch_size)]
        # the OpenAI API's models (decoders with a tokenizer), refused now rather than after Triton starts
        self.openai_models = served_models_of(self.artifacts) if self.options.openai_port is not None else []
        names = [spec.name for _, spec in self.specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ServingError(f"two artifacts would serve a model named {duplicates[0]!r}; model names are manifest names")
        self._runners: list[Any] = []
        self._warned: set[str] = set()  # models already named in the mapped-quantized warning
        self._schedulers: list[InflightScheduler] = []
        self._callables: list[PerRequest] = []
        self._triton: Any = None
        self._workspace: Any = None
        self._output: triton_output.TritonOutputFilter | None = None
        self.cancelled = CancelledRequests()  # HTTP generations whose client went away
        self._fronts: list[HttpFront | GrpcFront | OpenAIFront] = []
        self._triton_ports: tuple[int, int, int] | None = None  # Triton's own (http, grpc, metrics), behind the fronts
        self.metrics: GenerationMetrics | None = None

    @property
    def model_names(self) -> list[str]:
        return [spec.name for _, spec in self.specs]

    @property
    def http_url(self) -> str:
        return f"{self._host_for_url()}:{self.options.http_port}"

    @property
    def openai_url(self) -> str | None:
        """The OpenAI-compatible API's base URL (what `openai.OpenAI(base_url=...)` takes), if served."""
        port = self.options.openai_port
        return None if port is None else f"http://{self._host_for_url()}:{port}/v1"

    @property
    def grpc_url(self) -> str:
        return f"{self._host_for_url()}:{self.options.grpc_port}"

    @property
    def triton_http_url(self) -> str:
        """Triton's own HTTP endpoint on loopback, behind the front: no size limit, no HTTP cancellation."""
        return f"{TRITON_HOST}:{self._private_ports()[0]}"

    @property
    def triton_grpc_url(self) -> str:
        return f"{TRITON_HOST}:{self._private_ports()[1]}"

    def _private_ports(self) -> tuple[int, int, int]:
        if self._triton_ports is None:
            raise ServingError("the server is not running")
        return self._triton_ports

    @property
    def metrics_url(self) -> str:
        return f"http://{self._host_for_url()}:{self.options.metrics_port}/metrics"

    def _host_for_url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.options.host, self.options.host)
        return f"[{host}]" if ":" in host else host

    def start(self) -> ModelServer:
        """Load every runner, then start Triton and wait until every model is ready."""
        require_pytriton()
        o = self.options
        ports = [("http", o.http_port), ("grpc", o.grpc_port), ("metrics", o.metrics_port)]
        if o.openai_port is not None:  # its front starts after Triton: a taken port found then costs Triton's start
            ports.append(("openai", o.openai_port))
        for label, port in ports:
            check_port_free(o.host, port, label)
        try:
            from pytriton.utils.workspace import Workspace

            sweep_stale_workspaces()
            self._workspace = Workspace()
            claim(self._workspace.path)
            cancel_dir = self._workspace.path / CANCEL_DIR
            cancel_dir.mkdir()
            callables = []
            generation_runners: dict[Path, list[Any]] = {}
            self.metrics = GenerationMetrics()
            schedulers = {artifact.path: self._inflight_scheduler(artifact, spec.name) for artifact, spec in self.specs
                          if spec.name.endswith(STREAM_SUFFIX) and o.backend == "ort"}
            for artifact, spec in self.specs:
                # the stream model's scheduler, which the generate model's independent rows join too
                scheduler = schedulers.get(artifact.path) if spec.name.endswith((GENERATE_SUFFIX, STREAM_SUFFIX)) else None
                if spec.name.endswith(STREAM_SUFFIX) and o.backend == "ort":
                    # else the generate model's sessions (ONNX Runtime's run is thread-safe): no second copy of the weights
                    runners = generation_runners[artifact.path][:1] if scheduler else generation_runners[artifact.path]
                else:
                    in_flight = schedulers.get(artifact.path) is not None
                    runners = [self._runner(artifact, spec, in_flight) for _ in range(o.instances)]
                    self._runners += runners
                if spec.name.endswith(GENERATE_SUFFIX):
                    generation_runners[artifact.path] = runners
                callables.append([model_callable(artifact, spec, r, cancel_dir, self.cancelled, scheduler, self.metrics,
                                                 o.stream_interval) for r in runners])
                if spec.name.endswith(STREAM_SUFFIX):
                    self._watch(spec.name, scheduler, callables[-1])
            self._triton_ports = tuple(loopback_ports(3, avoid=(o.http_port, o.grpc_port, o.metrics_port)))
            self._callables = [c for per_model in callables for c in per_model]
            gpu = triton_output.cuda_visible()
            self._triton = self._bind(callables, gpu_metrics=gpu)
            self._output = triton_output.install(triton_output.harmless_lines(gpu))  # what is hidden, and why
            with python_library_first():
                self._triton.run()
            self._start_fronts()
        except BaseException as e:
            self.stop()
            if _from_triton(e):  # a model that would not load, a server that never came up
                first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(" Traceback")[0].rstrip(": ")
                log = f" (Triton's log: {o.log_file})" if o.log_file else ""
                raise ServingError(f"Triton Inference Server did not start: {first}{log}") from e
            raise
        return self

    def _runner(self, artifact: Artifact, spec: ModelSpec, in_flight: bool):
        """One activated runner of a served model: its weights packed or mapped (`_packs`), a
        quantized artifact at --accuracy-level."""
        o = self.options
        packed = self._packs(artifact, spec, in_flight)
        if not packed and o.backend == "ort" and artifact.manifest.get("quantization") and spec.name not in self._warned:
            self._warned.add(spec.name)  # once per model, not per instance
            LOGGER.warning("%s runs over the quantized artifact's memory-mapped codes, where ONNX Runtime's MatMulNBits "
                           "and QMoE compute in float, 20-30x slower than on their repacked layout; --packed-weights all "
                           "repacks it too (memory: a copy of the weights per session)", spec.name)
        return activated_runner(o.backend, artifact, packed, o.accuracy_level)

    def _packs(self, artifact: Artifact, spec: ModelSpec, in_flight: bool) -> bool:
        """Whether this model's ONNX Runtime sessions repack the weights into a copy of their own
        (faster) or share the artifact's memory-mapped file. With --packed-weights stream (the
        default) a decoder keeps one repacked copy, for the path that serves streams and the
        OpenAI API: the in-flight session when there is one, else the generate model's sessions
        (the stream model decodes on them). Its logits model, and its generate model beside an
        in-flight session, share the file: a checkpoint of tens of GB is then in memory once plus
        that copy, not once per model and instance. A quantized decoder's generate model repacks
        beside in-flight batching too: over the mapped codes ONNX Runtime's int8/int4 kernels
        compute in float whatever the accuracy level (and 20-30x slower), so a request that misses
        the in-flight batch would get other tokens than one in it; its copy is a quarter of the
        float weights or less. Its logits model stays mapped (`_runner` warns)."""
        if self.options.packed_weights == "all" or artifact.kind != "decoder":
            return True
        generate = spec.name.endswith(GENERATE_SUFFIX)
        return generate and (not in_flight or bool(artifact.manifest.get("quantization")))

    def _inflight_scheduler(self, artifact: Artifact, name: str) -> InflightScheduler | None:
        """In-flight batching for a decoder's stream model, or None where its attention cannot run on
        GroupQueryAttention (the stream model then decodes a request at a time, and says so)."""
        from moedeploy.runtime.inflight import RowCacheDecoder
        from moedeploy.runtime.lowering import LoweringError

        o = self.options
        try:
            decoder = RowCacheDecoder(artifact, slots=o.max_sequences, capacity=o.max_context,
                                      nbits_accuracy=o.accuracy_level)
        except LoweringError as e:
            LOGGER.warning("%s: no in-flight batching (%s); concurrent streams take turns", name, first_line(e))
            return None
        scheduler = InflightScheduler(decoder, max_queued=o.max_queued, name=name, prefill_chunk=o.prefill_chunk)
        self._schedulers.append(scheduler)
        return scheduler

    def _watch(self, name: str, scheduler: InflightScheduler | None, models: list[StreamModel]) -> None:
        """The running and queued gauges of a stream model: its scheduler's rows and queue, or
        (a request at a time) the calls in progress and no queue."""
        if scheduler is not None:
            self.metrics.watch(name, lambda: scheduler.running, lambda: scheduler.queued)
        else:
            self.metrics.watch(name, lambda: sum(m.active for m in models), lambda: 0)

    def _start_fronts(self) -> None:
        """The user's HTTP and gRPC ports, once Triton is ready (so they too open only then)."""
        o = self.options
        max_bytes = int(o.max_request_mb * 2**20)
        generation = {spec.name: generate_body_limit(int(artifact.manifest["config"]["max_positions"]),
                                                     max(1, spec.max_batch_size))
                      for artifact, spec in self.specs if spec.name.endswith((GENERATE_SUFFIX, STREAM_SUFFIX))}
        self._fronts.append(HttpFront(o.host, o.http_port, f"http://{self.triton_http_url}", max_bytes, generation,
                                      self.cancelled, generation))
        self._fronts[-1].start()
        self._fronts.append(GrpcFront(o.host, o.grpc_port, self.triton_grpc_url, max_bytes))
        self._fronts[-1].start()
        self._fronts.append(MetricsFront(o.host, o.metrics_port, f"http://{TRITON_HOST}:{self._private_ports()[2]}",
                                         self.metrics))
        self._fronts[-1].start()
        if o.openai_port is not None:  # forwards to the HTTP front above, so a client that goes away cancels there too
            self._fronts.append(OpenAIFront(o.host, o.openai_port, f"http://{self.http_url}", self.openai_models,
                                            max_bytes))
            self._fronts[-1].start()

    def _stop_fronts(self) -> None:
        for front in reversed(self._fronts):
            with contextlib.suppress(Exception):  # best effort: stop the others regardless
                front.stop()
        self._fronts = []

    def _bind(self, callables: list[list[Any]], gpu_metrics: bool):
        """A PyTriton server with every model bound; GPU metrics only where a GPU is visible
        (elsewhere Triton's NVML and DCGM probes print errors at start-up and measure nothing)."""
        from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
        from pytriton.triton import Triton, TritonConfig, TritonLifecyclePolicy

        o = self.options
        triton_http, triton_grpc, triton_metrics = self._private_ports()
        config = TritonConfig(
            http_address=TRITON_HOST, grpc_address=TRITON_HOST, metrics_address=TRITON_HOST,
            http_port=triton_http, grpc_port=triton_grpc, metrics_port=triton_metrics,
            # the front's request id reaches the model as a request parameter (HTTP cancellation)
            http_header_forward_pattern=TRITON_FORWARD_PATTERN,
            # Our drain waits exit_timeout_s for requests in flight; Triton's own exit timeout
            # also covers unloading the models after SIGTERM (a Python-backend model takes 2-4 s).
            exit_timeout_secs=o.exit_timeout_s + UNLOAD_TIMEOUT_S, log_verbose=0,
            # No pool of reusable gRPC request objects: a reused one keeps the capacity of the
            # largest request it held (a refused 200 MB request would stay resident).
            grpc_infer_allocation_pool_size=0,
            log_file=Path(o.log_file) if o.log_file else None,
            allow_gpu_metrics=None if gpu_metrics else False,
        )
        # A local model store: bind() writes each model's folder, Triton loads them all before
        # its endpoints open (and no model is loaded from files sent through the API).
        workspace = self._workspace
        policy = TritonLifecyclePolicy(launch_triton_on_startup=True, local_model_store=True)
        triton = Triton(config=config, workspace=workspace, triton_lifecycle_policy=policy)
        batcher = DynamicBatcher(max_queue_delay_microseconds=o.max_queue_delay_us) if o.dynamic_batching else None
        max_bytes = int(o.max_request_mb * 2**20)
        for (artifact, spec), infer_funcs in zip(self.specs, callables, strict=True):
            def tensors(specs):
                return [Tensor(name=t.name, dtype=np.dtype(t.dtype), shape=t.dims, optional=t.optional) for t in specs]

            stream = spec.name.endswith(STREAM_SUFFIX)  # decoupled: a response per token, one request at a time
            triton.bind(
                model_name=spec.name, infer_func=infer_funcs, inputs=tensors(spec.inputs), outputs=tensors(spec.outputs),
                config=ModelConfig(batching=True, max_batch_size=spec.max_batch_size,
                                   batcher=None if stream else batcher, decoupled=stream),
                strict=False,  # a refused request's answer is stub_guard's error entry, not a declared output
            )
            limits = request_limits(artifact, spec, max_bytes)
            if spec.name.endswith((GENERATE_SUFFIX, STREAM_SUFFIX)):  # only a generation can stop early
                limits["cancel_dir"] = str(workspace.path / CANCEL_DIR)
            install_guard(workspace.model_store_path / spec.name / "1", limits)
        return triton

    def is_alive(self) -> bool:
        return self._triton is not None and self._triton.is_alive()

    def stop(self) -> None:
        """Drain, let tritonserver stop itself, then stop PyTriton and free the runners.

        Draining answers every request that reaches a model from now on with UNAVAILABLE
        (HTTP 503) and waits (up to the exit timeout) for the calls in progress. Then the
        front closes the user's ports (a new request finds no listener, rather than the 404
        "unknown model" of an unloaded model) and every connection to Triton, and tritonserver
        gets SIGTERM while our inference handlers still run: it closes its endpoints, unloads
        every model, and its Python-backend stubs
        finalize against live handlers. Were PyTriton's stop first (it closes the handlers,
        then unloads), stubs would hang on as orphans until Triton's exit timeout. Where
        tritonserver cannot be found, every model is unloaded through the API instead.
        """
        if self._triton is not None:
            self._drain()
        self._stop_fronts()
        if self._triton is not None:
            exited = self._stop_tritonserver()
            if not exited:
                with contextlib.suppress(Exception):  # best effort: the server may be gone already
                    self._unload_models()
            self._stop_pytriton(exited)
            self._triton = None
        if self._workspace is not None:  # PyTriton's stop cleaned it; a failed start may not have
            with contextlib.suppress(Exception):
                self._workspace.clean()
            self._workspace = None
        if self._output is not None:  # after Triton's last line
            triton_output.uninstall(self._output)
            self._output = None
        for scheduler in self._schedulers:  # drained above: each ends what still runs, then its thread
            scheduler.stop()
        self._schedulers = []
        for runner in self._runners:
            with contextlib.suppress(Exception):
                runner.deactivate()
        self._runners = []
        self._callables = []
        self._triton_ports = None

    def _stop_pytriton(self, exited: bool) -> None:
        """PyTriton's stop (its inference handlers, its workspace) once tritonserver has exited.

        PyTriton signals tritonserver if its process handle says it is alive; between that check
        and the signal the exited process can be reaped, and os.kill raises ProcessLookupError. So
        first wait until the handle knows (asking it reaps the exited process), and should the race
        still happen, finish what the interrupted stop left: the inference handlers."""
        server = getattr(self._triton, "_triton_server", None)
        deadline = time.monotonic() + 5.0
        with contextlib.suppress(Exception):
            while exited and server is not None and server.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
        try:
            self._triton.stop()
        except ProcessLookupError:
            with contextlib.suppress(Exception):
                self._triton._model_manager.clean()

    def _drain(self) -> None:
        for model in self._callables:
            model.draining.set()
        deadline = time.monotonic() + self.options.exit_timeout_s
        while not all(model.idle for model in self._callables) and time.monotonic() < deadline:
            time.sleep(0.02)

    def _tritonservers(self) -> list[int]:
        return [pid for pid in _children(os.getpid()) if _is_tritonserver(pid, self._private_ports()[0])]

    def _stop_tritonserver(self) -> bool:
        """SIGTERM to this server's tritonserver; whether it exited (within the exit timeout + UNLOAD_TIMEOUT_S + 5 s)."""
        servers = self._tritonservers()
        if not servers:
            return False
        for pid in servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.options.exit_timeout_s + UNLOAD_TIMEOUT_S + 5.0
        while any(_running(pid) for pid in servers):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _unload_models(self) -> None:
        import tritonclient.http as http
        from pytriton.triton import TRITON_ACCESS_HEADER

        # PyTriton restricts the model-repository API to holders of its access token.
        headers = {TRITON_ACCESS_HEADER: self._triton.get_access_token()}
        servers = self._tritonservers()
        client = http.InferenceServerClient(self.triton_http_url, network_timeout=self.options.exit_timeout_s + 10.0)
        try:
            for name in self.model_names:
                client.unload_model(name, headers=headers)
        finally:
            client.close()
        # An unload returns at once; it is done when the model's stub process has exited.
        deadline = time.monotonic() + self.options.exit_timeout_s + 10.0
        while any(_children(pid) for pid in servers) and time.monotonic() < deadline:
            time.sleep(0.05)

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def wait_for_signal(server: ModelServer, poll_s: float = 0.5) -> str:
    """Block until SIGINT or SIGTERM (returns its name); raise if the server dies first.

    Call from the main thread (Python delivers signals there); the caller then stops the server.
    """
    stop = threading.Event()
    received: list[str] = []

    def handler(signum: int, _frame: Any) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(poll_s):
            # Ctrl-C reaches Triton too (same process group); give our handler the first word.
            if not server.is_alive() and not stop.wait(poll_s):
                raise ServingError("Triton Inference Server stopped unexpectedly; see its log above (or --log-file)")
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return received[0]
