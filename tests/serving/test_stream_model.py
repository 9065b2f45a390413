"""The stream model's callable without a server (the real ONNX Runtime runner on a real artifact,
called as PyTriton calls it: an async generator on an event loop), on both token sources: a
request at a time (SerialTokens) and in-flight batching (InflightTokens over a scheduler). It
stops at an EOS id of the checkpoint, stops before the next token once its client cancelled,
answers while draining with UNAVAILABLE, and concurrent streams get what they get alone."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
import torch

from tests.text_helpers import VOCAB, export_with_tokenizer

PROMPT = "the cat sat"


class Request(dict):
    """What PyTriton hands a callable: the inputs by name, and the request's parameters."""

    def __init__(self, inputs: dict, parameters: dict | None = None) -> None:
        super().__init__(inputs)
        self.parameters = parameters or {}


@pytest.fixture(scope="module", params=["serial", "inflight"])
def parts(request, tmp_path_factory):
    """(transformers model, artifact, token source): the activated ONNX Runtime runner a request
    at a time, or an in-flight scheduler of 3 rows."""
    from moedeploy.runtime.inflight import RowCacheDecoder
    from moedeploy.serving.decoder import DecoderShape
    from moedeploy.serving.inflight import InflightScheduler
    from moedeploy.serving.server import activated_runner
    from moedeploy.serving.streaming import InflightTokens, SerialTokens

    hf, artifact = export_with_tokenizer(tmp_path_factory.mktemp("stream-model"))
    if request.param == "serial":
        runner = activated_runner("ort", artifact)
        yield hf, artifact, SerialTokens(runner.infer, DecoderShape.of(artifact))
        runner.deactivate()
    else:
        scheduler = InflightScheduler(RowCacheDecoder(artifact, slots=3), max_queued=4)
        yield hf, artifact, InflightTokens(scheduler)
        scheduler.stop()


def stream_model(artifact, source, eos: list[int] | None = None, cancel_dir=None, stream_interval: int = 1):
    from moedeploy.runtime.text import TextCodec
    from moedeploy.serving.decoder import DecoderShape
    from moedeploy.serving.streaming import StreamModel

    codec = TextCodec.from_artifact(artifact)
    if eos is not None:
        codec.eos_token_ids = eos
    return StreamModel("decoder_stream", source, DecoderShape.of(artifact), codec, cancel_dir,
                       stream_interval=stream_interval)


class Responses:
    """A stream's async generator driven from a test: `next()` one response, `rest()` the others."""

    def __init__(self, generator, loop: asyncio.AbstractEventLoop) -> None:
        self.generator, self.loop = generator, loop

    def next(self) -> dict:
        (answer,) = self.loop.run_until_complete(anext(self.generator))
        return answer

    def rest(self) -> list[dict]:
        async def drain():
            return [answer async for (answer,) in self.generator]

        return self.loop.run_until_complete(drain())


def ids_of(answers: list[dict]) -> list[int]:
    """The token ids of a stream's responses, in order (a response holds one or more)."""
    return [int(t) for a in answers for t in a["output_ids"].reshape(-1)]


def run(model, requests, loop: asyncio.AbstractEventLoop | None = None) -> Responses:
    return Responses(model(requests), loop or asyncio.new_event_loop())


def answers_of(model, requests) -> list[dict]:
    loop = asyncio.new_event_loop()
    try:
        return run(model, requests, loop).rest()
    finally:  # no generator left for the garbage collector to finalise on a closed loop
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def request(max_tokens: int, parameters: dict | None = None) -> Request:
    return Request({"text_input": np.array([[PROMPT.encode()]], dtype=np.object_),
                    "max_tokens": np.array([[max_tokens]], dtype=np.int64)}, parameters)


@torch.no_grad()
def greedy(hf, artifact, n: int) -> list[int]:
    from moedeploy.runtime.text import TextCodec

    ids = TextCodec.from_artifact(artifact).encode(PROMPT)
    return hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


