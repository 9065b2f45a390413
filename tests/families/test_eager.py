"""Every family's eager model against transformers' own, loaded from a saved Hugging Face
folder (released per-expert tensor names, sharded): logits within 1e-4 in fp32, and the same
16 greedy tokens over the KV cache (prompts longer than the sliding windows)."""

from __future__ import annotations

import pytest
import torch

from moedeploy.models import load_decoder

from .cases import PROMPT, cases, make_model, prompt, save_checkpoint

CASES = cases()


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from its saved folder, case id)."""
    hf = make_model(CASES[request.param])
    folder = save_checkpoint(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_decoder(folder), request.param


def test_config_is_the_family(pair) -> None:
    hf, ours, case = pair
    assert ours.config.family == hf.config.model_type == case.split("-")[0]


@torch.no_grad()
def test_logits_match_transformers(pair) -> None:
    hf, ours, _ = pair
    ids = prompt(hf.config.vocab_size)
    expected = hf(ids).logits
    got = ours(ids)
    assert expected.abs().max() > 1.0  # random weights that give O(1) logits: a wrong term cannot hide
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@torch.no_grad()
def test_greedy_tokens_match_transformers(pair) -> None:
    hf, ours, _ = pair
    ids = prompt(hf.config.vocab_size)
    expected = hf.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    got = ours.generate(ids, max_new_tokens=16)
    assert expected.shape == (2, PROMPT + 16)
    assert torch.equal(got, expected)
