"""The front of `moedeploy serve`: HTTP and gRPC proxies on the user's ports, Triton behind them
on loopback, so a request over `--max-request-mb` is refused before Triton reads it and an HTTP
client that goes away cancels its generation.

Why: Triton 2.51 (bundled by PyTriton 0.7) reads a request whole and copies its tensors into the
Python backend's shared-memory pool before any check of ours runs (a 210 MB request leaves the
pool, and the server, 210 MB larger for good), and it has no option that caps a request's size.
It detects a client's cancellation on gRPC only; over HTTP an abandoned generation runs to its
last token.

- HTTP (aiohttp): bodies stream through in both directions. A request whose Content-Length is
  over the limit gets 413 with KServe's one-line `{"error": ...}` and is never forwarded (with
  `Expect: 100-continue` its body is not even sent). A body of no stated length (chunked) or a
  compressed one (counted decompressed) is read whole in the front first, up to the limit, and
  forwarded with its length, or refused the same way once it passes the limit: Triton keeps
  the memory of whatever it has buffered, so it never gets part of a refused body. A generate
  request's body is checked first (serving.generate_body: what Triton's own parser would answer
  500 gets 400), and its refusal before the first token comes back as one JSON line, 503 when
  the server is busy. An inference request's body is read whole too and its JSON checked
  (serving.infer_body: a shape its data does not fill would have Triton allocate what the shape
  declares, and die of it). A body that is not what its Content-Encoding says gets 400. Every
  other status, header and body passes through unchanged. An inference request to a generation model gets a fresh `REQUEST_ID_HEADER`, which Triton
  forwards to the model as a request parameter (`--http-header-forward-pattern`; through the generate extension, which forwards no header,
  the id goes into the JSON body's "parameters" instead); when its client disconnects before
  the answer (or, streaming, before the last token), the id is marked in `CancelledRequests`,
  which the generation loop (running in this same process, as PyTriton's callables do) checks
  before every token.
- gRPC (grpcio): a generic proxy that forwards every method's raw bytes (unary-unary, and the
  stream-stream ModelStreamInfer). grpcio refuses a message over the limit itself, with
  RESOURCE_EXHAUSTED, before it reaches a handler; a client's cancellation (or deadline)
  cancels the call to Triton, whose own cancellation then stops the generation (stub_guard).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote

from moedeploy.serving.generate_body import checked_generate_body, error_message, error_status
from moedeploy.serving.infer_body import (
    JSON_LENGTH_HEADER,
    checked_partly,
    infer_body_problem,
    whole_body_problem,
)
from moedeploy.serving.specs import ServingError

LOGGER = logging.getLogger("moedeploy.serving")
#: the most seconds the check of a large inference body Triton answered 500 may take (64 MiB of
#: JSON parses in about 6 s here); past it Triton's answer stands
WHOLE_CHECK_S = 30.0
#: Added by the HTTP front to each inference request of a generation model; Triton passes it
#: on as a request parameter of this name (lower case: HTTP header names are case-insensitive).
REQUEST_ID_HEADER = "moedeploy-request-id"
TRITON_FORWARD_PATTERN = f"^{REQUEST_ID_HEADER}$"
LIMIT_FLAG = "moedeploy serve --max-request-mb"
RETRY_AFTER = {"Retry-After": "1"}  # seconds, on a 503
_INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/[^/]+)?/(infer|generate|generate_stream)$")
# RFC 9110 7.6.1: meant for one connection, never forwarded (and the body framing is redone).
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
    "trailer", "transfer-encoding", "upgrade",
})
# A body aiohttp has already decompressed travels on without its Content-Encoding and length.
_DECODED = frozenset({"gzip", "x-gzip", "deflate", "br", "zstd"})
GRPC_WORKERS = 256  # gRPC calls in flight at once through the front (each holds a thread while it waits)


class CancelledRequests:
    """Ids of HTTP generation requests whose client went away before the answer.

    The front adds an id; the generation checks it between tokens and forgets it when the request
    ends. An id whose request never reaches a generation (refused first) is dropped after
    `ttl_s`, and at most `max_ids` are kept, so nothing accumulates.
    """

    def __init__(self, ttl_s: float = 3600.0, max_ids: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_ids = max_ids
        self._ids: dict[str, float] = {}
        self._lock = threading.Lock()

    def cancel(self, request_id: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._ids[request_id] = now
            while len(self._ids) > self.max_ids or next(iter(self._ids.values())) < now - self.ttl_s:
                del self._ids[next(iter(self._ids))]  # the oldest (ids are kept in the order they came)

    def is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._ids

    def forget(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                self._ids.pop(request_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)


def too_big_message(limit: int, size: int | None) -> str:
    """The 413's reason: the body's size (None: a body of unknown length that passed the limit)."""
    body = f"the request body ({size} bytes)" if size is not None else "the request body (sent without a length, or compressed)"
    return f"{body} is over the server's limit of {limit} bytes ({limit / 2**20:g} MiB); {LIMIT_FLAG} raises it"


async def expect_within(request, max_bytes: int, refuse: Callable[[int], Any]):
    """An aiohttp expect handler: `Expect: 100-continue` with an announced body over `max_bytes`
    gets refuse(its length), before the client sends it; otherwise what aiohttp's own expect
    handler does (100 Continue)."""
    from aiohttp import HttpVersion11, web

    if request.content_length is not None and request.content_length > max_bytes:
        return refuse(request.content_length)
    expect = request.headers.get("Expect", "")
    if request.version == HttpVersion11:
        if expect.lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
    return None


class LoopServer:
    """An aiohttp server on its own event loop in a daemon thread: `start()`, `stop()`.

    Subclasses build their app and client session in `_start` (on the loop) and name what they
    serve; stopping closes the listener, every connection and the session, then the loop."""

    what = "http"  # for the "cannot listen" message and the thread's name
    flag = "--http-port"
    thread_name = "moedeploy-http-front"

    def __init__(self, host: str, port: int, upstream: str) -> None:
        self.host, self.port, self.upstream = host, port, upstream.rstrip("/")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None
        self._session: Any = None

    async def _start(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=self.thread_name, daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        except OSError as e:
            self.stop()
            raise ServingError(f"cannot listen on {self.host}:{self.port} for {self.what} ({e.strerror or e}); "
                               f"choose another {self.flag}") from None
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop listening, close every connection (in both directions) and the loop's thread."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._stop(), loop).result(timeout=timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        if not loop.is_running():
            loop.close()

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()


class HttpFront(LoopServer):
    """The HTTP proxy in front of Triton's HTTP endpoint."""

    def __init__(self, host: str, port: int, upstream: str, max_bytes: int, generation_models: Collection[str],
                 cancelled: CancelledRequests, body_limits: dict[str, int] | None = None) -> None:
        """body_limits: a generation model's most generate-request bytes (generate_body_limit)."""
        super().__init__(host, port, upstream)
        self.max_bytes = max_bytes
        self.generation_models = frozenset(generation_models)
        self.body_limits = body_limits or {}
        self.cancelled = cancelled
        self._whole_checks: asyncio.Semaphore | None = None  # made on the loop, in _start

    async def _start(self) -> None:
        import aiohttp
        from aiohttp import web

        # one large body checked at a time: parsing 64 MiB of JSON can take a GB for a moment
        self._whole_checks = asyncio.Semaphore(1)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,  # bodies pass through as Triton encoded them
            # nothing the client did not send: no Accept-Encoding (Triton would compress), no
            # default User-Agent or Content-Type
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type", "Accept"),
        )
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle, expect_handler=self._expect)
        # handler_cancellation: a client that disconnects cancels its handler (and so its call to Triton)
        self._runner = app_runner(app, self.port, handle_signals=False, handler_cancellation=True,
                                  shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True, reuse_port=False)
        await site.start()

    def _refusal(self, status: int, message: str):
        from aiohttp import web

        # a busy server asks clients to come back in a second rather than at once
        return web.json_response({"error": message}, status=status, headers=RETRY_AFTER if status == 503 else None)

    async def _expect(self, request):
        return await expect_within(request, self.max_bytes,
                                   lambda size: self._refusal(413, too_big_message(self.max_bytes, size)))

    async def _whole_body(self, request, max_bytes: int) -> bytearray | None:
        """A body of no stated length (chunked) or that aiohttp decompressed, read up to the limit;
        None once it passes the limit. Forwarded whole, with its length: Triton keeps the memory of
        a body it has buffered, so it must never get part of one that is refused."""
        body = bytearray()
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > max_bytes:
                return None
        return body

    async def _whole_body_problem(self, body: bytearray, json_length: str | None) -> str | None:
        """infer_body's whole check of a large body, in a child process; None if it finds nothing
        or does not run (then Triton's own answer stands, and the log says why). One runs at a
        time, for at most WHOLE_CHECK_S: a 500 met while one runs passes through unchecked, so a
        client sending such bodies never queues another's answer (or holds its body) behind it."""
        assert self._whole_checks is not None
        if self._whole_checks.locked():
            LOGGER.info("http front: a %d-byte inference body Triton refused passes its answer on unchecked: another "
                        "large body is being checked", len(body))
            return None
        async with self._whole_checks:
            try:
                return await asyncio.wait_for(whole_body_problem(body, json_length), WHOLE_CHECK_S)
            except (OSError, RuntimeError, ValueError, asyncio.TimeoutError) as e:
                LOGGER.warning("http front: could not check a %d-byte inference body Triton refused: %s", len(body),
                               _one_line(e) if str(e) else f"no answer in {WHOLE_CHECK_S:g} s")
                return None

    async def _handle(self, request):
        from aiohttp import ClientError, web
        from aiohttp.web_protocol import RequestPayloadError
        from yarl import URL

        size = request.content_length
        if size is not None and size > self.max_bytes:
            return self._refusal(413, too_big_message(self.max_bytes, size))
        infer = _INFER_PATH.match(request.path)
        model = unquote(infer[1]) if infer else None
        limit = self.body_limits.get(model) if infer and infer[2] != "infer" else None
        if limit is not None and size is not None and size > limit:
            return self._refusal(413, f"a generate request to {model} of {size:,} bytes is larger than any prompt of "
                                      f"its model's positions needs ({limit:,} bytes); send a shorter prompt")
        headers: list[tuple[str, str]] = []
        for name, value in request.headers.items():
            key = name.lower()
            if key not in _HOP_BY_HOP and key not in ("host", "expect", REQUEST_ID_HEADER):
                headers.append((name, value))
        request_id = None
        if request.method == "POST" and infer and model in self.generation_models:
            request_id = uuid.uuid4().hex
            headers.append((REQUEST_ID_HEADER, request_id))
        body: Any = None
        # an inference request's JSON is checked before Triton allocates what its shapes declare
        inference = request.method == "POST" and infer is not None and infer[2] == "infer"
        json_length = request.headers.get(JSON_LENGTH_HEADER)
        if request.body_exists:
            encoding = request.headers.get("Content-Encoding", "").strip().lower()
            # Triton forwards no header to a model through its generate extension: the id goes in
            # the request's JSON "parameters" instead, so that body is read whole (up to the limit)
            generate = request_id is not None and infer[2] != "infer"
            if generate or inference or size is None or encoding in _DECODED:  # aiohttp hands us decompressed bytes: count and send those
                cap = min(self.max_bytes, limit or self.max_bytes)
                try:
                    body = await self._whole_body(request, cap)
                except RequestPayloadError as e:  # not what its Content-Encoding says, or broken chunks
                    return unreadable_body_answer(request, self._refusal(
                        400, f"the request body is not valid {encoding} data, as its Content-Encoding says; send it "
                             "encoded so, or without that header" if encoding in _DECODED
                        else f"the request body could not be read: {_one_line(e)}"))
                if body is None:
                    return self._refusal(413, too_big_message(cap, None) if cap == self.max_bytes else
                                         f"a generate request to {model} of more than {cap:,} bytes (sent without a "
                                         "length, or compressed) is larger than any prompt of its model's positions "
                                         "needs; send a shorter prompt")
                if generate:
                    body, problem = checked_generate_body(bytes(body), model, infer[2], (REQUEST_ID_HEADER, request_id))
                    if problem:
                        return self._refusal(400, problem)
                elif inference and (problem := await asyncio.to_thread(infer_body_problem, body, json_length)):
                    return self._refusal(400, problem)
                headers = [(n, v) for n, v in headers if n.lower() not in ("content-encoding", "content-length")]
                headers.append(("Content-Length", str(len(body))))
            else:  # streamed through; aiohttp stops at the stated length
                body = request.content.iter_any()
        elif inference:  # Content-Length 0: nothing Triton could run either
            return self._refusal(400, 'the request body is empty; send a JSON object with "inputs"')
        answered = False
        response: web.StreamResponse | None = None
        try:
            url = URL(self.upstream + request.raw_path, encoded=True)  # the path and query exactly as sent
            async with self._session.request(request.method, url, headers=headers,
                                             data=body, allow_redirects=False) as upstream:
                answered = True
                triton_said = None
                if inference and upstream.status == 500 and checked_partly(body, json_length):
                    # a JSON part too large to parse in the loop went through on its shapes alone,
                    # and Triton's parser refused it as a server error: find the client's mistake
                    triton_said = await upstream.read()
                    if (problem := await self._whole_body_problem(body, json_length)) is not None:
                        return self._refusal(400, problem)
                if request_id is not None and infer[2] != "infer" and upstream.status >= 400:
                    # a generation refused before its first token: one JSON line, and 503 for "busy"
                    message = error_message(await upstream.read())
                    return self._refusal(error_status(upstream.status, message), message)
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for name, value in upstream.headers.items():
                    if name.lower() not in _HOP_BY_HOP:
                        response.headers.add(name, value)
                await response.prepare(request)
                if triton_said is not None:
                    await response.write(triton_said)
                else:
                    async for chunk in upstream.content.iter_any():
                        await response.write(chunk)
                await response.write_eof()
                return response
        except asyncio.CancelledError:  # the client went away (a stream: while its tokens were still coming)
            if request_id is not None and (not answered or infer[2] == "generate_stream"):
                self.cancelled.cancel(request_id)
            raise
        except (ClientError, OSError, asyncio.TimeoutError) as e:
            if response is not None:  # mid-answer: the status is sent; cut the connection
                if request_id is not None:  # a write to a client that went away fails here, not as a cancel
                    self.cancelled.cancel(request_id)
                if request.transport is not None:
                    request.transport.abort()
                return response
            if request_id is not None:
                self.cancelled.forget([request_id])
            LOGGER.warning("http front: no answer from Triton for %s %s: %s", request.method, request.path,
                           _one_line(e))
            return self._refusal(503, f"the model server is unavailable ({_one_line(e)}); retry")


