"""Triton's dynamic batcher hands the model several requests at once; run them as few backend
calls as their shapes allow.

Requests whose tensors agree on every dim but the batch dim are concatenated along dim 0,
run as one call, and the outputs are split back by each request's batch size. Requests of
other shapes (another sequence length, another KV-cache length) form their own group:
padding would change what attention sees, and the artifact's graph has no mask input.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

Feed = dict[str, np.ndarray]
RunFn = Callable[[Feed], Mapping[str, np.ndarray]]


class RequestError(ValueError):
    """A request the model cannot run; the message names the input and the problem."""


def group_by_shape(feeds: Sequence[Feed]) -> list[list[int]]:
    """Indices of feeds that can be concatenated along dim 0, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, feed in enumerate(feeds):
        key = tuple(sorted((name, a.shape[1:]) for name, a in feed.items()))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def run_grouped(feeds: Sequence[Feed], run: RunFn, output_names: Sequence[str]) -> list[Feed]:
    """One `run` per shape group; each feed gets back its own rows of every output."""
    results: list[Feed | None] = [None] * len(feeds)
    for group in group_by_shape(feeds):
        names = feeds[group[0]].keys()
        batch = {name: np.concatenate([feeds[i][name] for i in group], axis=0) for name in names}
        outputs = run(batch)
        sizes = [len(next(iter(feeds[i].values()))) for i in group]
        bounds = np.cumsum(sizes)[:-1]
        # Copies: a runner may reuse its output buffers on the next call (Polygraphy's TrtRunner does).
        split = {name: [part.copy() for part in np.split(np.asarray(outputs[name]), bounds)] for name in output_names}
        for j, i in enumerate(group):
            results[i] = {name: split[name][j] for name in output_names}
    return results  # type: ignore[return-value]


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

    def __call__(self, requests: Sequence[Any]) -> list[Feed]:
        feeds = [self.prepare({name: np.asarray(a) for name, a in request.items()}) for request in requests]
        return run_grouped(feeds, self.run, self.output_names)
