"""`<name>_stream`: one generation per request, each new token sent as its own response.

A decoupled Triton model (PyTriton: the callable is a generator, each item one response per
request). Triton delivers the responses as they come over gRPC's ModelStreamInfer and over
its HTTP generate extension (`/v2/models/<name>_stream/generate_stream`, server-sent events),
so a client sees the first token while the rest are still being made.

The prompt is `text_input` (encoded with the artifact's own tokenizer, runtime/text.py) or
`input_ids`; each response holds the token (`output_ids`, shape [1, 1]) and its text piece
(`text_output`), detokenised incrementally so a character split over several tokens is sent
whole, with the token that completes it. Generation stops at max_tokens, at one of the
checkpoint's EOS ids (the EOS token is sent, its text is empty) or at a stop string (the
checkpoint's `stop_strings` and the request's `stop`; the text ends before it, and text that
might begin one is held back until it is known not to); the last response's `finish_reason` says
which: "length" or "stop". A refused request gets one
error response with its one-line reason (stub_guard turns it into a Triton error, HTTP 400 /
gRPC INVALID_ARGUMENT); the model takes one request per execution, so no other request
shares its fate. A client that cancels (gRPC) or disconnects (HTTP, marked by the front)
stops its generation before the next token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

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
from moedeploy.serving.decoder import DecoderShape, RunnerDecoder, option_value
from moedeploy.serving.front import REQUEST_ID_HEADER, CancelledRequests
from moedeploy.serving.specs import (
    DEFAULT_MAX_NEW_TOKENS,
    GENERATE_INPUT,
    GENERATE_OUTPUT,
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
    ids = np.array([codec.encode(_text(feed))], dtype=np.int64)
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


class StreamModel(InFlight):
    """The PyTriton callable of `<name>_stream` (a generator: one list of one response per token)."""

    def __init__(self, model_name: str, run: RunFn, shape: DecoderShape, codec: TextCodec | None,
                 cancel_dir: Path | None = None, cancelled: CancelledRequests | None = None) -> None:
        super().__init__()
        self.model_name = model_name
        self.run = run
        self.shape = shape
        self.codec = codec
        self.eos = set(codec.eos_token_ids) if codec is not None else set()
        self.cancel_dir = cancel_dir
        self.cancelled = cancelled

    def __call__(self, requests: Sequence[Any]) -> Iterator[list[Feed]]:
        self._enter()
        try:
            # max_batch_size 1 and no dynamic batcher: Triton hands over one request at a time
            for request in requests:
                yield from ([answer] for answer in self._answer(request))
        finally:
            self._leave()

    def _cancelled(self, request: Any) -> Callable[[], bool]:
        parameters = getattr(request, "parameters", None) or {}
        token, request_id = parameters.get(TOKEN_PARAMETER), parameters.get(REQUEST_ID_HEADER)
        checks: list[Callable[[], bool]] = []
        if token and self.cancel_dir is not None:
            checks.append((self.cancel_dir / str(token)).exists)
        if request_id and self.cancelled is not None:
            checks.append(lambda: self.cancelled.is_cancelled(str(request_id)))
        return lambda: any(check() for check in checks)

    def _answer(self, request: Any) -> Iterator[Feed]:
        try:
            if self.draining.is_set():
                raise Unavailable("the server is shutting down; retry on another replica")
            if problem := request_problem(request, []):
                raise RequestError(problem)
            feed = {name: np.asarray(array) for name, array in request.items()}
            ids = prompt_ids(feed, self.shape, self.codec)
            new = max_tokens_of(feed, ids.shape[1], self.shape)
            sampling = sampling_of(feed)
            stops = stop_strings_of(feed, self.codec)
        except (RequestError, Unavailable, TextError) as e:
            error = e if not isinstance(e, TextError) else RequestError(str(e))
            if isinstance(error, RequestError):
                LOGGER.warning("%s: refused a request: %s", self.model_name, first_line(error))
            yield error_answer(error)
            return
        text = IncrementalDetokenizer(self.codec) if self.codec is not None else None
        # A decoder (and so a KV cache) of its own: PyTriton iterates the generators of concurrent
        # requests to one instance in turns on its event loop, a token of one, then of another.
        decoder = RunnerDecoder(self.run, self.shape)
        try:
            for n, token in enumerate(decoder.stream(ids, new, sampling, self._cancelled(request)), 1):
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
                yield {GENERATE_OUTPUT: np.array([[token]], dtype=np.int64),
                       STREAM_TEXT_OUTPUT: np.array([[piece.encode("utf-8")]], dtype=np.bytes_),
                       STREAM_FINISH_OUTPUT: np.array([[finish.encode()]], dtype=np.bytes_)}
                if last:
                    break
        except Cancelled:
            return  # nobody reads the answer
        except Exception as e:  # a backend failure mid-stream: this request's error, the server goes on
            LOGGER.error("%s: a stream failed: %s", self.model_name, first_line(e))
            yield error_answer(ServerError(f"generation failed: {first_line(e)}"))

