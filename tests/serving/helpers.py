"""Shared by the serving tests: free loopback ports and one-call KServe v2 inference through
tritonclient (HTTP or gRPC), so each test reads as request -> expected value."""

from __future__ import annotations

import os
import queue
import socket
import time
import urllib.error
import urllib.request
from contextlib import ExitStack, suppress
from pathlib import Path

import numpy as np

HOST = "127.0.0.1"
PROTOCOLS = ("http", "grpc")
CLIENT_TIMEOUT_S = 60.0


def free_ports(n: int) -> list[int]:
    """n distinct ports the kernel had free on loopback a moment ago."""
    with ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((HOST, 0))
            ports.append(s.getsockname()[1])
        return ports


def client_module(protocol: str):
    if protocol == "http":
        import tritonclient.http as module
    else:
        import tritonclient.grpc as module
    return module


def client(protocol: str, server):
    module = client_module(protocol)
    if protocol == "http":
        return module.InferenceServerClient(server.http_url, network_timeout=CLIENT_TIMEOUT_S, connection_timeout=CLIENT_TIMEOUT_S)
    return module.InferenceServerClient(server.grpc_url)


def infer(protocol: str, c, model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
    """One request; raises tritonclient's InferenceServerException on an error response."""
    from tritonclient.utils import np_to_triton_dtype

    module = client_module(protocol)
    tensors = []
    for name, array in inputs.items():
        t = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        tensors.append(t)
    requested = [module.InferRequestedOutput(name) for name in outputs]
    kwargs = {"client_timeout": CLIENT_TIMEOUT_S} if protocol == "grpc" else {}
    result = c.infer(model, tensors, outputs=requested, **kwargs)
    return {name: np.array(result.as_numpy(name)) for name in outputs}  # writable copies


def metric(text: str, name: str, model: str) -> float:
    """Sum of a Prometheus counter's samples for one model (all versions, all reasons)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def stub_pids(root: int) -> list[int]:
    """PyTriton's Python-backend stub processes under `root` (they are tritonserver's children)."""
    def children(pid: int) -> list[int]:
        pids: list[int] = []
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with suppress(OSError):
                pids += [int(p) for p in (task / "children").read_text().split()]
        return pids

    def exe(pid: int) -> str:
        try:
            return os.readlink(f"/proc/{pid}/exe")
        except OSError:
            return ""

    servers = [pid for pid in children(root) if exe(pid).endswith("/tritonserver")]
    return [stub for server in servers for stub in children(server)]


def gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    """Whether every process has exited (waiting up to timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            return True
        time.sleep(0.1)
    return False


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """POST a raw body as JSON, the way a hand-written client would: (status, text); (0, why)
    when nothing answered (not listening yet, or any more). `headers`: added to Content-Type."""
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def tree_pss_mb(pid: int) -> float:
    """Summed PSS of a process and its descendants, in MB, as benchmarks/serving_soak.py measures
    a server: shared memory (the Python backend's /dev/shm pool) counts once, not per mapping."""
    pids, todo = [pid], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            with suppress(OSError):
                kids = [int(c) for c in (task / "children").read_text().split()]
                pids += kids
                todo += kids
    total = 0
    for p in pids:
        with suppress(OSError):
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text()
            total += sum(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
    return total / 1024


def grpc_stream(server, inputs: dict[str, np.ndarray], model: str = "decoder_stream") -> list[tuple[float, object, object]]:
    """Every (arrival time, result, error) of one streamed request to a decoupled `model`, up to its
    final response."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    answers: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: answers.put((time.perf_counter(), result, error)))
    tensors = []
    for name, array in inputs.items():
        t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        tensors.append(t)
    c.async_stream_infer(model, tensors, enable_empty_final_response=True)
    got = []
    while True:
        arrived, result, error = answers.get(timeout=60)
        got.append((arrived, result, error))
        if error is not None:
            break
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    c.stop_stream()
    c.close()
    return got


def result_ids(response) -> list[int]:
    _, result, error = response
    assert error is None, error
    return result.as_numpy("output_ids").reshape(-1).tolist()


def tokens_and_text(got, text: bool = True) -> tuple[list[int], list[str]]:
    """The token ids and text pieces of a stream's responses; text=False for a model served
    without a tokenizer (no text_output)."""
    tokens, pieces = [], []
    for _, result, error in got:
        assert error is None, error
        ids = result.as_numpy("output_ids")
        if ids is None:  # the empty final response
            continue
        tokens += ids.reshape(-1).tolist()
        if text:
            pieces += [p.decode("utf-8") for p in result.as_numpy("text_output").reshape(-1)]
    return tokens, pieces


def repacks(session) -> bool:
    """Whether an ONNX Runtime session repacks its weights (the default) or reads them from the
    artifact's memory-mapped file (runtime/ort.DISABLE_PREPACKING set)."""
    from moedeploy.runtime.ort import DISABLE_PREPACKING

    try:
        return session.get_session_options().get_session_config_entry(DISABLE_PREPACKING) != "1"
    except RuntimeError:  # the entry is not set: ONNX Runtime's default, repacking
        return True
