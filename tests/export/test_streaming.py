"""Streamed decoder export (the code path of a multi-GB checkpoint, on tiny sharded ones): the
artifact's logits against transformers, its weight file against the checkpoint's tensors,
layer-by-layer eager against the model loaded whole, and no second copy of the weights."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from moedeploy.export import export
from moedeploy.export.artifact import Artifact, ArtifactError
from moedeploy.export.blocks import DECODER_TOLERANCES
from moedeploy.models import load_decoder
from moedeploy.models.checkpoint import CheckpointWeights
from moedeploy.models.weights import fingerprint, layered_decoder
from moedeploy.runtime.ort import create_session

from ..models.helpers import tiny_mixtral

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = dict(vocab_size=80, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Sharded Hugging Face checkpoints (an index and several shards), fp32 and bf16, with
    transformers' own fp32 model loaded from each folder: the reference the export must match."""
    from transformers import MixtralForCausalLM

    root = tmp_path_factory.mktemp("ckpt")
    made = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        tiny_mixtral(seed=3, **SHAPE).to(dtype).save_pretrained(root / name, max_shard_size="30KB")
        assert (root / name / "model.safetensors.index.json").is_file()
        assert len(list((root / name).glob("*.safetensors"))) > 2
        hf = MixtralForCausalLM.from_pretrained(
            root / name, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        )
        made[name] = (root / name, hf.eval())
    return made


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory) -> dict[tuple[str, str], Artifact]:
    root = tmp_path_factory.mktemp("art")
    out = {}
    for ckpt, dtype in (("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "fp16")):
        out[ckpt, dtype] = export("decoder", root / f"{ckpt}-{dtype}", checkpoint=checkpoints[ckpt][0], dtype=dtype)
    return out


def _ids() -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(4))


def _plain_ort_logits(artifact: Artifact, ids: torch.Tensor) -> np.ndarray:
    """The artifact run by a plain onnxruntime session over model.onnx (the custom ops' function bodies)."""
    session = ort.InferenceSession(str(artifact.model_path), providers=["CPUExecutionProvider"])
    dtype = np.float16 if artifact.dtype == "fp16" else np.float32
    c = artifact.manifest["config"]
    feed = {"input_ids": ids.numpy()}
    for i in session.get_inputs()[1:]:
        feed[i.name] = np.zeros((ids.shape[0], c["n_kv_heads"], 0, c["head_dim"]), dtype)
    return session.run(["logits"], feed)[0].astype(np.float32)


@pytest.mark.parametrize(("ckpt", "dtype"), [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "fp16")])
def test_streamed_artifact_matches_transformers(ckpt, dtype, checkpoints, exported) -> None:
    artifact = exported[ckpt, dtype]
    assert artifact.model_files() == ["model.onnx", "model.onnx.data"]
    ids = _ids()
    with torch.no_grad():
        expected = checkpoints[ckpt][1](ids).logits.numpy()
    assert expected.std() > 0.3  # O(1) logits: the tolerance is a real bound
    atol, rtol = DECODER_TOLERANCES[dtype]
    np.testing.assert_allclose(_plain_ort_logits(artifact, ids), expected, atol=atol, rtol=rtol)
    # one thread: one Gemm per expert on its slice of the interleaved weight as stored; two: the
    # experts cut into two pieces each, re-laid from those stacks (plugins/moe_split.py)
    lowered = create_session(artifact, threads=1)
    if dtype == "fp32":
        assert lowered.lowering["moe_experts"] == SHAPE["num_hidden_layers"]
        split = create_session(artifact, threads=2)
        assert split.lowering["moe_split"] == SHAPE["num_hidden_layers"]
    c = artifact.manifest["config"]
    feed = {"input_ids": ids.numpy().astype(np.int64)}
    for name in artifact.input_names()[1:]:
        feed[name] = np.zeros((2, c["n_kv_heads"], 0, c["head_dim"]), np.float16 if dtype == "fp16" else np.float32)
    np.testing.assert_allclose(lowered.run(feed, ["logits"])[0].astype(np.float32), expected, atol=atol, rtol=rtol)


