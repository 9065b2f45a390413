"""The model callables without a server: how Triton's batches of requests are grouped, run
and split, on the eager-PyTorch runner (`--backend torch`), and how generation requests are
checked. References are rebuilt independently (tests.export.artifacts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moedeploy.runtime.runners import TorchRunner
from moedeploy.serving.batching import BatchedModel, RequestError, group_by_shape
from moedeploy.serving.decoder import (
    DecoderShape,
    GenerationModel,
    RunnerDecoder,
    logits_prepare,
    parse_generation,
)
from tests.export.artifacts import eager_block, eager_decoder


@pytest.fixture(scope="module")
def moe_runner(store):
    runner = TorchRunner(store.block("moe"))
    runner.activate()
    yield runner
    runner.deactivate()


@pytest.fixture(scope="module")
def decoder_runner(store):
    runner = TorchRunner(store.decoder("fp32"))
    runner.activate()
    yield runner
    runner.deactivate()


def x(batch: int, seq: int, seed: int) -> np.ndarray:
    return torch.randn(batch, seq, 64, generator=torch.Generator().manual_seed(seed)).numpy()


def test_requests_are_grouped_by_every_dim_but_the_batch_dim() -> None:
    feeds = [{"x": x(1, 4, 0)}, {"x": x(3, 4, 1)}, {"x": x(2, 5, 2)}, {"x": x(1, 4, 3)}]
    assert group_by_shape(feeds) == [[0, 1, 3], [2]]


def test_a_batch_of_requests_gets_each_its_own_rows(moe_runner) -> None:
    calls = []

    def run(feed):
        calls.append(feed["x"].shape)
        return moe_runner.infer(feed)

    requests = [{"x": x(1, 4, 0)}, {"x": x(3, 4, 1)}, {"x": x(2, 5, 2)}, {"x": x(1, 4, 3)}]
    responses = BatchedModel(run, ["y"])(requests)
    assert calls == [(5, 4, 64), (2, 5, 64)]  # two runs for two shapes
    module = eager_block("moe")
    for request, response in zip(requests, responses, strict=True):
        with torch.no_grad():
            expected = module(torch.from_numpy(request["x"]))
        torch.testing.assert_close(torch.from_numpy(response["y"]), expected, atol=1e-5, rtol=1e-5)


def test_generation_on_the_torch_runner_equals_eager(store, decoder_runner) -> None:
    """Greedy requests of two prompt lengths (batched per length) and a seeded sampled one."""
    shape = DecoderShape.of(store.decoder("fp32"))
    model = GenerationModel(RunnerDecoder(decoder_runner.infer, shape))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (b, s), generator=g) for b, s in ((1, 6), (2, 6), (1, 9))]
    greedy = [{"input_ids": p.numpy(), "max_new_tokens": np.full((len(p), 1), 12)} for p in prompts]
    sampled = {"input_ids": prompts[1].numpy(), "max_new_tokens": np.full((2, 1), 12),
               "temperature": np.full((2, 1), 0.8, np.float32), "seed": np.full((2, 1), 5)}
    responses = model([*greedy, sampled])
    decoder = eager_decoder()
    for p, response in zip(prompts, responses[:3], strict=True):
        assert torch.equal(torch.from_numpy(response["output_ids"]), decoder.generate(p, max_new_tokens=12))
    expected = decoder.generate(prompts[1], max_new_tokens=12, temperature=0.8, seed=5)
    assert torch.equal(torch.from_numpy(responses[3]["output_ids"]), expected)


def test_logits_feed_gets_an_empty_cache_when_none_is_sent(store) -> None:
    prepare = logits_prepare(DecoderShape.of(store.decoder("fp32")))
    feed = prepare({"input_ids": np.zeros((3, 5), np.int64)})
    assert feed["past_key_values.1.value"].shape == (3, 2, 0, 16)
    past = dict.fromkeys((f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")),
                         np.zeros((1, 2, 254, 16), np.float32))
    with pytest.raises(RequestError, match=r"past \(254\) \+ input_ids \(3\) positions exceed max_positions 256"):
        prepare({"input_ids": np.zeros((1, 3), np.int64), **past})


@pytest.mark.parametrize(("extra", "message"), [
    ({"max_new_tokens": np.array([[-1]])}, "max_new_tokens must be >= 0"),
    ({"temperature": np.array([[np.nan]], np.float32)}, "temperature must be a finite number"),
    ({"temperature": np.array([[-0.5]], np.float32)}, "temperature must be >= 0"),
    ({"top_k": np.array([[0]])}, "top_k must be >= 1"),
    ({"eos_token_id": np.array([[999]])}, "eos_token_id 999 is outside the vocabulary"),
    ({"input_ids": np.array([[-3, 1]])}, "input_ids holds token id -3"),
])
def test_generation_requests_are_checked(store, extra: dict, message: str) -> None:
    shape = DecoderShape.of(store.decoder("fp32"))
    with pytest.raises(RequestError, match=message.replace("(", r"\(")):
        parse_generation({"input_ids": np.zeros((1, 4), np.int64), **extra}, shape)
