"""`<name>_stream`: one generation per request, each new token sent as its own response.

A decoupled Triton model (PyTriton: the callable is a generator, each item one response per
request). Triton delivers the responses as they come over gRPC's ModelStreamInfer and over
its HTTP generate extension (`/v2/models/<name>_stream/generate_stream`, server-sent events),
so a client sees the first token while the rest are still being made.

The prompt is `text_input` (encoded with the artifact's own tokenizer, runtime/text.py) or
`input_ids`; each response holds the tokens made since the last response (`output_ids`, shape
[1, n]) and their text (`text_output`), detokenised incrementally so a character split over
several tokens is sent whole, with the token that completes it. A stream that keeps up gets a
token per response; one whose tokens come faster than its responses go out (many concurrent
streams on few cores) gets, after its first token (always alone), what has been made since
its last response in one response, as vLLM's output
collector does: every token still arrives, in order, and the per-response cost (PyTriton,
Triton's Python backend, gRPC or HTTP) is paid once per response instead of once per token.
`stream_interval` (`serve --stream-interval`, vLLM's option of that name) asks for that at
every step: after the first token, which always goes alone, a response waits for that many
tokens (the last takes what is left). Generation stops at max_tokens, at one of the
checkpoint's EOS ids (the EOS token is sent, its text is empty) or at a stop string (the
checkpoint's `stop_strings` and the request's `stop`; the text ends before it, and text that
might begin one is held back until it is known not to); the last response's `finish_reason` says
which: "length" or "stop". A refused request gets one
error response with its one-line reason (stub_guard turns it into a Triton error, HTTP 400 /
gRPC INVALID_ARGUMENT); the model takes one request per execution, so no other request
shares its fate. A client that cancels (gRPC) or disconnects (HTTP, marked by the front)
stops its generation before the next token.

Where the tokens come from is a `TokenSource`: on ONNX Runtime with GroupQueryAttention,
`InflightTokens` (every stream joins one scheduler that decodes all running streams in one
step, serving/inflight.py); elsewhere `SerialTokens` (each request decodes on its own cache,
and concurrent streams take turns a token at a time). The callable is an async generator, so
PyTriton's event loop serves every open stream while the scheduler works on its own thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from moedeploy.models.generation import SamplingConfig
from moedeploy.runtime.text import IncrementalDetokenizer, StopStrings, TextCodec, TextError
from moedeploy.serving.batching import (
    LOGGER,
    Cancelled,
    Feed,
    InFlight,
    RequestError,
    RunFn,
    ServerError,
    Unavailable,
    error_answer,
    first_line,
    request_problem,
)
from moedeploy.serving.decoder import DecoderShape, RunnerDecoder, cancellation_check, option_value
from moedeploy.serving.front import REQUEST_ID_HEADER, CancelledRequests
from moedeploy.serving.inflight import Finished, InflightScheduler
from moedeploy.serving.metrics import GenerationMetrics
from moedeploy.serving.specs import (
    DEFAULT_MAX_NEW_TOKENS,
    GENERATE_INPUT,
    GENERATE_OUTPUT,
    MAX_STOP_CHARS,
    STREAM_FINISH_OUTPUT,
    STREAM_OPTIONS,
    STREAM_STOP_INPUT,
    STREAM_TEXT_INPUT,
    STREAM_TEXT_OUTPUT,
)
from moedeploy.serving.stub_guard import TOKEN_PARAMETER


def _strings(feed: Feed, name: str) -> list[str]:
    try:
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in np.asarray(feed[name]).reshape(-1)]
    except UnicodeDecodeError:
        raise RequestError(f"{name} is not valid UTF-8") from None


def _text(feed: Feed) -> str:
    return _strings(feed, STREAM_TEXT_INPUT)[0]


def stop_strings_of(feed: Feed, codec: TextCodec | None) -> StopStrings | None:
    """The checkpoint's stop strings and the request's (`stop`), or None when there are none."""
    asked = _strings(feed, STREAM_STOP_INPUT) if STREAM_STOP_INPUT in feed else []
    if asked and codec is None:
        raise RequestError(f"{STREAM_STOP_INPUT} needs the model's tokenizer, and this artifact has none")
    if too_long := [s for s in asked if len(s) > MAX_STOP_CHARS]:
        raise RequestError(f"a {STREAM_STOP_INPUT} string has {len(too_long[0]):,} characters; the most is {MAX_STOP_CHARS}")
    stops = (codec.stop_strings if codec is not None else []) + [s for s in asked if s]
    return StopStrings(stops) if stops else None


def prompt_ids(feed: Feed, shape: DecoderShape, codec: TextCodec | None) -> np.ndarray:
    """The request's prompt as (1, S) ids: its text encoded, or its ids checked."""
    has_text, has_ids = STREAM_TEXT_INPUT in feed, GENERATE_INPUT in feed
    if has_text == has_ids:
        raise RequestError(f"send the prompt as {STREAM_TEXT_INPUT!r} or as {GENERATE_INPUT!r}, "
                           f"{'not both' if has_text else 'one of them'}")
    if has_ids:
        ids = np.asarray(feed[GENERATE_INPUT]).astype(np.int64).reshape(1, -1)
        shape.check_ids(ids)
        return ids
    if codec is None:
        raise RequestError(f"this model has no tokenizer (its artifact was not exported from a checkpoint with "
                           f"tokenizer.json): send {GENERATE_INPUT!r} instead of {STREAM_TEXT_INPUT!r}")
    ids = np.array([codec.encode(_text(feed), max_tokens=shape.max_positions)], dtype=np.int64)
    if ids.size == 0:
        raise RequestError(f"{STREAM_TEXT_INPUT} encodes to no tokens; send some text")
    shape.check_ids(ids, STREAM_TEXT_INPUT)
    return ids