class MalformedRequestsInOneLine:
    """aiohttp's server logger, as a front's runner hands it to aiohttp: a request aiohttp could
    not parse (a Content-Length that is not a number, two of them, a bad chunk size, a header
    past 8 KiB: HttpProcessingError) is the client's mistake, and gets one line in the log; aiohttp
    logged each with "Error handling request" and a traceback of about ten lines, a log any client
    could flood. aiohttp itself still answers it 400 and closes the connection. Anything else is
    logged as aiohttp logs it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._logger = logging.getLogger("aiohttp.server")

    def exception(self, message: str, *args: Any, exc_info: Any = None, **kwargs: Any) -> None:
        from aiohttp.http_exceptions import HttpProcessingError

        if isinstance(exc_info, HttpProcessingError):
            # aiohttp's message: a reason ending in ":" and the bytes it met on the next line
            reason = " ".join(line.strip() for line in str(exc_info.message).splitlines()[:3] if line.strip())
            LOGGER.info("refused a malformed HTTP request on port %d: %s: %s", self.port, type(exc_info).__name__,
                        reason[:200])
        else:
            self._logger.exception(message, *args, exc_info=exc_info, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


def app_runner(app: Any, port: int, **kwargs: Any) -> Any:
    """A web.AppRunner for a front's app whose malformed requests are logged in one line."""
    from aiohttp import web

    return web.AppRunner(app, access_log=None, logger=MalformedRequestsInOneLine(port), **kwargs)


