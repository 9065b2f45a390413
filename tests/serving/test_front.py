"""The front of `moedeploy serve` (moedeploy.serving.front): a request over `--max-request-mb` is
refused before Triton reads it, HTTP 413 / gRPC RESOURCE_EXHAUSTED with a one-line reason, and
the server's memory stays where it was. (Triton 2.51 alone read such a request whole and copied
it into the Python backend's shared-memory pool, which then stayed that large.)

The big requests come from a child process, so the server's measured memory (this process,
which runs the server, and Triton's processes) holds no client buffers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.serving.helpers import HOST, client, infer, tree_pss_mb

pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton")

BIG_SHAPE = [1, 819200, 64]  # fp32: 200 MiB, over the default --max-request-mb of 64
ROUNDS = 2  # of each kind: HTTP with a Content-Length, HTTP chunked, gRPC

SENDER = r"""
import http.client, json, sys
import numpy as np
import tritonclient.grpc as grpc
from tritonclient.utils import InferenceServerException

host, http_port, grpc_url, rounds, shape = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
size = int(np.prod(shape)) * 4
header = json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": "FP32",
                                 "parameters": {"binary_data_size": size}}]}).encode()
zeros = bytes(2**20)

def body():
    yield header
    for _ in range(size // len(zeros)):
        yield zeros

answers = []
for _ in range(rounds):
    for chunked in (False, True):
        conn = http.client.HTTPConnection(host, http_port, timeout=60)
        headers = {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}
        if chunked:
            headers["Transfer-Encoding"] = "chunked"
        else:
            headers["Content-Length"] = str(len(header) + size)
        try:
            conn.request("POST", "/v2/models/moe/infer", body=body(), headers=headers, encode_chunked=chunked)
            response = conn.getresponse()
            answers.append(["http chunked" if chunked else "http", response.status, response.read().decode()])
        except OSError as e:
            answers.append(["http chunked" if chunked else "http", 0, repr(e)])
        conn.close()
    c = grpc.InferenceServerClient(grpc_url)
    x = grpc.InferInput("x", shape, "FP32")
    x.set_data_from_numpy(np.zeros(shape, np.float32))
    try:
        c.infer("moe", [x], client_timeout=60)
        answers.append(["grpc", "OK", ""])
    except InferenceServerException as e:
        answers.append(["grpc", str(e.status()), e.message()])
    del x
    c.close()
print(json.dumps(answers))
"""


def binary_body_bytes(shape: list[int]) -> int:
    """Size of the SENDER's binary-format body: its JSON header, then the raw fp32 tensor."""
    size = int(np.prod(shape)) * 4
    header = json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": "FP32",
                                     "parameters": {"binary_data_size": size}}]})
    return len(header) + size


def small_request(server) -> None:
    y = infer("http", client("http", server), "moe", {"x": np.ones((1, 3, 64), np.float32)}, ["y"])["y"]
    assert y.shape == (1, 3, 64)


def test_requests_over_the_limit_are_refused_before_triton_and_memory_stays(server) -> None:
    limit = int(server.options.max_request_mb * 2**20)
    small_request(server)
    time.sleep(0.5)
    before = tree_pss_mb(os.getpid())
    http_port = int(server.http_url.rsplit(":", 1)[1])
    sent = subprocess.run([sys.executable, "-c", SENDER, HOST, str(http_port), server.grpc_url, str(ROUNDS),
                           json.dumps(BIG_SHAPE)], capture_output=True, text=True, timeout=300)
    assert sent.returncode == 0, sent.stderr[-2000:]
    answers = json.loads(sent.stdout)
    for kind, status, text in answers:
        assert "\n" not in text.strip() and "Traceback" not in text, (kind, text)
        if kind == "grpc":
            assert status == "StatusCode.RESOURCE_EXHAUSTED", (kind, status, text)
            assert f"vs. {limit})" in text, text  # grpcio's reason: "... larger than max (<size> vs. <limit>)"
            continue
        assert status == 413, (kind, status, text)
        message = json.loads(text)["error"]
        stated = "sent without a length, or compressed" if kind == "http chunked" else f"{binary_body_bytes(BIG_SHAPE)} bytes"
        assert message == (f"the request body ({stated}) is over the server's limit of {limit} bytes (64 MiB); "
                           "moedeploy serve --max-request-mb raises it"), message
    assert len(answers) == 3 * ROUNDS
    small_request(server)  # and the server still serves
    time.sleep(1.0)
    after = tree_pss_mb(os.getpid())
    assert after < before * 1.10, f"server memory went from {before:.0f} MB to {after:.0f} MB"


def test_cancelled_requests_forget_and_stay_bounded() -> None:
    from moedeploy.serving.front import CancelledRequests

    cancelled = CancelledRequests(ttl_s=3600, max_ids=3)
    for i in range(5):
        cancelled.cancel(f"id{i}")
    assert len(cancelled) == 3 and not cancelled.is_cancelled("id0") and cancelled.is_cancelled("id4")
    cancelled.forget(["id3", "id4", "unknown"])
    assert len(cancelled) == 1
    stale = CancelledRequests(ttl_s=0.0)
    stale.cancel("old")
    time.sleep(0.01)
    stale.cancel("new")  # an id no generation ever forgot is dropped once older than ttl_s
    assert not stale.is_cancelled("old") and len(stale) == 1


def test_a_group_stops_only_when_every_request_in_it_is_cancelled(tmp_path) -> None:
    """HTTP ids (the front's registry) and gRPC tokens (stub_guard's marker files) mix in one group."""
    from moedeploy.models.generation import SamplingConfig
    from moedeploy.serving.decoder import GenerationModel, GenerationRequest
    from moedeploy.serving.front import CancelledRequests

    cancelled = CancelledRequests()
    model = GenerationModel(None, tmp_path, cancelled)  # type: ignore[arg-type] (no decoding here)

    def request(token: str | None = None, request_id: str | None = None) -> GenerationRequest:
        return GenerationRequest(np.zeros((1, 3), np.int64), 4, SamplingConfig(), None, token, request_id)

    group = [request(request_id="http-1"), request(token="grpc-1")]
    stop = model.all_cancelled(group)
    cancelled.cancel("http-1")
    assert not stop()
    (tmp_path / "grpc-1").touch()
    assert stop()
    assert not model.all_cancelled([*group, request()])()  # a request nobody can cancel keeps it running


