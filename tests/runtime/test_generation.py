"""Generation over the ONNX decoder: the same tokens as eager PyTorch, greedy and sampled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moedeploy.runtime.generation import OrtDecoder
from tests.export.artifacts import eager_decoder

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def decoder():
    return eager_decoder()


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(42))


@pytest.fixture(scope="module")
def eager_greedy(decoder, prompt) -> torch.Tensor:
    return decoder.generate(prompt, max_new_tokens=NEW_TOKENS)


def test_eager_greedy_is_argmax_without_cache(decoder, prompt, eager_greedy) -> None:
    """The reference itself, checked against the plainest loop: full forward, argmax, append."""
    tokens = prompt
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tokens = torch.cat([tokens, decoder(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(eager_greedy, tokens)


@pytest.mark.parametrize("lowering", ["auto", "contrib", "experts", "function"])
def test_greedy_tokens_match_eager(store, prompt, eager_greedy, lowering: str) -> None:
    ort_decoder = OrtDecoder(store.decoder("fp32"), ["CPUExecutionProvider"], moe_lowering=lowering)
    assert ort_decoder.lowering["moe_contrib"] == (2 if lowering == "contrib" else 0)
    assert ort_decoder.lowering["moe_experts"] == (2 if lowering in ("auto", "experts") else 0)
    tokens = ort_decoder.generate(prompt, max_new_tokens=NEW_TOKENS)
    assert tokens.shape == (2, 7 + NEW_TOKENS)
    assert torch.equal(tokens, eager_greedy)
    assert len(set(tokens[0, 7:].tolist())) > 3  # not one token repeated


@pytest.mark.parametrize("lowering", ["contrib", "function"])
def test_sampled_tokens_match_eager_with_a_seed(store, decoder, prompt, eager_greedy, lowering: str) -> None:
    kwargs = dict(max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    expected = decoder.generate(prompt, **kwargs)
    assert not torch.equal(expected, eager_greedy)  # sampling really happened
    ort_decoder = OrtDecoder(store.decoder("fp32"), ["CPUExecutionProvider"], moe_lowering=lowering)
    assert torch.equal(ort_decoder.generate(prompt, **kwargs), expected)
    # same seed, same tokens; another seed, other tokens
    assert torch.equal(ort_decoder.generate(prompt, **kwargs), expected)
    assert not torch.equal(ort_decoder.generate(prompt, **{**kwargs, "seed": 99}), expected)


def test_step_logits_follow_the_cache(store, decoder, prompt) -> None:
    ort_decoder = OrtDecoder(store.decoder("fp32"), ["CPUExecutionProvider"])
    ort_decoder.reset(2)
    first = ort_decoder.step(prompt[:, :4], 0)
    second = ort_decoder.step(prompt[:, 4:], 4)
    with torch.no_grad():
        full = decoder(prompt)
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="cache holds 7"):
        ort_decoder.step(prompt[:, :1], 3)


def test_last_position_logits_are_the_full_graphs_last_row(store, decoder, prompt, eager_greedy) -> None:
    """logits="last" (the LM head on the last position only): the eager model's last row, at every step."""
    last = OrtDecoder(store.decoder("fp32"), ["CPUExecutionProvider"], logits="last")
    assert last.lowering["logits_last"] == 1
    last.reset(2)
    first = last.step(prompt[:, :4], 0)
    second = last.step(prompt[:, 4:], 4)
    assert first.shape == second.shape == (2, 1, 256)
    with torch.no_grad():
        full = decoder(prompt)
    torch.testing.assert_close(first[:, 0], full[:, 3], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second[:, 0], full[:, -1], rtol=1e-4, atol=1e-4)
    assert torch.equal(last.generate(prompt, max_new_tokens=NEW_TOKENS), eager_greedy)
    from moedeploy.runtime.ort import create_session

    with pytest.raises(ValueError, match="apply to decoder artifacts"):
        create_session(store.block("rmsnorm"), logits="last")


def test_skip_rmsnorm_lowering_computes_the_eager_logits(store, decoder, prompt, eager_greedy) -> None:
    """norm_lowering="skip": every residual Add + RMSNorm pair on SkipSimplifiedLayerNormalization
    (all but layer 0's first norm, which reads the embedding), the sum passed on to the next residual."""
    fused = OrtDecoder(store.decoder("fp32"), ["CPUExecutionProvider"], norm_lowering="skip")
    assert (fused.lowering["rmsnorm_skip"], fused.lowering["rmsnorm_native"]) == (4, 1)  # 2 layers x 2 + final
    fused.reset(2)
    with torch.no_grad():
        full = decoder(prompt)
    torch.testing.assert_close(fused.step(prompt, 0), full, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused.generate(prompt, max_new_tokens=NEW_TOKENS), eager_greedy)


def test_too_long_generation_is_refused(store, prompt) -> None:
    ort_decoder = OrtDecoder(store.decoder("fp32"), ["CPUExecutionProvider"])
    with pytest.raises(ValueError, match="max_positions 256"):
        ort_decoder.generate(prompt, max_new_tokens=250)


def test_a_block_artifact_is_not_a_decoder(store) -> None:
    with pytest.raises(ValueError, match="not a decoder"):
        OrtDecoder(store.block("moe"))


def test_generate_takes_numpy_and_lists_like_eager(store, decoder, prompt, eager_greedy) -> None:
    ort_decoder = OrtDecoder(store.decoder("fp32"), ["CPUExecutionProvider"])
    assert torch.equal(ort_decoder.generate(prompt.numpy(), max_new_tokens=NEW_TOKENS), eager_greedy)
    assert torch.equal(ort_decoder.generate(prompt.tolist(), max_new_tokens=NEW_TOKENS), eager_greedy)
    one = ort_decoder.generate(prompt[1].tolist(), max_new_tokens=NEW_TOKENS)  # 1-D: one sequence
    assert torch.equal(one, eager_greedy[1])


@pytest.mark.parametrize(
    ("input_ids", "message"),
    [
        ([[0.5, 1.0]], "integer token ids, got float64"),
        (np.zeros((1, 2, 3), dtype=np.int64), r"got shape \(1, 2, 3\)"),
        ([], "empty"),
        ([1, 999], r"token id 999 is outside the vocabulary \[0, 256\)"),
    ],
)
def test_generate_rejects_bad_prompts_in_one_line(store, input_ids, message: str) -> None:
    ort_decoder = OrtDecoder(store.decoder("fp32"), ["CPUExecutionProvider"])
    with pytest.raises(ValueError, match=message) as error:
        ort_decoder.generate(input_ids, max_new_tokens=4)
    assert "\n" not in str(error.value)
