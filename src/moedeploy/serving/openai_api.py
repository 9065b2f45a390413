"""The OpenAI-compatible API of `moedeploy serve --openai-port N`: /v1/models,
/v1/completions and /v1/chat/completions, with and without `stream`.

A thin layer, not a second inference path: each request's prompt is made into ids here (the
artifact's tokenizer; chat messages through its chat template) and forwarded to Triton's HTTP
generate_stream of `<name>_stream` through moedeploy's own HTTP front (so a client that goes
away stops its generation there, as any HTTP client's does). Triton's events come back as
OpenAI's chunks (`data: {...}` then `data: [DONE]`), or are gathered into one answer, with
usage counts (prompt and completion tokens) and the stream model's finish_reason: "stop" (an
EOS id of the checkpoint, or a stop string: the checkpoint's and the request's `stop`) or
"length". A bad request gets OpenAI's error object, `{"error": {"message",
"type", "param", "code"}}`, with status 400 (404 for an unknown model), and changes nothing
for any other request. Served: every decoder artifact with a tokenizer, under its manifest name.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from moedeploy.runtime.text import TextCodec, TextError, check_unicode
from moedeploy.serving.front import (
    RETRY_AFTER,
    LoopServer,
    app_runner,
    expect_within,
    unreadable_body_answer,
)
from moedeploy.serving.generate_body import FLOAT32_MAX, INT64, error_message
from moedeploy.serving.json_text import parse_json, shown
from moedeploy.serving.specs import (
    DEFAULT_MAX_NEW_TOKENS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    STREAM_SUFFIX,
    ServingError,
)

#: OpenAI's defaults where a request leaves a field out
DEFAULT_TEMPERATURE = 1.0
#: the roles OpenAI's chat API takes ("function" is its older name for "tool")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
#: fields this server does not implement -> the values that ask for nothing (those pass)
#: (logprobs 0 is no such value: the completions API answers it with the chosen tokens' log
#: probabilities; tool_choice "none" is, and any other tool_choice needs tools, refused too)
UNSUPPORTED = {
    "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "suffix": ("",), "tools": ([],),
    "functions": ([],), "tool_choice": ("none",), "function_call": ("none",), "logit_bias": ({},),
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "response_format": ({"type": "text"},),
}


class ApiError(Exception):
    """A request OpenAI's API would refuse: status, one-line message, the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ServedModel:
    name: str  # the artifact's name; Triton serves `<name>_stream`
    codec: TextCodec
    created: int
    max_positions: int  # prompt + completion tokens


@dataclass(frozen=True)
class Generation:
    """One request, checked: the prompt ids and the stream model's options."""

    model: ServedModel
    ids: list[int]
    max_tokens: int
    options: dict[str, Any]
    stream: bool
    include_usage: bool
    chat: bool


def _number(body: dict, name: str, kind: type, default: Any = None, low: float | None = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ApiError(f"{name} must be an integer, got {shown(value)}", name)
    if kind is float and (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                          or abs(value) > FLOAT32_MAX):
        raise ApiError(f"{name} must be a number within float32's range, got {shown(value)}", name)
    if low is not None and value < low:
        raise ApiError(f"{name} must be >= {low}, got {shown(value)}", name)
    if kind is int and not INT64[0] <= value <= INT64[1]:
        raise ApiError(f"{name} must be an integer in int64's range, got {shown(value)}", name)
    return value


def _unsupported(body: dict) -> str | None:
    """The first field asking for something this server does not do (it would be ignored)."""
    for name, neutral in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not (value in neutral and type(value) in {type(v) for v in neutral}):
            return name
    return None


def _as_float32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _checked_text(text: str, field: str) -> None:
    try:
        check_unicode(text, field)
    except TextError as e:
        raise ApiError(str(e), field) from None


def served_model(name: str, models: dict[str, ServedModel]) -> ServedModel:
    """The model a request names, or OpenAI's 404 `model_not_found`."""
    if name not in models:
        raise ApiError(f"the model {name!r} does not exist; served: {', '.join(models)}", "model", 404,
                       "model_not_found")
    return models[name]


def model_object(model: ServedModel) -> dict[str, Any]:
    """A model as /v1/models lists it."""
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "moedeploy"}


