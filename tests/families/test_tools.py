"""The tools work unchanged on a family's artifact: `compare` (layer-wise too) passes and its
report says which ONNX Runtime path the MoE took, and the Triton server generates
transformers' own greedy tokens. GLM-4-MoE is the Llama-style family furthest from Mixtral
(sigmoid routing with a selection bias and groups, routed on graph ops, shared experts, a
dense first layer, q/k norms, partial rotary); Qwen3-MoE stands for the families on
com.microsoft::MoE; gpt-oss (sinks, alternating windows, clamped SwiGLU experts with biases)
and DeepSeek-V2/V3 (latent attention with a latent KV cache, group-limited routing) follow.
`bench` on a DeepSeek-V3 checkpoint reports its latent cache's bytes per token."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moedeploy.compare.api import compare
from moedeploy.runtime.ort import default_threads

from .cases import cases, make_model, prompt, save_checkpoint

CASES = cases(n_layers=2)
EXPERTS = "moe::MoE on one If per expert over prepacked Gemms (fast path)"
#: where the session has two or more threads, renormalised softmax routing without biases
#: (qwen3_moe-headdim here) takes com.microsoft::MoE with its experts cut into pieces
SPLIT = "moe::MoE on com.microsoft::MoE, each expert cut into one piece per thread (fast path)"
#: the cases checked here; each must report its MoE layers on the per-expert lowering, the path
#: every routing takes by default (tests/plugins/test_moe_experts.py), or on SPLIT
PATHS = ("glm4_moe-groups", "qwen3_moe-headdim", "gpt_oss", "deepseek_v2-groups", "deepseek_v3")


@pytest.fixture(scope="module", params=PATHS)
def family(request, cli_exports):
    """(transformers model, fp32 artifact, case id): test_onnx.py's exports, shared (conftest.py)."""
    return *cli_exports(request.param), request.param


def moe_layers(hf) -> int:
    """How many of transformers' decoder layers are sparse MoE blocks (the others are dense MLPs)."""
    return sum(hasattr(layer.mlp, "experts") for layer in hf.model.layers)


def test_compare_passes_layerwise_and_names_the_path(family) -> None:
    hf, artifact, case = family
    report = compare(artifact, layerwise=True, iterations=2)
    assert report["passed"] and report["first_divergent_layer"] is None
    (comparison,) = report["comparisons"]
    split = case == "qwen3_moe-headdim" and default_threads() >= 2  # ONNX Runtime's threads by default
    assert comparison["path"].startswith(f"{moe_layers(hf)} {SPLIT if split else EXPERTS}")
    # Every MoE layer was localised with its own routing (selection bias and groups included):
    # every token routed, none flipped.
    moes = [m for m in comparison["layerwise"]["modules"] if "routing_flips" in m]
    assert len(moes) == moe_layers(hf)
    assert all(m["module"].endswith("ffn") and m["routing_flips"] == 0 and m["routed_tokens"] > 0 for m in moes)
    on_disk = json.loads((artifact.path / "report" / "report.json").read_text())
    assert on_disk["comparisons"][0]["path"] == comparison["path"]
    assert f"Path: {comparison['path']}." in (artifact.path / "report" / "report.md").read_text()


#: served end to end (each starts a Triton server): the new attention and routing of each issue;
#: every family's greedy tokens on ONNX Runtime are test_onnx.py's
SERVED = ("glm4_moe-groups", "gpt_oss", "deepseek_v3")


@torch.no_grad()
@pytest.mark.parametrize("family", SERVED, indirect=True)
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


def test_bench_reports_the_latent_cache_of_a_deepseek_checkpoint(tmp_path, monkeypatch) -> None:
    """`moedeploy bench DIR` on a DeepSeek-V3 folder: exported into the cache, both backends give
    the same greedy tokens, and the roofline counts layers x (kv_lora_rank + qk_rope_head_dim) x 4
    bytes of KV cache per token."""
    from typer.testing import CliRunner

    import moedeploy.bench.api as api
    from moedeploy.bench.decode import run
    from moedeploy.cli import app
    from tests.test_bench import FAKE_MACHINE

    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(api, "describe", lambda threads: FAKE_MACHINE)
    monkeypatch.setattr(api, "run_in_subprocess", run)  # the workers in this process
    hf = make_model(CASES["deepseek_v3"], seed=5)
    checkpoint = save_checkpoint(hf, tmp_path / "deepseek_v3")
    threads = torch.get_num_threads()
    try:
        result = CliRunner().invoke(app, ["bench", str(checkpoint), "--backend", "torch,ort", "--prompt-len", "5",
                                          "--new-tokens", "3", "--repeat", "1", "--threads", "1",
                                          "--json", str(tmp_path / "bench.json")])
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "bench.json").read_text())
    c = hf.config
    assert report["roofline"]["kv_cache_bytes_per_token"] == c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    assert report["greedy_tokens_agree"] is True
    assert "KV cache" in result.stdout
