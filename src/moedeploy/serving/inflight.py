"""In-flight (continuous) batching: concurrent generations share each decode step.

One scheduler thread owns a row cache (runtime/inflight.RowCacheDecoder). Between two decode
steps it drops the sequences that finished or whose client went away (their row is filled
by the last row, so the running rows stay packed), then runs one step that decodes a token for
every running sequence, each at its own position with its own sampling settings and
generator. Waiting requests join in free rows in that same step: their prompts are
prefilled beside the rows' single tokens (a ragged step), so one pass over the weights
serves both. A request's tokens are those it would get alone: greedy rows do not influence
each other's argmax, and a seeded row draws from its own generator exactly as
`models.generation.iterate_tokens` does for a request alone (the same `next_token`).

Chunked prefill (as vLLM and TensorRT-LLM do): while rows decode, and they are at least as
many as the prompts being prefilled, a prompt goes into its row at most `prefill_chunk`
tokens a step, so the decoding rows are padded only to the chunk for attention and wait for
a chunk, not a whole prompt, each step; the prompt's first token comes after its last chunk.
Where prompts outnumber the decoding rows (lockstep traffic: many requests at once) whole
prompts go in one step, which spends fewer steps on them.

Limits keep memory bounded: at most `slots` sequences run and `max_queued` wait; a request
beyond that is refused at once with a "busy" error (Unavailable: HTTP 503 / gRPC
UNAVAILABLE) instead of queueing without end. A step that fails is retried apart (the rows
already running together, then each one and each joining prompt alone), so a backend failure
fails only the rows that fail alone.

Each request's events go to its own `on_event` callback, called on the scheduler thread:
every token id as it is chosen, then one `Finished` (why it ended) or an exception.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from moedeploy.models.generation import SamplingConfig, next_token
from moedeploy.runtime.inflight import RowCacheDecoder
from moedeploy.serving.batching import LOGGER, ServerError, Unavailable, first_line


@dataclass(frozen=True)
class Finished:
    """The last event of a generation: "stop" (an EOS id), "length" (max_new_tokens),
    "cancelled" (its client went away or the consumer closed it)."""

    reason: Literal["stop", "length", "cancelled"]


Event = int | Finished | BaseException
EventFn = Callable[[Event], None]


@dataclass(eq=False)
class Sequence:
    """A generation in the scheduler: its request and where it stands."""

    prompt: np.ndarray  # (S,) int64
    max_new_tokens: int
    sampling: SamplingConfig
    eos: frozenset[int]
    on_event: EventFn
    cancelled: Callable[[], bool]
    generator: torch.Generator | None = None
    length: int = 0  # positions in its cache row
    fed: int = 0  # prompt tokens in its cache row: it decodes once all are
    last: int = -1  # the token to feed next
    produced: int = 0
    closed: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if self.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)

    def close(self) -> None:
        """The consumer stops reading (say at a stop string): the row is freed before the next step."""
        self.closed.set()

    def gone(self) -> bool:
        return self.closed.is_set() or self.cancelled()

    @property
    def decoding(self) -> bool:
        return self.fed == self.prompt.size


#: the most tokens of a prompt a step takes while rows decode (benchmarks/inflight_step.py)
DEFAULT_PREFILL_CHUNK = 32


class InflightScheduler:
    """Runs every submitted generation on one row cache, batching their decode steps."""

    def __init__(self, decoder: RowCacheDecoder, max_queued: int = 64, name: str = "decoder",
                 prompts_in_step: bool = True, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
        """prompts_in_step: prefill joining prompts in the step that decodes the running rows (a
        ragged step); False runs them in a step of their own first, as before that existed
        (benchmarks/inflight_step.py compares the two).
        prefill_chunk: with prompts_in_step, the most tokens of a prompt one step takes while
        rows decode (0: whole prompts); a step with fewer decoding rows than prompts being
        prefilled takes whole prompts, as one with none does."""
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0: whole prompts), got {prefill_chunk}")
        self.decoder = decoder
        self.prompts_in_step = prompts_in_step
        self.prefill_chunk = prefill_chunk if prompts_in_step else 0
        self.slots = decoder.slots
        self.capacity = decoder.capacity
        self.max_queued = max_queued
        self.name = name
        self._rows: list[Sequence] = []  # row i of the cache holds _rows[i]
        self._waiting: deque[Sequence] = deque()
        self._joining: list[Sequence] = []  # taken from the queue, joining rows in this step
        self._cond = threading.Condition()
        self._stopping = False
        #: counters since start: tokens made, sequences ended by reason, the most rows one step ran
        self.tokens_generated = 0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "cancelled": 0, "failed": 0}
        self.peak_running = 0
        #: steps in which prompts were prefilled beside rows that decoded
        self.mixed_steps = 0
        #: prompt chunks that left part of their prompt for a later step
        self.partial_chunks = 0
        self._thread = threading.Thread(target=self._loop, name=f"inflight-{name}", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def submit(self, prompt: np.ndarray, max_new_tokens: int, sampling: SamplingConfig, on_event: EventFn,
               eos: frozenset[int] = frozenset(), cancelled: Callable[[], bool] | None = None) -> Sequence:
        """Queue one sequence's generation, (S,) prompt ids; raises Unavailable when the server
        is busy (every row taken and the queue full) or stopping, ValueError when the prompt is
        empty or it and its tokens do not fit a row."""
        prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            raise ValueError("a prompt needs at least one token")
        if prompt.size + max_new_tokens > self.capacity:
            raise ValueError(f"prompt ({prompt.size} tokens) + max_tokens ({max_new_tokens}) exceeds the "
                             f"{self.capacity} positions a sequence may hold on this server (its --max-context)")
        sequence = Sequence(prompt, max_new_tokens, sampling, eos, on_event, cancelled or (lambda: False))
        with self._cond:
            if self._stopping:
                raise Unavailable("the server is shutting down; retry on another replica")
            free_rows = max(0, self.slots - len(self._rows) - len(self._joining))
            if len(self._waiting) >= self.max_queued + free_rows:
                raise Unavailable(f"the server is busy: {len(self._rows) + len(self._joining)} sequences running and "
                                  f"{len(self._waiting)} waiting (the limits); retry later")
            self._waiting.append(sequence)
            self._cond.notify()
        return sequence

    def stream(self, prompt: np.ndarray, max_new_tokens: int, sampling: SamplingConfig,
               eos: frozenset[int] = frozenset(), cancelled: Callable[[], bool] | None = None) -> Iterator[int]:
        """A blocking iterator over one generation's tokens (for callers on their own thread);
        closing it early frees the row. Raises what the generation failed with."""
        import queue

        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        sequence = self.submit(prompt, max_new_tokens, sampling, events.put, eos, cancelled)
        try:
            while True:
                event = events.get()
                if isinstance(event, Finished):
                    return
                if isinstance(event, BaseException):
                    raise event
                yield event
        finally:
            sequence.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish what runs and is queued, then end the thread (new submissions are refused)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)

    # -- the scheduler thread --------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._rows and not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._rows and not self._waiting:
                    return
                joining = self._joining = []
                while self._waiting and len(self._rows) + len(joining) < self.slots:
                    joining.append(self._waiting.popleft())
            try:
                self._release(lambda s: s.gone(), "cancelled")
                joining = [s for s in joining if not self._dropped(s)]
                if joining and not self.prompts_in_step:  # prefilled in steps of their own first
                    self._admit(joining)
                    joining = []
                if joining or self._rows:
                    self._step(joining)
                with self._cond:
                    self._joining = []
            except Exception as e:  # a bug here must not leave every client waiting forever
                LOGGER.exception("%s: the in-flight scheduler failed", self.name)
                for s in dict.fromkeys(self._rows + joining):  # a joined one is in both
                    if not s.closed.is_set():  # one that failed alone was told already
                        s.on_event(ServerError(f"generation failed: {first_line(e)}"))
                self._rows, self._joining = [], []

    def _dropped(self, sequence: Sequence) -> bool:
        if sequence.gone():
            self._tell(sequence, Finished("cancelled"))
            return True
        return False

    def _tell(self, sequence: Sequence, event: Finished) -> None:
        self.finished[event.reason] += 1
        sequence.on_event(event)

    def _release(self, done: Callable[[Sequence], bool], reason: Literal["stop", "length", "cancelled"] | None) -> None:
        """Free the rows of the sequences `done` picks (the last row fills each gap); `reason`:
        the Finished event they get (None: they were told already)."""
        i = 0
        while i < len(self._rows):
            sequence = self._rows[i]
            if not done(sequence):
                i += 1
                continue
            if reason is not None:
                self._tell(sequence, Finished(reason))
            last = self._rows.pop()
            if last is not sequence:  # keep the rows packed: the last one moves into the gap
                self.decoder.move(len(self._rows), i, last.length)
                self._rows[i] = last

    def _step(self, joining: list[Sequence]) -> None:
        """One step: a token for every decoding row, the next chunk of every row still
        prefilling, and the first chunk of each joining prompt in the next free rows. If it
        fails, it is retried apart (`_apart`), so only what fails alone fails."""
        members = self._rows + joining
        n_decoding = sum(s.decoding for s in self._rows)
        # chunks pay where the rows they keep from waiting are at least as many as the prompts
        # they spread over more steps; else whole prompts
        limit = self.prefill_chunk if self.prefill_chunk and n_decoding >= len(members) - n_decoding else None
        chunks = [np.array([s.last], dtype=np.int64) if s.decoding else s.prompt[s.fed:s.fed + limit if limit else None]
                  for s in members]
        lengths = np.array([s.length for s in members], dtype=np.int64)
        try:
            logits = self.decoder.step(0, chunks, lengths)
        except Exception as e:  # retried apart below, so that only what fails alone fails
            LOGGER.warning("%s: a step of %d row(s) failed (%s); running them apart",
                           self.name, len(members), first_line(e))
            self._apart(members, chunks, lengths)
            return
        self.peak_running = max(self.peak_running, len(members))
        self.mixed_steps += 0 < n_decoding < len(members)
        self._rows.extend(joining)
        self._advance(members, chunks, logits)

    def _advance(self, members: list[Sequence], chunks: list[np.ndarray], logits: np.ndarray) -> None:
        """After a step ran `chunks` into the members' rows: move each along, send a token for
        every row that decoded or fed its prompt's last chunk, and free the rows that ended."""
        ready = []
        for i, (s, chunk) in enumerate(zip(members, chunks, strict=True)):
            if not s.decoding:
                s.fed += chunk.size
                self.partial_chunks += not s.decoding
            s.length += chunk.size
            if s.decoding:
                ready.append(i)
        self._emit([members[i] for i in ready], logits[ready])
        self._release(self._finished, None)

    def _apart(self, members: list[Sequence], chunks: list[np.ndarray], lengths: np.ndarray) -> None:
        """A failed step again, apart: the rows already running together if prompts joined (a
        bad joining prompt costs them one more step), and if that fails too or none joined,
        each row alone; then each joining prompt alone. What fails alone fails (its row freed);
        a joining one takes no row."""
        running = len(self._rows)
        ran, parts = [], []
        together = None
        if 0 < running < len(members):  # prompts joined: the running rows again without them
            with contextlib.suppress(Exception):
                together = self.decoder.step(0, chunks[:running], lengths[:running])
        if together is not None:
            parts.extend(together)
            ran.extend(range(running))
        else:
            for i in range(running):
                try:
                    parts.append(self.decoder.step(i, [chunks[i]], lengths[i:i + 1])[0])
                    ran.append(i)
                except Exception as e:
                    self._fail(members[i], e)
        for i in range(running, len(members)):
            try:
                parts.append(self.decoder.step(len(self._rows), [chunks[i]], lengths[i:i + 1])[0])
            except Exception as e:
                self._fail(members[i], e)
                continue
            self._rows.append(members[i])
            ran.append(i)
        self._advance([members[i] for i in ran], [chunks[i] for i in ran],
                      np.stack(parts) if parts else np.empty((0, 0), dtype=np.float32))

    def _admit(self, joining: list[Sequence]) -> None:
        """Prefill the joining sequences into the next free rows in steps of their own, prompts
        of one length together (the prompts_in_step=False policy)."""
        by_length: dict[int, list[Sequence]] = {}
        for s in joining:
            by_length.setdefault(s.prompt.size, []).append(s)
        for group in by_length.values():
            first = len(self._rows)
            try:
                logits = self.decoder.prefill(first, np.stack([s.prompt for s in group]))
                admitted = group
            except Exception:  # retried one by one: only a prompt that fails alone fails
                admitted, rows = [], []
                for s in group:
                    try:
                        rows.append(self.decoder.prefill(first + len(admitted), s.prompt[None])[0])
                        admitted.append(s)
                    except Exception as e:
                        self._fail(s, e)
                if not admitted:
                    continue
                logits = np.stack(rows)
            for s in admitted:
                s.length = s.fed = s.prompt.size
            self._rows.extend(admitted)
            self._emit(admitted, logits)
        self._release(self._finished, None)

    def _fail(self, sequence: Sequence, error: Exception) -> None:
        LOGGER.error("%s: a generation failed: %s", self.name, first_line(error))
        self.finished["failed"] += 1
        sequence.on_event(ServerError(f"generation failed: {first_line(error)}"))
        sequence.close()

    def _emit(self, sequences: list[Sequence], logits: np.ndarray) -> None:
        """Choose each sequence's next token from its row of logits (V,) and send it on."""
        for s, row in zip(sequences, torch.from_numpy(logits), strict=True):
            if s.closed.is_set():
                continue
            try:  # a row whose logits its sampling cannot take fails alone, its row freed after
                token = int(next_token(row[None], s.sampling, s.generator)[0])
            except Exception as e:
                self._fail(s, e)
                continue
            s.last = token
            s.produced += 1
            self.tokens_generated += 1
            s.on_event(token)

    def _finished(self, sequence: Sequence) -> bool:
        """Whether a sequence just ended (told its Finished event) or was closed before."""
        if sequence.closed.is_set():
            return True
        if not sequence.decoding:  # its prompt is still being fed
            return False
        reason = "stop" if sequence.last in sequence.eos else "length" if sequence.produced >= sequence.max_new_tokens else None
        if reason is None:
            return False
        self._tell(sequence, Finished(reason))
        sequence.closed.set()
        return True