def unreadable_body_answer(request, response):
    """`response` to a request whose body aiohttp failed to read (RequestPayloadError), sent on a
    connection that then closes. Without this aiohttp drains the rest of the body after the
    answer, meets the same error and logs it as an "Unhandled exception" of three tracebacks,
    one per bad request: a log any client could flood."""
    request.content.feed_eof()  # nothing more will be read: no draining after the answer
    response.force_close()  # where the body's bytes end on the connection is unknown now
    return response


def _one_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [""])[0][:200]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class GrpcFront:
    """The gRPC proxy: every method's raw bytes to Triton's gRPC port and back."""

    def __init__(self, host: str, port: int, upstream: str, max_bytes: int) -> None:
        self.host, self.port, self.upstream = host, port, upstream
        self.max_bytes = max_bytes
        self._server: Any = None
        self._channel: Any = None

    def start(self) -> None:
        import grpc

        unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self._channel = grpc.insecure_channel(self.upstream, options=unlimited)
        self._server = grpc.server(
            ThreadPoolExecutor(GRPC_WORKERS, thread_name_prefix="moedeploy-grpc-front"),
            handlers=[_Forward(self._channel)],
            options=[("grpc.max_receive_message_length", self.max_bytes), ("grpc.max_send_message_length", -1),
                     ("grpc.so_reuseport", 0)],
        )
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            bound = self._server.add_insecure_port(address)
        except RuntimeError:
            bound = 0
        if bound != self.port:
            self.stop()
            raise ServingError(f"cannot listen on {self.host}:{self.port} for grpc (address in use or not "
                               "available); choose another --grpc-port")
        self._server.start()

    def stop(self, grace_s: float = 1.0) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace_s).wait(grace_s + 5)
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()


