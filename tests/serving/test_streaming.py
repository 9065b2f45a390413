"""`<name>_stream`: each new token is its own response, over gRPC streaming (tritonclient) and
Triton's HTTP generate_stream (server-sent events), with text in and out through the artifact's
own tokenizer. Streamed tokens equal the non-streamed generation's and transformers' greedy
tokens; the text pieces join to the tokenizer's decode, no piece splitting a character."""

from __future__ import annotations

import json
import queue
import time
import urllib.request

import numpy as np
import pytest
import torch

from tests.families.cases import cases, make_model, save_checkpoint
from tests.serving.helpers import HOST, client, free_ports, infer
from tests.text_helpers import VOCAB, write_tokenizer

MODEL = "decoder_stream"
PROMPT = "café 🙂 and the cat"
NEW = 10


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, transformers model, artifact): a 2-layer Mixtral with its tokenizer, exported and served."""
    pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton")
    pytest.importorskip("tritonclient.grpc", reason="the serving tests talk to Triton through tritonclient[all]")
    from moedeploy.export.exporter import export
    from moedeploy.serving import ModelServer, ServeOptions

    config = cases(n_layers=2)["mixtral-window"]
    config.vocab_size = VOCAB + 8
    root = tmp_path_factory.mktemp("streaming")
    hf = make_model(config, seed=2)
    checkpoint = save_checkpoint(hf, root / "checkpoint")
    write_tokenizer(checkpoint)
    artifact = export("decoder", root / "artifact", checkpoint=checkpoint, golden=False)
    http, grpc, metrics = free_ports(3)
    options = ServeOptions(backend="ort", host=HOST, http_port=http, grpc_port=grpc, metrics_port=metrics,
                           exit_timeout_s=1, log_file=root / "tritonserver.log")
    with ModelServer([artifact], options) as server:
        yield server, hf, artifact


def grpc_stream(server, inputs: dict[str, np.ndarray]) -> list[tuple[float, object, object]]:
    """Every (arrival time, result, error) of one streamed request, up to its final response."""
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
    c.async_stream_infer(MODEL, tensors, enable_empty_final_response=True)
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


def tokens_and_text(got) -> tuple[list[int], list[str]]:
    tokens, pieces = [], []
    for _, result, error in got:
        assert error is None, error
        ids = result.as_numpy("output_ids")
        if ids is None:  # the empty final response
            continue
        tokens += ids.reshape(-1).tolist()
        pieces += [p.decode("utf-8") for p in result.as_numpy("text_output").reshape(-1)]
    return tokens, pieces


@torch.no_grad()
def test_grpc_stream_sends_transformers_tokens_one_by_one_with_their_text(served) -> None:
    from moedeploy.runtime.text import TextCodec

    server, hf, artifact = served
    codec = TextCodec.from_artifact(artifact)
    ids = codec.encode(PROMPT)
    expected = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, len(ids):]
    got = grpc_stream(server, {"text_input": np.array([[PROMPT.encode()]], dtype=np.object_),
                               "max_tokens": np.array([[NEW]], dtype=np.int64)})
    tokens, pieces = tokens_and_text(got)
    assert tokens == expected.tolist()
    assert len(got) == NEW + 1  # one response per token, then the empty final one
    assert got[0][0] < got[NEW - 1][0]  # the first token arrived before the last was sent
    # the pieces join to the decode of all tokens (random weights make arbitrary byte tokens, so that
    # decode may itself hold U+FFFD; that no piece splits a character is tests/export/test_tokenizer.py's)
    assert "".join(pieces) == codec.decode(tokens)
    assert sum(bool(p) for p in pieces) > 1  # the text came piece by piece, not at the end

    # the same prompt as ids, and the non-streamed generation of the same server
    by_ids, _ = tokens_and_text(grpc_stream(server, {"input_ids": np.array([ids], dtype=np.int64),
                                                     "max_tokens": np.array([[NEW]], dtype=np.int64)}))
    whole = infer("grpc", client("grpc", server), "decoder_generate",
                  {"input_ids": np.array([ids], dtype=np.int64), "max_new_tokens": np.array([[NEW]], dtype=np.int64)},
                  ["output_ids"])["output_ids"]
    assert by_ids == tokens == whole[0, len(ids):].tolist()


def test_http_generate_stream_sends_server_sent_events(served) -> None:
    server, *_ = served
    body = json.dumps({"text_input": PROMPT, "max_tokens": NEW}).encode()
    request = urllib.request.Request(f"http://{HOST}:{server.options.http_port}/v2/models/{MODEL}/generate_stream",
                                     data=body, headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers.get_content_type() == "text/event-stream"
        for line in response:
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: "):]))
    grpc_tokens, grpc_pieces = tokens_and_text(grpc_stream(server, {
        "text_input": np.array([[PROMPT.encode()]], dtype=np.object_), "max_tokens": np.array([[NEW]], dtype=np.int64)}))
    assert [e["output_ids"] for e in events if "output_ids" in e] == grpc_tokens
    assert "".join(e["text_output"] for e in events if "text_output" in e) == "".join(grpc_pieces)


def test_a_bad_stream_request_gets_its_own_one_line_error(served) -> None:
    server, *_ = served
    (_, _, error), = grpc_stream(server, {"text_input": np.array([[b"hi"]], dtype=np.object_),
                                          "max_tokens": np.array([[10_000]], dtype=np.int64)})
    assert "max_tokens (10000) exceeds max_positions" in str(error)
    (_, _, error), = grpc_stream(server, {"max_tokens": np.array([[4]], dtype=np.int64)})
    assert "send the prompt as 'text_input' or as 'input_ids', one of them" in str(error)
    # the server goes on: a good request right after
    tokens, _ = tokens_and_text(grpc_stream(server, {"text_input": np.array([[b"hi"]], dtype=np.object_),
                                                     "max_tokens": np.array([[3]], dtype=np.int64)}))
    assert len(tokens) == 3
