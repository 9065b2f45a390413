"""The stream model's callable without a server (the real ONNX Runtime runner on a real artifact,
called as PyTriton calls it): it stops at an EOS id of the checkpoint, stops before the next token
once its client cancelled, and answers while draining with UNAVAILABLE."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.text_helpers import VOCAB, export_with_tokenizer

PROMPT = "the cat sat"


class Request(dict):
    """What PyTriton hands a callable: the inputs by name, and the request's parameters."""

    def __init__(self, inputs: dict, parameters: dict | None = None) -> None:
        super().__init__(inputs)
        self.parameters = parameters or {}


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """(transformers model, artifact, activated ONNX Runtime runner)."""
    from moedeploy.serving.server import activated_runner

    hf, artifact = export_with_tokenizer(tmp_path_factory.mktemp("stream-model"))
    runner = activated_runner("ort", artifact)
    yield hf, artifact, runner
    runner.deactivate()


def stream_model(artifact, runner, eos: list[int] | None = None, cancel_dir=None):
    from moedeploy.runtime.text import TextCodec
    from moedeploy.serving.decoder import DecoderShape
    from moedeploy.serving.streaming import StreamModel

    codec = TextCodec.from_artifact(artifact)
    if eos is not None:
        codec.eos_token_ids = eos
    return StreamModel("decoder_stream", runner.infer, DecoderShape.of(artifact), codec, cancel_dir)


def request(max_tokens: int, parameters: dict | None = None) -> Request:
    return Request({"text_input": np.array([[PROMPT.encode()]], dtype=np.object_),
                    "max_tokens": np.array([[max_tokens]], dtype=np.int64)}, parameters)


@torch.no_grad()
def greedy(hf, artifact, n: int) -> list[int]:
    from moedeploy.runtime.text import TextCodec

    ids = TextCodec.from_artifact(artifact).encode(PROMPT)
    return hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


def test_generation_stops_at_an_eos_id_with_finish_reason_stop(parts) -> None:
    hf, artifact, runner = parts
    expected = greedy(hf, artifact, 8)
    eos = expected[3]  # as if the checkpoint's EOS were the 4th greedy token
    stop_at = expected.index(eos)
    (answers,) = zip(*stream_model(artifact, runner, eos=[eos])([request(8)]), strict=True)
    assert [int(a["output_ids"][0, 0]) for a in answers] == expected[:stop_at + 1]
    assert [a["finish_reason"][0, 0] for a in answers] == [b""] * stop_at + [b"stop"]
    assert answers[-1]["text_output"][0, 0] == b""  # the EOS token's own text is not sent
    (answers,) = zip(*stream_model(artifact, runner, eos=[])([request(8)]), strict=True)
    assert [int(a["output_ids"][0, 0]) for a in answers] == expected
    assert answers[-1]["finish_reason"][0, 0] == b"length"


def test_a_cancelled_stream_stops_before_its_next_token(parts, tmp_path) -> None:
    from moedeploy.serving.stub_guard import TOKEN_PARAMETER

    _, artifact, runner = parts
    model = stream_model(artifact, runner, eos=[], cancel_dir=tmp_path)
    answers = model([request(20, {TOKEN_PARAMETER: "abc"})])
    got = [next(answers), next(answers)]
    (tmp_path / "abc").touch()  # what stub_guard does when Triton reports the request cancelled
    got += list(answers)
    assert len(got) == 2 and model.idle


def test_draining_and_bad_requests_get_their_own_errors(parts) -> None:
    from moedeploy.serving.stub_guard import ERROR_OUTPUT

    _, artifact, runner = parts
    model = stream_model(artifact, runner)
    (answer,), = model([Request({"input_ids": np.array([[1, VOCAB + 100]], dtype=np.int64)})])
    assert json.loads(answer[ERROR_OUTPUT][0]) == {
        "code": "INVALID_ARG", "message": f"input_ids holds token id {VOCAB + 100}, outside the vocabulary [0, {VOCAB + 8})"}
    model.draining.set()
    (answer,), = model([request(4)])
    assert json.loads(answer[ERROR_OUTPUT][0])["code"] == "UNAVAILABLE"


def test_concurrent_streams_iterated_in_turns_each_keep_their_own_cache(parts) -> None:
    """PyTriton iterates the generators of concurrent requests to one instance in turns, a token
    of each; each must still get the tokens it gets alone."""
    _, artifact, runner = parts
    model = stream_model(artifact, runner, eos=[])
    prompts = [np.array([[5, 9, 2]], dtype=np.int64), np.array([[7, 1, 3, 3, 8]], dtype=np.int64)]

    def request_for(prompt):
        return Request({"input_ids": prompt, "max_tokens": np.array([[6]], dtype=np.int64)})

    alone = [[int(a["output_ids"][0, 0]) for (a,) in model([request_for(p)])] for p in prompts]
    streams = [model([request_for(p)]) for p in prompts]
    together: list[list[int]] = [[], []]
    for _ in range(6):
        for i, stream in enumerate(streams):
            (answer,) = next(stream)
            together[i].append(int(answer["output_ids"][0, 0]))
    assert together == alone and alone[0] != alone[1]
