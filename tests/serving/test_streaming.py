"""`<name>_stream`: each new token is its own response, over gRPC streaming (tritonclient) and
Triton's HTTP generate_stream (server-sent events), with text in and out through the artifact's
own tokenizer. Streamed tokens equal the non-streamed generation's and transformers' greedy
tokens; the text pieces join to the tokenizer's decode, no piece splitting a character."""

from __future__ import annotations

import json
import logging
import queue
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from tests.serving.helpers import (
    HOST,
    client,
    free_ports,
    grpc_stream,
    infer,
    repacks,
    result_ids,
    tokens_and_text,
)
from tests.text_helpers import export_with_tokenizer

MODEL = "decoder_stream"
PROMPT = "café 🙂 and the cat"
NEW = 10


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, transformers model, artifact): a 2-layer Mixtral with its tokenizer, exported and served."""
    pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton")
    pytest.importorskip("tritonclient.grpc", reason="the serving tests talk to Triton through tritonclient[all]")
    from moedeploy.serving import ModelServer, ServeOptions

    root = tmp_path_factory.mktemp("streaming")
    hf, artifact = export_with_tokenizer(root)
    http, grpc, metrics, openai = free_ports(4)
    options = ServeOptions(backend="ort", host=HOST, http_port=http, grpc_port=grpc, metrics_port=metrics,
                           openai_port=openai, exit_timeout_s=1, log_file=root / "tritonserver.log")
    with ModelServer([artifact], options) as server:
        yield server, hf, artifact


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
    # a response per token as it is made (the first always alone; several in one only when the
    # client falls behind, tests/serving/test_stream_model.py), then the empty final one
    assert 3 <= len(got) <= NEW + 1 and result_ids(got[0]) == tokens[:1]
    assert got[0][0] < got[-2][0]  # the first token arrived before the last was sent
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
    # Triton's JSON holds a one-token response's id as a number, several as a list
    sse_tokens = [t for e in events if "output_ids" in e
                  for t in (e["output_ids"] if isinstance(e["output_ids"], list) else [e["output_ids"]])]
    assert sse_tokens == grpc_tokens
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


def post(url: str, body: bytes) -> tuple[int, dict]:
    """(status, JSON answer) of a POST, error statuses included."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_generate_requests_triton_would_answer_500_get_400_from_the_front(served) -> None:
    server, *_ = served
    base = f"http://{HOST}:{server.options.http_port}/v2/models"
    assert post(f"{base}/{MODEL}/generate_stream", b'{"text_input": "hi", "max_tokens": "3"}') == (
        400, {"error": "max_tokens must be an integer in int64's range, got \"3\""})
    assert post(f"{base}/{MODEL}/generate_stream", b"{oops") == (
        400, {"error": "the request body is not valid JSON: Expecting property name enclosed in double quotes: "
                       "line 1 column 2 (char 1)"})
    status, answer = post(f"{base}/{MODEL}/generate", json.dumps({"text_input": "hi", "max_tokens": 3}).encode())
    assert (status, answer["error"].split(":")[0]) == (400, f"{MODEL} sends a response per token")
    # a body larger than any prompt of the model's 2,048 positions needs: refused unread
    status, answer = post(f"{base}/{MODEL}/generate_stream", json.dumps({"text_input": "x" * 1_500_000}).encode())
    assert (status, answer["error"].split(" bytes is larger")[0]) == (
        413, f"a generate request to {MODEL} of 1,500,018")
    # compressed, it is counted decompressed against the same limit, which the refusal names
    # (it named --max-request-mb, which cannot raise it)
    import gzip

    request = urllib.request.Request(f"{base}/{MODEL}/generate_stream",
                                     data=gzip.compress(json.dumps({"text_input": "x" * 1_500_000}).encode()),
                                     headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    message = json.loads(e.value.read())["error"]
    assert e.value.code == 413 and message.startswith(f"a generate request to {MODEL} of more than ")
    assert message.endswith("is larger than any prompt of its model's positions needs; send a shorter prompt")
    # a refusal of the model's own, before its first token: one JSON line, 400
    assert post(f"{base}/{MODEL}/generate_stream", b'{"text_input": "hi", "max_tokens": 100000}') == (
        400, {"error": "prompt (3 tokens) + max_tokens (100000) exceeds max_positions 2048"})


def test_openai_prompts_up_to_the_models_positions_are_taken(served, openai_client) -> None:
    """The artifact's graph was exported for 1..1,024 tokens a call; a stream's prompt runs
    through the generation loop, so the API takes prompts up to max_positions (2,048)."""
    from moedeploy.runtime.text import TextCodec

    _, _, artifact = served
    prompt = "the cat " * 350
    n = len(TextCodec.from_artifact(artifact).encode(prompt))
    assert 1024 < n < 2040
    answer = openai_client.completions.create(model="decoder", prompt=prompt, max_tokens=2, temperature=0)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (n, 2)


def test_openai_answers_unknown_paths_and_methods_with_its_error_object(served) -> None:
    server, *_ = served
    with urllib.request.urlopen(f"{server.openai_url}/models/decoder", timeout=30) as response:
        assert json.loads(response.read())["id"] == "decoder"
    for url, method, status in [(f"{server.openai_url}/embeddings", "POST", 404),
                                (f"{server.openai_url}/completions", "GET", 405),
                                (f"{server.openai_url}/models/nope", "GET", 404)]:
        request = urllib.request.Request(url, data=b"{}" if method == "POST" else None, method=method)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=30)
        error = json.loads(e.value.read())["error"]
        assert e.value.code == status and error["type"] == "invalid_request_error" and error["message"], (url, error)


