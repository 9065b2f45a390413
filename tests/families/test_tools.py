"""The tools work unchanged on a family's artifact: `compare` (layer-wise too) passes and its
report says which ONNX Runtime path the MoE took, and the Triton server generates
transformers' own greedy tokens. GLM-4-MoE is the family furthest from Mixtral (sigmoid routing
with a selection bias and groups on the function body, shared experts, a dense first layer,
q/k norms, partial rotary); Qwen3-MoE stands for the families on com.microsoft::MoE."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moedeploy.compare.api import compare
from moedeploy.export.exporter import export

from .cases import cases, make_model, prompt, save_checkpoint

CASES = cases(n_layers=2)
#: case id -> the path `compare` must report: 1 MoE layer each (the other layer is dense).
PATHS = {
    "glm4_moe-groups": "1 moe::MoE on the standard-op function body",
    "qwen3_moe-headdim": "1 moe::MoE on com.microsoft::MoE (fast path)",
}


@pytest.fixture(scope="module", params=list(PATHS))
def family(request, tmp_path_factory):
    hf = make_model(CASES[request.param], seed=3)
    root = tmp_path_factory.mktemp(request.param)
    artifact = export("decoder", root / "artifact", checkpoint=save_checkpoint(hf, root / "checkpoint"))
    return hf, artifact, request.param


def test_compare_passes_layerwise_and_names_the_path(family) -> None:
    _, artifact, case = family
    report = compare(artifact, layerwise=True, iterations=2)
    assert report["passed"] and report["first_divergent_layer"] is None
    (comparison,) = report["comparisons"]
    assert comparison["path"].startswith(PATHS[case])
    # The MoE layer was localised with its own routing (selection bias and groups included):
    # every token routed, none flipped.
    (moe,) = [m for m in comparison["layerwise"]["modules"] if "routing_flips" in m]
    assert moe["module"].endswith("ffn") and moe["routing_flips"] == 0 and moe["routed_tokens"] > 0
    on_disk = json.loads((artifact.path / "report" / "report.json").read_text())
    assert on_disk["comparisons"][0]["path"] == comparison["path"]
    assert f"Path: {comparison['path']}." in (artifact.path / "report" / "report.md").read_text()


@torch.no_grad()
def test_served_greedy_tokens_are_transformers(family, tmp_path) -> None:
    pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton")
    pytest.importorskip("tritonclient.http", reason="the serving tests talk to Triton through tritonclient[all]")
    from moedeploy.serving import ModelServer, ServeOptions
    from tests.serving.helpers import HOST, client, free_ports, infer

    hf, artifact, _ = family
    ids = prompt(hf.config.vocab_size, seed=11)
    expected = hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    http, grpc, metrics = free_ports(3)
    options = ServeOptions(backend="ort", host=HOST, http_port=http, grpc_port=grpc, metrics_port=metrics,
                           exit_timeout_s=1, log_file=tmp_path / "tritonserver.log")
    with ModelServer([artifact], options) as server:
        feed = {"input_ids": ids.numpy(), "max_new_tokens": np.full((len(ids), 1), 12, np.int64)}
        tokens = infer("http", client("http", server), "decoder_generate", feed, ["output_ids"])["output_ids"]
    assert torch.equal(torch.from_numpy(tokens), expected)