def sampling_of(feed: Feed) -> SamplingConfig:
    values = {name: option_value(feed, name) for name in STREAM_OPTIONS}
    try:
        return SamplingConfig(0.0 if values["temperature"] is None else float(values["temperature"]), values["top_k"],
                              None if values["top_p"] is None else float(values["top_p"]), values["seed"])
    except ValueError as e:
        raise RequestError(str(e)) from None


def max_tokens_of(feed: Feed, prompt_len: int, shape: DecoderShape) -> int:
    new = option_value(feed, "max_tokens")
    new = DEFAULT_MAX_NEW_TOKENS if new is None else int(new)
    if new < 1:
        raise RequestError(f"max_tokens must be >= 1, got {new}")
    if prompt_len + new > shape.max_positions:
        raise RequestError(f"prompt ({prompt_len} tokens) + max_tokens ({new}) exceeds max_positions {shape.max_positions}")
    return new


class TokenSource(Protocol):
    """Makes one request's tokens; `open` checks and queues it (raising RequestError or
    Unavailable before any token), the iterator yields the token ids made since its last item (at
    least one, in order) and raises Cancelled once `cancelled()` says so."""

    def open(self, ids: np.ndarray, max_new_tokens: int, sampling: SamplingConfig, eos: frozenset[int],
             cancelled: Callable[[], bool]) -> AsyncIterator[list[int]]: ...


class SerialTokens:
    """Each request on a cache of its own over a runner's graph: a step at a time on the caller's
    thread, so concurrent streams take turns (any backend)."""

    def __init__(self, run: RunFn, shape: DecoderShape) -> None:
        self.run = run
        self.shape = shape

    def open(self, ids: np.ndarray, max_new_tokens: int, sampling: SamplingConfig, eos: frozenset[int],
             cancelled: Callable[[], bool]) -> AsyncIterator[list[int]]:
        # A decoder (and so a KV cache) of its own: PyTriton iterates the generators of concurrent
        # requests to one instance in turns on its event loop, a token of one, then of another.
        decoder = RunnerDecoder(self.run, self.shape)

        async def tokens() -> AsyncIterator[list[int]]:
            for token in decoder.stream(ids, max_new_tokens, sampling, cancelled):
                yield [token]
                await asyncio.sleep(0)  # let the event loop send it, and serve the other streams

        return tokens()


