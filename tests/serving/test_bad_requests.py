"""A bad request gets a client error (HTTP 400, gRPC INVALID_ARGUMENT) whose message is one line
naming the problem, never a traceback, and the server keeps serving.

Triton rejects unknown names, wrong dtypes and ranks, oversized batches and malformed bodies
itself; requests past the artifact's dynamic ranges, empty tensors and requests without a
required input are refused in Triton's stub (stub_guard); requests that are well-formed but
unservable (too long, token ids outside the vocabulary, bad options) by our model callables.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from tests.export.artifacts import eager_block
from tests.serving import helpers
from tests.serving.helpers import PROTOCOLS, client, infer

InferenceServerException = pytest.importorskip("tritonclient.utils", reason="needs tritonclient[all]").InferenceServerException


def still_serving(server) -> None:
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    y = infer("http", client("http", server), "moe", {"x": x.numpy()}, ["y"])["y"]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(y), eager_block("moe")(x), atol=1e-5, rtol=1e-5)
    assert server.is_alive()


CLIENT_ERROR = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}


def refused(protocol: str, server, model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> str:
    """The error message of a request that must be refused as the client's error, in one line."""
    with pytest.raises(InferenceServerException) as info:
        infer(protocol, client(protocol, server), model, inputs, outputs)
    message = info.value.message()
    assert str(info.value.status()) == CLIENT_ERROR[protocol], message
    assert "\n" not in message.strip() and "Traceback" not in message and ".py" not in message, message
    return message


X = np.zeros((2, 3, 64), np.float32)
IDS = np.zeros((1, 4), np.int64)

