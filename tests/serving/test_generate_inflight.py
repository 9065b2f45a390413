"""`<name>_generate` beside in-flight batching: the rows of a request whose rows are independent
run as sequences of the stream model's scheduler (ONNX Runtime, GroupQueryAttention), any
prompt length together; the rest (a seeded sample of several rows, a request longer than a
row, one a busy scheduler cannot take) on the runner as before. Either way each request gets
eager PyTorch's `generate`, EOS padding included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moedeploy.runtime.runners import TorchRunner
from moedeploy.serving.decoder import DecoderShape, GenerationModel, RunnerDecoder
from tests.export.artifacts import eager_decoder

CAPACITY = 40


@pytest.fixture(scope="module")
def parts(store):
    """(model, scheduler, runner calls): the generate callable over a torch runner that counts its
    runs, beside a scheduler of 4 rows (2 more may wait) of CAPACITY positions."""
    from moedeploy.runtime.inflight import RowCacheDecoder
    from moedeploy.serving.inflight import InflightScheduler

    artifact = store.decoder("fp32")
    runner = TorchRunner(artifact)
    runner.activate()
    calls: list[tuple[int, ...]] = []

    def run(feed):
        calls.append(feed["input_ids"].shape)
        return runner.infer(feed)

    scheduler = InflightScheduler(RowCacheDecoder(artifact, slots=4, capacity=CAPACITY), max_queued=2)
    yield GenerationModel(RunnerDecoder(run, DecoderShape.of(artifact)), scheduler=scheduler), scheduler, calls
    scheduler.stop()
    runner.deactivate()


def request(ids: torch.Tensor, new: int, **options) -> dict[str, np.ndarray]:
    feed = {"input_ids": ids.numpy(), "max_new_tokens": np.full((len(ids), 1), new)}
    for name, value in options.items():
        feed[name] = np.full((len(ids), 1), value, np.float32 if isinstance(value, float) else np.int64)
    return feed


def prompts(*shapes: tuple[int, int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, shape, generator=g) for shape in shapes]


def test_independent_rows_run_in_flight_and_get_eager_tokens(parts) -> None:
    model, scheduler, calls = parts
    decoder = eager_decoder()
    short, pair, long, single = prompts((1, 6), (2, 6), (1, 9), (1, 5))
    eos = int(decoder.generate(pair[:1], max_new_tokens=12)[0, 6 + 3])  # row 0's 4th token
    before, calls[:] = scheduler.tokens_generated, []
    responses = model([request(short, 12), request(pair, 12, eos_token_id=eos), request(long, 12),
                       request(single, 10, temperature=0.8, seed=5)])
    assert calls == []  # nothing ran on the runner
    expected = [decoder.generate(short, max_new_tokens=12),
                decoder.generate(pair, max_new_tokens=12, eos_token_id=eos),  # row 0 stops, padded with eos
                decoder.generate(long, max_new_tokens=12),
                decoder.generate(single, max_new_tokens=10, temperature=0.8, seed=5)]
    for response, want in zip(responses, expected, strict=True):
        assert torch.equal(torch.from_numpy(response["output_ids"]), want)
    assert (expected[1][0, 6:] == eos).any()

    def until_eos(row: torch.Tensor) -> int:  # the tokens a row makes: up to its first EOS, or all
        hits = (row == eos).nonzero()
        return int(hits[0]) + 1 if len(hits) else len(row)

    made = 12 + until_eos(expected[1][0, 6:]) + until_eos(expected[1][1, 6:]) + 12 + 10
    assert scheduler.tokens_generated - before == made  # every row was a sequence of the scheduler


def test_what_cannot_run_in_flight_runs_on_the_runner(parts) -> None:
    model, scheduler, calls = parts
    decoder = eager_decoder()
    pair, long_prompt, many = prompts((2, 6), (1, CAPACITY - 4), (7, 5), seed=1)
    calls[:] = []
    sampled, too_long = model([request(pair, 8, temperature=0.8, seed=3), request(long_prompt, 8)])
    # a seeded sample of two rows draws both from one generator: the runner, one request a run
    assert torch.equal(torch.from_numpy(sampled["output_ids"]),
                       decoder.generate(pair, max_new_tokens=8, temperature=0.8, seed=3))
    assert torch.equal(torch.from_numpy(too_long["output_ids"]), decoder.generate(long_prompt, max_new_tokens=8))
    assert [c for c in calls if c[1] > 1] == [(2, 6), (1, CAPACITY - 4)]  # the two prefills
    # seven rows: more than the 4 rows and 2 waiting places; those queued are withdrawn
    calls[:] = []
    (busy,) = model([request(many, 6)])
    assert torch.equal(torch.from_numpy(busy["output_ids"]), decoder.generate(many, max_new_tokens=6))
    assert calls[0] == (7, 5)
    assert scheduler.running == scheduler.queued == 0