def parse_request(body: Any, models: dict[str, ServedModel], chat: bool) -> Generation:
    """The request as the stream model takes it, or an ApiError naming the field."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str):
        raise ApiError("model is required: one of " + ", ".join(models), "model")
    model = served_model(name, models)
    for field in ("n", "best_of"):
        if (value := _number(body, field, int)) is not None and value != 1:
            raise ApiError(f"{field} must be 1: this server makes one choice per request", field)
    if unsupported := _unsupported(body):
        raise ApiError(f"{unsupported} is not supported by this server; leave it out", unsupported)
    limit = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    default = DEFAULT_MAX_NEW_TOKENS if chat else 16  # OpenAI's completions default is 16 tokens
    max_tokens = _number(body, limit, int, default, low=1)
    options = {"temperature": float(_number(body, "temperature", float, DEFAULT_TEMPERATURE, low=0.0))}
    if (top_p := _number(body, "top_p", float)) is not None:
        if not 0 < top_p <= 1:  # the nucleus's probability mass: some, at most all
            raise ApiError(f"top_p must be in (0, 1], got {shown(top_p)}", "top_p")
        if _as_float32(top_p) == 0:  # what the stream model reads
            raise ApiError(f"top_p must be in (0, 1], got {shown(top_p)}, which is 0 as a float32", "top_p")
        options["top_p"] = float(top_p)
    if (top_k := _number(body, "top_k", int, low=1)) is not None:  # not OpenAI's; vLLM's and TensorRT-LLM's
        options["top_k"] = top_k
    if (seed := _number(body, "seed", int)) is not None:
        options["seed"] = seed
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise ApiError(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    for text in stop:
        if len(text) > MAX_STOP_CHARS:
            raise ApiError(f"a stop string has {len(text):,} characters; the most is {MAX_STOP_CHARS}", "stop")
        _checked_text(text, "stop")
    if stop := [s for s in stop if s]:
        options["stop"] = stop
    field = "messages" if chat else "prompt"
    try:
        if chat:
            messages = body.get("messages")
            for i, message in enumerate(messages if isinstance(messages, list) else []):
                role = message.get("role") if isinstance(message, dict) else None
                if isinstance(role, str) and role not in CHAT_ROLES:
                    raise ApiError(f"messages[{i}].role is {shown(role)}; use one of {', '.join(CHAT_ROLES)}", field)
            messages = [text_parts_joined(m, i) for i, m in enumerate(messages)] if isinstance(messages, list) else messages
            ids = model.codec.chat_ids(messages, max_tokens=model.max_positions)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if not isinstance(prompt, str) or not prompt:
                raise ApiError("prompt must be one non-empty string", "prompt")
            ids = model.codec.encode(prompt, max_tokens=model.max_positions)
    except TextError as e:
        raise ApiError(str(e), field) from None
    if len(ids) + max_tokens > model.max_positions:
        raise ApiError(f"the prompt ({len(ids):,} tokens) and {limit} ({max_tokens:,}) come to more than the model's "
                       f"{model.max_positions:,} positions; shorten the prompt or ask for fewer tokens",
                       field if len(ids) >= model.max_positions else limit)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("stream must be true or false", "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise ApiError("stream_options is only allowed when stream is true", "stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise ApiError("stream_options must be an object such as {\"include_usage\": true}", "stream_options")
    include_usage = (stream_options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ApiError(f"stream_options.include_usage must be true or false, got {shown(include_usage)}",
                       "stream_options")
    return Generation(model, ids, max_tokens, options, stream, include_usage, chat)


def text_parts_joined(message: Any, index: int) -> Any:
    """A chat message whose content is a list of text parts ([{"type": "text", "text": ...}], as
    OpenAI's API allows) with that content as one string, the parts joined by newlines (as vLLM
    joins them); a part of another type is refused by name. Anything else is returned as it is
    (check_messages says what is wrong with it)."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    texts = []
    for j, part in enumerate(message["content"]):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and not isinstance(part.get("text"), str):
            raise ApiError(f"messages[{index}].content[{j}] is a text part without a \"text\" string", "messages")
        if kind != "text":
            what = f"a {shown(kind)} part" if isinstance(kind, str) else "not a {\"type\": \"text\", \"text\": ...} part"
            raise ApiError(f"messages[{index}].content[{j}] is {what}; this server takes text only", "messages")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