CASES = {
    "unknown input name": ("moe", {"x": X, "z": X}, "Got input(s) ['z','x']"),
    "missing input": ("moe", {"z": X}, "unexpected inference input 'z'"),
    "wrong dtype": ("moe", {"x": X.astype(np.float64)}, "inference input 'x' data-type is 'FP64', but model 'moe' expects 'FP32'"),
    "wrong shape": ("moe", {"x": np.zeros((2, 3, 32), np.float32)}, "unexpected shape for input 'x' for model 'moe'"),
    "wrong rank": ("moe", {"x": np.zeros((2, 64), np.float32)}, "unexpected shape for input 'x'"),
    "batch over the limit": ("moe", {"x": np.zeros((17, 3, 64), np.float32)}, "batch-size must be <= 16"),
    "prompt too long": ("decoder_generate", {"input_ids": IDS, "max_new_tokens": np.array([[300]])},
                        "prompt (4) + max_new_tokens (300) exceeds max_positions 256"),
    "token outside the vocabulary": ("decoder_generate", {"input_ids": np.array([[1, 2, 256]])},
                                     "input_ids holds token id 256, outside the vocabulary [0, 256)"),
    "bad top_p": ("decoder_generate", {"input_ids": IDS, "temperature": np.array([[1.0]], np.float32),
                                       "top_p": np.array([[1.5]], np.float32)}, "top_p must lie in (0, 1], got 1.5"),
    "options differ within a request": ("decoder_generate", {"input_ids": np.zeros((2, 4), np.int64),
                                                              "max_new_tokens": np.array([[3], [4]])},
                                        "max_new_tokens must be the same for every sequence of one request"),
    "half a KV cache": ("decoder", {"input_ids": IDS, "past_key_values.0.key": np.zeros((1, 2, 3, 16), np.float32)},
                        "send all 4 past_key_values.* inputs or none"),
    "negative max_new_tokens": ("decoder_generate", {"input_ids": IDS, "max_new_tokens": np.array([[-1]])},
                                "max_new_tokens must be >= 0, got -1"),
    "negative temperature": ("decoder_generate", {"input_ids": IDS, "temperature": np.array([[-0.5]], np.float32)},
                             "temperature"),
    "bad top_k": ("decoder_generate", {"input_ids": IDS, "temperature": np.array([[1.0]], np.float32),
                                       "top_k": np.array([[0]])}, "top_k"),
    "NaN temperature": ("decoder_generate", {"input_ids": IDS, "temperature": np.array([[np.nan]], np.float32)},
                        "temperature must be a finite number"),
    # refused before the model runs (they used to raise KeyError, TypeError or an ONNX Runtime error)
    "generation without input_ids": ("decoder_generate", {"max_new_tokens": np.array([[3]])},
                                     "missing required input 'input_ids'"),
    "empty prompt": ("decoder_generate", {"input_ids": np.zeros((1, 0), np.int64)},
                     "input 'input_ids' has shape [1, 0]: dim 1 (seq) is empty"),
    "empty block input": ("moe", {"x": np.zeros((1, 0, 64), np.float32)}, "input 'x' has shape [1, 0, 64]: dim 1 (seq) is empty"),
    "empty KV cache": ("decoder", {"input_ids": IDS, **dict.fromkeys(
        [f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")], np.zeros((1, 2, 0, 16), np.float32))},
        "leave every past_key_values.* input out for an empty cache"),
    "logits prompt past the range": ("decoder", {"input_ids": np.zeros((1, 300), np.int64)},
                                     "input 'input_ids' has shape [1, 300]: dim 1 (seq) is 300, outside the model's range [1, "),
    "sequence far past the range": ("moe", {"x": np.zeros((1, 4096, 64), np.float32)},
                                    "input 'x' has shape [1, 4096, 64]: dim 1 (seq) is 4096, outside the model's range [1, "),
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_is_refused_by_name(server, protocol: str, case: str) -> None:
    model, inputs, message = CASES[case]
    outputs = ["output_ids"] if model.endswith("_generate") else ["y"] if model == "moe" else ["logits"]
    assert message in refused(protocol, server, model, inputs, outputs)
    still_serving(server)


def test_a_refusal_logs_one_line(server, caplog: pytest.LogCaptureFixture) -> None:
    """The server's log gets the reason in one line, not PyTriton's traceback of an exception."""
    caplog.set_level(logging.INFO)
    refused("http", server, "decoder_generate", {"input_ids": np.array([[1, 2, 300]])}, ["output_ids"])
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in records] == [
        "decoder_generate: refused a request: input_ids holds token id 300, outside the vocabulary [0, 256)"
    ]
    assert records[0].exc_info is None


def test_unknown_model_is_refused(server) -> None:
    with pytest.raises(InferenceServerException) as info:
        infer("grpc", client("grpc", server), "no_such_model", {"x": X}, ["y"])
    assert str(info.value.status()) == "StatusCode.NOT_FOUND"
    assert "no_such_model" in info.value.message()


def post(server, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
    return helpers.post(f"http://{server.http_url}{path}", body, headers)


def test_an_empty_tensor_in_a_json_body_is_refused(server) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 0, 64], "datatype": "FP32", "data": []}]}
    status, text = post(server, "/v2/models/moe/infer", json.dumps(body).encode())
    assert (status, json.loads(text)["error"]) == (400, "input 'x' has shape [1, 0, 64]: dim 1 (seq) is empty; "
                                                        "send at least one element along every dim")
    still_serving(server)


@pytest.mark.parametrize("model", ["moe", "decoder_generate"])
def test_an_empty_body_is_refused(server, model: str) -> None:
    status, text = post(server, f"/v2/models/{model}/infer", b"")
    assert status == 400
    message = json.loads(text)["error"]
    assert "\n" not in message and "Traceback" not in message
    still_serving(server)


def test_malformed_json_body_is_refused(server) -> None:
    status, body = post(server, "/v2/models/moe/infer", b'{"inputs": [ {"name": "x",')
    assert status == 400  # Triton 2.51's parser answered 500; the front answers first
    assert json.loads(body)["error"].startswith("the request body is not valid JSON: Expecting")
    still_serving(server)


