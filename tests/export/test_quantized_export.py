"""Weight-only int8/int4 export of a sharded Hugging Face Mixtral checkpoint, against transformers'
own model with the same weights quantized and dequantized by hand (blockquant, itself checked
against llama.cpp's quantizers and ONNX's reference DequantizeLinear): the portable artifact on
plain ONNX Runtime (standard DequantizeLinear), its MatMulNBits lowering on every attention path,
greedy tokens, and the bytes on disk against the arithmetic of the format."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from typer.testing import CliRunner

from moedeploy.export import export
from moedeploy.export.artifact import MODEL_DATA_FILE, Artifact
from moedeploy.models.blockquant import QuantScheme, quantize
from moedeploy.runtime.generation import OrtDecoder
from moedeploy.runtime.ort import create_session
from tests.export.artifacts import ArtifactStore, rewrite_manifest

from ..models.helpers import tiny_mixtral
from ..onnx_helpers import external_initializer_bytes
from .moe_nbits_check import assert_plugin_matches_artifact

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# hidden 64 = 2 blocks of 32 per row; the experts' 96 = 3 (an odd count: 4-bit zero points repacked)
SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
SCHEMES = {"int8": QuantScheme(8, 32), "int4": QuantScheme(4, 32), "int4-asym-16": QuantScheme(4, 16, False)}
MIXED = {"int4"}  # exported mixed (the default): the LM head and K/V at int8; the others uniform
# the LM head's blocks by default: an int8 head (int8, mixed int4) in the largest power of two up to
# 256 that divides hidden 64, i.e. whole rows; an int4 head in the scheme's
HEAD_BLOCKS = {"int8": 64, "int4": 64, "int4-asym-16": 16}
QUANTIZED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "lm_head.weight",
             "experts.gate_up_proj", "experts.down_proj")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "mixtral"
    tiny_mixtral(seed=5, **SHAPE).save_pretrained(folder, max_shard_size="60KB")  # several shards
    return folder


@pytest.fixture(scope="module")
def artifacts(checkpoint, tmp_path_factory) -> dict[str, Artifact]:
    root = tmp_path_factory.mktemp("quantized")
    return {name: export("decoder", root / name, checkpoint=checkpoint, quantization=scheme, mixed=name in MIXED)
            for name, scheme in SCHEMES.items()}


def hf_dequantized(checkpoint: Path, scheme: QuantScheme, mixed: bool = False, head_block: int | None = None):
    """transformers' Mixtral from the checkpoint, its Linear and expert weights replaced by their
    dequantized values (router, norms and embeddings as they are); mixed int4: the LM head and
    K/V projections at int8; the LM head in blocks of `head_block` (default the scheme's)."""
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager",
                                               experts_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(QUANTIZED):  # (out, in) weights, blocks along in: gate_up's row order is irrelevant
                eight = mixed and name.endswith(("lm_head.weight", "k_proj.weight", "v_proj.weight"))
                block = (head_block or scheme.block_size) if name == "lm_head.weight" else scheme.block_size
                p.copy_(quantize(p, QuantScheme(8 if eight else scheme.bits, block, scheme.symmetric)).dequantize())
    return model


def hf_for(checkpoint: Path, name: str):
    """hf_dequantized for the artifact `name` of the `artifacts` fixture, as it was exported."""
    return hf_dequantized(checkpoint, SCHEMES[name], name in MIXED, HEAD_BLOCKS[name])


def prompt(n: int = 9) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (2, n), generator=torch.Generator().manual_seed(1))


def prefill_feed(artifact: Artifact, ids: torch.Tensor) -> dict[str, np.ndarray]:
    """The artifact graph's inputs for a prefill of `ids`: the ids and an empty past per layer,
    (batch, heads, 0, features) as the graph declares them (any family's cache layout)."""
    graph_inputs = onnx.load(str(artifact.model_path), load_external_data=False).graph.input
    feed = {"input_ids": ids.numpy()}
    for value in graph_inputs[1:]:
        dims = value.type.tensor_type.shape.dim
        feed[value.name] = np.zeros((ids.shape[0], dims[1].dim_value, 0, dims[3].dim_value), np.float32)
    return feed


@pytest.mark.parametrize("name", SCHEMES)
def test_portable_artifact_on_plain_onnxruntime_equals_transformers_dequantized(name, artifacts, checkpoint) -> None:
    """No lowering: ONNX Runtime runs the DequantizeLinear nodes and the custom ops' function bodies."""
    artifact = artifacts[name]
    model = onnx.load(str(artifact.model_path), load_external_data=False)
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 2 * 4 + 1 + 2 * 2  # q, k, v, o per layer, the LM head, gate/up and down per layer
    session = ort.InferenceSession(str(artifact.model_path), providers=["CPUExecutionProvider"])
    ids = prompt()
    logits = session.run(["logits"], prefill_feed(artifact, ids))[0]
    with torch.no_grad():
        expected = hf_for(checkpoint, name)(ids).logits.numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("attention", ["graph", "gqa"])
def test_matmul_nbits_lowering_generates_transformers_tokens(name, attention, artifacts, checkpoint) -> None:
    artifact = artifacts[name]
    decoder = OrtDecoder(artifact, threads=2, attention_lowering=attention, logits="last",
                         kv_cache="inplace" if attention == "gqa" else "copy")
    # every Linear (4 per layer and the LM head) on MatMulNBits; int4 experts on QMoE, int8 ones
    # (at level 0, where QMoE has no float kernel for them) with each expert's matmuls in its If
    assert decoder.lowering["matmul_nbits"] == 9
    # with GroupQueryAttention, a layer's q, k and v (one input) go on one MatMulNBits where their
    # bits agree (the mixed int4 keeps q at int4, k and v at int8: those two), handed to it packed
    fused_per_layer = 1 if name in MIXED else 2
    assert decoder.lowering["matmul_nbits_fused"] == (2 * fused_per_layer if attention == "gqa" else 0)
    assert decoder.lowering["packed_qkv"] == (2 if attention == "gqa" and name not in MIXED else 0)
    int4 = SCHEMES[name].bits == 4
    assert (decoder.lowering["moe_qmoe"], decoder.lowering["moe_experts"]) == ((2, 0) if int4 else (0, 2))
    hf = hf_for(checkpoint, name)
    ids = prompt()
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                               pad_token_id=SHAPE["vocab_size"] - 1)
        first = hf(ids).logits[:, -1]
    np.testing.assert_array_equal(decoder.generate(ids, max_new_tokens=16).numpy(), expected.numpy())
    decoder.reset(2, ids.shape[1])
    np.testing.assert_allclose(decoder.step(ids, 0)[:, -1].numpy(), first.numpy(), rtol=1e-4, atol=1e-4)


def test_compare_passes_every_lowering_against_the_dequantized_eager_model(artifacts) -> None:
    from moedeploy.cli import app

    result = CliRunner().invoke(app, ["compare", str(artifacts["int4"].path), "--backend", "ort,ort-gqa,ort-contrib"])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output
    # what the quantization section measured, by hand for SHAPE's mixed int4: q and o (2 layers)
    # and gate, up, down (2 layers) at int4; k and v at int8; the LM head at int8 in whole rows of 64
    assert ("int4 (the narrowest bit width; int4 in blocks of 32: 10 tensors; int8 in blocks of 32: 4 tensors; "
            "int8 in blocks of 64: the LM head)") in " ".join(result.output.split())