def test_weight_file_holds_the_checkpoint_experts_interleaved(checkpoints, exported) -> None:
    """model.onnx.data holds each layer's gate and up rows alternating (what com.microsoft::MoE
    takes), read back by onnx and compared with transformers' own expert tensors."""
    artifact = exported["fp32", "fp32"]
    model = onnx.load(str(artifact.model_path))  # resolves the external data
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    hf = checkpoints["fp32"][1]
    inter = SHAPE["intermediate_size"]
    for layer in range(SHAPE["num_hidden_layers"]):
        fused = weights[f"decoder.layers.{layer}.ffn.w_gate_up"]
        assert fused.shape == (SHAPE["num_local_experts"], 2 * inter, SHAPE["hidden_size"])
        gate_up = hf.model.layers[layer].mlp.experts.gate_up_proj.detach().numpy()  # (E, 2I, H), gate rows first
        np.testing.assert_array_equal(fused[:, 0::2], gate_up[:, :inter])
        np.testing.assert_array_equal(fused[:, 1::2], gate_up[:, inter:])
        assert f"decoder.layers.{layer}.ffn.w_gate" not in weights  # stored once, not twice
    for t in onnx.load(str(artifact.model_path), load_external_data=False).graph.initializer:
        if t.name.startswith("decoder.") and t.name != "decoder.rope.inv_freq":
            assert t.data_location == onnx.TensorProto.EXTERNAL, t.name


def test_no_second_copy_of_the_weights_after_compare(exported) -> None:
    """After compare (which lowers the graph for ONNX Runtime), the weights exist once: no
    file of the artifact but model.onnx.data holds the bytes of any weight tensor."""
    from moedeploy.compare.api import compare

    artifact = exported["fp32", "fp32"]
    report = compare(artifact, backends=["ort"], iterations=2)
    assert report["passed"]
    model = onnx.load(str(artifact.model_path))
    samples = [numpy_helper.to_array(t).tobytes()[:256] for t in model.graph.initializer if t.name.startswith("decoder.")
               and numpy_helper.to_array(t).nbytes >= 1024]
    assert len(samples) >= 10
    others = [p for p in artifact.path.rglob("*") if p.is_file() and p.name != "model.onnx.data"]
    assert any(p.parent.name == "report" for p in others)
    for path in others:
        data = path.read_bytes()
        assert not any(sample in data for sample in samples), f"{path} holds a copy of a weight"


def test_layered_decoder_computes_what_the_whole_model_does(checkpoints) -> None:
    folder = checkpoints["bf16"][0]
    whole = load_decoder(folder, dtype=torch.float32)
    layered = layered_decoder(CheckpointWeights(folder), torch.float32)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(layered(ids), whole(ids))
    assert all(p.is_meta for p in layered.parameters())  # nothing stays loaded after a forward


def test_streamed_fingerprint_is_sha256_of_the_whole_state_dict(checkpoints) -> None:
    folder = checkpoints["bf16"][0]
    whole = load_decoder(folder, dtype=torch.float16)
    digest = hashlib.sha256()
    for name, tensor in whole.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    assert fingerprint(CheckpointWeights(folder), torch.float16) == digest.hexdigest()


def test_no_golden_skips_the_eager_outputs_and_compare_still_runs(checkpoints, tmp_path) -> None:
    artifact = export("decoder", tmp_path / "a", checkpoint=checkpoints["fp32"][0], golden=False)
    assert artifact.manifest["golden_outputs"] is False
    assert not (artifact.path / "golden" / "outputs.json").exists()
    assert artifact.golden_inputs()  # the inputs are still there
    with pytest.raises(ArtifactError, match="--no-golden"):
        artifact.golden_outputs()
    from moedeploy.compare.api import compare

    assert compare(artifact, backends=["ort"], iterations=1)["passed"]


def test_export_refuses_before_tracing_when_the_disk_is_too_small(checkpoints, tmp_path, monkeypatch) -> None:
    import shutil

    import moedeploy.export.exporter as exporter

    def never(*_args, **_kwargs):
        raise AssertionError("traced although the artifact cannot fit")

    free = shutil.disk_usage(tmp_path)._replace(free=1000)
    monkeypatch.setattr("moedeploy.utils.io.shutil.disk_usage", lambda _path: free)
    monkeypatch.setattr(exporter, "trace_decoder", never)
    with pytest.raises(OSError, match="not enough free space"):
        export("decoder", tmp_path / "a", checkpoint=checkpoints["fp32"][0])
    assert not (tmp_path / "a").exists()


def test_manifest_records_how_the_weights_are_laid_out(exported) -> None:
    manifest = json.loads((exported["fp32", "fp32"].path / "manifest.json").read_text())
    layers = SHAPE["num_hidden_layers"]
    # Per layer: q, k, v, o stored transposed (they feed MatMul), one interleaved expert
    # weight (gate + up), and norms, router and down copied; plus the embedding, final norm
    # and lm_head (transposed).
    assert manifest["weights_layout"] == {"transpose": 4 * layers + 1, "interleave": layers, "copy": 4 * layers + 2}


