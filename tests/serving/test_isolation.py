"""One client's bad requests never fail, change or reach another client's requests.

Eight good clients and one bad client hit the same model at once, so Triton's dynamic batcher
puts their requests into the same executions (checked: fewer executions than requests). The
bad requests have the good ones' shapes and dtypes: only their values are wrong. Every good
answer must equal eager PyTorch, every bad one must be a client error (HTTP 400 / gRPC
INVALID_ARGUMENT) carrying its own one-line reason, which names its own bad token id.
"""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tests.export.artifacts import eager_decoder
from tests.serving.helpers import PROTOCOLS, client, infer, metric

InferenceServerException = pytest.importorskip("tritonclient.utils", reason="needs tritonclient[all]").InferenceServerException

GOOD_CLIENTS = 8
GOOD_REQUESTS = 6  # per good client
BAD_REQUESTS = 40  # at most, sent while the good clients run
NEW_TOKENS = 4
SEQ = 6
DEADLINE_S = 120


@pytest.fixture(scope="module")
def decoder():
    return eager_decoder()


def prompts() -> list[np.ndarray]:
    g = torch.Generator().manual_seed(12)
    return [torch.randint(0, 256, (1, SEQ), generator=g).numpy() for _ in range(GOOD_CLIENTS)]


CLIENT_ERROR = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}


def executions(server, model: str) -> tuple[float, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return metric(text, "nv_inference_request_success", model) + metric(text, "nv_inference_request_failure", model), \
        metric(text, "nv_inference_exec_count", model)


def mixed_traffic(server, protocol: str, model: str, good_feed, check_good, bad_feed) -> None:
    """GOOD_CLIENTS x GOOD_REQUESTS good requests while one client sends bad ones; assert each answer."""
    before = executions(server, model)
    outputs = ["output_ids"] if model.endswith("_generate") else ["logits"]
    done = []
    start = time.monotonic()

    def good(c: int) -> list[str]:
        conn, problems = client(protocol, server), []
        try:
            for _ in range(GOOD_REQUESTS):
                try:
                    got = infer(protocol, conn, model, good_feed(c), outputs)[outputs[0]]
                except InferenceServerException as e:
                    problems.append(f"good client {c} failed: {e.message()}")
                    continue
                if not check_good(c, got):
                    problems.append(f"good client {c} got a wrong answer")
        finally:
            conn.close()
            done.append(c)
        return problems

    def bad() -> list[str]:
        conn, problems, k = client(protocol, server), [], 0
        try:
            while len(done) < GOOD_CLIENTS and k < BAD_REQUESTS and time.monotonic() - start < DEADLINE_S:
                token = 256 + k  # its own bad id: the error must name this one, not another request's
                try:
                    infer(protocol, conn, model, bad_feed(token), outputs)
                    problems.append(f"bad request {token} was answered")
                except InferenceServerException as e:
                    message, status = e.message(), str(e.status())
                    if status != CLIENT_ERROR[protocol]:
                        problems.append(f"bad request {token}: status {status}")
                    if f"token id {token}," not in message or "\n" in message.strip() or "Traceback" in message:
                        problems.append(f"bad request {token}: message {message!r}")
                k += 1
        finally:
            conn.close()
        return problems + ([] if k >= 3 else [f"only {k} bad requests were sent"])

    with ThreadPoolExecutor(GOOD_CLIENTS + 1) as pool:
        bad_future = pool.submit(bad)
        good_futures = [pool.submit(good, c) for c in range(GOOD_CLIENTS)]
        problems = [p for f in good_futures for p in f.result(timeout=DEADLINE_S + 30)]
        problems += bad_future.result(timeout=DEADLINE_S + 30)
    assert problems == [], problems[:10]
    requests, execs = (a - b for a, b in zip(executions(server, model), before, strict=True))
    assert execs < requests  # the batcher really put requests (good and bad) together


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_generation_requests_fail_alone(server, decoder, protocol: str) -> None:
    ids = prompts()
    expected = [decoder.generate(torch.from_numpy(p), max_new_tokens=NEW_TOKENS).numpy() for p in ids]
    budget = np.array([[NEW_TOKENS]], np.int64)

    def bad_feed(token: int) -> dict[str, np.ndarray]:
        bad = ids[0].copy()
        bad[0, 2] = token
        return {"input_ids": bad, "max_new_tokens": budget}

    mixed_traffic(
        server, protocol, "decoder_generate",
        good_feed=lambda c: {"input_ids": ids[c], "max_new_tokens": budget},
        check_good=lambda c, got: np.array_equal(got, expected[c]),
        bad_feed=bad_feed,
    )


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_logits_requests_fail_alone(server, decoder, protocol: str) -> None:
    ids = prompts()
    with torch.no_grad():
        expected = [decoder(torch.from_numpy(p)).numpy() for p in ids]

    def bad_feed(token: int) -> dict[str, np.ndarray]:
        bad = ids[1].copy()
        bad[0, -1] = token
        return {"input_ids": bad}

    mixed_traffic(
        server, protocol, "decoder",
        good_feed=lambda c: {"input_ids": ids[c]},
        check_good=lambda c, got: got.shape == expected[c].shape and np.allclose(got, expected[c], atol=1e-4, rtol=1e-4),
        bad_feed=bad_feed,
    )
