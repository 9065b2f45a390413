"""Runs inside Triton's Python-backend stub, beside PyTriton's proxy `model.py`: per-request
errors and a size check before a request's tensors are copied towards moedeploy's process.

PyTriton 0.7 answers a whole dynamic batch with one error when its callable raises (the
callable's traceback, as Triton status INTERNAL: HTTP 500), and its stub copies every
request's tensors into its tensor store before anything of ours sees them (a zero-sized
tensor cannot even be copied: `memoryview: cannot cast view with zeros`, which fails the
batch). The server writes this file next to each model's `model.py` and appends two lines
to it that call `install`, which replaces two of that module's functions:

- `TritonRequestsServer._wrap_request`: a request with a tensor outside the model's limits
  (a dim past the artifact's range or zero-sized, too many bytes) leaves the stub without
  its tensors, carrying only the reason in its parameters (`GUARD_PARAMETER`);
- `_wrap_response`: a response holding `ERROR_OUTPUT` (which moedeploy's callables return
  for a request they refuse) becomes that one request's own Triton error, with its code
  (INVALID_ARG answers HTTP 400 and gRPC INVALID_ARGUMENT);
- `TritonPythonModel.execute`: every request in execution gets a token (passed on in its
  parameters as `TOKEN_PARAMETER`; a decoupled model's request keeps it until its final
  response, `DecoupledResponsesHandler.handle_responses`), and a watcher thread creates `<cancel_dir>/<token>` when
  Triton reports the request cancelled (a gRPC client cancelled it or went away; Triton 2.51
  detects no cancellation over HTTP, for which moedeploy's front marks the request itself, see
  `front`). A generation polls for that file between tokens.

Standard library and NumPy only: the stub's Python need not see moedeploy.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

GUARD_PARAMETER = "moedeploy_refused"
TOKEN_PARAMETER = "moedeploy_token"
WATCH_INTERVAL_S = 0.05
ERROR_OUTPUT = "__moedeploy_error__"
#: Name of this file next to the stub's model.py (imported relatively from there).
MODULE_NAME = "moedeploy_guard"


def tensor_problem(name: str, shape: tuple[int, ...], limits: dict[str, Any]) -> str | None:
    """Why a tensor of this shape is refused, or None. `limits[name]` lists per dim
    [label, low, high] (dim 0 is the batch; a fixed dim is Triton's to check)."""
    dims = limits["inputs"].get(name)
    if dims is None:
        return None
    if len(shape) != len(dims):
        return None  # Triton refuses a wrong rank itself, with its own message
    for axis, (size, (label, low, high)) in enumerate(zip(shape, dims, strict=True)):
        if size == 0:
            hint = limits["empty_hints"].get(name, "send at least one element along every dim")
            return f"input {name!r} has shape {list(shape)}: dim {axis} ({label}) is empty; {hint}"
        if not low <= size <= high:
            return f"input {name!r} has shape {list(shape)}: dim {axis} ({label}) is {size}, outside the model's range [{low}, {high}]"
    return None


def request_problem(arrays: dict[str, Any], limits: dict[str, Any]) -> str | None:
    """Why a request (name -> array) is refused before it leaves the stub, or None."""
    for name, array in arrays.items():
        problem = tensor_problem(name, tuple(array.shape), limits)
        if problem:
            return problem
    size = sum(int(a.nbytes) for a in arrays.values())
    if size > limits["max_request_bytes"]:
        return (f"the request's tensors hold {size} bytes, over the server's limit of {limits['max_request_bytes']} "
                "(moedeploy serve --max-request-mb)")
    return None


def install(namespace: dict[str, Any], limits_json: str) -> None:
    """Replace `_wrap_request` and `_wrap_response` in PyTriton's proxy model module `namespace`."""
    limits = json.loads(limits_json)
    pb_utils = namespace["pb_utils"]
    request_type = namespace["Request"]
    server_type = namespace["TritonRequestsServer"]
    original_request = server_type._wrap_request
    original_response = namespace["_wrap_response"]

    model_type = namespace["TritonPythonModel"]
    original_execute = model_type.execute
    tokens = Tokens(Path(limits["cancel_dir"]) if limits.get("cancel_dir") else None)

    def execute(self: Any, triton_requests: Any) -> Any:
        for request in triton_requests:
            tokens.add(request)
        decoupled = bool(getattr(self, "_decoupled_model", False))
        try:
            return original_execute(self, triton_requests)
        except BaseException:
            decoupled = False
            raise
        finally:
            if not decoupled:  # a decoupled model answers after execute returns: see handle_responses
                for request in triton_requests:
                    tokens.remove(request)

    async def handle_responses(self: Any, scope: Any, responses_queue: Any, responses_future: Any) -> Any:
        """A decoupled model's requests keep their tokens (and so their cancellation watch) until
        their final response: the tokens go just before it is sent, since Triton frees a
        request's response factory with the final response, and asking a freed one whether it
        was cancelled crashes tritonserver (TRITONBACKEND_ResponseFactoryIsCancelled)."""
        requests = list(self._requests_map.get(scope["requests_id"], []))

        def release() -> None:
            for request in requests:
                tokens.remove(request)  # waits for a check in progress (under `ipc`)

        try:
            return await original_handle(self, scope, _BeforeFinal(responses_queue, eos_flag, release),
                                         responses_future)
        finally:
            release()

    def wrap_request(self: Any, triton_request: Any, inputs: Any, span: Any = None) -> Any:
        with tokens.ipc:
            request = wrap_checked(self, triton_request, inputs, span)
        if request.parameters is not None and (token := tokens.of(triton_request)):
            request.parameters[TOKEN_PARAMETER] = token
        return request

    def wrap_checked(self: Any, triton_request: Any, inputs: Any, span: Any = None) -> Any:
        arrays = {}
        for name in inputs:
            tensor = pb_utils.get_input_tensor_by_name(triton_request, name)
            if tensor is not None:
                arrays[name] = tensor.as_numpy()
        problem = request_problem(arrays, limits)
        if problem is None:
            return original_request(self, triton_request, inputs, span)
        kwargs = {"span": span} if span is not None else {}
        return request_type(data={}, parameters={GUARD_PARAMETER: problem},
                            requested_output_names=list(triton_request.requested_output_names()), **kwargs)

    def wrap_response(response: Any, requested_outputs_names: Any, model_outputs_dict: Any) -> Any:
        with tokens.ipc:
            return wrap_unlocked(response, requested_outputs_names, model_outputs_dict)

    def wrap_unlocked(response: Any, requested_outputs_names: Any, model_outputs_dict: Any) -> Any:
        data = response.data
        if data is not None and ERROR_OUTPUT in data:
            error = json.loads(bytes(data[ERROR_OUTPUT].reshape(-1)[0]).decode("utf-8"))
            code = getattr(pb_utils.TritonError, error["code"], pb_utils.TritonError.INTERNAL)
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(error["message"], code))
        return original_response(response, requested_outputs_names, model_outputs_dict)

    server_type._wrap_request = wrap_request
    namespace["_wrap_response"] = wrap_response
    if tokens.cancel_dir is not None:
        model_type.execute = execute
        eos_flag = namespace["PyTritonResponseFlags"].EOS
        decoupled_type = namespace["DecoupledResponsesHandler"]
        original_handle = decoupled_type.handle_responses
        decoupled_type.handle_responses = handle_responses
        threading.Thread(target=tokens.watch, name="moedeploy-cancel-watch", daemon=True).start()