def test_run_results_keep_only_the_iterations_that_fit_the_budget(exported, monkeypatch) -> None:
    """A large model's outputs are not all saved: run_results.json keeps the first iterations
    that fit, report.json says how many, and Polygraphy still loads the file."""
    from polygraphy.comparator import RunResults

    import moedeploy.compare.api as api

    artifact = exported["fp32", "fp32"]
    report = api.compare(artifact, backends=["ort"], iterations=3)
    assert report["run_results_iterations"] == 3  # a small model keeps everything
    saved = RunResults.load(str(artifact.path / "report" / "run_results.json"))
    first = sum(v.nbytes for _, iters in saved.items() for v in iters[0].values())
    monkeypatch.setattr(api, "RUN_RESULTS_BUDGET", first)  # room for iteration 0 of both runners only
    report = api.compare(artifact, backends=["ort"], iterations=3)
    assert report["passed"] and report["run_results_iterations"] == 1
    saved = RunResults.load(str(artifact.path / "report" / "run_results.json"))
    assert [len(iters) for _, iters in saved.items()] == [1, 1]
    assert "the first 1 of 3 iterations" in (artifact.path / "report" / "report.html").read_text()


def test_bf16_checkpoint_exports_to_bf16_bit_exact(checkpoints, tmp_path) -> None:
    """bf16 in, bf16 out: every weight byte is the checkpoint's own (read back by onnx,
    compared with the safetensors shards through transformers' names)."""
    from safetensors.torch import load_file

    folder = checkpoints["bf16"][0]
    artifact = export("decoder", tmp_path / "a", checkpoint=folder, dtype="bf16", golden=False)
    stored = {}
    for shard in folder.glob("*.safetensors"):
        stored.update(load_file(str(shard)))
    weights = {t.name: t for t in onnx.load(str(artifact.model_path)).graph.initializer}

    def bits(name: str) -> np.ndarray:
        t = weights[name]
        assert t.data_type == onnx.TensorProto.BFLOAT16
        return np.frombuffer(t.raw_data, dtype=np.uint16)

    def hf_bits(tensor: torch.Tensor) -> np.ndarray:
        return tensor.contiguous().view(torch.int16).numpy().view(np.uint16).ravel()

    np.testing.assert_array_equal(bits("decoder.embed.weight"), hf_bits(stored["model.embed_tokens.weight"]))
    # q_proj is stored transposed (it feeds MatMul)
    np.testing.assert_array_equal(bits("decoder.layers.1.attn.wq.weight.T"),
                                  hf_bits(stored["model.layers.1.self_attn.q_proj.weight"].t()))
    # the experts: transformers' own fused (E, 2I, H) tensor (its fp32 copy of the bf16 values
    # is exact), gate rows interleaved with up rows
    inter = SHAPE["intermediate_size"]
    gate_up = checkpoints["bf16"][1].model.layers[1].mlp.experts.gate_up_proj.detach().to(torch.bfloat16)
    interleaved = torch.stack([gate_up[:, :inter], gate_up[:, inter:]], dim=2).reshape(gate_up.shape)
    np.testing.assert_array_equal(bits("decoder.layers.1.ffn.w_gate_up"), hf_bits(interleaved))
    assert (artifact.path / "model.onnx.data").stat().st_size >= sum(
        math.prod(weights[n].dims) * 2 for n in weights if n.startswith("decoder.") and n != "decoder.rope.inv_freq")


def test_one_expert_per_expert_checkpoint_loads_and_exports(tmp_path) -> None:
    """num_local_experts=1 in the per-expert layout: one file tensor per expert is still stacked."""
    from transformers import MixtralForCausalLM

    folder = tmp_path / "one"
    tiny_mixtral(seed=5, **{**SHAPE, "num_local_experts": 1, "num_experts_per_tok": 1}).save_pretrained(folder)
    hf = MixtralForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                            experts_implementation="eager").eval()
    ids = _ids()
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(load_decoder(folder)(ids), expected, atol=1e-4, rtol=1e-4)
    artifact = export("decoder", tmp_path / "a", checkpoint=folder, golden=False)
    np.testing.assert_allclose(_plain_ort_logits(artifact, ids), expected.numpy(), atol=1e-4, rtol=1e-4)


