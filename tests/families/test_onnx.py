"""Every family exported from its Hugging Face folder: the artifact on a plain
onnxruntime.InferenceSession (the custom ops' standard-op function bodies, nothing of moedeploy
imported) matches transformers within 1e-4 in fp32, and moedeploy's ONNX Runtime decoder gives
transformers' 16 greedy tokens over the KV cache, on com.microsoft::MoE: with its own routing
wherever that expresses the family's, with the routing on graph ops before it where not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from moedeploy.runtime.generation import OrtDecoder

from .cases import cases, prompt

#: every configuration of every family the eager tests check, but two whose differences from their
#: family's other case (one KV head, top-3 routing, other multipliers, whole-head rotary, head_dim
#: 10) go through code the other exported cases take: the decoder and its attention are shared by
#: every family, and four others export one KV head (mixtral, qwen2/3-MoE, gpt-oss)
CASES = {case: config for case, config in cases().items() if case not in ("granitemoe-mqa", "minimax_m2-mqa")}
#: Families whose routing com.microsoft::MoE computes (softmax top-k, renormalised or not).
CONTRIB_FAMILIES = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss"}


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, cli_exports):
    """(transformers model, fp32 artifact exported from its saved folder by the CLI, case id)."""
    return *cli_exports(request.param), request.param


def test_manifest_names_the_family_and_the_checkpoint(exported) -> None:
    hf, artifact, _ = exported
    config = artifact.manifest["config"]
    assert config["family"] == hf.config.model_type
    assert Path(config["source"]["checkpoint"]).name == "checkpoint"
    assert config["n_layers"] == hf.config.num_hidden_layers and config["vocab_size"] == hf.config.vocab_size


@torch.no_grad()
def test_plain_onnxruntime_matches_transformers(exported) -> None:
    hf, artifact, _ = exported
    ids = prompt(hf.config.vocab_size, seed=7)
    session = ort.InferenceSession(str(artifact.model_path), providers=["CPUExecutionProvider"])
    feed = {"input_ids": ids.numpy()}
    for i in session.get_inputs()[1:]:  # an empty cache: (batch, heads, 0, features)
        feed[i.name] = np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), np.float32)
    got = session.run(["logits"], feed)[0]
    expected = hf(ids).logits.numpy()
    assert np.abs(expected).max() > 1.0
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


@torch.no_grad()
def test_onnxruntime_greedy_tokens_match_transformers(exported) -> None:
    hf, artifact, _ = exported
    ids = prompt(hf.config.vocab_size, seed=8)
    decoder = OrtDecoder(artifact, threads=1)
    got = decoder.generate(ids, max_new_tokens=16)
    expected = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(got, expected)
    config = artifact.manifest["config"]
    n_moe = config["n_layers"] - len(config["dense_layers"])
    assert decoder.lowering["moe_experts"] == n_moe  # the default on CPU fp32, one thread: one If per expert
    assert decoder.lowering["moe_contrib"] == decoder.lowering["moe_function"] == decoder.lowering["moe_split"] == 0
    # two threads: each expert cut into two pieces on com.microsoft::MoE where it qualifies
    # (tests/plugins/test_moe_split.py), one If per expert elsewhere
    two = OrtDecoder(artifact, threads=2)
    assert two.lowering["moe_split"] + two.lowering["moe_experts"] == n_moe
    if hf.config.model_type == "mixtral":  # renormalised softmax, no biases: split where 2 divides the hidden size
        assert two.lowering["moe_split"] == (n_moe if hf.config.intermediate_size % 2 == 0 else 0)
    assert torch.equal(two.generate(ids, max_new_tokens=16), expected)
    contrib = OrtDecoder(artifact, moe_lowering="contrib", threads=1)  # each expert whole
    assert torch.equal(contrib.generate(ids, max_new_tokens=16), expected)
    fast = hf.config.model_type in CONTRIB_FAMILIES
    # the others' routing runs on graph ops before com.microsoft::MoE
    assert contrib.lowering["moe_contrib"] == (n_moe if fast else 0)
    assert contrib.lowering["moe_routed"] == (0 if fast else n_moe)
    if hf.config.model_type == "mixtral":  # and the function body on a family that has the fast path
        assert torch.equal(OrtDecoder(artifact, moe_lowering="function").generate(ids, max_new_tokens=16), expected)


def _expected_cache_floats_per_token_and_layer(config) -> int:
    """From transformers' config: latent attention caches kv_lora_rank + qk_rope_head_dim values
    per token and layer; every other family keys and values for each KV head."""
    if getattr(config, "kv_lora_rank", None):
        return config.kv_lora_rank + config.qk_rope_head_dim
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_key_value_heads * head_dim


def test_kv_cache_bytes_per_token_are_measured_and_recorded(exported) -> None:
    hf, artifact, _ = exported
    c = hf.config
    expected = c.num_hidden_layers * _expected_cache_floats_per_token_and_layer(c) * 4  # fp32
    assert artifact.manifest["kv_cache"]["bytes_per_token"] == expected
    decoder = OrtDecoder(artifact)
    decoder.generate(prompt(c.vocab_size, batch=1, seed=9), max_new_tokens=2)  # 15 positions cached
    cached = sum(t.nbytes for t in decoder._past)
    assert cached == expected * (len(prompt(c.vocab_size, batch=1)[0]) + 1)  # the last token is not cached yet
