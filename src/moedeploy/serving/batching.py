"""Triton's dynamic batcher hands the model several requests at once; run them as few backend
calls as their shapes allow.

Requests whose tensors agree on every dim but the batch dim are concatenated along dim 0,
run as one call, and the outputs are split back by each request's batch size. Requests of
other shapes (another sequence length, another KV-cache length) form their own group:
padding would change what attention sees, and the artifact's graph has no mask input.

Every request is answered on its own: one that cannot run gets its own error (RequestError:
a client error, answered 400 / INVALID_ARGUMENT with its one-line reason) and the batch runs
without it. A group whose run fails is retried one request at a time, so a request that
slipped past validation fails alone. `PerRequest` turns these outcomes into what
PyTriton returns, and `stub_guard` into each request's own Triton error.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from moedeploy.serving.stub_guard import ERROR_OUTPUT, GUARD_PARAMETER

Feed = dict[str, np.ndarray]
RunFn = Callable[[Feed], Mapping[str, np.ndarray]]
LOGGER = logging.getLogger("moedeploy.serving")


class RequestError(ValueError):
    """A request the model cannot run; the message names the input and the problem."""

    code = "INVALID_ARG"  # Triton's status: HTTP 400, gRPC INVALID_ARGUMENT


class ServerError(RuntimeError):
    """The server failed one request (not the client's fault); the message is one line."""

    code = "INTERNAL"  # HTTP 500, gRPC INTERNAL


class Cancelled(RuntimeError):
    """The client cancelled the request (Triton told the stub) while it ran."""

    code = "CANCELLED"


class Unavailable(RuntimeError):
    """The server is shutting down and takes no new work."""

    code = "UNAVAILABLE"  # HTTP 503, gRPC UNAVAILABLE


Outcome = Feed | RequestError | ServerError | Unavailable | Cancelled


def run_isolated(members: Sequence[int], run_group: Callable[[Sequence[int]], list[Feed]]) -> dict[int, Outcome]:
    """`run_group(members)`, or, when that fails, each member alone: only a failing request fails.

    The traceback of a failure goes to the server's log; the request gets one line.
    """
    try:
        return dict(zip(members, run_group(members), strict=True))
    except Cancelled as e:
        return dict.fromkeys(members, e)
    except Exception as e:
        if len(members) > 1:
            return {i: outcome for m in members for i, outcome in run_isolated([m], run_group).items()}
        LOGGER.exception("a request failed in the backend")
        return {members[0]: ServerError(f"the backend failed on this request: {type(e).__name__}: {first_line(e)}")}


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


def group_by_shape(feeds: Sequence[Feed]) -> list[list[int]]:
    """Indices of feeds that can be concatenated along dim 0, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, feed in enumerate(feeds):
        key = tuple(sorted((name, a.shape[1:]) for name, a in feed.items()))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def run_concatenated(feeds: Sequence[Feed], run: RunFn, output_names: Sequence[str]) -> list[Feed]:
    """One `run` over feeds of one shape group; each feed gets back its own rows of every output."""
    names = feeds[0].keys()
    batch = {name: np.concatenate([feed[name] for feed in feeds], axis=0) for name in names}
    outputs = run(batch)
    bounds = np.cumsum([len(next(iter(feed.values()))) for feed in feeds])[:-1]
    # Copies: a runner may reuse its output buffers on the next call (Polygraphy's TrtRunner does).
    split = {name: [part.copy() for part in np.split(np.asarray(outputs[name]), bounds)] for name in output_names}
    return [{name: split[name][j] for name in output_names} for j in range(len(feeds))]


def run_grouped(feeds: Sequence[Feed], run: RunFn, output_names: Sequence[str]) -> list[Outcome]:
    """One `run` per shape group; each feed gets back its own rows of every output (or its own error)."""
    results: dict[int, Outcome] = {}
    for group in group_by_shape(feeds):
        results |= run_isolated(group, lambda members: run_concatenated([feeds[i] for i in members], run, output_names))
    return [results[i] for i in range(len(feeds))]


class BatchedModel:
    """A PyTriton inference callable over one backend runner: requests -> grouped runs -> responses.

    `prepare` turns a request's inputs into the runner's feed (fill defaults, check values);
    it raises RequestError for a request the model cannot run.
    """

    def __init__(
        self, run: RunFn, output_names: Sequence[str], prepare: Callable[[Feed], Feed] | None = None
    ) -> None:
        self.run = run
        self.output_names = list(output_names)
        self.prepare = prepare or (lambda feed: feed)

    def __call__(self, requests: Sequence[Any]) -> list[Outcome]:
        """Prepare each request on its own; run only those that prepared, in shape groups."""
        outcomes: dict[int, Outcome] = {}
        feeds: dict[int, Feed] = {}
        for i, request in enumerate(requests):
            try:
                feeds[i] = self.prepare({name: np.asarray(a) for name, a in request.items()})
            except RequestError as e:
                outcomes[i] = e
        outcomes |= dict(zip(feeds, run_grouped(list(feeds.values()), self.run, self.output_names), strict=True))
        return [outcomes[i] for i in range(len(requests))]


def error_answer(error: RequestError | ServerError | Unavailable | Cancelled) -> Feed:
    """What the callable returns for a refused request; stub_guard makes it that request's Triton error."""
    payload = json.dumps({"code": error.code, "message": first_line(error)}).encode()
    return {ERROR_OUTPUT: np.array([payload], dtype=np.bytes_)}


def request_problem(request: Any, required: Sequence[str]) -> str | None:
    """Checks every model needs, before its own: the stub's verdict, required inputs, no empty tensor."""
    refused = (getattr(request, "parameters", None) or {}).get(GUARD_PARAMETER)
    if refused:
        return str(refused)
    missing = [name for name in required if name not in request]
    if missing:
        return f"missing required input {missing[0]!r}"
    for name, array in request.items():
        if np.asarray(array).size == 0:
            return f"input {name!r} has shape {list(np.shape(array))}: an empty tensor; send at least one element"
    return None


class InFlight:
    """Counts the calls in progress; shutdown waits until `idle` before it unloads the model, and
    `draining` set means new requests get UNAVAILABLE."""

    def __init__(self) -> None:
        self.draining = threading.Event()
        self._active = 0
        self._lock = threading.Lock()

    @property
    def idle(self) -> bool:
        """No call in progress."""
        return self.active == 0

    @property
    def active(self) -> int:
        """Calls in progress."""
        with self._lock:
            return self._active

    def _enter(self) -> None:
        with self._lock:
            self._active += 1

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1


class PerRequest(InFlight):
    """The PyTriton callable of one served model: every request gets its own answer or its own error.

    Refusals are logged as one line each; a request that arrives while the server drains gets
    UNAVAILABLE (503), never another request's outcome.
    """

    def __init__(self, model_name: str, model: Callable[[Sequence[Any]], list[Outcome]], required: Sequence[str]) -> None:
        super().__init__()
        self.model_name = model_name
        self.model = model
        self.required = list(required)

    def __call__(self, requests: Sequence[Any]) -> list[Feed]:
        self._enter()
        try:
            return self._answer_all(requests)
        finally:
            self._leave()

    def _answer_all(self, requests: Sequence[Any]) -> list[Feed]:
        outcomes: dict[int, Outcome] = {}
        pending: list[int] = []
        for i, request in enumerate(requests):
            if self.draining.is_set():
                outcomes[i] = Unavailable("the server is shutting down; retry on another replica")
            elif problem := request_problem(request, self.required):
                outcomes[i] = RequestError(problem)
            else:
                pending.append(i)
        if pending:
            outcomes |= run_isolated(pending, lambda members: self.model([requests[i] for i in members]))
        return [self.answer(outcomes[i]) for i in range(len(requests))]

    def answer(self, outcome: Outcome) -> Feed:
        if isinstance(outcome, dict):
            return outcome
        if isinstance(outcome, RequestError):
            LOGGER.warning("%s: refused a request: %s", self.model_name, first_line(outcome))
        return error_answer(outcome)