def test_data_that_does_not_fill_the_shape_is_refused(server) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 2, 64], "datatype": "FP32", "data": [0.0] * 5}]}
    status, text = post(server, "/v2/models/moe/infer", json.dumps(body).encode())
    assert (status, json.loads(text)["error"]) == (
        400, "inputs[0] (x): shape [1, 2, 64] holds 128 values but data has 5; send as many values as the shape holds")
    still_serving(server)


@pytest.mark.parametrize(("body", "message"), [
    # Triton allocated 25 GB for this 300-byte body's declared shape before counting its data,
    # and died of std::bad_alloc, the whole server with it
    ({"inputs": [{"name": "x", "shape": [1, 100_000_000, 64], "datatype": "FP32", "data": [[0.5] * 64]}]},
     "inputs[0] (x): shape [1, 100000000, 64] holds 6,400,000,000 values but data has 64; send as many values as "
     "the shape holds"),
    ({}, '"inputs" must be a non-empty list of input objects ({"name", "shape", "datatype", "data"})'),
    ({"inputs": [{"name": "x", "shape": [1, -1, 64], "datatype": "FP32", "data": [0.5] * 64}]},
     "inputs[0] (x): shape must be a list of non-negative integers"),
    ([1, 2], 'the request body must be a JSON object with "inputs"'),
    # values of the wrong JSON type: Triton's parser answered 500
    ({"inputs": [{"name": "x", "shape": [1, 1, 64], "datatype": "FP32", "data": ["hot"] + [0.5] * 63}]},
     'inputs[0] (x): data holds "hot", which is not of datatype FP32; send numbers'),
    ({"inputs": [{"name": "x", "shape": [1, 1, 64], "datatype": "FP32", "data": [0.5] * 64}],
      "parameters": {"binary_data_output": "yes"}},
     'the request\'s parameter "binary_data_output" must be true or false, got "yes"'),
])
def test_an_inference_body_triton_would_choke_on_is_refused_by_the_front(server, body, message) -> None:
    status, text = post(server, "/v2/models/moe/infer", json.dumps(body).encode())
    assert (status, json.loads(text)["error"]) == (400, message)
    still_serving(server)


def padded(body: dict) -> bytes:
    """`body`'s JSON with 3 MiB of spaces before its last brace: still valid JSON, and past the
    size the front parses in its event loop (PARSED_JSON_BYTES)."""
    from moedeploy.serving.infer_body import PARSED_JSON_BYTES

    raw = json.dumps(body).encode()
    return raw[:-1] + b" " * (PARSED_JSON_BYTES + 2**20) + b"}"


@pytest.mark.parametrize(("data", "message"), [
    (["hot"] + [0.5] * 127, 'inputs[0] (x): data holds "hot", which is not of datatype FP32; send numbers'),
    ([0.5] * 100, "inputs[0] (x): shape [1, 2, 64] holds 128 values but data has 100; send as many values as the "
                  "shape holds"),
])
def test_a_large_body_triton_answers_500_gets_the_reason_and_400(server, data: list, message: str) -> None:
    """A JSON part too large to parse in the front's loop (it would stall every stream for
    seconds) reaches Triton on its declared shapes alone. Triton's parser answered these 500; the
    front then checks the whole body in a child process and answers 400 with the reason. A good
    body of that size passes through and is answered as usual."""
    body = {"inputs": [{"name": "x", "shape": [1, 2, 64], "datatype": "FP32", "data": data}]}
    status, text = post(server, "/v2/models/moe/infer", padded(body))
    assert (status, json.loads(text)["error"]) == (400, message)
    x = np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(1, 2, 64)
    status, text = post(server, "/v2/models/moe/infer", padded({**body, "inputs": [
        {**body["inputs"][0], "data": x.ravel().tolist()}]}))
    assert status == 200, text
    with torch.no_grad():
        expected = eager_block("moe")(torch.from_numpy(x)).numpy().ravel()
    np.testing.assert_allclose(json.loads(text)["outputs"][0]["data"], expected, atol=1e-5, rtol=1e-5)
    still_serving(server)