def test_quantized_bytes_are_the_formats_arithmetic(artifacts) -> None:
    """codes bits/8 per weight, one fp32 scale per block and, asymmetric only, one zero point
    (bits/8 byte) per block, for the quantized tensors; the rest in fp32. Hand-counted for SHAPE."""
    h, i, e, v, layers = 64, 96, 4, 96, 2
    linear = layers * (h * h + 2 * (h // 2) * h + h * h) + v * h  # q, k, v (2 KV heads of 16), o; LM head
    experts = layers * e * (2 * i * h + h * i)
    quantized = linear + experts
    kept = v * h + layers * (e * h + 2 * h) + h  # embedding, router, two norms per layer, final norm
    eight_in_mixed = v * h + layers * 2 * (h // 2) * h  # the LM head and K/V
    head = v * h
    for name, scheme in SCHEMES.items():
        blocks = (quantized - head) // scheme.block_size + head // HEAD_BLOCKS[name]
        zero_point_bits = 0 if scheme.symmetric else scheme.bits  # signed codes have none
        ideal = quantized * scheme.bits / 8 + blocks * 4 + blocks * zero_point_bits / 8 + kept * 4
        if name in MIXED:  # those at 8 bits: 4 more bits per weight (symmetric: no zero points)
            ideal += eight_in_mixed * 4 / 8
        model = onnx.load(str(artifacts[name].model_path), load_external_data=False)
        stored = sum(int(next(e.value for e in t.external_data if e.key == "length")) for t in model.graph.initializer
                     if t.data_location == onnx.TensorProto.EXTERNAL)
        # the 4-bit zero points of an odd number of values round up to a byte: a few bytes at most
        assert ideal <= stored <= ideal + 16, (name, stored, ideal)
        assert (artifacts[name].path / MODEL_DATA_FILE).stat().st_size < stored + 128 * 2**16  # + alignment


def test_the_manifest_records_the_scheme_and_each_tensors_bits(artifacts) -> None:
    q = artifacts["int4-asym-16"].manifest["quantization"]
    assert (q["bits"], q["block_size"], q["symmetric"], q["mixed"]) == (4, 16, False, False)
    assert q["weights"] == {"linear": 9, "experts": 4}
    assert "layers.0.ffn.router.weight" not in q["tensors"] and "embed.weight" not in q["tensors"]
    assert {q["tensors"][n] for n in ("lm_head.weight", "layers.1.attn.wq.weight", "layers.0.ffn.w_gate",
                                      "layers.0.ffn.w_down")} == {4}
    mixed = artifacts["int4"].manifest["quantization"]
    assert mixed["mixed"] and mixed["tensors"]["lm_head.weight"] == 8 and mixed["tensors"]["layers.1.attn.wv.weight"] == 8
    assert mixed["tensors"]["layers.1.attn.wq.weight"] == 4 and mixed["tensors"]["layers.1.ffn.w_up"] == 4
    # the blocks that differ from the scheme's: the int8 LM head's (whole rows of 64), none for an int4 head
    assert mixed["block_sizes"] == {"lm_head.weight": 64} and q["block_sizes"] == {}
    assert artifacts["int8"].manifest["quantization"]["block_sizes"] == {"lm_head.weight": 64}


def test_bad_quantize_options_fail_in_one_line_before_any_work(tmp_path) -> None:
    from moedeploy.cli import app

    runner = CliRunner()
    cases = [
        (["export", "decoder", "--quantize", "int3"], "--quantize 'int3': choose int8 or int4"),
        (["export", "decoder", "--quantize", "int4", "--block-size", "24"], "must be a power of two"),
        (["export", "decoder", "--block-size", "64"], "--block-size applies with --quantize int8|int4 only"),
        (["export", "decoder", "--quantize", "int8", "--uniform"], "--mixed/--uniform applies with --quantize int4 only"),
        (["export", "rmsnorm", "--quantize", "int8"], "--quantize applies to the decoder only"),
        (["export", "decoder", "--quantize", "int4", "--block-size", "128"],
         "weight layers.0.attn.wq.weight: its input dimension 64 is not a multiple of --block-size 128; "
         "choose 16 or 32"),  # 64 would fit this weight, not the experts' 96
        (["export", "decoder", "--quantize", "int8", "--block-size", "64"],  # tiny's experts: 96 wide
         "weight layers.0.ffn.w_down: its input dimension 96 is not a multiple of --block-size 64; choose 16 or 32"),
        (["export", "decoder", "--head-block-size", "64"], "--head-block-size applies with --quantize int8|int4 only"),
        (["export", "decoder", "--quantize", "int8", "--head-block-size", "48"],
         "--head-block-size: block size 48 must be a power of two"),
        (["export", "decoder", "--quantize", "int8", "--head-block-size", "128"],
         "weight lm_head.weight: its input dimension 64 is not a multiple of --head-block-size 128"),
    ]
    for args, message in cases:
        out = tmp_path / "out"
        result = runner.invoke(app, [*args, "--out", str(out)])
        assert result.exit_code == 1, result.output
        assert message in result.output and "Traceback" not in result.output
        assert "tracing" not in result.output  # a block size that cannot fit is refused before the trace
        assert not out.exists()  # nothing half-written


def test_head_block_default_is_the_largest_power_of_two_up_to_256_dividing_an_int8_heads_rows() -> None:
    from moedeploy.export.quantize import head_block

    assert head_block(32, 8, 4096) == 256  # Mixtral, Qwen3-MoE: 4096 = 16 x 256
    assert head_block(32, 8, 2880) == 64  # gpt-oss: 2880 = 64 x 45
    assert head_block(32, 8, 64) == 64 and head_block(16, 8, 48) == 16  # 48 = 16 x 3
    assert head_block(512, 8, 4096) == 512  # never below --block-size
    assert head_block(32, 4, 4096) == 32  # an int4 head keeps --block-size
    assert head_block(32, 8, 4096, head_block_size=16) == 16  # asked for: as asked


def test_a_malformed_quantization_section_is_refused_by_name() -> None:
    from moedeploy.export.quantize import QuantizeError, manifest_formats

    good = {"block_size": 32, "symmetric": True, "tensors": {"lm_head.weight": 8, "layers.0.ffn.w_up": 4}}
    assert manifest_formats(good) == {"lm_head.weight": QuantScheme(8, 32), "layers.0.ffn.w_up": QuantScheme(4, 32)}
    assert manifest_formats(good | {"block_sizes": {"lm_head.weight": 256}})["lm_head.weight"] == QuantScheme(8, 256)
    for bad in ({"block_sizes": {"lm_head.weight": "256"}}, {"block_sizes": {"lm_head.weight": 24}},
                {"block_sizes": [256]}, {"tensors": {"lm_head.weight": 3}}):
        with pytest.raises(QuantizeError, match=r"malformed at 'lm_head\.weight'"):
            manifest_formats(good | bad)


def _edited(artifact: Artifact, folder: Path, edit) -> Path:
    """A copy of `artifact` whose manifest.json went through `edit(manifest)`."""
    import json
    import shutil

    shutil.copytree(artifact.path, folder, ignore=shutil.ignore_patterns("report", "cache"))
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    rewrite_manifest(folder, manifest)  # sealed again: what is tested is the quantization section's own check
    return folder


def _set(path: tuple[str, ...], value):
    """An edit that sets manifest[path[0]][path[1]]... to `value`."""
    def edit(manifest):
        *parents, key = path
        node = manifest
        for part in parents:
            node = node[part]
        node[key] = value
    return edit


def _delete(path: tuple[str, ...]):
    def edit(manifest):
        *parents, key = path
        node = manifest
        for part in parents:
            node = node[part]
        del node[key]
    return edit


@pytest.mark.parametrize(("edit", "message"), [
    (_set(("quantization", "tensors", "lm_head.weight"), 4), "holds a quantization section other than the one model.onnx "
                                                     "was exported with (the manifest was edited)"),
    (_set(("quantization", "block_sizes"), {}), "holds a quantization section other than the one"),
    (_set(("quantization", "symmetric"), False), "holds a quantization section other than the one"),
    (_delete(("quantization",)), "lost the quantization section model.onnx was exported with"),
    (_delete(("quantization", "block_size")), "quantization.block_size is missing, not a power of two >= 16"),
    (_delete(("quantization", "tensors")), "quantization.tensors is missing, not an object of tensor names to bits"),
    (_set(("quantization",), "int8"), "quantization is 'int8', not an object"),
    (_set(("quantization", "bits"), 3), "quantization.bits is 3, not 4 or 8"),
    (_set(("quantization", "symmetric"), "no"), "quantization.symmetric is 'no', not true or false"),
    (_set(("quantization", "mixed"), True), "quantization.mixed is true, but only int4 exports are mixed"),
    (_set(("quantization", "tensors", "nonexistent.weight"), 8), "holds a quantization section other than the one"),
    (_set(("quantization", "block_sizes"), None), "quantization.block_sizes is None, not an object"),
    (_set(("quantization", "block_sizes", "ghost"), 64), "quantization.block_sizes names 'ghost', which quantization.tensors"),
])
def test_an_edited_quantization_section_is_refused_at_load_in_one_line(artifacts, tmp_path, edit, message) -> None:
    """The manifest holds the files' hashes, so nothing hashes it: model.onnx records the digest
    of the quantization section it was exported with, and the section's schema is checked, so an
    edit is refused by every command that loads the artifact instead of changing what it reads."""
    from moedeploy.export.artifact import ArtifactError

    folder = _edited(artifacts["int8"], tmp_path / "edited", edit)
    with pytest.raises(ArtifactError, match="re-export the artifact") as e:
        Artifact.load(folder)
    assert message in str(e.value) and "\n" not in str(e.value)


def _without_digest(artifact: Artifact, folder: Path) -> Path:
    """A copy of `artifact` as an export from before the quantization digest made it: model.onnx
    without the metadata entry, its sha256 in the manifest updated."""
    import json
    import shutil

    from moedeploy.export.artifact import QUANTIZATION_DIGEST_KEY, sha256

    shutil.copytree(artifact.path, folder, ignore=shutil.ignore_patterns("report", "cache"))
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    kept = [(p.key, p.value) for p in model.metadata_props if p.key != QUANTIZATION_DIGEST_KEY]
    assert len(kept) == len(model.metadata_props) - 1
    del model.metadata_props[:]
    for key, value in kept:
        model.metadata_props.add(key=key, value=value)
    onnx.save_model(model, str(folder / "model.onnx"))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["model.onnx"] = sha256(folder / "model.onnx")
    rewrite_manifest(folder, manifest)
    return folder


def test_an_older_artifact_without_the_digest_is_checked_against_its_graphs_formats(artifacts, tmp_path) -> None:
    """Before the digest, the graph still says what it stores: each DequantizeLinear's codes type
    and block size. An older artifact is read while its section lists those formats exactly."""
    from moedeploy.export.artifact import ArtifactError

    old = _without_digest(artifacts["int8"], tmp_path / "old")
    assert Artifact.load(old).manifest["quantization"]["bits"] == 8  # untouched: read as before
    cases = [(_set(("quantization", "tensors", "lm_head.weight"), 4),
              "lists int4 in blocks of 64, int8 in blocks of 32, but model.onnx stores int8 in blocks of 32, int8 in "
              "blocks of 64 (the manifest was edited)"),
             (_delete(("quantization",)), "has no quantization section, but model.onnx stores int8 in blocks of 32"),
             (_set(("quantization", "block_sizes"), {}), "lists int8 in blocks of 32, but model.onnx stores")]
    for i, (edit, message) in enumerate(cases):
        folder = _edited(Artifact.load(old), tmp_path / f"edited{i}", edit)
        with pytest.raises(ArtifactError, match="re-export the artifact") as e:
            Artifact.load(folder)
        assert message in str(e.value), str(e.value)


def test_a_manifest_forged_with_its_digest_is_still_held_to_the_graphs_formats(artifacts, tmp_path) -> None:
    """A section edited (the LM head claimed int4 over its int8 codes) with the digest in
    model.onnx rewritten to match passed the digest check, and bench labelled and rooflined the
    artifact by the forged section. The graph's own formats are checked whatever the digest says."""
    import json

    from moedeploy.export.artifact import (
        QUANTIZATION_DIGEST_KEY,
        ArtifactError,
        section_digest,
        sha256,
    )

    folder = _edited(artifacts["int8"], tmp_path / "forged", _set(("quantization", "tensors", "lm_head.weight"), 4))
    manifest = json.loads((folder / "manifest.json").read_text())
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    entry = next(p for p in model.metadata_props if p.key == QUANTIZATION_DIGEST_KEY)
    entry.value = section_digest(manifest["quantization"])
    onnx.save_model(model, str(folder / "model.onnx"))
    manifest["files"]["model.onnx"] = sha256(folder / "model.onnx")
    rewrite_manifest(folder, manifest)
    with pytest.raises(ArtifactError, match="re-export the artifact") as e:
        Artifact.load(folder)
    assert "lists int4 in blocks of 64, int8 in blocks of 32, but model.onnx stores int8 in blocks of 32, int8 in " \
           "blocks of 64 (the manifest was edited)" in str(e.value), str(e.value)


def test_a_quantization_section_added_to_a_float_artifact_is_refused(tmp_path, tmp_path_factory) -> None:
    from moedeploy.export.artifact import ArtifactError

    fp32 = ArtifactStore.for_session(tmp_path_factory).decoder("fp32")  # only read: edited in a copy
    folder = _edited(fp32, tmp_path / "edited", _set(("quantization",), {
        "format": 2, "bits": 8, "block_size": 32, "symmetric": True, "mixed": False, "tensors": {"lm_head.weight": 8}}))
    with pytest.raises(ArtifactError, match=r"has a quantization section but model\.onnx reads no quantized weight"):
        Artifact.load(folder)


def test_an_asked_head_block_size_is_what_the_artifact_computes(checkpoint, tmp_path) -> None:
    """--head-block-size 16 on int8: the LM head in blocks of 16, the rest in 32, recorded in the
    manifest, and the artifact equals transformers with exactly those blocks dequantized."""
    artifact = export("decoder", tmp_path / "int8-h16", checkpoint=checkpoint, quantization=SCHEMES["int8"],
                      head_block_size=16, golden=False)
    q = artifact.manifest["quantization"]
    assert q["block_size"] == 32 and q["block_sizes"] == {"lm_head.weight": 16}
    model = onnx.load(str(artifact.model_path), load_external_data=False)
    head_dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and "lm_head" in n.input[0])
    assert next(a.i for a in head_dq.attribute if a.name == "block_size") == 16
    session = ort.InferenceSession(str(artifact.model_path), providers=["CPUExecutionProvider"])
    ids = prompt()
    logits = session.run(["logits"], prefill_feed(artifact, ids))[0]
    with torch.no_grad():
        expected = hf_dequantized(checkpoint, SCHEMES["int8"], head_block=16)(ids).logits.numpy()
        other = hf_dequantized(checkpoint, SCHEMES["int8"], head_block=64)(ids).logits.numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
    assert np.abs(other - expected).max() > 1e-3  # the head's blocks are seen at this tolerance
    # four blocks a row through both lowerings: MatMulNBits (float compute) ...
    decoder = OrtDecoder(artifact)
    decoder.reset(2, ids.shape[1])
    np.testing.assert_allclose(decoder.step(ids, 0).numpy(), expected, rtol=1e-4, atol=1e-4)
    # ... and TensorRT's per-channel view, (96 x 64 / 16, 16) rows, run by ONNX Runtime
    from moedeploy.runtime.tensorrt_lowering import lower_for_tensorrt

    lowered, _ = lower_for_tensorrt(model, experts_on_codes=False)
    head_view = next(n for n in lowered.graph.node if n.op_type == "DequantizeLinear" and "lm_head" in n.input[0])
    assert list(next(i for i in lowered.graph.initializer if i.name == head_view.input[0]).dims) == [96 * 64 // 16, 16]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # (README: ORT's per-axis INT8)
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(artifact.path))
    session = ort.InferenceSession(lowered.SerializeToString(), options, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(["logits"], prefill_feed(artifact, ids))[0], expected, rtol=1e-4, atol=1e-4)


def test_a_checkpoint_with_a_nan_weight_is_refused_in_one_line_and_nothing_is_written(tmp_path) -> None:
    """No scale represents NaN: int4's searched scale would have made the block zeros silently. The
    export's pass over the weights names it before quantizing (the quantizer refuses it too:
    tests/models/test_blockquant.py)."""
    from moedeploy.cli import app

    model = tiny_mixtral(seed=5, **SHAPE)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[3, 7] = float("nan")
    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["export", "decoder", "--checkpoint", str(tmp_path / "ckpt"), "--quantize", "int4",
                                      "--no-golden", "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert "weight layers.1.attn.wo.weight (stored as model.layers.1.self_attn.o_proj.weight, in model.safetensors) " \
        "holds 1 NaN and 0 infinite values" in " ".join(result.output.split())
    assert "Traceback" not in result.output and not out.exists()


def test_an_unquantized_session_is_unchanged_by_the_lowering(tmp_path_factory) -> None:
    """The fp32 artifact lowers exactly as before: no MatMulNBits."""
    artifact = ArtifactStore.for_session(tmp_path_factory).decoder("fp32")
    assert create_session(artifact).lowering["matmul_nbits"] == 0


def test_bench_times_a_quantized_artifact_beside_its_dequantized_eager_twin(artifacts) -> None:
    """bench's torch backend on a quantized artifact runs the dequantized weights: the same greedy
    tokens here, reported as a quantized export's are (ONNX Runtime's int8 activations may round
    a token apart, which is no reason for bench's warning about backends of the same weights)."""
    from moedeploy.bench.api import bench

    artifact = artifacts["int4"]
    report = bench(str(artifact.path), ["torch", "ort"], prompt_len=8, new_tokens=4, repeat=1)
    assert not [r for r in report["raw"] if "error" in r], report["raw"]
    assert report["greedy_tokens_agree"] is None and report["quantized_tokens_agree"] == {"int4": True}
    # the memory ratio is against the quantized weights' bytes, not the data file's size (its
    # tensors are aligned for mapping)
    stored = external_initializer_bytes(artifact.model_path)
    assert report["roofline"]["weight_bytes"] == stored < (artifact.path / MODEL_DATA_FILE).stat().st_size
    # an int4 artifact given by its folder is called int4, not by its activations' dtype
    assert list(report["variants"]) == ["int4"] and {r["variant"] for r in report["raw"]} == {"int4"}
    # eager torch reads the dequantized fp32 weights: its bound is theirs, ONNX Runtime's the codes'
    from moedeploy.bench.roofline import decode_step_bytes, decode_step_flops
    from moedeploy.models import DecoderConfig

    config = DecoderConfig.from_manifest(artifact.manifest["config"])
    context = 8 + 4 // 2
    flops = decode_step_flops(config, 1, context)
    rows = {r["backend"]: r for r in report["raw"]}
    for backend, step_bytes in (("torch", decode_step_bytes(config, 1, context, 4, None)),
                                ("ort", report["variants"]["int4"]["decode_step_bytes"])):
        bound = 1 / max(step_bytes / (rows[backend]["bandwidth_gbs"] * 1e9),
                        flops / (report["machine"]["gemm_gflops"] * 1e9))
        assert rows[backend]["decode_bound_tokens_per_s"] == pytest.approx(bound, rel=1e-9), backend
    assert report["variants"]["int4"]["decode_step_bytes"] < decode_step_bytes(config, 1, context, 4, None) / 3


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_int8_activations_stay_close_to_the_float_computation(name, artifacts, checkpoint) -> None:
    """nbits_accuracy=4 (what bench times) quantizes the activations to int8 per block: not the
    dequantized graph to rounding, so it is held to distribution thresholds against transformers."""
    hf = hf_for(checkpoint, name)
    ids = prompt(24)
    with torch.no_grad():
        expected = hf(ids).logits.double()
    decoder = OrtDecoder(artifacts[name], nbits_accuracy=4)
    assert decoder.lowering["matmul_nbits"] == 9
    decoder.reset(2, ids.shape[1])
    got = decoder.step(ids, 0).double()
    kl = (expected.softmax(-1) * (expected.log_softmax(-1) - got.log_softmax(-1))).sum(-1)
    # measured here: KL mean 2.1e-4 / 2.4e-4, max 9e-4 / 6e-4, max error 0.12 / 0.10 of logits with std 1.06,
    # top-1 0.98 (int8 / int4): thresholds with room, far below what a broken kernel gives
    assert float(kl.mean()) < 1e-3 and float(kl.max()) < 5e-3
    assert float((expected - got).abs().max()) < 0.25 * float(expected.std())
    assert float((expected.argmax(-1) == got.argmax(-1)).double().mean()) >= 0.9


def test_an_unknown_accuracy_level_is_refused(artifacts) -> None:
    from moedeploy.runtime.lowering import LoweringError

    with pytest.raises(LoweringError, match="invalid MatMulNBits accuracy level 2; choose one of"):
        create_session(artifacts["int8"], nbits_accuracy=2)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_shared_experts_dense_layers_and_latent_attention_quantize_and_compare_exactly(family, tmp_path) -> None:
    """A shared expert's projections reach the graph as transB Gemms, not MatMuls: quantized and
    lowered too (DeepSeek: latent attention's projections, a dense first layer, a shared expert).
    For TensorRT every MoE layer's experts go on their codes, and compute what the artifact does
    (DeepSeek-V3: sigmoid scores, groups, a selection bias, scaling)."""
    from moedeploy.compare.api import compare
    from moedeploy.runtime.tensorrt_lowering import lower_for_tensorrt

    from ..families.cases import _family_config, make_model, save_checkpoint

    shape = dict(hidden_size=64, num_attention_heads=4, moe_intermediate_size=32, intermediate_size=64,
                 num_experts_per_tok=2)
    if family == "qwen2_moe":
        config = _family_config(family, 2, **shape, num_key_value_heads=2, head_dim=16,
                                shared_expert_intermediate_size=32, num_experts=4)
        linears = 2 * (4 + 3) + 1  # q, k, v, o and the shared expert's three per layer; the LM head
    else:
        config = _family_config(family, 2, **shape, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                                qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4, n_group=2, topk_group=1,
                                first_k_dense_replace=1, n_shared_experts=1)
        linears = 15  # per layer q_a, q_b, kv_a, o; the dense layer's three, the shared expert's three; the LM head
    checkpoint = save_checkpoint(make_model(config), tmp_path / "ckpt")
    artifact = export("decoder", tmp_path / "q4", checkpoint=checkpoint, quantization=QuantScheme(4, 16))
    assert artifact.manifest["quantization"]["weights"]["linear"] == linears
    assert create_session(artifact).lowering["matmul_nbits"] == linears
    report = compare(artifact, ["ort"])
    assert report["passed"], report["comparisons"][0]["outputs"]["logits"]
    model = onnx.load(str(artifact.model_path), load_external_data=False)
    lowered, counts = lower_for_tensorrt(model)
    assert counts["moe_nodes_on_codes"] == sum(n.op_type == "MoE" for n in model.graph.node) > 0
    ids = torch.randint(0, config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    attrs = assert_plugin_matches_artifact(artifact, lowered, prefill_feed(artifact, ids))
    assert attrs["scoring"] == (b"sigmoid" if family == "deepseek_v3" else b"softmax")


#: the families' own expert shapes at sizes that quantize in blocks of 16
FAMILY_SHAPES = {
    "qwen3_moe": dict(head_dim=16, moe_intermediate_size=32, intermediate_size=64, num_experts=4),
    "olmoe": dict(intermediate_size=32, num_experts=4),
    "granitemoe": dict(intermediate_size=32, num_local_experts=4),
    "phimoe": dict(intermediate_size=32, num_local_experts=4),
    "glm4_moe": dict(head_dim=16, moe_intermediate_size=32, intermediate_size=64, n_routed_experts=8, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=4, topk_group=2),
    "minimax_m2": dict(head_dim=16, intermediate_size=32, num_local_experts=4),
    "deepseek_v2": dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                        moe_intermediate_size=32, intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
                        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=2, topk_group=1),
}


@pytest.mark.parametrize("family", list(FAMILY_SHAPES))
def test_every_familys_quantized_experts_go_on_their_codes_for_tensorrt(family, tmp_path) -> None:
    """Every MoE layer of each family's int4 export goes on its codes for TensorRT, computes what
    the artifact's moe::MoE node does (PhiMoE: sparsemixer; GLM-4-MoE and MiniMax-M2: sigmoid,
    GLM-4-MoE with groups and a shared expert; DeepSeek-V2: max group scoring), and the graph
    passes TensorRT's pre-flight check. (Mixtral, Qwen2-MoE, DeepSeek-V3, gpt-oss: above.)"""
    from moedeploy.export.preflight import check_tensorrt
    from moedeploy.runtime.tensorrt_lowering import lower_for_tensorrt

    from ..families.cases import _family_config, make_model, save_checkpoint

    config = _family_config(family, 2, hidden_size=64, num_attention_heads=4, num_experts_per_tok=2,
                            **FAMILY_SHAPES[family])
    checkpoint = save_checkpoint(make_model(config), tmp_path / "ckpt")
    artifact = export("decoder", tmp_path / "q4", checkpoint=checkpoint, quantization=QuantScheme(4, 16))
    model = onnx.load(str(artifact.model_path), load_external_data=False)
    lowered, counts = lower_for_tensorrt(model)
    assert counts["moe_nodes_on_codes"] == sum(n.op_type == "MoE" for n in model.graph.node) > 0
    ids = torch.randint(0, config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    assert_plugin_matches_artifact(artifact, lowered, prefill_feed(artifact, ids))
    report = check_tensorrt(artifact)
    assert report.ok and report.lowering["moe_nodes_on_codes"] == counts["moe_nodes_on_codes"]


def test_gpt_oss_experts_on_their_codes_keep_biases_and_the_clamped_swiglu(tmp_path) -> None:
    """gpt-oss's experts carry biases and a clamped SwiGLU (alpha 1.702, beta 1, limit 7): on their
    codes for TensorRT they compute what the artifact's moe::MoE node does, biases included."""
    from moedeploy.runtime.tensorrt_lowering import lower_for_tensorrt

    from ..families.cases import _family_config, make_model, save_checkpoint

    config = _family_config("gpt_oss", 2, hidden_size=64, num_attention_heads=4, head_dim=16, intermediate_size=32,
                            num_local_experts=4, num_experts_per_tok=2, swiglu_limit=7.0)
    checkpoint = save_checkpoint(make_model(config), tmp_path / "ckpt")
    artifact = export("decoder", tmp_path / "q4", checkpoint=checkpoint, quantization=QuantScheme(4, 16))
    lowered, counts = lower_for_tensorrt(onnx.load(str(artifact.model_path), load_external_data=False))
    assert counts["moe_nodes_on_codes"] == 2
    node = next(n for n in lowered.graph.node if n.op_type == "MoENBits")
    biases = {i.name: i for i in lowered.graph.initializer if i.name in node.input[11:14]}
    assert len(biases) == 3  # the checkpoint's expert biases, as initializers
    ids = torch.randint(0, config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    attrs = assert_plugin_matches_artifact(artifact, lowered, prefill_feed(artifact, ids))
    assert (attrs["activation_alpha"], attrs["activation_beta"], attrs["swiglu_limit"]) == pytest.approx((1.702, 1.0, 7.0))


def test_tensorrt_preflight_checks_each_dequantize_against_tensorrts_dequantize_layer(artifacts, checkpoint,
                                                                                      tmp_path) -> None:
    """TensorRT's Dequantize takes signed INT8/INT4 codes, no zero point but zeros, and blocked
    scales for INT4 only, of rank 2 (NVIDIA's operator documentation): `check --target trt` names
    each node of the graph build_engine parses (the TensorRT lowering's) that falls outside that,
    and passes the rest."""
    from moedeploy.export.preflight import check_tensorrt

    def findings(artifact) -> list[str]:
        report = check_tensorrt(artifact)
        assert {f.op for f in report.blocking} <= {"DequantizeLinear"}  # the rest of the graph parses
        assert report.op_counts["DequantizeLinear"] == 9  # the experts' 4 went to moe::MoENBits
        assert [f.op for f in report.plugins].count("moe::MoENBits") == 2
        return [f.detail for f in report.blocking]

    asymmetric = findings(artifacts["int4-asym-16"])  # unsigned codes with zero points: none parses
    assert len(asymmetric) == 9 and all("its codes are UINT4" in d for d in asymmetric)
    # signed codes parse once lowered: int8 blocks as channels, the experts on their codes
    assert findings(artifacts["int8"]) == [] and findings(artifacts["int4"]) == []
    assert check_tensorrt(artifacts["int4"]).lowering == {"moe_nodes_on_codes": 2, "int4_stacks_as_rows": 0,
                                                          "int8_blocks_as_channels": 5}
    uniform = export("decoder", tmp_path / "uniform", checkpoint=checkpoint, quantization=SCHEMES["int4"], mixed=False)
    assert findings(uniform) == []


def test_tensorrt_preflight_names_int8_blocks_and_rank_3_int4_blocks_left_as_they_are(artifacts) -> None:
    """The same rules on the graph as exported (no TensorRT lowering): what the lowering is for."""
    from moedeploy.export import preflight

    artifact = artifacts["int4"]
    model = onnx.load(str(artifact.model_path), load_external_data=False)
    ops = preflight.support_matrix()["operators"]
    ranks = preflight._ranks(model)
    types = {i.name: i.data_type for i in model.graph.initializer}
    found = [preflight._dequantize_restriction(n, ranks, ops, types) for n in model.graph.node
             if n.op_type == "DequantizeLinear"]
    assert sum(f is not None and "INT8 codes with blocked scales" in f for f in found) == 5  # LM head, K/V
    assert sum(f is not None and "blocked scales on a rank-3 tensor" in f for f in found) == 4  # gate/up, down; 2 layers
    assert found.count(None) == 4  # q and o at int4, rank 2


@pytest.mark.parametrize(("name", "expected"), [("int4", {"int4_stacks_as_rows": 4, "int8_blocks_as_channels": 5}),
                                              ("int8", {"int4_stacks_as_rows": 0, "int8_blocks_as_channels": 13})])
def test_tensorrt_lowering_views_the_same_bytes_and_computes_the_same(name, expected, artifacts) -> None:
    """int4 expert stacks become rank-2 rows, int8 blocks become per-channel rows, each with a
    Reshape back, over the same external bytes (dims changed, data untouched): ONNX Runtime gives
    the same logits for both graphs. (At ORT_ENABLE_BASIC: ONNX Runtime 1.32's MatMulNBits fusion
    miscomputes per-axis INT8 weights, README.md; the lowered graph is TensorRT's, not ORT's.)
    The experts stay on moe::MoE here (ONNX Runtime has no moe::MoENBits): the fallback for
    stacks the plugin cannot take, checked on graphs ONNX Runtime runs."""
    from moedeploy.runtime.tensorrt_lowering import lower_for_tensorrt

    artifact = artifacts[name]
    model = onnx.load(str(artifact.model_path), load_external_data=False)
    lowered, counts = lower_for_tensorrt(model, experts_on_codes=False)
    assert counts == {"moe_nodes_on_codes": 0, **expected}
    rewritten = [n for n in lowered.graph.node if n.op_type == "DequantizeLinear" and "/int" in n.output[0]]
    inits = {i.name: i for i in lowered.graph.initializer}
    assert len(rewritten) == sum(expected.values())
    onnx.shape_inference.infer_shapes(lowered, strict_mode=True, check_type=True)  # dims and value_info agree
    assert all(len(inits[n.input[0]].dims) == 2 and inits[n.input[0]].data_location == onnx.TensorProto.EXTERNAL
               for n in rewritten)
    feed = prefill_feed(artifact, prompt())
    outputs = []
    for graph in (model, lowered):
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(artifact.path))
        session = ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])
        outputs.append(session.run(["logits"], feed)[0])
    np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.parametrize("name", SCHEMES)
def test_tensorrt_lowering_runs_the_experts_on_their_codes(name, artifacts) -> None:
    """Each moe::MoE over dequantized stacks becomes moe::MoENBits over the artifact's own codes
    and scales (re-typed as INT8 bytes: the same external data, nothing copied), its
    DequantizeLinear and Slice nodes gone. Run the way the TensorRT plugin runs it, it gives
    ONNX Runtime's output for the artifact's moe::MoE node (`assert_plugin_matches_artifact`)."""
    from onnx import helper

    from moedeploy.plugins import moe_nbits
    from moedeploy.runtime.tensorrt_lowering import lower_for_tensorrt

    artifact = artifacts[name]
    scheme = SCHEMES[name]
    model = onnx.load(str(artifact.model_path), load_external_data=False)
    lowered, counts = lower_for_tensorrt(model)
    assert counts["moe_nodes_on_codes"] == SHAPE["num_hidden_layers"] and counts["int4_stacks_as_rows"] == 0
    onnx.shape_inference.infer_shapes(lowered, strict_mode=True, check_type=True)
    assert not any(n.op_type in ("Slice", "Constant", "MoE") for n in lowered.graph.node)
    original = {i.name: i for i in model.graph.initializer}
    inits = {i.name: i for i in lowered.graph.initializer}
    plugin_nodes = [n for n in lowered.graph.node if n.op_type == moe_nbits.OP_TYPE]
    moe_nodes = [n for n in model.graph.node if n.op_type == "MoE"]
    assert [n.name for n in plugin_nodes] == [n.name for n in moe_nodes]
    node = plugin_nodes[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert (attrs["bits"], attrs["block_size"], attrs["symmetric"], attrs["interleaved"]) == \
        (scheme.bits, scheme.block_size, int(scheme.symmetric), 1)  # the streamed export interleaves gate/up
    e, h, i = SHAPE["num_local_experts"], SHAPE["hidden_size"], SHAPE["intermediate_size"]
    for stack, rows, k in ((2, 2 * i, h), (8, h, i)):  # gate (= up), down
        codes = inits[node.input[stack]]
        assert codes.data_type == onnx.TensorProto.INT8 and list(codes.dims) == [e, rows, k * scheme.bits // 8]
        assert codes.external_data == original[codes.name].external_data  # the same bytes on disk
        assert (node.input[stack + 2] == node.input[stack]) == scheme.symmetric  # signed: no zero point
    assert node.input[2:5] == node.input[5:8]  # the gate and up inputs name one interleaved stack
    assert_plugin_matches_artifact(artifact, lowered, prefill_feed(artifact, prompt()))


def test_check_and_build_take_the_experts_dequantized_as_a_fallback(artifacts) -> None:
    """`--experts-dequantized` (for a TensorRT that refuses INT8 plugin inputs) checks and builds
    the graph with the experts left on moe::MoE behind DequantizeLinear (as rank-2 rows); the
    default puts them on their codes. Both pass the pre-flight check."""
    from moedeploy.cli import app

    runner = CliRunner()
    path = str(artifacts["int4"].path)
    on_codes = runner.invoke(app, ["check", path, "--target", "trt"])
    dequantized = runner.invoke(app, ["check", path, "--target", "trt", "--experts-dequantized"])
    assert on_codes.exit_code == dequantized.exit_code == 0, (on_codes.output, dequantized.output)
    said, said_dequantized = (" ".join(r.output.split()) for r in (on_codes, dequantized))  # unwrapped
    assert "2 moe nodes on codes" in said and "moe::MoENBits" in said
    assert "4 int4 stacks as rows" in said_dequantized and "moe::MoENBits" not in said_dequantized
    assert "--experts-dequantized" in runner.invoke(app, ["build", "--help"]).output


def test_moe_nbits_plugin_signature_matches_the_lowered_node(artifacts) -> None:
    """moe::MoENBits' tensorrt.plugin functions take the lowered node's 15 inputs, then its
    attributes in node order (plugin_namespace is the parser's), as the other plugins do; its
    autotune types cover every I/O, codes and zero points INT8."""
    import moedeploy.plugins.tensorrt_plugins as glue
    from moedeploy.plugins import moe_nbits
    from moedeploy.runtime.tensorrt_lowering import lower_for_tensorrt

    from ..plugins.test_tensorrt_glue import TAILS, _decorated

    lowered, _ = lower_for_tensorrt(onnx.load(str(artifacts["int4"].model_path), load_external_data=False))
    node = next(n for n in lowered.graph.node if n.op_type == moe_nbits.OP_TYPE)
    attributes = [a.name for a in node.attribute if a.name != "plugin_namespace"]
    assert attributes[-len(moe_nbits.ATTRIBUTES):] == list(moe_nbits.ATTRIBUTES) and len(node.input) == 15
    found = _decorated()
    for kind, tail in TAILS.items():
        assert found[("moe::MoENBits", kind)] == [*moe_nbits.INPUTS, *attributes, *tail]
    types = [t.strip() for t in glue._moe_nbits_io_types().split(",")]
    assert len(types) == len(node.input) + 1
    assert [k for k, t in zip(moe_nbits.INPUTS, types, strict=False) if t.startswith("INT8")] == \
        ["w_gate", "z_gate", "w_up", "z_up", "w_down", "z_down"]
    assert all(len(t.split("|")) == 3 for t in types)  # every position pairs the three float types by index


def test_compare_measures_quantization_against_the_float_model_as_transformers_does(artifacts, checkpoint) -> None:
    """compare's quantization section: the int4 artifact against the unquantized eager model on
    one token stream, recomputed here from transformers' float and dequantized models."""
    import torch.nn.functional as F
    from transformers import MixtralForCausalLM

    from moedeploy.compare.api import compare
    from moedeploy.compare.quantization import token_stream

    report = compare(artifacts["int4"], ["ort-gqa"], iterations=1, seed=3)
    q = report["quantization"]
    assert (q["bits"], q["stream_tokens"], q["greedy_prompt_tokens"], q["greedy_new_tokens"]) == (4, 64, 16, 48)
    assert q["thresholds"] == {"kl_mean": 0.15, "top1": 0.25} and q["passed"] and report["passed"]
    stream = token_stream(SHAPE["vocab_size"], 64, seed=3)
    float_model = MixtralForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager",
                                                     experts_implementation="eager").eval()
    quantized = hf_for(checkpoint, "int4")
    with torch.no_grad():
        p, q_log = float_model(stream).logits[0].log_softmax(-1), quantized(stream).logits[0].log_softmax(-1)
        kl = F.kl_div(q_log, p, log_target=True, reduction="none").sum(-1)
        greedy = [m.generate(stream[:, :16], attention_mask=torch.ones(1, 16, dtype=torch.long), max_new_tokens=48,
                             do_sample=False, pad_token_id=SHAPE["vocab_size"] - 1)[0, 16:] for m in (float_model, quantized)]
    top1 = float((p.argmax(-1) == q_log.argmax(-1)).double().mean())
    agreement = float((greedy[0] == greedy[1]).double().mean())
    assert kl.mean() > 1e-4  # int4 moves the distributions measurably
    for backend in ("onnxrt-gqa",):
        m = q["backends"][backend]
        assert m["kl_mean"] == pytest.approx(float(kl.mean()), rel=0.02)
        assert m["kl_max"] == pytest.approx(float(kl.max()), rel=0.02)
        assert abs(m["top1"] - top1) <= 1 / 64
        assert abs(m["greedy_agreement"] - agreement) <= 0.1
        # as served (int8 activations): its own measurement, near the format's cost but not it
        served = q["backends"][f"{backend} level 4"]
        assert served["accuracy_level"] == 4 and served["passed"]
        assert served["kl_mean"] != m["kl_mean"] and served["kl_mean"] == pytest.approx(m["kl_mean"], rel=0.5)
    md = (artifacts["int4"].path / "report" / "report.md").read_text()
    assert "## Quantization accuracy: pass" in md and "| onnxrt-gqa |" in md and "| onnxrt-gqa level 4 |" in md
    assert "Quantization accuracy" in (artifacts["int4"].path / "report" / "report.html").read_text()


def test_quantization_thresholds_judge_and_are_checked(artifacts, tmp_path_factory) -> None:
    from moedeploy.cli import app

    path = str(artifacts["int8"].path)
    result = CliRunner().invoke(app, ["compare", path, "--max-kl-mean", "0"])
    assert result.exit_code == 1 and "FAIL" in result.output  # no quantization is that exact
    assert "KL mean <= 0 and top-1 >= 0.8" in " ".join(result.output.split())
    result = CliRunner().invoke(app, ["compare", path, "--min-top1", "2"])
    assert result.exit_code == 2 and "'--min-top1': 2.0 is not a fraction of positions from 0 to 1" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(app, ["compare", path, "--max-kl-mean", "nan"])
    assert result.exit_code == 2 and "'--max-kl-mean': nan is not a finite number >= 0" in result.output
    fp32 = ArtifactStore.for_session(tmp_path_factory).decoder("fp32")  # refused before any work: only read
    result = CliRunner().invoke(app, ["compare", str(fp32.path), "--max-kl-mean", "0.5"])
    assert result.exit_code == 1 and "is not quantized (compare it without them)" in " ".join(result.output.split())


def test_a_quantized_decoder_is_never_passed_on_backends_that_cannot_measure_its_accuracy(artifacts) -> None:
    """ort-inflight (and trt) have no teacher-forced stream: with only them, the quantization section
    had no rows and passed any --max-kl-mean / --min-top1. Now refused before any work, report untouched."""
    from moedeploy.cli import app

    report = artifacts["int4"].path / "report"
    before = sorted((p.name, p.stat().st_mtime_ns) for p in report.iterdir()) if report.exists() else None
    result = CliRunner().invoke(app, ["compare", str(artifacts["int4"].path), "--backend", "ort-inflight",
                                      "--max-kl-mean", "0", "--min-top1", "1"])
    assert result.exit_code == 1 and "PASS" not in result.output and "Traceback" not in result.output
    assert "cannot measure a quantized decoder's accuracy" in " ".join(result.output.split())
    assert "--backend ort,ort-inflight" in " ".join(result.output.split())
    after = sorted((p.name, p.stat().st_mtime_ns) for p in report.iterdir()) if report.exists() else None
    assert after == before


@pytest.mark.parametrize("lowering", ["auto", "contrib"])
def test_int4_experts_leave_qmoe_where_the_runtime_refuses_it(lowering, artifacts, checkpoint, monkeypatch) -> None:
    """Where runtime/qmoe_check finds this ONNX Runtime's QMoE refusing the lowering's node (as
    1.30's did), int4 experts run per expert on MatMulNBits ("auto") or on com.microsoft::MoE over
    the dequantized weights ("contrib"): the session still loads, with the dequantized model's logits."""
    from moedeploy.runtime import qmoe_check

    monkeypatch.setattr(qmoe_check, "qmoe_refusal", lambda *args: "QMoE refused (this test)")
    decoder = OrtDecoder(artifacts["int4"], moe_lowering=lowering)
    assert decoder.lowering["moe_qmoe"] == 0
    assert decoder.lowering["moe_experts" if lowering == "auto" else "moe_contrib"] == 2
    ids = prompt()
    with torch.no_grad():
        expected = hf_for(checkpoint, "int4")(ids).logits
    decoder.reset(2, ids.shape[1])
    np.testing.assert_allclose(decoder.step(ids, 0).numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", SCHEMES)
def test_contrib_lowering_runs_quantized_experts_on_qmoe(name, artifacts, checkpoint) -> None:
    """ort-contrib hands the experts' codes, scales and zero points to com.microsoft::QMoE (the
    down stack's 3 blocks per row at block 32: 4-bit zero points repacked per row). int4 at
    level 0 computes the dequantized products; QMoE's int8 kernel has int8 activations only,
    so int8 takes QMoE at level 4 and stays on com.microsoft::MoE over the dequantized weights at 0."""
    hf = hf_for(checkpoint, name)
    ids = prompt()
    with torch.no_grad():
        expected = hf(ids).logits.double()
    bits = SCHEMES[name].bits
    exact = OrtDecoder(artifacts[name], moe_lowering="contrib")  # (int4: what "auto" picks too)
    assert exact.lowering["moe_qmoe"] == (2 if bits == 4 else 0) and exact.lowering["moe_contrib"] == 2
    exact.reset(2, ids.shape[1])
    np.testing.assert_allclose(exact.step(ids, 0).numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)
    fast = OrtDecoder(artifacts[name], moe_lowering="contrib", nbits_accuracy=4)
    assert fast.lowering["moe_qmoe"] == 2
    ids = prompt(24)
    with torch.no_grad():
        expected = hf(ids).logits.double()
    fast.reset(2, ids.shape[1])
    got = fast.step(ids, 0).double()
    kl = (expected.softmax(-1) * (expected.log_softmax(-1) - got.log_softmax(-1))).sum(-1)
    # int8 activations: distribution thresholds, as for MatMulNBits at level 4 (measured: KL mean
    # 2e-4 (int8, int4) and 1.1e-3 (asymmetric int4 in blocks of 16), top-1 0.9 to 1.0 of 48
    # positions; a wrong byte gives KL of order 1)
    assert float(kl.mean()) < 3e-3 and float((expected.argmax(-1) == got.argmax(-1)).double().mean()) >= 0.85


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_the_in_flight_decoder_runs_a_quantized_artifact_at_the_served_level(name, artifacts, checkpoint) -> None:
    """RowCacheDecoder (serve's in-flight batching) at RUN_ACCURACY, what serve passes by default:
    int8 activations, within distribution thresholds of transformers on the dequantized weights,
    with int8 experts on QMoE (it takes them at level 4 only); at its default level 0 (compare's
    in-flight check) the dequantized products to rounding."""
    from moedeploy.runtime.inflight import RowCacheDecoder
    from moedeploy.runtime.quantized import RUN_ACCURACY

    hf = hf_for(checkpoint, name)
    ids = prompt(24)
    with torch.no_grad():
        expected = hf(ids).logits[:, -1].double()
    served = RowCacheDecoder(artifacts[name], slots=2, capacity=32, nbits_accuracy=RUN_ACCURACY)
    assert served.lowered.lowering["moe_qmoe"] == 2 and served.lowered.lowering["matmul_nbits"] > 0
    got = torch.from_numpy(served.prefill(0, ids.numpy())).double()
    kl = (expected.softmax(-1) * (expected.log_softmax(-1) - got.log_softmax(-1))).sum(-1)
    assert float(kl.max()) < 5e-3 and not np.allclose(got.numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)
    exact = RowCacheDecoder(artifacts[name], slots=2, capacity=32)
    assert exact.lowered.lowering["moe_qmoe"] == (2 if name == "int4" else 0)
    np.testing.assert_allclose(exact.prefill(0, ids.numpy()), expected.numpy(), rtol=1e-4, atol=1e-4)


def test_a_mapped_session_flips_signed_codes_per_run_instead_of_holding_a_flipped_copy(artifacts) -> None:
    """prepack=False exists to share the artifact's mapped bytes between sessions: folding the
    BitwiseXor that feeds signed codes to the kernels would give each session a private copy, so
    such a session skips constant folding; it computes the same logits."""
    from moedeploy.runtime.ort import DISABLED_OPTIMIZERS

    artifact = artifacts["int4"]
    packed, mapped = create_session(artifact), create_session(artifact, prepack=False)
    assert packed.lowering["sign_flips"] > 0
    assert mapped.session.get_session_options().get_session_config_entry(DISABLED_OPTIMIZERS) == "ConstantFolding"
    assert not _skips_optimizers(packed.session)
    feed = prefill_feed(artifact, prompt())
    np.testing.assert_allclose(mapped.session.run(["logits"], feed)[0], packed.session.run(["logits"], feed)[0],
                               rtol=1e-5, atol=1e-5)
    asymmetric = create_session(artifacts["int4-asym-16"], prepack=False)  # unsigned codes: nothing to flip
    assert asymmetric.lowering["sign_flips"] == 0
    assert not _skips_optimizers(asymmetric.session)


def _skips_optimizers(session) -> bool:
    """Whether the session was told to skip any graph optimizer (reading an unset entry raises)."""
    from moedeploy.runtime.ort import DISABLED_OPTIMIZERS

    try:
        return bool(session.get_session_options().get_session_config_entry(DISABLED_OPTIMIZERS))
    except RuntimeError:
        return False


def test_a_tied_lm_heads_block_size_is_refused_before_the_trace(tmp_path) -> None:
    """A tied LM head is quantized as lm_head.weight, with --head-block-size (checked by hand in
    the manifest), so a head block that cannot divide hidden 64 is refused before the trace too."""
    from moedeploy.cli import app

    from ..families.cases import _family_config, make_model, save_checkpoint

    config = _family_config("mixtral", 2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True)
    checkpoint = save_checkpoint(make_model(config), tmp_path / "ckpt")
    result = CliRunner().invoke(app, ["export", "decoder", "--checkpoint", str(checkpoint), "--quantize", "int8",
                                      "--head-block-size", "128", "--out", str(tmp_path / "q")])
    assert result.exit_code == 1 and "tracing" not in result.output
    assert "weight lm_head.weight: its input dimension 64 is not a multiple of --head-block-size 128" in result.output
    artifact = export("decoder", tmp_path / "q", checkpoint=checkpoint, quantization=QuantScheme(8, 32), head_block_size=16)
    assert artifact.manifest["quantization"]["block_sizes"] == {"lm_head.weight": 16}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_asymmetric_codes_in_bf16_are_exported_with_a_warning(tmp_path, dtype) -> None:
    """An asymmetric bf16 artifact runs on neither ONNX Runtime's CPU provider (no bf16 kernels)
    nor TensorRT (its DequantizeLinear refuses a zero point): export says so before the work,
    and still writes it (ONNX Runtime's CUDA provider may take it; not verified here). Not said
    for asymmetric fp16/fp32."""
    from moedeploy.cli import app

    out = tmp_path / "q"
    result = CliRunner().invoke(app, ["export", "decoder", "--quantize", "int4", "--asymmetric", "--dtype", dtype,
                                      "--out", str(out), "--no-golden"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert ("warning: --asymmetric with --dtype bf16: ONNX Runtime's CPU provider has no bf16 kernels and TensorRT "
            "takes symmetric codes only, so neither runs this artifact" in said) == (dtype == "bf16")
    assert Artifact.load(out).manifest["quantization"]["symmetric"] is False
    if dtype == "bf16":  # compare's refusal offered TensorRT, which takes no zero points either
        result = CliRunner().invoke(app, ["compare", str(out)])
        said = " ".join(result.output.split())
        assert result.exit_code == 1 and "export with --dtype fp32 or fp16" in said and "trt" not in said, said