def test_large_2d_weights_stream_in_blocks(checkpoints, monkeypatch) -> None:
    """An embedding or LM head is read a block of rows (or, transposed, of columns) at a time,
    and the blocks put together are the tensor: same bytes as read whole."""
    import moedeploy.models.weights as weights_module
    from moedeploy.export.streaming import recipe_chunks

    source = CheckpointWeights(checkpoints["bf16"][0])
    monkeypatch.setattr(weights_module, "BLOCK_BYTES", 4 * SHAPE["hidden_size"] * 7)  # 7 rows a block
    whole = source.tensor("lm_head.weight").float()
    pieces = list(weights_module.chunks(source, "lm_head.weight", torch.float32))
    assert len(pieces) == -(-SHAPE["vocab_size"] // 7) and all(p.shape[0] <= 7 for p in pieces)
    assert torch.equal(torch.cat(pieces), whole)
    transposed = list(recipe_chunks(("transpose", ("lm_head.weight",)), source, torch.float32))
    assert len(transposed) > 1 and torch.equal(torch.cat(transposed), whole.t())


def test_layered_decoder_drops_a_layers_weights_even_when_its_forward_raises(checkpoints) -> None:
    layered = layered_decoder(CheckpointWeights(checkpoints["fp32"][0]), torch.float32)

    def fail(*_args, **_kwargs):
        raise RuntimeError("boom")

    layered.layers[1].attn.forward = fail
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        layered(_ids())
    assert all(p.is_meta for p in layered.parameters())


@pytest.mark.parametrize(("value", "dtype", "message"), [
    (float("nan"), "fp32", "1 NaN and 0 infinite"),
    (float("inf"), "fp32", "0 NaN and 1 infinite"),
    (1e5, "fp16", "past its range, ±65504 for fp16"),  # finite in the checkpoint, infinite once cast
])
def test_a_weight_that_is_not_finite_is_named_and_nothing_is_written(value, dtype, message, tmp_path) -> None:
    folder = tmp_path / "ckpt"
    model = tiny_mixtral(seed=6, **SHAPE)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[2, 3, 4] = value
    model.save_pretrained(folder)
    with pytest.raises(ValueError, match=message) as refused:
        export("decoder", tmp_path / "art", checkpoint=folder, dtype=dtype)
    # named as the checkpoint stores it too: save_pretrained writes Mixtral's experts one tensor each
    assert "weight layers.1.ffn.w_down (stored as model.layers.1.block_sparse_moe.experts.2.w2.weight, in " \
        "model.safetensors) holds" in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_config_traced_before_is_not_traced_again_and_exports_the_same_bytes(tmp_path, monkeypatch) -> None:
    """A checkpoint exported again in the same process (bench's fp32, int8 and int4 exports of one
    checkpoint) reuses its trace: torch.onnx.export runs once, and the artifact's files are
    byte-identical to the first's, after an int4 export of the same trace in between (quantizing
    changes a copy, never the remembered graph). One config field changed is another key."""
    import dataclasses

    from moedeploy.export import streaming
    from moedeploy.models.blockquant import QuantScheme

    monkeypatch.setattr(streaming, "_TRACES", type(streaming._TRACES)())
    # the trace itself, not the suite's traces shared by workers (tests/conftest.py)
    monkeypatch.setattr(streaming, "_trace", getattr(streaming._trace, "__wrapped__", streaming._trace))
    traced = []
    real_export = torch.onnx.export
    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: traced.append(1) or real_export(*a, **k))
    checkpoint = tmp_path / "checkpoint"
    tiny_mixtral(seed=3, **{**SHAPE, "intermediate_size": 32}).save_pretrained(checkpoint)
    first = export("decoder", tmp_path / "first", checkpoint=checkpoint, golden=False)
    int4 = export("decoder", tmp_path / "int4", checkpoint=checkpoint, quantization=QuantScheme(4, 16), golden=False)
    again = export("decoder", tmp_path / "again", checkpoint=checkpoint, golden=False)
    assert len(traced) == 1
    assert int4.manifest["quantization"]["weights"]["linear"] > 0
    for name in ("model.onnx", "model.onnx.data"):
        assert (again.path / name).read_bytes() == (first.path / name).read_bytes(), name

    config = CheckpointWeights(checkpoint).config
    other = dataclasses.replace(config, rope_theta=config.rope_theta * 2)
    names = CheckpointWeights(checkpoint).names()
    assert streaming.trace_key(other, torch.float32, names) != streaming.trace_key(config, torch.float32, names)
    assert streaming.trace_key(config, torch.float16, names) != streaming.trace_key(config, torch.float32, names)
    assert streaming.trace_key(config, torch.float32, names[::-1]) != streaming.trace_key(config, torch.float32, names)