@pytest.mark.parametrize("path", ["/v2/models/moe/infer", "/v2/models/decoder_generate/generate"])
def test_json_nested_too_deep_and_a_false_content_encoding_are_refused(server, path: str, caplog) -> None:
    """Python's JSON parser raises RecursionError, not ValueError, past its nesting limit, and a
    body that is not the gzip its Content-Encoding says failed in aiohttp: both answered 500. The
    second is answered without aiohttp logging it as an unhandled exception (three tracebacks a
    request: a log any client could flood)."""
    import time

    deep = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, text = post(server, path, deep)
    assert (status, json.loads(text)["error"]) == (400, "the request body is not valid JSON: it is nested too deep")
    with caplog.at_level(logging.DEBUG, logger="aiohttp"):
        status, text = post(server, path, b'{"inputs": []}', {"Content-Encoding": "gzip"})
        time.sleep(0.5)  # aiohttp drains and logs after the answer is sent
    assert (status, json.loads(text)["error"]) == (
        400, "the request body is not valid gzip data, as its Content-Encoding says; send it encoded so, or without "
             "that header")
    assert "Unhandled exception" not in caplog.text and "zlib" not in caplog.text, caplog.text[-2000:]
    still_serving(server)


@pytest.mark.parametrize("head", [
    b"Content-Length: abc\r\n",
    b"Content-Length: -5\r\n",
    b"Content-Length: 2\r\nContent-Length: 3\r\n",
    b"X-Long: " + b"a" * 9000 + b"\r\n",
])
def test_a_request_aiohttp_cannot_parse_is_one_log_line_not_a_traceback(server, head: bytes, caplog) -> None:
    """aiohttp answers these 400 itself, before any handler of ours, and logged each as "Error
    handling request" with a traceback of about ten lines: a log any client could flood."""
    import socket
    import time

    host, port = server.http_url.rsplit(":", 1)
    with caplog.at_level(logging.DEBUG):
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            connection.sendall(b"POST /v2/models/moe/infer HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n{}")
            answer = connection.recv(65536)
        time.sleep(0.2)
    assert answer.split(b" ", 2)[1] == b"400", answer[:200]
    assert "Traceback" not in caplog.text and "Error handling request" not in caplog.text, caplog.text[-2000:]
    (line,) = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert line.startswith(f"refused a malformed HTTP request on port {port}: ") and "\n" not in line, line
    assert line.split(": ", 2)[2].strip(), line  # aiohttp's reason, not only the exception's name
    still_serving(server)


def test_a_gzip_inference_body_is_read_decompressed(server) -> None:
    import gzip

    x = np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(1, 2, 64)
    body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    status, text = post(server, "/v2/models/moe/infer", gzip.compress(json.dumps(body).encode()),
                        {"Content-Encoding": "gzip"})
    assert status == 200, text
    with torch.no_grad():
        expected = eager_block("moe")(torch.from_numpy(x)).numpy().ravel()
    np.testing.assert_allclose(json.loads(text)["outputs"][0]["data"], expected, atol=1e-5, rtol=1e-5)


def test_a_json_request_without_the_client_library_works(server) -> None:
    """Plain KServe v2 JSON, as curl would send it."""
    x = np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(1, 2, 64)
    body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    status, text = post(server, "/v2/models/moe/infer", json.dumps(body).encode())
    assert status == 200
    out = json.loads(text)["outputs"][0]
    assert out["name"] == "y" and out["shape"] == [1, 2, 64]
    with torch.no_grad():
        expected = eager_block("moe")(torch.from_numpy(x)).numpy().ravel()
    np.testing.assert_allclose(out["data"], expected, atol=1e-5, rtol=1e-5)
