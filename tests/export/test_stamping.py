"""A decoder traced for its first layers of each kind and grown to all of them by copying
(export/stamping.py) computes what the trace of every layer computes, and what transformers
computes, for families whose layers differ (dense and MoE, sliding and full attention)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from moedeploy.export import export, stamping, streaming
from tests.families.cases import cases, make_model, prompt, save_checkpoint

LAYERS = 3

#: case -> (its layers, how many leading layers the trace holds), read off transformers' config by hand
#: (a config whose last layer is a new kind is traced whole: test_the_trace_holds_the_shortest_prefix...)
TRACED = {
    "qwen2_moe-shared-dense": (LAYERS, 2),  # mlp_only_layers=[1]: MoE, dense, then MoE again
    "deepseek_v3": (LAYERS, 2),  # first_k_dense_replace=1: one dense layer, then MoE
    "gpt_oss": (LAYERS, 2),  # sliding and full attention alternate
    "phimoe": (LAYERS, 1),  # every layer alike; LayerNorm's first nodes read the hidden state, no weight
}
#: the cases also exported with every layer traced, to hold the grown graph to it within float rounding
AGAINST_FULL_TRACE = ("gpt_oss",)


@pytest.mark.parametrize("case", list(TRACED))
@torch.no_grad()
def test_a_decoder_grown_from_its_traced_layers_computes_what_transformers_and_the_full_trace_compute(
        case, tmp_path, monkeypatch) -> None:
    layers, traced = TRACED[case]
    hf = make_model(cases(n_layers=layers)[case], seed=4)
    checkpoint = save_checkpoint(hf, tmp_path / "checkpoint")
    # the trace itself, not the suite's traces shared by workers (tests/conftest.py) or this process's memo
    monkeypatch.setattr(streaming, "_trace", getattr(streaming._trace, "__wrapped__", streaming._trace))
    monkeypatch.setattr(streaming, "_TRACES", type(streaming._TRACES)())
    traced_layers = []
    trace_layers = streaming._trace_layers
    monkeypatch.setattr(streaming, "_trace_layers",
                        lambda config, *a, **k: traced_layers.append(config.n_layers) or trace_layers(config, *a, **k))

    artifacts = [export("decoder", tmp_path / "grown", checkpoint=checkpoint, golden=False)]
    assert traced_layers == [traced]
    if case in AGAINST_FULL_TRACE:
        monkeypatch.setattr(streaming, "_TRACES", type(streaming._TRACES)())
        monkeypatch.setattr(stamping, "traced_prefix", lambda signatures: None)
        artifacts.append(export("decoder", tmp_path / "full", checkpoint=checkpoint, golden=False))
        assert traced_layers == [traced, layers]

    ids = prompt(hf.config.vocab_size, seed=7)
    expected = hf(ids).logits.numpy()
    results = []
    for artifact in artifacts:
        session = ort.InferenceSession(str(artifact.model_path), providers=["CPUExecutionProvider"])
        inputs = session.get_inputs()
        assert [i.name for i in inputs] == ["input_ids", *(f"past_key_values.{i}.{kv}" for i in range(layers)
                                                           for kv in ("key", "value"))]
        # prefill the first 5 tokens, then decode the rest over the cache they made
        feed = {"input_ids": ids[:, :5].numpy()}
        for i in inputs[1:]:
            feed[i.name] = np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), np.float32)
        names = [o.name for o in session.get_outputs()]
        prefill = dict(zip(names, session.run(None, feed), strict=True))
        feed = {"input_ids": ids[:, 5:].numpy(),
                **{i.name: prefill[i.name.replace("past_key_values", "present")] for i in inputs[1:]}}
        decode = dict(zip(names, session.run(None, feed), strict=True))
        logits = np.concatenate([prefill["logits"], decode["logits"]], axis=1)
        assert np.abs(expected).max() > 1.0
        np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
        results.append(decode)
    for name, value in results[-1].items():
        np.testing.assert_allclose(results[0][name], value, atol=1e-5, rtol=0, err_msg=name)


@pytest.mark.parametrize(("signatures", "traced"), [
    (["a", "a", "a"], 1),
    (["dense", "moe", "moe", "moe"], 2),
    (["sliding", "full", "sliding", "full"], 2),
    (["a", "b", "a", "c"], None),  # the last kind is nowhere before it
    (["a", "b"], None),  # nothing to copy
    (["a"], None),
])
def test_the_trace_holds_the_shortest_prefix_with_every_later_layers_kind(signatures, traced) -> None:
    assert stamping.traced_prefix(signatures) == traced


def test_layers_differ_by_their_modules_and_their_window() -> None:
    import dataclasses

    from moedeploy.models.config import PRESETS

    config = dataclasses.replace(PRESETS["tiny"], n_layers=4, dense_layers=[1], sliding_window=8, sliding_layers=[2])
    a, dense, sliding, b = stamping.layer_signatures(config)
    assert a == b
    assert len({a, dense, sliding}) == 3