class OpenAIFront(LoopServer):
    """The API, in front of moedeploy's HTTP front (`upstream`)."""

    what = "the OpenAI API"
    flag = "--openai-port"
    thread_name = "moedeploy-openai"

    def __init__(self, host: str, port: int, upstream: str, models: list[ServedModel],
                 max_bytes: int = 16 * 2**20) -> None:
        super().__init__(host, port, upstream)
        self.models = {m.name: m for m in models}
        self.max_bytes = max_bytes

    async def _start(self) -> None:
        import aiohttp
        from aiohttp import web

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        app = web.Application(client_max_size=self.max_bytes, middlewares=[_openai_errors_middleware(self.max_bytes)])
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_post("/v1/completions", self._completions, expect_handler=self._expect)
        app.router.add_post("/v1/chat/completions", self._chat_completions, expect_handler=self._expect)
        self._runner = app_runner(app, self.port, handle_signals=False, handler_cancellation=True,
                                  shutdown_timeout=2.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, reuse_address=True).start()

    async def _expect(self, request):
        """A body announced over the limit (`Expect: 100-continue`) is refused before it is sent."""
        from aiohttp import web

        error = ApiError(too_big_text(self.max_bytes), status=413)
        return await expect_within(request, self.max_bytes, lambda size: web.json_response(error.body(), status=413))

    async def _list_models(self, request):
        from aiohttp import web

        data = [model_object(m) for m in self.models.values()]
        return web.json_response({"object": "list", "data": data})

    async def _model(self, request):
        from aiohttp import web

        try:
            return web.json_response(model_object(served_model(request.match_info["model"], self.models)))
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)

    async def _completions(self, request):
        return await self._generate(request, chat=False)

    async def _chat_completions(self, request):
        return await self._generate(request, chat=True)

    async def _generate(self, request, chat: bool):
        from aiohttp import web
        from aiohttp.web_protocol import RequestPayloadError

        try:
            try:
                raw = await request.read()
            except RequestPayloadError:  # aiohttp could not decode it as its Content-Encoding says
                encoding = request.headers.get("Content-Encoding", "")
                error = ApiError(f"the request body could not be read as its Content-Encoding ({encoding}) says; send "
                                 "it encoded so, or without that header")
                return unreadable_body_answer(request, web.json_response(error.body(), status=error.status))
            body, problem = parse_json(raw)  # nested too deep is invalid JSON too, not a server error
            if problem is not None:
                raise ApiError(problem)
            # on a worker thread: encoding a long prompt must not hold up the other requests
            generation = await asyncio.to_thread(parse_request, body, self.models, chat)
            if generation.stream:
                return await self._stream(request, generation)
            pieces, tokens, finish = [], 0, "length"
            async for piece, finish_reason, count in self._tokens(generation):
                pieces.append(piece)
                tokens += count
                finish = finish_reason or finish
            return web.json_response(self._whole(generation, "".join(pieces), tokens, finish))
        except ApiError as e:
            return web.json_response(e.body(), status=e.status, headers=RETRY_AFTER if e.status == 503 else None)

    async def _tokens(self, generation: Generation) -> AsyncIterator[tuple[str, str | None, int]]:
        """(text, finish_reason or None, tokens) per response of Triton's generate_stream: the
        tokens made since the last response (one, or several for a stream the server batched)."""
        payload = {"input_ids": generation.ids, "max_tokens": generation.max_tokens, **generation.options}
        url = f"{self.upstream}/v2/models/{generation.model.name}{STREAM_SUFFIX}/generate_stream"
        async with self._session.post(url, json=payload) as upstream:
            if upstream.status != 200:
                raise ApiError(await _triton_error(upstream), status=400 if upstream.status < 500 else 503)
            async for raw in upstream.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[len("data:"):])
                if "error" in event:
                    raise ApiError(str(event["error"]).split("\n")[0])
                if "output_ids" not in event:
                    continue
                ids = event["output_ids"]
                yield event.get("text_output", ""), event.get("finish_reason") or None, len(ids) if isinstance(ids, list) else 1

    def _whole(self, generation: Generation, text: str, tokens: int, finish: str) -> dict[str, Any]:
        usage = {"prompt_tokens": len(generation.ids), "completion_tokens": tokens,
                 "total_tokens": len(generation.ids) + tokens}
        head = {"created": int(time.time()), "model": generation.model.name, "usage": usage}
        if generation.chat:
            return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", **head, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}]}
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", **head, "choices": [
            {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}

    async def _stream(self, request, generation: Generation):
        """OpenAI's server-sent events: a chunk per token, the last with its finish_reason, usage
        when stream_options.include_usage asks, then [DONE]. A failure after the first chunk can
        only end the stream with an error event (the status is sent)."""
        from aiohttp import web

        chat = generation.chat
        chunk_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": chunk_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": generation.model.name}

        def choice(piece: str, finish: str | None, first: bool) -> dict[str, Any]:
            if chat:
                delta = {"role": "assistant", "content": piece} if first else {"content": piece}
                return {"index": 0, "delta": delta if piece or first else {}, "finish_reason": finish}
            return {"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}

        events = self._tokens(generation)
        try:  # the first token decides between an error answer and a stream
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(data: Any) -> None:
            await response.write(f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode())

        tokens = 0
        try:
            try:
                if first is not None:
                    tokens += first[2]
                    await send({**head, "choices": [choice(first[0], first[1], True)]})
                    async for piece, finish, count in events:
                        tokens += count
                        await send({**head, "choices": [choice(piece, finish, False)]})
                if generation.include_usage:
                    await send({**head, "choices": [], "usage": {
                        "prompt_tokens": len(generation.ids), "completion_tokens": tokens,
                        "total_tokens": len(generation.ids) + tokens}})
            except ApiError as e:
                await send(e.body())
            await send("[DONE]")
            await response.write_eof()
        except ConnectionResetError:
            # the client went away between two writes (a cancel reaches the handler only while it
            # waits on the connection): nobody to answer; closing the token stream cancels the
            # generation upstream. Raised out of the handler, aiohttp logged it with a traceback.
            await events.aclose()
            if request.transport is not None:
                request.transport.abort()
        return response


def too_big_text(max_bytes: int) -> str:
    return f"the request body is over this server's limit of {max_bytes:,} bytes (moedeploy serve --max-request-mb)"


def _openai_errors_middleware(max_bytes: int):
    from aiohttp import web

    @web.middleware
    async def middleware(request, handler):
        """aiohttp's own refusals (no such path, wrong method, a body over the limit) as OpenAI's
        error object instead of plain text."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            message = {404: f"no such endpoint: {request.method} {request.path}",
                       405: f"{request.path} does not take {request.method}",
                       413: too_big_text(max_bytes)}.get(e.status, e.text or e.reason)
            return web.json_response(ApiError(message, status=e.status).body(), status=e.status)

    return middleware


async def _triton_error(response) -> str:
    """The one-line reason of an error answer ({"error": "..."}, or as a server-sent event),
    else its status."""
    return error_message(await response.read()) or f"the model server answered HTTP {response.status}"


def served_models_of(artifacts: list) -> list[ServedModel]:
    """The decoders with a tokenizer; the OpenAI API needs text. Refuses a server with none."""
    models = [ServedModel(a.name, TextCodec.from_artifact(a), int(a.path.stat().st_mtime),
                          int(a.manifest["config"]["max_positions"]))
              for a in artifacts if a.kind == "decoder" and a.manifest.get("tokenizer")]
    if not models:
        raise ServingError("--openai-port serves decoders with a tokenizer, and none of these artifacts has one: "
                           "export the decoder from a checkpoint folder with tokenizer.json")
    return models