class InflightTokens:
    """Every request joins one in-flight scheduler: concurrent streams share each decode step."""

    def __init__(self, scheduler: InflightScheduler, wake_every: int = 1) -> None:
        """wake_every (the stream interval): the scheduler's thread hands a stream's events to
        the event loop at its first token, at its end and then once that many tokens wait, not
        at every token (a response waits for them anyway): on few cores each wake-up of the
        loop takes a core from the decode step."""
        self.scheduler = scheduler
        self.wake_every = wake_every

    def open(self, ids: np.ndarray, max_new_tokens: int, sampling: SamplingConfig, eos: frozenset[int],
             cancelled: Callable[[], bool]) -> AsyncIterator[list[int]]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()  # lists of events, in order
        held: list = []  # events made since the last hand-over (only the scheduler's thread calls on_event)
        first = True

        def on_event(event: Any) -> None:
            nonlocal first
            held.append(event)
            if first or not isinstance(event, int) or len(held) >= self.wake_every:
                first = False
                loop.call_soon_threadsafe(events.put_nowait, held.copy())
                held.clear()

        try:
            sequence = self.scheduler.submit(ids.reshape(-1), max_new_tokens, sampling, on_event, eos, cancelled)
        except ValueError as e:  # it does not fit the server's rows
            raise RequestError(str(e)) from None

        async def tokens() -> AsyncIterator[list[int]]:
            started = False
            try:
                while True:
                    made = await events.get()
                    # what else is ready goes with it, except with the first token: that goes alone
                    while started and not events.empty() and isinstance(made[-1], int):
                        made = made + events.get_nowait()
                    started = True
                    if cancelled():  # tokens made ahead of a slow reader are not sent once it has gone
                        raise Cancelled("the client cancelled the request")
                    ready = [event for event in made if isinstance(event, int)]
                    if ready:
                        yield ready
                    end = made[-1]
                    if isinstance(end, Finished):
                        if end.reason == "cancelled":
                            raise Cancelled("the client cancelled the request")
                        return
                    if isinstance(end, BaseException):
                        raise end
            finally:  # read to the end, stopped at a stop string, or the stream was closed: the row is free
                sequence.close()

        return tokens()


