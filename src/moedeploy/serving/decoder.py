"""The decoder on the server: its logits graph with an optional KV cache, and generation.

Generation runs the shared loop (`moedeploy.models.generation.generate_tokens`) over any
backend runner's KV-cache graph, so the server's tokens are eager PyTorch's whenever the
backend's logits agree, whatever the backend. Greedy requests with the same prompt length
and token budget are decoded together (rows of a batch do not influence each other's
argmax); a sampled request runs alone, because a seeded sampler draws for its whole batch
at once and another request's rows would change what this one gets.

With in-flight batching (a scheduler, serving/inflight.py) every row of a request whose rows
are independent (greedy, a single row, or unseeded) is one sequence of the scheduler instead:
it shares decode steps with every other generation and stream, whatever its prompt length,
and gets the tokens it would get alone. Each row stops at the request's EOS id, and rows that
stop early are padded with it to the longest, as the shared loop does. A seeded sample of
several rows (one generator for the batch), a request longer than the scheduler's rows, or
one the busy scheduler cannot take runs on the runner as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moedeploy.export.artifact import NP_DTYPES, Artifact
from moedeploy.export.decoder import past_names, present_names
from moedeploy.models.config import DecoderConfig
from moedeploy.models.generation import SamplingConfig, generate_tokens, iterate_tokens
from moedeploy.serving.batching import (
    LOGGER,
    Cancelled,
    Feed,
    Outcome,
    RequestError,
    RunFn,
    Unavailable,
    run_isolated,
)
from moedeploy.serving.front import REQUEST_ID_HEADER, CancelledRequests
from moedeploy.serving.specs import (
    DEFAULT_MAX_NEW_TOKENS,
    GENERATE_INPUT,
    GENERATE_OPTIONS,
    GENERATE_OUTPUT,
)
from moedeploy.serving.stub_guard import TOKEN_PARAMETER

if TYPE_CHECKING:
    from moedeploy.serving.inflight import InflightScheduler


@dataclass(frozen=True)
class DecoderShape:
    """What a request is checked against, from the manifest's config."""

    vocab_size: int
    max_positions: int
    n_layers: int
    kv_cache_dims: tuple[tuple[int, int], tuple[int, int]]  # (heads, features) of key and value
    dtype: Any

    @classmethod
    def of(cls, artifact: Artifact) -> DecoderShape:
        c = DecoderConfig.from_manifest(artifact.manifest["config"])
        return cls(c.vocab_size, c.max_positions, c.n_layers, c.kv_cache_dims, NP_DTYPES[artifact.dtype])

    def empty_past(self, batch: int) -> dict[str, np.ndarray]:
        (k_heads, k_dim), (v_heads, v_dim) = self.kv_cache_dims
        key = np.zeros((batch, k_heads, 0, k_dim), dtype=self.dtype)  # (B, heads, 0, features)
        value = np.zeros((batch, v_heads, 0, v_dim), dtype=self.dtype)
        return {name: key if name.endswith(".key") else value for name in past_names(self.n_layers)}

    def check_ids(self, ids: np.ndarray, name: str = "input_ids") -> None:
        if ids.size == 0:
            raise RequestError(f"{name} has shape {list(ids.shape)}: it is empty; send at least one token")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise RequestError(f"{name} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})")


def logits_prepare(shape: DecoderShape):
    """Feed check for the logits model: ids in the vocabulary, positions within max_positions,
    and the KV cache either complete or absent (absent = the prefill's empty cache)."""
    names = past_names(shape.n_layers)

    def prepare(feed: Feed) -> Feed:
        ids = feed["input_ids"]
        shape.check_ids(ids)
        given = [n for n in names if n in feed]
        if not given:
            if ids.shape[1] > shape.max_positions:
                raise RequestError(f"input_ids ({ids.shape[1]}) positions exceed max_positions {shape.max_positions}")
            return {**feed, **shape.empty_past(len(ids))}
        if len(given) != len(names):
            missing = [n for n in names if n not in feed]
            raise RequestError(f"send all {len(names)} past_key_values.* inputs or none (none = empty cache); missing {missing[0]}")
        past_len = feed[names[0]].shape[2]
        if any(feed[n].shape[2] != past_len for n in names):
            raise RequestError("every past_key_values.* input must hold the same number of positions")
        if past_len + ids.shape[1] > shape.max_positions:
            raise RequestError(
                f"past ({past_len}) + input_ids ({ids.shape[1]}) positions exceed max_positions {shape.max_positions}"
            )
        return feed

    return prepare