@torch.no_grad()
def test_concurrent_streams_are_batched_in_flight_and_each_gets_its_tokens_alone(served) -> None:
    """Twelve gRPC streams at once with prompts and budgets of their own, and beside them two
    non-streamed generate requests (one of two rows): the server decodes them all in shared
    steps (its scheduler ran several rows at once, and made every one of their tokens) and each
    gets transformers' greedy tokens for its prompt alone. (Sixteen such streams once crashed
    tritonserver: the cancellation watch asked a request whose final response was sent whether
    it was cancelled.)"""
    import threading

    from moedeploy.runtime.text import TextCodec

    server, hf, artifact = served
    (scheduler,) = server._schedulers
    rng = np.random.default_rng(3)
    requests = [(rng.integers(0, hf.config.vocab_size, int(n)).tolist(), int(new))
                for n, new in zip(rng.integers(2, 12, 12), rng.integers(8, 30, 12), strict=True)]
    eos = set(TextCodec.from_artifact(artifact).eos_token_ids)

    def until_eos(tokens: list[int]) -> list[int]:  # the stream ends with the checkpoint's first EOS id
        return next((tokens[:i + 1] for i, t in enumerate(tokens) if t in eos), tokens)

    expected = [until_eos(hf.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
                          [0, len(ids):].tolist()) for ids, new in requests]
    got: list = [None] * len(requests)

    def stream(i: int) -> None:
        ids, new = requests[i]
        got[i] = tokens_and_text(grpc_stream(server, {"input_ids": np.array([ids], dtype=np.int64),
                                                      "max_tokens": np.array([[new]], dtype=np.int64)}))[0]

    generations = [rng.integers(0, hf.config.vocab_size, (1, 7)), rng.integers(0, hf.config.vocab_size, (2, 4))]
    generated: list = [None] * len(generations)

    def generate(i: int) -> None:
        feed = {"input_ids": generations[i].astype(np.int64),
                "max_new_tokens": np.full((len(generations[i]), 1), 16, dtype=np.int64)}
        generated[i] = infer("grpc", client("grpc", server), "decoder_generate", feed, ["output_ids"])["output_ids"]

    peak_before, made_before = scheduler.peak_running, scheduler.tokens_generated
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(requests))]
    threads += [threading.Thread(target=generate, args=(i,)) for i in range(len(generations))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == expected
    for ids, out in zip(generations, generated, strict=True):
        want = hf.generate(torch.from_numpy(ids), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert torch.equal(torch.from_numpy(out), want)
    assert scheduler.peak_running > 1 or peak_before > 1
    assert scheduler.tokens_generated - made_before == sum(map(len, expected)) + 3 * 16  # the generate rows too
    assert scheduler.running == 0


def scrape(server) -> dict[tuple[str, tuple], float]:
    """Every sample on the metrics port, by (name, sorted labels), parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_the_metrics_port_counts_tokens_and_times_first_token_and_gaps(served) -> None:
    """One stream of NEW tokens and one refused request move moedeploy's metrics by exactly that
    much; Triton's own metrics stay on the same page; nothing runs or waits afterwards."""
    server, *_ = served
    label = (("model", MODEL),)
    before = scrape(server)
    got = grpc_stream(server, {"input_ids": np.array([[5, 6, 7]], dtype=np.int64),
                               "max_tokens": np.array([[NEW]], dtype=np.int64)})
    tokens, _ = tokens_and_text(got)
    (_, _, error), = grpc_stream(server, {"max_tokens": np.array([[4]], dtype=np.int64)})
    assert error is not None
    after = scrape(server)

    def delta(name: str, labels=label) -> float:
        labels = tuple(sorted(labels))
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert delta("moedeploy_generated_tokens_total") == len(tokens) > 0
    assert delta("moedeploy_time_to_first_token_seconds_count") == 1
    assert delta("moedeploy_inter_token_latency_seconds_count") == len(tokens) - 1
    assert 0 < delta("moedeploy_time_to_first_token_seconds_sum") < 30
    # a histogram's buckets are cumulative: the +Inf bucket holds every observation
    assert delta("moedeploy_inter_token_latency_seconds_bucket", (*label, ("le", "+Inf"))) == len(tokens) - 1
    assert delta("moedeploy_stream_requests_total", (*label, ("outcome", "finished"))) == 1
    assert delta("moedeploy_stream_requests_total", (*label, ("outcome", "refused"))) == 1
    assert after[("moedeploy_running_sequences", label)] == 0 and after[("moedeploy_queued_sequences", label)] == 0
    # Triton's own, on the same page (the parser names a counter's sample <name>_total)
    assert after[("nv_inference_request_success_total", (("model", MODEL), ("version", "1")))] >= 1


def test_stream_clients_that_go_away_free_their_rows(served) -> None:
    """An SSE client that closes its connection after two events, and a gRPC client that cancels
    its stream after two responses: each generation stops long before its 2,000 tokens (outcome
    "cancelled" on the metrics port) and its row of the in-flight cache is free again."""
    import http.client

    import tritonclient.grpc as grpcclient

    server, *_ = served
    (scheduler,) = server._schedulers
    label = (("model", MODEL),)
    cancelled_key = ("moedeploy_stream_requests_total", tuple(sorted((*label, ("outcome", "cancelled")))))
    tokens_key = ("moedeploy_generated_tokens_total", label)
    before = scrape(server)

    def wait_for_cancelled(n: int) -> dict:
        deadline = time.monotonic() + 30
        while True:
            now = scrape(server)
            if now.get(cancelled_key, 0) - before.get(cancelled_key, 0) >= n or time.monotonic() > deadline:
                return now
            time.sleep(0.02)

    connection = http.client.HTTPConnection(HOST, server.options.http_port, timeout=60)
    connection.request("POST", f"/v2/models/{MODEL}/generate_stream",
                       json.dumps({"input_ids": [5, 6, 7], "max_tokens": 2000}), {"Content-Type": "application/json"})
    response = connection.getresponse()
    events = 0
    while events < 2:
        line = response.readline()
        assert line, "the stream ended before two events"
        events += line.startswith(b"data: ")
    connection.close()  # the client goes away mid-stream
    after_http = wait_for_cancelled(1)

    answers: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: answers.put((result, error)))
    tensors = []
    for name, array in {"input_ids": np.array([[5, 6, 7]], dtype=np.int64),
                        "max_tokens": np.array([[2000]], dtype=np.int64)}.items():
        tensors.append(grpcclient.InferInput(name, list(array.shape), "INT64"))
        tensors[-1].set_data_from_numpy(array)
    c.async_stream_infer(MODEL, tensors)
    answers.get(timeout=60)
    answers.get(timeout=60)
    c.stop_stream(cancel_requests=True)
    c.close()
    after = wait_for_cancelled(2)

    assert after_http[cancelled_key] - before.get(cancelled_key, 0) == 1
    assert after[cancelled_key] - before.get(cancelled_key, 0) == 2
    assert after[tokens_key] - before.get(tokens_key, 0) < 2 * 1000  # both stopped well before their 2,000 tokens
    deadline = time.monotonic() + 10
    while scheduler.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.running == 0


@pytest.fixture(scope="module")
def openai_client(served):
    """The official `openai` client on the server's OpenAI-compatible port."""
    openai = pytest.importorskip("openai", reason="the OpenAI API is tested with the official openai client")
    server, *_ = served
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=60)