def test_generation_stops_at_an_eos_id_with_finish_reason_stop(parts) -> None:
    hf, artifact, source = parts
    expected = greedy(hf, artifact, 8)
    eos = expected[3]  # as if the checkpoint's EOS were the 4th greedy token
    stop_at = expected.index(eos)
    answers = answers_of(stream_model(artifact, source, eos=[eos]), [request(8)])
    assert ids_of(answers) == expected[:stop_at + 1]
    assert [a["finish_reason"][0, 0] for a in answers] == [b""] * (len(answers) - 1) + [b"stop"]
    if answers[-1]["output_ids"].size == 1:
        assert answers[-1]["text_output"][0, 0] == b""  # the EOS token's own text is not sent
    answers = answers_of(stream_model(artifact, source, eos=[]), [request(8)])
    assert ids_of(answers) == expected
    assert answers[-1]["finish_reason"][0, 0] == b"length"


def test_a_cancelled_stream_stops_before_its_next_token(parts, tmp_path) -> None:
    from moedeploy.serving.stub_guard import TOKEN_PARAMETER

    _, artifact, source = parts
    model = stream_model(artifact, source, eos=[], cancel_dir=tmp_path)
    answers = run(model, [request(60, {TOKEN_PARAMETER: "abc"})])
    got = [answers.next(), answers.next()]
    (tmp_path / "abc").touch()  # what stub_guard does when Triton reports the request cancelled
    got += answers.rest()
    assert len(got) == 2 and model.idle
    if hasattr(source, "scheduler"):  # its row is freed at the scheduler's next step
        deadline = time.monotonic() + 10
        while source.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.001)
        assert source.scheduler.running == 0


def test_draining_and_bad_requests_get_their_own_errors(parts) -> None:
    from moedeploy.serving.stub_guard import ERROR_OUTPUT

    _, artifact, source = parts
    model = stream_model(artifact, source)
    (answer,) = answers_of(model, [Request({"input_ids": np.array([[1, VOCAB + 100]], dtype=np.int64)})])
    assert json.loads(answer[ERROR_OUTPUT][0]) == {
        "code": "INVALID_ARG", "message": f"input_ids holds token id {VOCAB + 100}, outside the vocabulary [0, {VOCAB + 8})"}
    model.draining.set()
    (answer,) = answers_of(model, [request(4)])
    assert json.loads(answer[ERROR_OUTPUT][0])["code"] == "UNAVAILABLE"


def test_concurrent_streams_iterated_in_turns_each_get_what_they_get_alone(parts) -> None:
    """PyTriton iterates the generators of concurrent requests to one instance in turns on one
    event loop; each must still get the tokens it gets alone (serial: its own cache; in flight:
    its own row of a step they share)."""
    _, artifact, source = parts
    model = stream_model(artifact, source, eos=[])
    prompts = [np.array([[5, 9, 2]], dtype=np.int64), np.array([[7, 1, 3, 3, 8]], dtype=np.int64)]

    def request_for(prompt):
        return Request({"input_ids": prompt, "max_tokens": np.array([[6]], dtype=np.int64)})

    alone = [ids_of(answers_of(model, [request_for(p)])) for p in prompts]
    loop = asyncio.new_event_loop()
    streams = [run(model, [request_for(p)], loop) for p in prompts]
    together: list[list[int]] = [[], []]
    for _ in range(6):
        for i, stream in enumerate(streams):
            if len(together[i]) < 6:
                together[i] += ids_of([stream.next()])
    assert together == alone and alone[0] != alone[1] and len(alone[0]) == 6
    assert [stream.rest() for stream in streams] == [[], []]  # nothing after max_tokens, and both generators end


def test_a_stream_read_slower_than_made_gets_the_waiting_tokens_in_one_response(parts) -> None:
    """In flight, the scheduler makes tokens whether or not the stream's responses have gone
    out: a reader that falls behind gets, in one response, every token made since its last one,
    with their text and the finish reason; tokens and text are those of a prompt reader."""
    _, artifact, source = parts
    if not hasattr(source, "scheduler"):
        pytest.skip("a serial stream makes its next token only when the last has been taken")
    model = stream_model(artifact, source, eos=[])
    prompt_reader = answers_of(model, [request(12)])
    slow = run(model, [request(12)])
    first = slow.next()
    deadline = time.monotonic() + 30
    while source.scheduler.running and time.monotonic() < deadline:  # the rest is made meanwhile
        time.sleep(0.005)
    rest = slow.rest()
    assert first["output_ids"].shape == (1, 1)  # the first token alone, even when more were ready
    assert len(rest) == 1 and rest[0]["output_ids"].shape == (1, 11)
    assert ids_of([first, *rest]) == ids_of(prompt_reader) and len(ids_of(prompt_reader)) == 12
    text = b"".join(a["text_output"][0, 0] for a in prompt_reader)
    assert first["text_output"][0, 0] + rest[0]["text_output"][0, 0] == text and text
    assert rest[0]["finish_reason"][0, 0] == b"length"