class RunnerDecoder:
    """Prefill + decode over a runner's graph: it feeds back the cache the graph returned."""

    def __init__(self, run: RunFn, shape: DecoderShape) -> None:
        self.run = run
        self.shape = shape
        self.present = present_names(shape.n_layers)
        self._past: dict[str, np.ndarray] = {}
        self._cancelled: Callable[[], bool] = lambda: False

    def step(self, ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        if self._cancelled():
            LOGGER.info("generation stopped at position %d: its client cancelled the request", start_pos)
            raise Cancelled("the client cancelled the request")
        feed = {"input_ids": ids.numpy().astype(np.int64), **self._past}
        outputs = self.run(feed)
        # Copies: the next step's feed must not alias a runner's reusable output buffers.
        self._past = {p: np.array(outputs[n]) for p, n in zip(past_names(self.shape.n_layers), self.present, strict=True)}
        return torch.from_numpy(np.array(outputs["logits"]))  # (B, S, V)

    def generate(self, ids: np.ndarray, max_new_tokens: int, sampling: SamplingConfig, eos: int | None,
                 cancelled: Callable[[], bool] | None = None) -> np.ndarray:
        """The tokens; raises Cancelled before a step once `cancelled()` says so."""
        self._past = self.shape.empty_past(len(ids))
        self._cancelled = cancelled or (lambda: False)
        try:
            tokens = generate_tokens(self.step, torch.from_numpy(ids), max_new_tokens, sampling, eos)
        finally:
            self._cancelled = lambda: False
        return tokens.numpy()

    def stream(self, ids: np.ndarray, max_new_tokens: int, sampling: SamplingConfig,
               cancelled: Callable[[], bool] | None = None) -> Iterator[int]:
        """One sequence's new ids, each as soon as it is chosen (ids: (1, S)); stops, raising
        Cancelled, before a step once `cancelled()` says so, and when the caller stops reading."""
        self._past = self.shape.empty_past(len(ids))
        self._cancelled = cancelled or (lambda: False)
        try:
            for token in iterate_tokens(self.step, torch.from_numpy(ids), max_new_tokens, sampling):
                yield int(token[0])
        finally:
            self._cancelled = lambda: False
            self._past = {}


def cancellation_check(token: str | None, request_id: str | None, cancel_dir: Path | None,
                       cancelled: CancelledRequests | None) -> Callable[[], bool] | None:
    """Whether a request's client cancelled it or went away: stub_guard's marker
    `<cancel_dir>/<token>` (gRPC) or the HTTP front's mark of its id; None if neither can tell."""
    checks: list[Callable[[], bool]] = []
    if token and cancel_dir is not None:
        checks.append((cancel_dir / token).exists)
    if request_id and cancelled is not None:
        checks.append(lambda: cancelled.is_cancelled(request_id))
    return (lambda: any(check() for check in checks)) if checks else None


class InflightRows:
    """One generate request's rows as sequences of the in-flight scheduler: each row's events
    collected (from the scheduler's thread) until it finishes."""

    def __init__(self, n: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.ends: list[Any] = [None] * n  # Finished, or the exception the row failed with
        self.sequences: list[Any] = []
        self._done = threading.Semaphore(0)

    def collector(self, row: int) -> Callable[[Any], None]:
        from moedeploy.serving.inflight import Finished

        def on_event(event: Any) -> None:
            if isinstance(event, (Finished, BaseException)):
                self.ends[row] = event
                self._done.release()
            else:
                self.tokens[row].append(int(event))
        return on_event

    def outcome(self, request: GenerationRequest) -> Outcome:
        """Waits for every row: the prompt with its continuation, rows that stopped at the EOS
        id padded with it to the longest; or the first row's failure, or Cancelled."""
        for _ in self.tokens:
            self._done.acquire()
        for end, tokens in zip(self.ends, self.tokens, strict=True):
            if isinstance(end, BaseException):
                return end
            if end.reason == "cancelled":
                LOGGER.info("generation stopped at position %d: its client cancelled the request",
                            request.ids.shape[1] + len(tokens))
                return Cancelled("the client cancelled the request")
        width = max(len(t) for t in self.tokens)
        pad = request.eos_token_id if request.eos_token_id is not None else 0  # rows differ only after an EOS
        new = np.array([t + [pad] * (width - len(t)) for t in self.tokens], dtype=np.int64)
        return {GENERATE_OUTPUT: np.concatenate([request.ids, new], axis=1)}


@dataclass(frozen=True)
class GenerationRequest:
    ids: np.ndarray  # (B, S) int64
    max_new_tokens: int
    sampling: SamplingConfig
    eos_token_id: int | None
    token: str | None = None  # stub_guard's token: <cancel_dir>/<token> appears if a gRPC client cancels
    request_id: str | None = None  # the HTTP front's id: marked in CancelledRequests if its client goes away

    @property
    def batchable(self) -> bool:
        """Greedy without EOS: its rows' tokens do not depend on what else is in the batch."""
        return self.sampling.greedy and self.eos_token_id is None

    @property
    def rows_independent(self) -> bool:
        """Each row gets the same tokens decoded on its own: all but a seeded sample of several
        rows, which draws every row from one generator."""
        return self.sampling.greedy or self.sampling.seed is None or len(self.ids) == 1


def option_value(feed: Feed, name: str) -> Any:
    """The one value of an optional [batch, 1] input, or None when the request left it out."""
    if name not in feed:
        return None
    values = feed[name].reshape(-1)
    if np.issubdtype(values.dtype, np.floating) and not np.isfinite(values).all():
        raise RequestError(f"{name} must be a finite number")
    if not (values == values[0]).all():
        raise RequestError(f"{name} must be the same for every sequence of one request, got {values.tolist()}")
    return values[0].item()


def parse_generation(feed: Feed, shape: DecoderShape) -> GenerationRequest:
    if GENERATE_INPUT not in feed:
        raise RequestError(f"missing required input {GENERATE_INPUT!r}")
    ids = feed[GENERATE_INPUT]
    shape.check_ids(ids, GENERATE_INPUT)
    options = {name: option_value(feed, name) for name in GENERATE_OPTIONS}
    new = options["max_new_tokens"]
    new = DEFAULT_MAX_NEW_TOKENS if new is None else new
    if new < 0:
        raise RequestError(f"max_new_tokens must be >= 0, got {new}")
    if ids.shape[1] + new > shape.max_positions:
        raise RequestError(
            f"prompt ({ids.shape[1]}) + max_new_tokens ({new}) exceeds max_positions {shape.max_positions}"
        )
    eos = options["eos_token_id"]
    if eos is not None and not 0 <= eos < shape.vocab_size:
        raise RequestError(f"eos_token_id {eos} is outside the vocabulary [0, {shape.vocab_size})")
    temperature = options["temperature"]
    try:
        sampling = SamplingConfig(
            0.0 if temperature is None else float(temperature), options["top_k"],
            None if options["top_p"] is None else float(options["top_p"]), options["seed"],
        )
    except ValueError as e:
        raise RequestError(str(e)) from None
    return GenerationRequest(ids, int(new), sampling, eos)


class GenerationModel:
    """PyTriton callable of `<name>_generate`: checks each request on its own, then decodes the
    valid ones in groups; a refused request gets its own RequestError and changes no other.

    A group stops before its next token once every request in it is cancelled: a gRPC request
    when stub_guard's marker `<cancel_dir>/<token>` exists, an HTTP one when the front has
    marked its id in `cancelled` (the callable runs in the front's process)."""

    def __init__(self, decoder: RunnerDecoder, cancel_dir: Path | None = None,
                 cancelled: CancelledRequests | None = None, scheduler: InflightScheduler | None = None) -> None:
        self.decoder = decoder
        self.cancel_dir = cancel_dir
        self.cancelled = cancelled
        self.scheduler = scheduler

    def __call__(self, requests: list[Any]) -> list[Outcome]:
        outcomes: dict[int, Outcome] = {}
        parsed: dict[int, GenerationRequest] = {}
        for i, r in enumerate(requests):
            try:
                request = parse_generation({n: np.asarray(a) for n, a in r.items()}, self.decoder.shape)
            except RequestError as e:
                outcomes[i] = e
                continue
            parameters = getattr(r, "parameters", None) or {}
            token, request_id = parameters.get(TOKEN_PARAMETER), parameters.get(REQUEST_ID_HEADER)
            parsed[i] = replace(request, token=str(token) if token else None,
                                request_id=str(request_id) if request_id else None)
        in_flight = {i: rows for i, r in parsed.items() if (rows := self._submit(r)) is not None}
        groups: dict[tuple, list[int]] = {}
        for i, r in parsed.items():
            if i in in_flight:
                continue
            key = (r.ids.shape[1], r.max_new_tokens) if r.batchable else ("alone", i)
            groups.setdefault(key, []).append(i)
        try:
            for members in groups.values():
                outcomes |= run_isolated(members, lambda group: self.decode([parsed[i] for i in group]))
            for i, rows in in_flight.items():  # meanwhile decoded by the scheduler's thread
                outcomes[i] = rows.outcome(parsed[i])
        finally:
            if self.cancelled is not None:  # answered (or stopped): its id is no longer needed
                self.cancelled.forget(r.request_id for r in parsed.values() if r.request_id)
        return [outcomes[i] for i in range(len(requests))]

    def _submit(self, request: GenerationRequest) -> InflightRows | None:
        """The request's rows queued on the scheduler, or None where it runs on the runner: no
        scheduler, rows that are not independent, no new token, more positions than a row holds,
        or a busy scheduler (the rows already queued are withdrawn)."""
        s = self.scheduler
        if (s is None or not request.rows_independent or request.max_new_tokens < 1
                or request.ids.shape[1] + request.max_new_tokens > s.capacity):
            return None
        rows = InflightRows(len(request.ids))
        eos = frozenset() if request.eos_token_id is None else frozenset({request.eos_token_id})
        try:
            for j, prompt in enumerate(request.ids):
                rows.sequences.append(s.submit(prompt, request.max_new_tokens, request.sampling, rows.collector(j),
                                               eos, self._cancelled(request)))
        except Unavailable:
            for sequence in rows.sequences:
                sequence.close()
            return None
        return rows

    def _cancelled(self, request: GenerationRequest) -> Callable[[], bool] | None:
        return cancellation_check(request.token, request.request_id, self.cancel_dir, self.cancelled)

    def all_cancelled(self, group: list[GenerationRequest]) -> Callable[[], bool]:
        """Whether every request of the group was cancelled (then nobody waits for its tokens)."""
        checks = [self._cancelled(r) for r in group]
        if any(check is None for check in checks):
            return lambda: False
        return lambda: all(check() for check in checks)

    def decode(self, group: list[GenerationRequest]) -> list[Feed]:
        """One generation over requests that may share it (same length, budget and sampling)."""
        first = group[0]
        ids = np.concatenate([r.ids for r in group], axis=0)  # (sum B, S)
        tokens = self.decoder.generate(ids, first.max_new_tokens, first.sampling, first.eos_token_id,
                                       cancelled=self.all_cancelled(group))
        rows = np.cumsum([len(r.ids) for r in group])[:-1]
        return [{GENERATE_OUTPUT: part} for part in np.split(tokens, rows)]