class StreamModel(InFlight):
    """The PyTriton callable of `<name>_stream` (an async generator: one list of one response per
    item its token source yields: the tokens made since the last response)."""

    def __init__(self, model_name: str, source: TokenSource, shape: DecoderShape, codec: TextCodec | None,
                 cancel_dir: Path | None = None, cancelled: CancelledRequests | None = None,
                 metrics: GenerationMetrics | None = None, stream_interval: int = 1) -> None:
        super().__init__()
        self.stream_interval = stream_interval
        self.model_name = model_name
        self.metrics = metrics
        self.source = source
        self.shape = shape
        self.codec = codec
        self.eos = frozenset(codec.eos_token_ids) if codec is not None else frozenset()
        self.cancel_dir = cancel_dir
        self.cancelled = cancelled

    async def __call__(self, requests: Sequence[Any]) -> AsyncIterator[list[Feed]]:
        self._enter()
        try:
            # max_batch_size 1 and no dynamic batcher: Triton hands over one request at a time
            for request in requests:
                async for answer in self._answer(request):
                    yield [answer]
        finally:
            self._leave()

    def _cancelled(self, request: Any) -> Callable[[], bool]:
        parameters = getattr(request, "parameters", None) or {}
        token, request_id = parameters.get(TOKEN_PARAMETER), parameters.get(REQUEST_ID_HEADER)
        check = cancellation_check(str(token) if token else None, str(request_id) if request_id else None,
                                   self.cancel_dir, self.cancelled)
        return check or (lambda: False)

    async def _answer(self, request: Any) -> AsyncIterator[Feed]:
        timer = self.metrics.request(self.model_name) if self.metrics is not None else _NoTimer()
        try:
            if self.draining.is_set():
                raise Unavailable("the server is shutting down; retry on another replica")
            if problem := request_problem(request, []):
                raise RequestError(problem)
            feed = {name: np.asarray(array) for name, array in request.items()}
            # a text on a worker thread: a long one's encoding must not hold up the other streams' tokens
            ids = (await asyncio.to_thread(prompt_ids, feed, self.shape, self.codec) if STREAM_TEXT_INPUT in feed
                   else prompt_ids(feed, self.shape, self.codec))
            new = max_tokens_of(feed, ids.shape[1], self.shape)
            sampling = sampling_of(feed)
            stops = stop_strings_of(feed, self.codec)
            tokens = self.source.open(ids, new, sampling, self.eos, self._cancelled(request))
        except (RequestError, Unavailable, TextError) as e:
            error = e if not isinstance(e, TextError) else RequestError(str(e))
            if isinstance(error, RequestError):
                LOGGER.warning("%s: refused a request: %s", self.model_name, first_line(error))
            timer.done("refused")
            yield error_answer(error)
            return
        text = IncrementalDetokenizer(self.codec) if self.codec is not None else None
        batches = grouped(tokens, self.stream_interval)
        n, last = 0, False
        try:
            async for made in batches:
                sent, pieces, finish = [], [], ""
                for token in made:
                    n += 1
                    sent.append(token)
                    eos = token in self.eos
                    last = n == new or eos
                    piece = ""
                    if text is not None:
                        piece = "" if eos else text.push(token)
                        piece += text.flush() if last else ""  # a character still incomplete goes out as it is
                    finish = "stop" if eos else "length" if last else ""
                    if stops is not None:
                        piece = stops.push(piece)
                        if stops.stopped:
                            last, finish = True, "stop"
                        elif last:
                            piece += stops.flush()
                    pieces.append(piece)
                    if last:
                        break
                timer.tokens(len(sent))
                yield {GENERATE_OUTPUT: np.array([sent], dtype=np.int64),
                       STREAM_TEXT_OUTPUT: np.array([["".join(pieces).encode("utf-8")]], dtype=np.bytes_),
                       STREAM_FINISH_OUTPUT: np.array([[finish.encode()]], dtype=np.bytes_)}
                if last:
                    break
            timer.done("finished")
        except Cancelled:
            timer.done("cancelled")
            return  # nobody reads the answer
        except Exception as e:  # a backend failure mid-stream: this request's error, the server goes on
            LOGGER.error("%s: a stream failed: %s", self.model_name, first_line(e))
            timer.done("failed")
            yield error_answer(e if isinstance(e, ServerError) else ServerError(f"generation failed: {first_line(e)}"))
        finally:
            await batches.aclose()
            await tokens.aclose()  # frees its row (in flight) or its cache (serial) now, not when collected


async def grouped(tokens: AsyncIterator[list[int]], interval: int) -> AsyncIterator[list[int]]:
    """The source's tokens, the first alone and then `interval` or more at a time (what was
    waiting may make more), the last group whatever is left; tokens made before a failure are
    passed on before it (not before a cancellation: nobody reads them)."""
    first, waiting = True, []
    try:
        async for made in tokens:
            waiting += made
            if first or len(waiting) >= interval:
                yield waiting
                first, waiting = False, []
    except Cancelled:
        raise
    except Exception:
        if waiting:
            yield waiting
        raise
    if waiting:
        yield waiting


class _NoTimer:
    """What a stream model without metrics records: nothing."""

    def tokens(self, n: int = 1) -> None:
        pass

    def done(self, outcome: str) -> None:
        pass
