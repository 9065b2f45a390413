"""stub_guard's checks without a server: what a request may hold per dim and in bytes, from the
manifest's dynamic ranges (the server tests send these requests for real)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moedeploy.serving.specs import request_limits, served_models
from moedeploy.serving.stub_guard import request_problem


@pytest.fixture(scope="module")
def moe_limits(store) -> dict:
    artifact = store.block("moe")
    return json.loads(json.dumps(request_limits(artifact, served_models(artifact)[0], 2**20)))  # as the stub reads it


@pytest.fixture(scope="module")
def decoder_limits(store) -> dict[str, dict]:
    artifact = store.decoder("fp32")
    return {spec.name: request_limits(artifact, spec, 2**20) for spec in served_models(artifact)}


def test_a_request_inside_the_ranges_passes(moe_limits) -> None:
    assert request_problem({"x": np.zeros((16, 256, 64), np.float32)}, moe_limits) is None


@pytest.mark.parametrize(("shape", "problem"), [
    ((1, 257, 64), "input 'x' has shape [1, 257, 64]: dim 1 (seq) is 257, outside the model's range [1, 256]"),
    ((17, 4, 64), "input 'x' has shape [17, 4, 64]: dim 0 (batch) is 17, outside the model's range [1, 16]"),
    ((1, 0, 64), "input 'x' has shape [1, 0, 64]: dim 1 (seq) is empty; send at least one element along every dim"),
])
def test_a_dim_outside_the_ranges_is_named(moe_limits, shape, problem: str) -> None:
    assert request_problem({"x": np.zeros(shape, np.float32)}, moe_limits) == problem


def test_a_wrong_rank_is_left_to_triton(moe_limits) -> None:
    assert request_problem({"x": np.zeros((1, 64), np.float32)}, moe_limits) is None


def test_the_byte_cap(moe_limits) -> None:
    small = {**moe_limits, "max_request_bytes": 1000}
    assert request_problem({"x": np.zeros((1, 3, 64), np.float32)}, small) is None  # 768 bytes
    assert request_problem({"x": np.zeros((1, 4, 64), np.float32)}, small) == (
        "the request's tensors hold 1024 bytes, over the server's limit of 1000 (moedeploy serve --max-request-mb)")


def test_decoder_limits(decoder_limits) -> None:
    generate = decoder_limits["decoder_generate"]
    assert generate["inputs"]["input_ids"][1][2] <= 256  # never past max_positions
    assert generate["inputs"]["max_new_tokens"] == [["batch", 1, 8], ["one value", 1, 1]]
    empty_cache = {"input_ids": np.zeros((1, 2), np.int64), "past_key_values.0.key": np.zeros((1, 2, 0, 16), np.float32)}
    assert "leave every past_key_values.* input out" in request_problem(empty_cache, decoder_limits["decoder"])


def test_a_pytriton_whose_proxy_lacks_the_hooks_is_refused_by_name(tmp_path) -> None:
    from moedeploy.serving.server import install_guard
    from moedeploy.serving.specs import ServingError

    (tmp_path / "model.py").write_text("class TritonPythonModel:\n    def execute(self, requests):\n        pass\n")
    with pytest.raises(ServingError, match=r"no 'def _wrap_response'.*PyTriton 0\.7"):
        install_guard(tmp_path, {})
    assert not (tmp_path / "moedeploy_guard.py").exists()
