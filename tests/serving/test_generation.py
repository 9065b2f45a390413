"""Generation through the server equals eager PyTorch's `MoEDecoder.generate`: greedy, seeded
sampling, and greedy requests that Triton batches together."""

from __future__ import annotations

import json
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tests.export.artifacts import eager_decoder
from tests.serving.helpers import HOST, PROTOCOLS, client, infer

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def decoder():
    return eager_decoder()


def prompt(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def options(batch: int, **values) -> dict[str, np.ndarray]:
    """Optional inputs hold one value per request, repeated in every row: shape [batch, 1]."""
    dtypes = {"temperature": np.float32, "top_p": np.float32}
    return {k: np.full((batch, 1), v, dtype=dtypes.get(k, np.int64)) for k, v in values.items()}


def generate(protocol: str, server, ids: torch.Tensor, **values) -> torch.Tensor:
    feed = {"input_ids": ids.numpy(), **options(len(ids), **values)}
    out = infer(protocol, client(protocol, server), "decoder_generate", feed, ["output_ids"])["output_ids"]
    return torch.from_numpy(out)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_greedy_generation_equals_eager(server, decoder, protocol: str) -> None:
    ids = prompt(2, 7, seed=42)
    expected = decoder.generate(ids, max_new_tokens=NEW_TOKENS)
    tokens = generate(protocol, server, ids, max_new_tokens=NEW_TOKENS)
    assert tokens.shape == (2, 7 + NEW_TOKENS)
    assert torch.equal(tokens, expected)
    assert len(set(tokens[0, 7:].tolist())) > 3  # a real continuation, not one token repeated


def test_default_token_budget_is_generates(server, decoder) -> None:
    ids = prompt(1, 5, seed=1)
    assert torch.equal(generate("http", server, ids), decoder.generate(ids))  # both default to 32 tokens


def test_seeded_sampling_equals_eager(server, decoder) -> None:
    ids = prompt(2, 6, seed=7)
    kwargs = dict(max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    expected = decoder.generate(ids, **kwargs)
    assert not torch.equal(expected, decoder.generate(ids, max_new_tokens=NEW_TOKENS))  # it really sampled
    assert torch.equal(generate("grpc", server, ids, **kwargs), expected)
    assert not torch.equal(generate("grpc", server, ids, **{**kwargs, "seed": 99}), expected)


def test_eos_stops_like_eager(server, decoder) -> None:
    ids = prompt(1, 6, seed=5)
    greedy = decoder.generate(ids, max_new_tokens=NEW_TOKENS)
    eos = int(greedy[0, 6 + 3])  # the fourth generated token
    expected = decoder.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    tokens = generate("http", server, ids, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    assert torch.equal(tokens, expected)
    assert tokens.shape[1] < 6 + NEW_TOKENS


def test_concurrent_greedy_requests_each_equal_eager(server, decoder) -> None:
    """12 requests from 4 clients at once: Triton batches them, each still gets its own tokens."""
    prompts = [prompt(1 + i % 2, 8 if i % 3 else 5, seed=100 + i) for i in range(12)]
    expected = [decoder.generate(p, max_new_tokens=16) for p in prompts]

    def request(i: int) -> torch.Tensor:
        return generate(PROTOCOLS[i % 2], server, prompts[i], max_new_tokens=16)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(request, range(12), timeout=120))
    for got, want in zip(results, expected, strict=True):
        assert torch.equal(got, want)


def test_a_cancelled_generation_stops_and_frees_the_model(server, decoder, caplog: pytest.LogCaptureFixture) -> None:
    """A gRPC client cancels a long generation: the server stops decoding it (Triton reports the
    cancellation to its stub, stub_guard marks it, the loop checks before every token), so the
    next request does not wait for the abandoned tokens. The cancellation passes through
    moedeploy's gRPC front, which cancels its own call to Triton."""
    import tritonclient.grpc as grpc

    long_ids = prompt(1, 6, seed=3)
    generate("grpc", server, long_ids, max_new_tokens=240)  # warm, so the timed run is like the one cancelled
    start = time.monotonic()
    generate("grpc", server, long_ids, max_new_tokens=240)
    long_s = time.monotonic() - start

    caplog.set_level(logging.INFO, logger="moedeploy.serving")
    c = grpc.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, array in {"input_ids": long_ids.numpy(), "max_new_tokens": np.array([[240]])}.items():
        tensor = grpc.InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    call = c.async_infer("decoder_generate", inputs, callback=lambda *_, **__: None)
    time.sleep(long_s / 5)
    call.cancel()
    short_ids = prompt(1, 5, seed=4)
    start = time.monotonic()
    tokens = generate("grpc", server, short_ids, max_new_tokens=4)
    short_s = time.monotonic() - start
    c.close()
    assert torch.equal(tokens, decoder.generate(short_ids, max_new_tokens=4))
    stopped = [r.getMessage() for r in caplog.records if "its client cancelled the request" in r.getMessage()]
    assert len(stopped) == 1, stopped
    position = int(stopped[0].split("position ")[1].split(":")[0])
    assert 6 < position < 6 + 240
    assert short_s < long_s


def test_an_http_client_that_disconnects_frees_the_model(server, decoder, caplog: pytest.LogCaptureFixture) -> None:
    """An HTTP client sends a long generation and closes its connection: the front marks the
    request cancelled (Triton 2.51 itself detects no HTTP cancellation), the generation stops at
    its next token, and the next request is answered without waiting for the abandoned tokens."""
    long_ids = prompt(1, 6, seed=3)
    start = time.monotonic()
    generate("http", server, long_ids, max_new_tokens=240)
    long_s = time.monotonic() - start

    caplog.set_level(logging.INFO, logger="moedeploy.serving")
    body = json.dumps({"inputs": [
        {"name": "input_ids", "shape": [1, 6], "datatype": "INT64", "data": long_ids.ravel().tolist()},
        {"name": "max_new_tokens", "shape": [1, 1], "datatype": "INT64", "data": [240]},
    ]}).encode()
    port = int(server.http_url.rsplit(":", 1)[1])
    with socket.create_connection((HOST, port), timeout=30) as raw:
        raw.sendall(b"POST /v2/models/decoder_generate/infer HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (HOST.encode(), len(body), body))
        time.sleep(long_s / 5)
    short_ids = prompt(1, 5, seed=4)
    start = time.monotonic()
    tokens = generate("http", server, short_ids, max_new_tokens=4)
    short_s = time.monotonic() - start
    assert torch.equal(tokens, decoder.generate(short_ids, max_new_tokens=4))
    # without the cancellation it would wait for the rest of the abandoned generation (~0.8 long_s)
    assert short_s < long_s / 2, f"the next request took {short_s:.2f} s; the whole long generation {long_s:.2f} s"
    stopped = [r.getMessage() for r in caplog.records if "its client cancelled the request" in r.getMessage()]
    assert len(stopped) == 1, stopped
    position = int(stopped[0].split("position ")[1].split(":")[0])
    assert 6 < position < 6 + 240
    assert len(server.cancelled) == 0  # the stopped generation forgot its id: nothing accumulates
