"""Sampling rules and the prefill/decode loop: hand examples, transformers' warpers, scripted models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moedeploy.models import MoEDecoder, SamplingConfig, generate_tokens, preset
from moedeploy.models.generation import filter_logits, greedy_argmax, next_token

from .helpers import randomize_

NEG_INF = float("-inf")
# Token probabilities in a shuffled order: the top ones are token 1 (0.5), 3 (0.2), 4 (0.15).
PROBS = [0.05, 0.5, 0.1, 0.2, 0.15]
LOGITS = torch.tensor([PROBS]).log()


def _kept(filtered: torch.Tensor) -> set[int]:
    return set(torch.nonzero(filtered[0] > NEG_INF).flatten().tolist())


# ---------------------------------------------------------------- filter_logits by hand


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.3, {1}),  # 0.5 alone reaches 0.3
        (0.6, {1, 3}),  # mass before token 4 is 0.7 >= 0.6
        (0.75, {1, 3, 4}),  # mass before token 2 is 0.85 >= 0.75
        (0.9, {1, 3, 4, 2}),  # mass before token 0 is 0.95 >= 0.9
        (1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_by_hand(top_p: float, kept: set[int]) -> None:
    filtered = filter_logits(LOGITS, None, top_p)
    assert _kept(filtered) == kept
    # Survivors keep their logits; the rest are -inf.
    idx = sorted(kept)
    assert torch.equal(filtered[0, idx], LOGITS[0, idx])
    assert (filtered[0, sorted(set(range(5)) - kept)] == NEG_INF).all()


@pytest.mark.parametrize(
    ("top_k", "kept"),
    [(1, {1}), (2, {1, 3}), (3, {1, 3, 4}), (5, set(range(5))), (9, set(range(5)))],
)
def test_top_k_by_hand(top_k: int, kept: set[int]) -> None:
    assert _kept(filter_logits(LOGITS, top_k, None)) == kept


def test_top_k_then_top_p_by_hand() -> None:
    # As transformers applies them: top-3 leaves {0.5, 0.2, 0.15} / 0.85 = {0.588, 0.235, 0.176};
    # top-p 0.55 then stops after 0.588. On the full distribution top-p 0.55 would keep two.
    assert _kept(filter_logits(LOGITS, 3, 0.55)) == {1}
    assert _kept(filter_logits(LOGITS, None, 0.55)) == {1, 3}
    assert _kept(filter_logits(LOGITS, 3, 0.6)) == {1, 3}


def test_filter_rows_are_independent_and_input_untouched() -> None:
    logits = torch.stack([LOGITS[0], LOGITS[0].flip(0)])  # row 2: token 3 (0.5), token 1 (0.2)
    original = logits.clone()
    filtered = filter_logits(logits, None, 0.6)
    assert (filtered[0] > NEG_INF).tolist() == [False, True, False, True, False]
    assert (filtered[1] > NEG_INF).tolist() == [False, True, False, True, False][::-1]
    assert torch.equal(logits, original)


@pytest.mark.parametrize(
    ("top_k", "top_p"), [(None, 0.5), (None, 0.9), (10, None), (7, 0.8), (1, 0.3), (49, 0.99)]
)
def test_filter_matches_transformers_warpers(top_k: int | None, top_p: float | None) -> None:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = 2.0 * torch.randn(6, 50)
    expected = logits.clone()
    if top_k is not None:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p is not None:
        expected = TopPLogitsWarper(top_p)(None, expected)
    assert torch.equal(filter_logits(logits, top_k, top_p), expected)


# ---------------------------------------------------------------- sampling config / next_token


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -0.1}, {"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.2}]
)
def test_sampling_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


def test_next_token_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    assert next_token(logits, SamplingConfig(), None).tolist() == [1, 0]


def test_greedy_argmax_is_torch_argmax_on_ties_nan_and_inf() -> None:
    """NumPy's argmax stands in for torch's on the CPU: the same index on rows made to tell argmax
    rules apart (ties, NaN anywhere, +Inf before a NaN, all -Inf), on random rows with those put
    in, in fp32 and bf16 (next_token takes the float of it), and a (V,) row gives a 0-d index."""
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1, 3, 3, 2], [1, nan, 5, 2], [1, 5, 2, nan], [-inf] * 4, [inf, 1, nan, 0], [nan] * 4])
    assert greedy_argmax(rows).tolist() == rows.argmax(-1).tolist() == [1, 1, 3, 0, 2, 0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 500, generator=gen)
    picks = torch.randint(0, 64 * 500, (96,), generator=gen)
    x.view(-1)[picks] = torch.tensor([nan, inf, -inf, 3.0])[torch.randint(0, 4, (96,), generator=gen)]
    for dtype in (torch.float32, torch.bfloat16):
        logits = x.to(dtype)
        assert torch.equal(next_token(logits, SamplingConfig(), None), logits.float().argmax(-1))
    assert greedy_argmax(x[0]).shape == x[0].argmax(-1).shape == ()
    assert greedy_argmax(x).dtype == torch.int64


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, None), (0.5, None, None), (2.0, 3, None), (1.0, None, 0.75)],
)
def test_sampled_frequencies_match_formula(
    temperature: float, top_k: int | None, top_p: float | None
) -> None:
    n = 20000
    logits = LOGITS.expand(n, 5)
    g = torch.Generator().manual_seed(0)
    tokens = next_token(logits, SamplingConfig(temperature, top_k, top_p, seed=0), g)
    freq = torch.bincount(tokens, minlength=5).double() / n
    # By hand: p_i^(1/T) renormalised over the survivors of top-k / top-p.
    weights = [p ** (1.0 / temperature) for p in PROBS]
    order = sorted(range(5), key=lambda i: -PROBS[i])
    allowed = set(order[:top_k]) if top_k else set(range(5))
    if top_p is not None:  # PROBS-based nucleus (temperature is 1 in that case)
        allowed, mass = set(), 0.0
        for i in order:
            if mass >= top_p:
                break
            allowed.add(i)
            mass += PROBS[i]
    z = sum(weights[i] for i in allowed)
    expected = torch.tensor(
        [weights[i] / z if i in allowed else 0.0 for i in range(5)], dtype=torch.float64
    )
    # Binomial standard error at n = 20000 is at most 0.0036; allow 5 of them.
    torch.testing.assert_close(freq, expected, atol=0.018, rtol=0)
    assert (freq[expected == 0] == 0).all()


@pytest.mark.parametrize("temperature", [1e-46, 1e-45, 1e-38])
def test_a_vanishing_temperature_samples_the_largest_logits(temperature: float) -> None:
    """logits / 1e-45 overflows (to +inf for a positive logit, -inf for every logit of a negative
    row), and 1e-46 is 0 in float32, which made softmax NaN and torch.multinomial raise, failing
    every request sharing the server's batch. The limit T -> 0 is the argmax, ties sampled evenly: checked by hand on rows of
    positive, negative and tied logits, and a row that does not overflow keeps logits / T."""
    rows = torch.tensor([[1.0, 3.0, -2.0, 0.5], [-7.0, -3.0, -9.0, -5.0], [2.0, 4.0, 4.0, 1.0]])
    n = 4000
    g = torch.Generator().manual_seed(0)
    tokens = next_token(rows.repeat_interleave(n, 0), SamplingConfig(temperature, seed=0), g).view(3, n)
    assert (tokens[0] == 1).all() and (tokens[1] == 1).all()
    tied = tokens[2]
    assert set(tied.tolist()) == {1, 2} and abs((tied == 1).double().mean().item() - 0.5) < 0.05
    from moedeploy.models.generation import scale_by_temperature

    assert torch.equal(scale_by_temperature(LOGITS, 0.5), LOGITS / 0.5)  # transformers' division, untouched


# ---------------------------------------------------------------- the loop, with a scripted model


class Scripted:
    """A fake backend whose next-token argmax follows a script per sequence; records its calls."""

    def __init__(self, script: list[list[int]], prompt_len: int, vocab: int = 10) -> None:
        self.script, self.prompt_len, self.vocab = script, prompt_len, vocab
        self.calls: list[tuple[list[list[int]], int]] = []

    def __call__(self, ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        self.calls.append((ids.tolist(), start_pos))
        B, S = ids.shape
        logits = torch.zeros(B, S, self.vocab)
        t = start_pos + S - self.prompt_len  # index of the token these logits predict
        for b in range(B):
            logits[b, -1, self.script[b][t]] = 10.0
        return logits


PROMPT = torch.tensor([[4, 4, 4], [8, 8, 8]])
SCRIPT = [[5, 7, 9, 3, 4, 1], [1, 2, 3, 9, 6, 2]]


def test_loop_without_eos() -> None:
    step = Scripted(SCRIPT, 3)
    out = generate_tokens(step, PROMPT, 6)
    assert out.tolist() == [[4, 4, 4, *SCRIPT[0]], [8, 8, 8, *SCRIPT[1]]]
    # One prefill at position 0, then one decode per new token except the last, each fed the
    # previous token at its absolute position.
    assert [pos for _, pos in step.calls] == [0, 3, 4, 5, 6, 7]
    assert step.calls[0][0] == PROMPT.tolist()
    assert [ids for ids, _ in step.calls[1:]] == [
        [[5], [1]],
        [[7], [2]],
        [[9], [3]],
        [[3], [9]],
        [[4], [6]],
    ]


def test_loop_eos_pads_finished_rows_and_stops_when_all_finished() -> None:
    step = Scripted(SCRIPT, 3)
    out = generate_tokens(step, PROMPT, 6, eos_token_id=9)
    # Row 0 emits 9 at step 3 and then only 9; row 1 emits 9 at step 4; then the loop stops.
    assert out.tolist() == [[4, 4, 4, 5, 7, 9, 9], [8, 8, 8, 1, 2, 3, 9]]
    assert [pos for _, pos in step.calls] == [0, 3, 4, 5]


def test_loop_eos_in_one_row_only() -> None:
    script = [[9, 1, 2, 3], [1, 2, 3, 4]]
    out = generate_tokens(Scripted(script, 3), PROMPT, 4, eos_token_id=9)
    assert out.tolist() == [[4, 4, 4, 9, 9, 9, 9], [8, 8, 8, 1, 2, 3, 4]]


def test_loop_single_new_token_needs_only_prefill() -> None:
    step = Scripted(SCRIPT, 3)
    assert generate_tokens(step, PROMPT, 1).tolist() == [[4, 4, 4, 5], [8, 8, 8, 1]]
    assert len(step.calls) == 1


@pytest.mark.parametrize(
    "prompt", [torch.zeros(2, 0, dtype=torch.long), torch.zeros(3, dtype=torch.long)]
)
def test_loop_rejects_bad_prompt(prompt: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="prompt"):
        generate_tokens(Scripted(SCRIPT, 0), prompt, 2)


# ---------------------------------------------------------------- MoEDecoder.generate


@pytest.fixture(scope="module")
def model() -> MoEDecoder:
    torch.manual_seed(0)
    return randomize_(MoEDecoder(preset("tiny")), seed=11).eval()


def test_seeded_sampling_is_reproducible(model: MoEDecoder) -> None:
    prompt = torch.randint(0, 256, (2, 4))
    a = model.generate(prompt, 32, temperature=1.0, seed=123)
    b = model.generate(prompt, 32, temperature=1.0, seed=123)
    c = model.generate(prompt, 32, temperature=1.0, seed=124)
    assert torch.equal(a, b)
    assert not torch.equal(a[:, 4:], c[:, 4:])
    assert not torch.equal(a, model.generate(prompt, 32))  # sampling is not greedy here


@pytest.mark.parametrize("temperature", [0.7, 1.0, 3.0])
def test_top_k_1_sampling_is_greedy(model: MoEDecoder, temperature: float) -> None:
    prompt = torch.randint(0, 256, (2, 5))
    greedy = model.generate(prompt, 32)
    for seed in (0, 1):
        assert torch.equal(
            model.generate(prompt, 32, temperature=temperature, top_k=1, seed=seed), greedy
        )


def test_generate_eos(model: MoEDecoder) -> None:
    prompt = torch.randint(0, 256, (2, 3))
    free = model.generate(prompt, 32)[:, 3:].tolist()
    common = set(free[0]) & set(free[1])
    assert common, "pick another prompt: the rows share no token"
    # The shared token both rows reach soonest, so the loop's early exit is exercised.
    eos = min(common, key=lambda t: (max(free[0].index(t), free[1].index(t)), t))
    expected_rows, stops = [], []
    for row in free:
        first = row.index(eos) if eos in row else None
        expected_rows.append(
            row if first is None else row[: first + 1] + [eos] * (len(row) - first - 1)
        )
        stops.append(32 if first is None else first + 1)
    new = max(stops)  # the loop ends once every row has emitted eos
    out = model.generate(prompt, 32, eos_token_id=eos)
    assert out.shape == (2, 3 + new)
    assert out[:, 3:].tolist() == [r[:new] for r in expected_rows]
    assert out[0, 3 + stops[0] - 1].item() == eos
    assert new < 32  # the early stop is exercised


# ---------------------------------------------------------------- what generate accepts as a prompt

ROWS = [[3, 17, 250, 9], [40, 0, 255, 12]]


@pytest.mark.parametrize(
    "prompt",
    [ROWS, tuple(map(tuple, ROWS)), np.array(ROWS), np.array(ROWS, dtype=np.int32), torch.tensor(ROWS, dtype=torch.int32)],
    ids=["list", "tuple", "numpy-int64", "numpy-int32", "torch-int32"],
)
def test_generate_takes_lists_and_arrays_as_a_batch(model: MoEDecoder, prompt) -> None:
    reference = model.generate(torch.tensor(ROWS), 8)  # the int64 tensor the loop always took
    out = model.generate(prompt, 8)
    assert out.dtype == torch.long and out.shape == (2, 4 + 8)
    assert torch.equal(out, reference)


@pytest.mark.parametrize("prompt", [ROWS[1], np.array(ROWS[1]), torch.tensor(ROWS[1])], ids=["list", "numpy", "torch"])
def test_generate_takes_one_sequence_as_1d(model: MoEDecoder, prompt) -> None:
    batch = model.generate(torch.tensor([ROWS[1]]), 8)  # (1, 12)
    out = model.generate(prompt, 8)
    assert out.shape == (4 + 8,)  # one sequence in, one sequence out
    assert torch.equal(out, batch[0])


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([1.0, 2.0], "integer token ids, got float64"),
        (torch.tensor([[1.0, 2.0]]), "integer token ids, got float32"),
        (np.array([[0.5]], dtype=np.float16), "integer token ids, got float16"),
        ([True, False], "integer token ids, got bool"),
        (["a", "b"], "integer token ids"),
        (np.zeros((1, 2, 3), dtype=np.int64), r"1-D \(one sequence\) or 2-D \(batch, seq\), got shape \(1, 2, 3\)"),
        (torch.tensor(5), r"got shape \(\)"),
        ([], "empty"),
        ([[]], "empty"),
        (torch.zeros(2, 0, dtype=torch.long), "empty"),
        ([[1, 2], [3]], "different lengths"),
        ([1, 256], r"token id 256 is outside the vocabulary \[0, 256\)"),
        ([-1, 2], "token id -1 is outside"),
        ("1 2 3", "got str"),
        (None, "got NoneType"),
    ],
)
def test_generate_rejects_bad_prompts_in_one_line(model: MoEDecoder, prompt, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        model.generate(prompt, 4)
    assert "\n" not in str(error.value)
