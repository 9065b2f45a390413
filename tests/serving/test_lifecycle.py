"""`moedeploy serve` as a process, from launch to exit: never ready before every model is, a
request-size cap (on the body, at the front, and on the tensors, in Triton's stub), a clean and quick SIGTERM after concurrent bad traffic (503 while draining,
every model unloaded, nothing left behind), and a sweep of what a SIGKILL leaves behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.export.artifacts import eager_block
from tests.serving import helpers
from tests.serving.helpers import HOST, free_ports, gone
from tests.serving.test_cli import SHIM

pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton")
MODELS = ["moe", "decoder", "decoder_generate"]
MAX_REQUEST_MB = 0.2  # 209,715 bytes: x of (16, 64, 64) fp32 (262,144 bytes) is over, (1, 4, 64) is far under
STARTUP_S = 180


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0  # not listening (yet, or any more)


def post(url: str, body: dict) -> tuple[int, str]:
    return helpers.post(url, json.dumps(body).encode())


def moe_body(x: np.ndarray) -> dict:
    return {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}


class Served:
    """A `moedeploy serve` process and what was seen while it started."""

    def __init__(self, args: list[str], http: int, console: Path) -> None:
        self.http = f"http://{HOST}:{http}"
        self.console = console
        with console.open("w") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", SHIM, *args], stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, "COLUMNS": "200"})
        self.first_ready_models: dict[str, int] | None = None
        deadline = time.monotonic() + STARTUP_S
        while self.first_ready_models is None:
            assert self.proc.poll() is None and time.monotonic() < deadline, console.read_text()[-3000:]
            if get(f"{self.http}/v2/health/ready") == 200:
                self.first_ready_models = {m: get(f"{self.http}/v2/models/{m}/ready") for m in MODELS}
            else:
                time.sleep(0.01)

    def workspaces(self) -> list[Path]:
        from pytriton.constants import PYTRITON_HOME

        from moedeploy.serving.server import OWNER_FILE

        return [w.parent for w in Path(PYTRITON_HOME).glob(f"workspace_*/{OWNER_FILE}")
                if w.read_text().split()[0] == str(self.proc.pid)]

    def shm(self) -> list[Path]:
        return list(Path("/dev/shm").glob(f"pytrtion{self.proc.pid}-*"))

    def descendants(self) -> list[int]:
        from moedeploy.serving.server import _children

        found, todo = [], [self.proc.pid]
        while todo:
            kids = _children(todo.pop())
            found += kids
            todo += kids
        return found

    def kill(self) -> None:
        for pid in [*self.descendants(), self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def served(store, tmp_path_factory: pytest.TempPathFactory):
    http, grpc, metrics = free_ports(3)
    log = tmp_path_factory.mktemp("lifecycle") / "triton.log"
    args = ["serve", str(store.block("moe").path), str(store.decoder("fp32").path), "--http-port", str(http),
            "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--exit-timeout", "5",
            "--max-queue-delay-us", "2000", "--max-request-mb", str(MAX_REQUEST_MB), "--log-file", str(log)]
    server = Served(args, http, log.with_name("console.txt"))
    server.log = log
    yield server
    if server.proc.poll() is None:
        server.kill()


def test_ready_only_once_every_model_is(served) -> None:
    assert served.first_ready_models == dict.fromkeys(MODELS, 200)


def test_requests_over_the_byte_cap_are_refused(served) -> None:
    """A body over the cap is refused by the front (413) before Triton reads it; a body under it
    whose tensors are over (compact JSON: 2 bytes a number, 4 a float32) by the stub (400)."""
    x = np.zeros((16, 64, 64), np.float32)
    status, text = post(f"{served.http}/v2/models/moe/infer", moe_body(x))  # "0.0, " a number: 327,760 bytes
    assert status == 413
    assert json.loads(text)["error"] == ("the request body (327760 bytes) is over the server's limit of 209715 bytes "
                                         "(0.2 MiB); moedeploy serve --max-request-mb raises it")
    compact = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": [0] * x.size}]}
    status, text = helpers.post(f"{served.http}/v2/models/moe/infer", json.dumps(compact, separators=(",", ":")).encode())
    assert status == 400
    assert json.loads(text)["error"] == ("the request's tensors hold 262144 bytes, over the server's limit of 209715 "
                                         "(moedeploy serve --max-request-mb)")
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(4))
    status, text = post(f"{served.http}/v2/models/moe/infer", moe_body(x.numpy()))
    assert status == 200
    with torch.no_grad():
        expected = eager_block("moe")(x).numpy().ravel()
    np.testing.assert_allclose(json.loads(text)["outputs"][0]["data"], expected, atol=1e-5, rtol=1e-5)


def bad_bodies() -> list[tuple[str, dict]]:
    """One of each malformed class, as JSON bodies (model, body)."""
    def ids(name: str, shape: list[int], data: list[int]) -> dict:
        return {"name": name, "shape": shape, "datatype": "INT64", "data": data}

    return [
        ("decoder_generate", {"inputs": [ids("input_ids", [1, 3], [1, 2, 999])]}),
        ("decoder_generate", {"inputs": [ids("input_ids", [1, 3], [1, 2, 3]), ids("max_new_tokens", [1, 1], [-4])]}),
        ("decoder_generate", {"inputs": [ids("max_new_tokens", [1, 1], [4])]}),
        ("decoder_generate", {"inputs": [ids("input_ids", [1, 0], [])]}),
        ("decoder", {"inputs": [ids("input_ids", [1, 2], [5, -3])]}),
        ("moe", {"inputs": [{"name": "x", "shape": [1, 0, 64], "datatype": "FP32", "data": []}]}),
        ("moe", moe_body(np.zeros((1, 300, 64), np.float32))),
    ]


def test_sigterm_after_concurrent_bad_traffic_is_quick_and_clean(served) -> None:
    """Good and bad clients at once; then SIGTERM while a client keeps sending."""
    x = np.linspace(-1, 1, 3 * 64, dtype=np.float32).reshape(1, 3, 64)
    with torch.no_grad():
        expected = eager_block("moe")(torch.from_numpy(x)).numpy().ravel()
    url = f"{served.http}/v2/models/%s/infer"

    def good(_: int) -> list[str]:
        problems = []
        for _ in range(20):
            status, text = post(url % "moe", moe_body(x))
            if status != 200 or not np.allclose(json.loads(text)["outputs"][0]["data"], expected, atol=1e-5, rtol=1e-5):
                problems.append(f"good request: {status} {text[:200]}")
        return problems

    def bad(_: int) -> list[str]:
        problems = []
        for _ in range(3):
            for model, body in bad_bodies():
                status, text = post(url % model, body)
                if status != 400 or "\n" in json.loads(text)["error"]:
                    problems.append(f"bad request to {model}: {status} {text[:200]}")
        return problems

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda f: f[0](f[1]), [(good, i) for i in range(4)] + [(bad, i) for i in range(2)],
                                timeout=240))
    assert [p for r in results for p in r] == []

    workspaces, stubs = served.workspaces(), served.descendants()
    assert len(workspaces) == 1 and served.shm()
    statuses: list[int] = []
    stop_sending = []

    def keep_sending() -> None:
        while not stop_sending and len(statuses) < 5000:
            statuses.append(post(url % "moe", moe_body(x))[0])

    with ThreadPoolExecutor(1) as pool:
        sender = pool.submit(keep_sending)
        time.sleep(0.3)
        start = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(timeout=60)
        took = time.monotonic() - start
        stop_sending.append(True)
        sender.result(timeout=60)
    assert served.proc.returncode == 0
    assert took < 15, f"SIGTERM took {took:.1f} s"
    assert set(statuses) <= {200, 503, 0}, sorted(set(statuses))  # served, draining, or closed: never 404
    assert gone(stubs), "processes outlived the server"
    assert not any(w.exists() for w in workspaces)
    assert served.shm() == []
    log = served.log.read_text()
    assert "Exit timeout expired" not in log
    for model in MODELS:
        assert f"successfully unloaded '{model}'" in log
    assert "/tmp/folder" not in log  # models load from the workspace's store, not from temporary folders


def test_what_a_sigkill_leaves_is_swept_on_the_next_start(store, tmp_path: Path) -> None:
    from moedeploy.serving.server import sweep_stale_workspaces

    http, grpc, metrics = free_ports(3)
    server = Served(["serve", str(store.block("moe").path), "--http-port", str(http), "--grpc-port", str(grpc),
                     "--metrics-port", str(metrics)], http, tmp_path / "console.txt")
    workspaces, shm = server.workspaces(), server.shm()
    assert len(workspaces) == 1 and shm
    server.kill()
    assert workspaces[0].exists() and all(r.exists() for r in shm)  # what the next start must clean
    removed = sweep_stale_workspaces()
    assert set(workspaces + shm) <= set(removed)
    assert not workspaces[0].exists() and not any(r.exists() for r in shm)