class _BeforeFinal:
    """A decoupled handler's responses queue that calls `before()` when it hands over the last
    responses (flag EOS), or when the handler is cancelled: before the final response is sent."""

    def __init__(self, queue: Any, eos_flag: int, before: Any) -> None:
        self._queue, self._eos_flag, self._before = queue, eos_flag, before

    async def get(self) -> Any:
        import asyncio

        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self._before()
            raise
        if item[0] & self._eos_flag:
            self._before()
        return item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


class Tokens:
    """Tokens of the requests in execution, and the watcher that marks the cancelled ones.

    `ipc` serialises what our hooks ask of Triton (tensors, responses, is_cancelled), so the
    watcher thread never talks to Triton while another of our hooks does, and never about a
    request whose execution has ended (removal waits for a check in progress).
    """

    def __init__(self, cancel_dir: Path | None) -> None:
        self.cancel_dir = cancel_dir
        self._counter = itertools.count()
        self._by_request: dict[int, tuple[str, Any]] = {}
        self._lock = threading.Lock()
        self.ipc = threading.RLock()

    def add(self, request: Any) -> None:
        with self._lock:
            self._by_request[id(request)] = (f"{os.getpid()}-{next(self._counter)}", request)

    def of(self, request: Any) -> str | None:
        with self._lock:
            entry = self._by_request.get(id(request))
        return entry[0] if entry else None

    def remove(self, request: Any) -> None:
        with self.ipc, self._lock:
            token, _ = self._by_request.pop(id(request), (None, None))
        if token and self.cancel_dir is not None:
            (self.cancel_dir / token).unlink(missing_ok=True)

    def watch(self) -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            with self._lock:
                tokens = [token for token, _ in self._by_request.values()]
            for token in tokens:
                self._check(token)

    def _check(self, token: str) -> None:
        """Ask Triton about one request, if it is still in execution (under `ipc`)."""
        with self.ipc:
            with self._lock:
                entry = next((e for e in self._by_request.values() if e[0] == token), None)
            if entry is None or self.cancel_dir is None:
                return
            try:
                cancelled = entry[1].is_cancelled()
            except Exception:  # the next round asks again
                return
        if cancelled:
            (self.cancel_dir / token).touch()