def test_a_stream_interval_sends_the_first_token_alone_then_groups_of_that_many(parts) -> None:
    """`serve --stream-interval 5`: the first token alone, then at least 5 tokens a response
    (exactly 5 where each token is taken as it is made), the last whatever is left; the same
    tokens, text and finish reason as a token per response."""
    _, artifact, source = parts
    each = answers_of(stream_model(artifact, source, eos=[]), [request(12)])
    grouped = answers_of(stream_model(artifact, source, eos=[], stream_interval=5), [request(12)])
    sizes = [a["output_ids"].size for a in grouped]
    if not hasattr(source, "scheduler"):
        assert sizes == [1, 5, 5, 1]
    assert sum(sizes) == 12 and all(size >= 5 for size in sizes[1:-1]) and len(grouped) <= 4
    assert ids_of(grouped) == ids_of(each)
    assert b"".join(a["text_output"][0, 0] for a in grouped) == b"".join(a["text_output"][0, 0] for a in each)
    assert [a["finish_reason"][0, 0] for a in grouped] == [b""] * (len(grouped) - 1) + [b"length"]


def test_in_flight_the_event_loop_is_woken_per_response_not_per_token(parts) -> None:
    """InflightTokens(wake_every=5), as serve builds it at --stream-interval 5: the scheduler's
    thread wakes the event loop for the first token alone, then once 5 wait, then for the rest
    with the end: 4 wake-ups for 12 tokens, where wake_every=1 makes 13. The tokens are greedy's,
    in order, the first alone."""
    from moedeploy.models.generation import SamplingConfig
    from moedeploy.serving.streaming import InflightTokens

    hf, artifact, source = parts
    if not hasattr(source, "scheduler"):
        pytest.skip("only in-flight batching hands tokens over between threads")
    ids = np.array([stream_model(artifact, source).codec.encode(PROMPT)], dtype=np.int64)
    for wake_every, wakes in ((5, 4), (1, 13)):
        loop = asyncio.new_event_loop()
        calls = [0]
        handover = loop.call_soon_threadsafe

        def counted(*args, handover=handover, calls=calls):
            calls[0] += 1
            return handover(*args)

        loop.call_soon_threadsafe = counted

        async def read(wake_every: int) -> list[list[int]]:  # open() wants the running loop
            tokens = InflightTokens(source.scheduler, wake_every).open(ids, 12, SamplingConfig(), frozenset(),
                                                                       lambda: False)
            return [made async for made in tokens]

        try:
            handed = loop.run_until_complete(read(wake_every))
        finally:
            loop.close()
        assert calls[0] == wakes
        assert len(handed[0]) == 1 and [t for made in handed for t in made] == greedy(hf, artifact, 12)


def test_in_flight_a_request_beyond_the_rows_and_queue_is_answered_busy(parts) -> None:
    from moedeploy.serving.stub_guard import ERROR_OUTPUT

    _, artifact, source = parts
    if not hasattr(source, "scheduler"):
        pytest.skip("only in-flight batching has a queue")
    model = stream_model(artifact, source, eos=[])
    scheduler = source.scheduler
    deadline = time.monotonic() + 30
    while (scheduler.running or scheduler.queued) and time.monotonic() < deadline:  # earlier tests' rows freed
        time.sleep(0.005)
    loop = asyncio.new_event_loop()
    with scheduler._cond:  # the scheduler takes no request off its queue meanwhile: they stay counted
        held = [model([request(8)]) for _ in range(scheduler.slots + scheduler.max_queued)]
        firsts = [loop.create_task(anext(stream)) for stream in held]
        loop.run_until_complete(asyncio.sleep(0.05))  # each submitted, waiting for its first token
        assert scheduler.queued == len(held)
        (answer,) = run(model, [request(4)], loop).rest()
    error = json.loads(answer[ERROR_OUTPUT][0])
    assert error["code"] == "UNAVAILABLE" and error["message"].startswith("the server is busy")
    for first, stream in zip(firsts, held, strict=True):
        answers = [loop.run_until_complete(first)[0], *Responses(stream, loop).rest()]
        assert len(ids_of(answers)) == 8 and answers[-1]["finish_reason"][0, 0] == b"length"
