"""The decoder with its KV cache on ONNX Runtime vs eager PyTorch, prefill and decode."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
import torch

from moedeploy.export import export, export_decoder
from moedeploy.export.blocks import DECODER_TOLERANCES
from moedeploy.export.decoder import DecoderWithPast, decoder_dynamic_ranges
from moedeploy.models import MoEDecoder, RMSNorm, SparseMoE, preset
from moedeploy.runtime.ort import create_session
from tests.export.artifacts import decoder_feed, decoder_inputs, eager_decoder, plain_session

# (batch, past_len, seq): prefill (past 0), single-token decode, and mixed chunks; none is
# the trace's (2, 3, 5) or the golden's (2, 6, 4).
CASES = [(1, 0, 1), (1, 0, 17), (3, 5, 1), (5, 12, 9), (2, 30, 1)]


@pytest.fixture(scope="module")
def fp32_decoder():
    return eager_decoder("fp32")


@pytest.mark.parametrize("batch,past_len,seq", CASES)
def test_fp32_logits_and_present_match_eager(store, fp32_decoder, batch, past_len, seq) -> None:
    artifact = store.decoder("fp32")
    n_layers = artifact.manifest["config"]["n_layers"]
    ids, new_ids, past = decoder_inputs(fp32_decoder, batch, past_len, seq, seed=batch * 100 + past_len)
    with torch.no_grad():
        logits, present = DecoderWithPast(fp32_decoder)(new_ids, past)
        # Independent of any cache: a full forward over the whole sequence.
        full = fp32_decoder(ids)[:, past_len:]
    np.testing.assert_allclose(logits.numpy(), full.numpy(), rtol=1e-5, atol=1e-5)

    outputs = create_session(artifact, ["CPUExecutionProvider"]).run(decoder_feed(new_ids, past))
    ort_logits, ort_present = outputs[0], outputs[1:]
    assert ort_logits.shape == (batch, seq, 256)
    np.testing.assert_allclose(ort_logits, full.numpy(), rtol=1e-4, atol=1e-4)
    assert len(ort_present) == 2 * n_layers
    eager_present = [t for kv in present for t in kv]
    for got, want in zip(ort_present, eager_present, strict=True):
        assert got.shape == (batch, 2, past_len + seq, 16)
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    # The present cache starts with the past it was given, unchanged.
    for i, (k, v) in enumerate(past):
        np.testing.assert_array_equal(ort_present[2 * i][:, :, :past_len], k.numpy())
        np.testing.assert_array_equal(ort_present[2 * i + 1][:, :, :past_len], v.numpy())


def test_fp32_plain_session_matches_eager(store, fp32_decoder) -> None:
    """The model file as written (function bodies inlined by ORT, no lowering)."""
    artifact = store.decoder("fp32")
    ids, new_ids, past = decoder_inputs(fp32_decoder, 2, 7, 3, seed=5)
    with torch.no_grad():
        full = fp32_decoder(ids)[:, 7:]
    outputs = plain_session(artifact.model_path).run(None, decoder_feed(new_ids, past))
    np.testing.assert_allclose(outputs[0], full.numpy(), rtol=1e-4, atol=1e-4)


def test_golden_outputs_are_the_eager_decoder(store, fp32_decoder) -> None:
    artifact = store.decoder("fp32")
    (feed,) = artifact.golden_inputs()
    (golden,) = artifact.golden_outputs()
    past = [
        (torch.from_numpy(feed[f"past_key_values.{i}.key"]), torch.from_numpy(feed[f"past_key_values.{i}.value"]))
        for i in range(2)
    ]
    with torch.no_grad():
        logits, present = DecoderWithPast(fp32_decoder)(torch.from_numpy(feed["input_ids"]), past)
    np.testing.assert_allclose(golden["logits"], logits.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(golden["present.1.value"], present[1][1].numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("batch,past_len,seq", [(1, 0, 9), (3, 6, 1)])
def test_fp16_logits_match_eager_fp16(store, batch, past_len, seq) -> None:
    artifact = store.decoder("fp16")
    decoder = eager_decoder("fp16")
    _, new_ids, past = decoder_inputs(decoder, batch, past_len, seq, seed=11 + past_len)
    with torch.no_grad():
        logits, present = DecoderWithPast(decoder)(new_ids, past)
    feed = decoder_feed(new_ids, past)
    assert feed["past_key_values.0.key"].dtype == np.float16
    session = create_session(artifact, ["CPUExecutionProvider"])
    assert session.lowering["moe_contrib"] == 0 and session.lowering["moe_function"] == 2
    outputs = session.run(feed)
    assert outputs[0].dtype == np.float16
    atol, rtol = DECODER_TOLERANCES["fp16"]
    np.testing.assert_allclose(
        outputs[0].astype(np.float32), logits.float().numpy(), rtol=rtol, atol=atol
    )
    for got, want in zip(outputs[1:], [t for kv in present for t in kv], strict=True):
        np.testing.assert_allclose(got.astype(np.float32), want.float().numpy(), rtol=rtol, atol=atol)


# --- the TensorRT profile: every corner runs --------------------------------------------------


def _random_past(batch: int, past_len: int, n_layers: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Any keys and values are a valid cache for attention; shapes as the tiny preset's (2 KV heads of 16)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 2, past_len, 16, generator=g), torch.randn(batch, 2, past_len, 16, generator=g))
        for _ in range(n_layers)
    ]


def test_every_corner_of_the_profile_runs_on_ort_and_matches_eager(store, fp32_decoder) -> None:
    artifact = store.decoder("fp32")
    ranges = artifact.manifest["dynamic_ranges"]
    max_positions = artifact.manifest["config"]["max_positions"]
    # A profile is a box: its largest prompt and largest cache must fit together.
    assert ranges["seq"]["max"] + ranges["past_seq"]["max"] <= max_positions
    assert ranges["seq"]["opt"] + ranges["past_seq"]["opt"] <= max_positions
    session = create_session(artifact, ["CPUExecutionProvider"])
    corners = itertools.product(*[(ranges[d]["min"], ranges[d]["max"]) for d in ("batch", "seq", "past_seq")])
    for i, (batch, seq, past_len) in enumerate(corners):
        ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(i))
        past = _random_past(batch, past_len, 2, seed=i)
        with torch.no_grad():
            logits, _ = DecoderWithPast(fp32_decoder)(ids, past)
        (ort_logits, *_) = session.run(decoder_feed(ids, past))
        np.testing.assert_allclose(ort_logits, logits.numpy(), rtol=1e-4, atol=1e-4, err_msg=f"corner {batch, seq, past_len}")


def test_profile_positions_cap_and_max_seq_len() -> None:
    def total(ranges) -> int:
        return ranges["seq"].max + ranges["past_seq"].max

    assert total(decoder_dynamic_ranges(256)) == 256
    assert total(decoder_dynamic_ranges(131072)) == 4096  # a long-context model: a sensible default
    assert total(decoder_dynamic_ranges(131072, max_seq_len=32768)) == 32768
    assert total(decoder_dynamic_ranges(7)) == 7 and decoder_dynamic_ranges(1)["past_seq"].max == 0
    for bad in (0, 131073):
        with pytest.raises(ValueError, match=r"max_seq_len \(--max-seq-len\) must lie in \[1, max_positions=131072\]"):
            decoder_dynamic_ranges(131072, max_seq_len=bad)


def test_max_seq_len_is_checked_before_anything_is_written(tmp_path) -> None:
    with pytest.raises(ValueError, match="max_positions=256"):
        export("decoder", tmp_path / "dec", max_seq_len=1000)
    with pytest.raises(ValueError, match="decoder only"):
        export("moe", tmp_path / "moe", max_seq_len=64)
    assert list(tmp_path.iterdir()) == []


def test_long_context_checkpoint_exports_without_a_position_table(store, tmp_path) -> None:
    """max_position_embeddings=131072 once wrote a 17.9 MB RoPE table into a 1 MB model."""
    config = preset("tiny")
    config.max_positions = 131072
    torch.manual_seed(3)
    model = MoEDecoder(config).eval()
    model.save_pretrained(tmp_path / "ckpt")
    artifact = export_decoder(tmp_path / "art", checkpoint=tmp_path / "ckpt")
    short = store.decoder("fp32")  # the same shapes with max_positions 256
    size, short_size = artifact.model_path.stat().st_size, short.model_path.stat().st_size
    assert abs(size - short_size) < 0.01 * short_size, (size, short_size)

    manifest = artifact.manifest
    assert manifest["config"]["max_positions"] == 131072  # the model's own limit, recorded
    ranges = manifest["dynamic_ranges"]
    assert ranges["seq"]["max"] + ranges["past_seq"]["max"] == manifest["max_seq_len"] == 4096
    # Positions far beyond the tiny preset's 256, at the profile's largest cache.
    past_len, seq = ranges["past_seq"]["max"], 3
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(0))
    past = _random_past(1, past_len, 2, seed=1)
    with torch.no_grad():
        logits, _ = DecoderWithPast(model)(ids, past)
    (ort_logits, *_) = create_session(artifact, ["CPUExecutionProvider"]).run(decoder_feed(ids, past))
    np.testing.assert_allclose(ort_logits, logits.numpy(), rtol=1e-4, atol=1e-4)


# --- names in the graph and the manifest --------------------------------------------------------


def test_cache_length_is_spelled_one_way(store) -> None:
    artifact = store.decoder("fp32")
    graph_outputs = onnx.load(str(artifact.model_path), load_external_data=False).graph.output
    present = [o for o in graph_outputs if o.name.startswith("present.")]
    assert len(present) == 4
    for output in present:
        assert output.type.tensor_type.shape.dim[2].dim_param == "past_seq + seq", output.name
    for spec in artifact.manifest["outputs"]:
        if spec["name"].startswith("present."):
            assert spec["shape"] == ["batch", 2, "past_seq + seq", 16], spec["name"]


def test_custom_nodes_are_named_after_their_modules(store, fp32_decoder) -> None:
    model = onnx.load(str(store.decoder("fp32").model_path), load_external_data=False)
    custom = {n.name: n.op_type for n in model.graph.node if n.domain == "moe"}
    # The reference: the eager model's own module names, by the class each op comes from.
    expected = {name: "RMSNorm" for name, m in fp32_decoder.named_modules() if isinstance(m, RMSNorm)}
    expected |= {name: "MoE" for name, m in fp32_decoder.named_modules() if isinstance(m, SparseMoE)}
    assert custom == expected
    assert {"layers.0.attn_norm", "layers.1.ffn", "norm"} <= set(custom)
    names = [n.name for n in model.graph.node]
    assert len(names) == len(set(names))  # still unique in the graph