def _metadata(context: Any) -> list[tuple[str, Any]]:
    """The client's metadata, less what gRPC itself sets on the outgoing call."""
    return [(k, v) for k, v in context.invocation_metadata() if not k.startswith((":", "grpc-")) and k != "user-agent"]


def _timeout(context: Any) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e8 else max(remaining, 0.0)


class _Forward:
    """A grpc.GenericRpcHandler for every method: raw bytes in, raw bytes out, cancellation through."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel

    def service(self, details: Any) -> Any:
        import grpc

        method = details.method
        if method.endswith("/ModelStreamInfer"):
            return grpc.stream_stream_rpc_method_handler(self._streams(method))
        return grpc.unary_unary_rpc_method_handler(self._unary(method))

    def _unary(self, method: str) -> Callable[[bytes, Any], bytes]:
        import grpc

        call = self.channel.unary_unary(method)

        def forward(request: bytes, context: Any) -> bytes:
            future = call.future(request, timeout=_timeout(context), metadata=_metadata(context))
            context.add_callback(future.cancel)  # the client cancelled or went away: so does Triton's call
            try:
                response = future.result()
            except grpc.FutureCancelledError:
                context.abort(grpc.StatusCode.CANCELLED, "the client cancelled the request")
            except grpc.RpcError as e:
                context.set_trailing_metadata(e.trailing_metadata() or ())
                context.abort(e.code(), e.details() or "")
            context.set_trailing_metadata(future.trailing_metadata() or ())
            return response

        return forward

    def _streams(self, method: str) -> Callable[[Iterator[bytes], Any], Iterator[bytes]]:
        import grpc

        call = self.channel.stream_stream(method)

        def forward(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
            responses = call(requests, timeout=_timeout(context), metadata=_metadata(context))
            context.add_callback(responses.cancel)
            try:
                yield from responses
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED and not context.is_active():
                    return
                context.set_trailing_metadata(e.trailing_metadata() or ())
                context.abort(e.code(), e.details() or "")
            context.set_trailing_metadata(responses.trailing_metadata() or ())

        return forward
