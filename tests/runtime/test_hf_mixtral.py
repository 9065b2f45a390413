"""A Hugging Face Mixtral checkpoint folder, exported by the CLI, generates on ONNX Runtime
exactly what transformers generates."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moedeploy.runtime.generation import OrtDecoder

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model here is built from a config
import transformers

NEW_TOKENS = 32


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations: HF's std-0.02 init gives near-flat logits that hide mistakes."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 1:  # RMSNorm weights
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """(transformers model, exported artifact folder)."""
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    randomize_(model, seed=1)
    model.eval()
    model.generation_config.eos_token_id = None  # generate all the tokens asked for
    model.generation_config.pad_token_id = 0
    root = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(root / "ckpt")
    assert list((root / "ckpt").glob("*.safetensors"))
    result = subprocess.run(
        [sys.executable, "-m", "moedeploy.cli", "export", "decoder", "--checkpoint", "ckpt", "--out", "art"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "exported decoder" in result.stdout
    return model, root / "art"


def test_manifest_records_the_checkpoint(mixtral) -> None:
    _, art = mixtral
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["kind"] == "decoder"
    assert Path(manifest["config"]["source"]["checkpoint"]).name == "ckpt"
    assert manifest["config"]["vocab_size"] == 96 and manifest["config"]["n_layers"] == 2


def test_logits_match_transformers(mixtral) -> None:
    model, art = mixtral
    ids = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(ids).logits
    assert expected.std() > 0.5  # a real spread of logits, not a near-constant one
    ort_decoder = OrtDecoder(art, ["CPUExecutionProvider"])
    ort_decoder.reset(3)
    prefill = ort_decoder.step(ids[:, :9], 0)  # prefill, then a chunk through the cache
    chunk = ort_decoder.step(ids[:, 9:], 9)
    got = torch.cat([prefill, chunk], dim=1)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def generated(mixtral) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt, transformers' greedy generate of it): one reference for both lowerings, only read."""
    model, _ = mixtral
    prompt = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, do_sample=False,
        )
    return prompt, expected


@pytest.mark.parametrize("lowering", ["contrib", "function"])
def test_greedy_tokens_match_transformers_generate(mixtral, generated, lowering: str) -> None:
    _, art = mixtral
    prompt, expected = generated
    assert expected.shape == (2, 6 + NEW_TOKENS)
    tokens = OrtDecoder(art, ["CPUExecutionProvider"], moe_lowering=lowering).generate(prompt, NEW_TOKENS)
    assert torch.equal(tokens, expected)
