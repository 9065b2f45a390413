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


@pytest.mark.parametrize(("lowering", "threads", "path"), [
    ("auto", 2, "moe_split"), ("auto", 1, "moe_experts"), ("contrib", 3, "moe_split"), ("contrib", 1, "moe_contrib"),
    ("experts", 2, "moe_experts"), ("function", 2, "moe_function"),
])
def test_greedy_tokens_match_eager(store, prompt, eager_greedy, lowering: str, threads: int, path: str) -> None:
    """Every MoE lowering; with 2 or more threads the experts are cut into pieces on
    com.microsoft::MoE in "auto" and "contrib" (3 pieces: the tiny decoder's expert hidden 96)."""
    ort_decoder = OrtDecoder(store.decoder("fp32"), ["CPUExecutionProvider"], moe_lowering=lowering, threads=threads)
    moe_counts = {k: ort_decoder.lowering[k] for k in ("moe_split", "moe_experts", "moe_contrib", "moe_function")}
    assert moe_counts == {k: (2 if k == path else 0) for k in moe_counts}
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


def test_greedy_token_nodes_rank_like_torch_argmax() -> None:
    """The graph's greedy token (lowering.argmax_nodes) against torch.argmax on rows that tell
    argmax rules apart: a tie (the first index), a NaN anywhere (torch ranks it above everything;
    ONNX Runtime's ArgMax skips it), +Inf before a NaN, two NaNs, all -Inf; then random rows with
    NaN, Inf and repeated maxima put in; fp32 and fp16 scores."""
    import onnx_ir as ir
    import onnxruntime as ort

    from moedeploy.runtime.lowering import argmax_nodes

    nan, inf = float("nan"), float("inf")
    rows = [[1, 3, 3, 2], [1, nan, 5, 2], [1, 5, 2, nan], [-inf] * 4, [inf, 1, nan, 0], [1, inf, 2, inf], [nan] * 4,
            [2, nan, 7, nan], [-inf, nan, inf, 1]]
    rng = np.random.default_rng(0)
    for dtype, np_dtype in ((ir.DataType.FLOAT, np.float32), (ir.DataType.FLOAT16, np.float16)):
        scores = ir.Value(name="scores", shape=ir.Shape(["rows", 1, "vocab"]), type=ir.TensorType(dtype))
        graph = ir.Graph([scores], [], nodes=[], opset_imports={"": 21}, name="argmax")
        nodes = argmax_nodes(scores, graph)
        graph.extend(nodes)
        graph.outputs.append(nodes[-1].outputs[0])
        model = ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString()
        session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        x = np.array(rows, dtype=np_dtype)[:, None]
        got = session.run(None, {"scores": x})[0]
        assert got.dtype == np.int64 and got.shape == (9, 1)
        expected = torch.from_numpy(x.astype(np.float32)).argmax(-1)
        assert got[:, 0].tolist() == expected[:, 0].tolist() == [1, 1, 3, 0, 2, 1, 0, 1, 1]
        x = rng.standard_normal((64, 1, 500)).astype(np_dtype)
        for row, col in zip(rng.integers(0, 64, 96), rng.integers(0, 500, 96), strict=True):
            x[row, 0, col] = rng.choice([nan, inf, -inf, x[row].max()])
        expected = torch.from_numpy(x.astype(np.float32)).argmax(-1)
        assert np.array_equal(session.run(None, {"scores": x})[0], expected.numpy())


@pytest.mark.parametrize(("kv_cache", "attention"), [("copy", "graph"), ("inplace", "gqa")])
def test_greedy_lowering_picks_the_eager_tokens_in_the_graph(store, decoder, prompt, eager_greedy, kv_cache: str,
                                                             attention: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """logits="greedy": the graph's own argmax, step by step and through generate, gives the eager
    model's greedy tokens; a token handed out is never overwritten by the next step; sampling
    still reads the logits."""
    greedy = OrtDecoder(store.decoder("fp32"), ["CPUExecutionProvider"], logits="greedy", attention_lowering=attention,
                        kv_cache=kv_cache)
    assert greedy.lowering["greedy_token"] == greedy.lowering["logits_last"] == 1 and greedy.has_greedy_token
    for step in (greedy.step, greedy.greedy_step):  # one line, not an index error deep inside
        with pytest.raises(ValueError, match=r"call reset\(batch\) before the first step"):
            step(prompt, 0)
    greedy.reset(2, 7 + NEW_TOKENS)
    first = greedy.greedy_step(prompt, 0)
    assert first.dtype == torch.int64 and first.shape == (2,)
    second = greedy.greedy_step(first[:, None], 7)
    assert torch.equal(first, eager_greedy[:, 7]) and torch.equal(second, eager_greedy[:, 8])
    logits = greedy.step(second[:, None], 8)  # step and greedy_step share the cache
    assert logits.shape == (2, 1, 256) and torch.equal(logits[:, 0].argmax(-1), eager_greedy[:, 9])
    held = logits.clone()
    assert torch.equal(greedy.greedy_step(eager_greedy[:, 9:10], 9), eager_greedy[:, 10])
    assert torch.equal(logits, held)  # logits handed out are the caller's: no later step writes them

    kwargs = dict(max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    assert torch.equal(greedy.generate(prompt, **kwargs), decoder.generate(prompt, **kwargs))

    def no_logits(*_):
        raise AssertionError("greedy generation read the logits")

    monkeypatch.setattr(greedy, "step", no_logits)
    assert torch.equal(greedy.generate(prompt, max_new_tokens=NEW_TOKENS), eager_greedy)


def test_no_new_tokens_runs_the_prefill_and_draws_nothing(store, decoder, prompt) -> None:
    """max_new_tokens=0 gives the prompt back, and sampling then draws nothing from torch's
    global generator (an unseeded request must not move another's random stream)."""
    greedy = OrtDecoder(store.decoder("fp32"), ["CPUExecutionProvider"], logits="greedy")
    for model in (decoder, greedy):
        state = torch.get_rng_state()
        assert torch.equal(model.generate(prompt, max_new_tokens=0, temperature=0.8), prompt)
        assert torch.equal(model.generate(prompt, max_new_tokens=0), prompt)
        assert torch.equal(torch.get_rng_state(), state)


def test_greedy_logits_are_refused_with_the_ragged_cache(store) -> None:
    """The ragged cache (in-flight batching) gives (1, rows) logits; its greedy token is not built for it."""
    from moedeploy.runtime.lowering import LoweringError

    with pytest.raises(LoweringError, match="use logits='last'"):
        OrtDecoder(store.decoder("fp32"), ["CPUExecutionProvider"], logits="greedy", attention_lowering="gqa",
                   kv_cache="ragged")