def test_openai_models_and_completions_streamed_and_not(served, openai_client) -> None:
    from moedeploy.runtime.text import TextCodec

    _, hf, artifact = served
    codec = TextCodec.from_artifact(artifact)
    assert [m.id for m in openai_client.models.list().data] == ["decoder"]
    whole = openai_client.completions.create(model="decoder", prompt=PROMPT, max_tokens=NEW, temperature=0)
    ids = codec.encode(PROMPT)
    expected = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, len(ids):]
    assert whole.choices[0].text == codec.decode(expected.tolist())
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), NEW)
    chunks = list(openai_client.completions.create(model="decoder", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == NEW


def test_openai_chat_renders_the_template_and_streams(served, openai_client) -> None:
    from transformers import AutoTokenizer

    _, hf, artifact = served
    messages = [{"role": "user", "content": "naïve 🙂?"}]
    reference = AutoTokenizer.from_pretrained(artifact.path / "tokenizer")
    ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(ids):]
    whole = openai_client.chat.completions.create(model="decoder", messages=messages, max_tokens=6, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == reference.decode(expected.tolist(), skip_special_tokens=True)
    assert whole.usage.prompt_tokens == len(ids)
    streamed = openai_client.chat.completions.create(model="decoder", messages=messages, max_tokens=6, temperature=0,
                                                     stream=True)
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_openai_bad_requests_get_openai_errors(served, openai_client) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        openai_client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "'nope' does not exist" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model="decoder", prompt="hi", max_tokens=10_000)
    assert e.value.body["message"] == ("the prompt (3 tokens) and max_tokens (10,000) come to more than the model's "
                                       "2,048 positions; shorten the prompt or ask for fewer tokens")
    assert e.value.body["param"] == "max_tokens" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="decoder", messages=[{"role": "user", "content": 3}], max_tokens=2)
    assert e.value.body["param"] == "messages" and "messages[0].content is not a string" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="temperature must be >= 0"):
        openai_client.completions.create(model="decoder", prompt="hi", max_tokens=2, temperature=-1)
    # the server goes on
    assert openai_client.completions.create(model="decoder", prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens == 2


def _raw_answer(port: int, request: bytes) -> tuple[int, bytes]:
    """Send raw HTTP bytes, read the first answer: (status, body). The socket's own timeout fails
    the test if the server waits for a body instead of answering."""
    import socket

    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                next((line.split(b":")[1] for line in data.split(b"\r\n") if line.lower().startswith(b"content-length")),
                     b"0")):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_openai_port_refuses_bodies_it_cannot_read_in_its_error_object(served, caplog) -> None:
    """An announced body over the limit (Expect: 100-continue) is refused before it is sent, as
    the KServe port does (it answered 100 Continue and waited); JSON nested past Python's parser
    and a body that is not the gzip it says were answered 500 with a traceback in the log."""
    import gzip

    server, *_ = served
    port = int(server.openai_url.rsplit(":", 1)[1].split("/")[0])
    status, body = _raw_answer(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: 999999999\r\nExpect: 100-continue\r\n\r\n")
    error = json.loads(body)["error"]
    assert status == 413 and error["message"].startswith("the request body is over this server's limit of ")
    request = urllib.request.Request(f"{server.openai_url}/completions", data=b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 400
    assert json.loads(e.value.read())["error"]["message"] == "the request body is not valid JSON: it is nested too deep"
    request = urllib.request.Request(f"{server.openai_url}/completions", data=b'{"model": "decoder"}',
                                     headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    with caplog.at_level(logging.DEBUG, logger="aiohttp"), pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 400 and "Content-Encoding (gzip)" in json.loads(e.value.read())["error"]["message"]
    time.sleep(0.5)  # aiohttp would drain and log after the answer
    assert "Unhandled exception" not in caplog.text, caplog.text[-2000:]
    good = gzip.compress(json.dumps({"model": "decoder", "prompt": "the cat", "max_tokens": 2, "temperature": 0}).encode())
    request = urllib.request.Request(f"{server.openai_url}/completions", data=good,
                                     headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == 2


def test_kserve_port_refuses_an_announced_body_over_the_limit_before_it_is_sent(served) -> None:
    server, *_ = served
    status, body = _raw_answer(server.options.http_port,
                               b"POST /v2/models/decoder_generate/infer HTTP/1.1\r\nHost: x\r\n"
                               b"Content-Length: 999999999\r\nExpect: 100-continue\r\n\r\n")
    assert status == 413 and "moedeploy serve --max-request-mb raises it" in json.loads(body)["error"]


def test_openai_port_without_a_tokenizer_is_refused_before_triton_starts(store) -> None:
    pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton")
    from moedeploy.serving import ModelServer, ServeOptions, ServingError

    with pytest.raises(ServingError, match=r"--openai-port serves decoders with a tokenizer, and none of these artifacts has one"):
        ModelServer([store.decoder("fp32")], ServeOptions(openai_port=free_ports(1)[0]))


def test_openai_stream_clients_that_close_mid_stream_are_cancelled_without_a_traceback(served, caplog) -> None:
    """A write to a client that closed its connection between two tokens raised out of the
    handler (the cancel that aiohttp sends reaches it only while it waits on the connection),
    and aiohttp logged "Error handling request" with a traceback: 3 of 30 abandoned streams
    (this test saw it in 1 of 2 runs before the fix)."""
    import socket

    server, *_ = served
    label = (("model", MODEL),)
    cancelled_key = ("moedeploy_stream_requests_total", tuple(sorted((*label, ("outcome", "cancelled")))))
    before = scrape(server).get(cancelled_key, 0)
    body = json.dumps({"model": "decoder", "prompt": "x", "max_tokens": 1500, "temperature": 0, "stream": True})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
    streams = 30
    with caplog.at_level(logging.INFO):
        for _ in range(streams):
            with socket.create_connection((HOST, server.options.openai_port), timeout=60) as connection:
                connection.sendall(request)
                received = b""
                while received.count(b"data: ") < 1:
                    chunk = connection.recv(4096)
                    assert chunk, received
                    received += chunk
                # closed (a FIN: aiohttp closes its side at once, and a write before it has noticed
                # the connection is lost meets a closing transport) while tokens are being written
        deadline = time.monotonic() + 30
        while scrape(server).get(cancelled_key, 0) - before < streams and time.monotonic() < deadline:
            time.sleep(0.05)
    assert scrape(server).get(cancelled_key, 0) - before == streams  # every generation stopped early
    assert "Traceback" not in caplog.text and "Error handling request" not in caplog.text, caplog.text[-3000:]


def test_a_taken_openai_port_is_refused_before_triton_starts(served) -> None:
    """Its front starts after Triton: a taken port was found only after Triton's whole start-up
    (80 lines of its output, then a shutdown)."""
    import socket
    import time

    from moedeploy.serving import ModelServer, ServeOptions, ServingError

    _, _, artifact = served
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        http, grpc, metrics = free_ports(3)  # while the taken port is held, so none of these can be it
        options = ServeOptions(backend="ort", host=HOST, http_port=http, grpc_port=grpc, metrics_port=metrics,
                               openai_port=port)
        start = time.monotonic()
        with pytest.raises(ServingError, match=rf"cannot listen on {HOST}:{port} for openai \(.*\); choose another "
                                               r"--openai-port$"):
            ModelServer([artifact], options).start()
        assert time.monotonic() - start < 5  # before Triton, which takes longer than that to start


def test_a_stop_string_ends_the_text_before_it_and_finishes_with_stop(served, openai_client) -> None:
    whole = openai_client.completions.create(model="decoder", prompt=PROMPT, max_tokens=NEW, temperature=0).choices[0]
    assert whole.finish_reason == "length" and len(whole.text) >= 4
    middle = len(whole.text) // 2
    stop = whole.text[middle:middle + 2]  # a stop string the greedy text reaches half-way
    expected = whole.text[:whole.text.find(stop)]
    cut = openai_client.completions.create(model="decoder", prompt=PROMPT, max_tokens=NEW, temperature=0, stop=[stop])
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (expected, "stop")
    assert cut.usage.completion_tokens < NEW  # generation ended there, not at max_tokens
    chunks = list(openai_client.completions.create(model="decoder", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                                   stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # the Triton model itself, over gRPC: the same text, finish_reason on the last response only
    server, *_ = served
    got = grpc_stream(server, {"text_input": np.array([[PROMPT.encode()]], dtype=np.object_),
                               "max_tokens": np.array([[NEW]], dtype=np.int64),
                               "stop": np.array([[stop.encode()]], dtype=np.object_)})
    _, pieces = tokens_and_text(got)
    assert "".join(pieces) == expected
    finishes = [r.as_numpy("finish_reason").reshape(-1)[0].decode() for _, r, _ in got if r.as_numpy("finish_reason") is not None]
    assert finishes[-1] == "stop" and set(finishes[:-1]) <= {""}


def test_only_the_in_flight_session_keeps_a_repacked_copy_of_the_weights(served) -> None:
    """--packed-weights stream (the default): the in-flight session, which serves the streams,
    repacks the weights; the logits and generate models share the artifact's mapped file."""
    server, *_ = served

    assert [repacks(runner.sess) for runner in server._runners] == [False, False]  # decoder, decoder_generate
    (scheduler,) = server._schedulers
    assert repacks(scheduler.decoder.lowered.session)


@pytest.mark.parametrize(("packed", "in_flight", "expected"), [
    ("stream", True, [False, False]),  # the in-flight session serves the streams: it alone repacks
    ("stream", False, [False, True]),  # no in-flight batching: the stream model decodes on the generate model's runners
    ("all", True, [True, True]),
])
def test_which_models_repack_the_weights(served, packed: str, in_flight: bool, expected: list[bool]) -> None:
    from moedeploy.serving import ModelServer, ServeOptions

    _, _, artifact = served
    server = ModelServer([artifact], ServeOptions(packed_weights=packed))  # not started: the policy alone
    logits, generate = (spec for _, spec in server.specs if not spec.name.endswith("_stream"))
    assert [server._packs(artifact, spec, in_flight) for spec in (logits, generate)] == expected
