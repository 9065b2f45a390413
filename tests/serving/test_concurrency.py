"""16 clients x 50 requests at once, half over HTTP and half over gRPC, with mixed batch and
sequence sizes: zero errors, every response equal to eager PyTorch on its own input, and
Triton's dynamic batcher really merged requests (fewer executions than requests)."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from tests.export.artifacts import eager_block
from tests.serving.helpers import PROTOCOLS, client, infer, metric

CLIENTS = 16
REQUESTS = 50
DEADLINE_S = 240  # the whole run; on 2 cores it takes a fraction of this


def request_input(c: int, i: int) -> np.ndarray:
    g = torch.Generator().manual_seed(c * 1000 + i)
    batch, seq = 1 + (c + i) % 3, (1, 4, 16)[i % 3]
    return torch.randn(batch, seq, 64, generator=g).numpy()


def counters(server) -> tuple[float, float, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return (metric(text, "nv_inference_request_success", "moe"), metric(text, "nv_inference_exec_count", "moe"),
            metric(text, "nv_inference_request_failure", "moe"))


def test_sixteen_clients_fifty_requests_each(server, store) -> None:
    tolerance = store.block("moe").manifest["tolerances"]["y"]
    inputs = [[request_input(c, i) for i in range(REQUESTS)] for c in range(CLIENTS)]
    module = eager_block("moe")
    with torch.no_grad():
        expected = [[module(torch.from_numpy(x)).numpy() for x in row] for row in inputs]
    before = counters(server)
    start = time.monotonic()

    def run_client(c: int) -> tuple[int, int]:
        protocol = PROTOCOLS[c % 2]
        conn = client(protocol, server)
        errors = wrong = 0
        try:
            for i in range(REQUESTS):
                if time.monotonic() - start > DEADLINE_S:
                    errors += REQUESTS - i
                    break
                try:
                    y = infer(protocol, conn, "moe", {"x": inputs[c][i]}, ["y"])["y"]
                except Exception:
                    errors += 1
                    continue
                if y.shape != expected[c][i].shape or not np.allclose(y, expected[c][i], **tolerance):
                    wrong += 1
        finally:
            conn.close()  # in this thread: gevent's HTTP client must not be torn down from another
        return errors, wrong

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(run_client, range(CLIENTS), timeout=DEADLINE_S + 30))
    assert sum(e for e, _ in results) == 0, results
    assert sum(w for _, w in results) == 0, results

    after = counters(server)
    requests, executions, failures = (a - b for a, b in zip(after, before, strict=True))
    assert requests == CLIENTS * REQUESTS
    assert failures == 0
    assert executions < requests  # the dynamic batcher merged concurrent requests
