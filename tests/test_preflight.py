"""`moedeploy check --target trt`: the pre-flight check against TensorRT's support matrix."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from moedeploy.export.artifact import MANIFEST, Artifact, sha256
from moedeploy.export.preflight import check_tensorrt, support_matrix
from tests.export.artifacts import ArtifactStore, rewrite_manifest

DERIVED = shutil.ignore_patterns("cache", "report", "engines")  # what other tests add to a shared artifact


@pytest.fixture(scope="module")
def decoder(tmp_path_factory) -> Artifact:
    """The session's tiny decoder (exported once for every test directory): only read here."""
    return ArtifactStore.for_session(tmp_path_factory).decoder("fp32")


def _replace_model(artifact: Artifact, model: onnx.ModelProto) -> None:
    """Swap the artifact's graph and re-sign it, as a (buggy) exporter would have written it: the
    manifest's inputs and outputs are the new graph's, as export takes them."""
    from moedeploy.export.artifact import io_spec

    onnx.save(model, str(artifact.model_path))
    manifest = json.loads((artifact.path / MANIFEST).read_text())
    manifest["files"]["model.onnx"] = sha256(artifact.model_path)
    manifest["inputs"], manifest["outputs"] = io_spec(model.graph.input), io_spec(model.graph.output)
    rewrite_manifest(artifact.path, manifest)


def test_support_matrix_is_the_published_one() -> None:
    matrix = support_matrix()
    ops = matrix["operators"]
    assert matrix["tensorrt_version"].startswith("10.")
    # spot checks against onnx-tensorrt docs/operators.md (TensorRT 10.16)
    assert ops["RMSNormalization"]["supported"] and ops["Attention"]["supported"]
    assert not ops["DFT"]["supported"] and not ops["BitShift"]["supported"]
    assert "4D" in ops["Attention"]["restrictions"]


def test_decoder_passes_with_every_custom_node_on_a_plugin(decoder: Artifact) -> None:
    report = check_tensorrt(decoder)
    assert report.ok, [f"{f.node}: {f.detail}" for f in report.blocking]
    model = onnx.load(str(decoder.model_path))
    custom = [n for n in model.graph.node if n.domain == "moe"]
    assert len(report.plugins) == len(custom) > 0
    assert {f.op for f in report.plugins} == {"moe::MoE", "moe::RMSNorm"}
    assert sum(report.op_counts.values()) == len(model.graph.node)


def test_unsupported_and_contrib_ops_are_reported(tmp_path: Path, tmp_path_factory) -> None:
    shared = ArtifactStore.for_session(tmp_path_factory).block("rmsnorm")
    artifact = Artifact.load(shutil.copytree(shared.path, tmp_path / "rms", ignore=DERIVED))  # a private copy to edit
    model = onnx.load(str(artifact.model_path))
    y = model.graph.output[0].name
    # append an op TensorRT 10.16 does not import, and a contrib op
    model.graph.node.append(helper.make_node("BitwiseNot", ["bits"], ["bits_out"], name="bitwise"))
    model.graph.node.append(helper.make_node("FastGelu", [y], ["fg"], domain="com.microsoft", name="contrib"))
    model.graph.input.append(helper.make_tensor_value_info("bits", TensorProto.INT32, [4]))
    model.graph.output.extend([helper.make_tensor_value_info("bits_out", TensorProto.INT32, [4]),
                               helper.make_tensor_value_info("fg", TensorProto.FLOAT, ["b", "s", 64])])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _replace_model(artifact, model)
    report = check_tensorrt(artifact.path)
    assert {f.node for f in report.blocking} == {"bitwise", "contrib"}
    done = subprocess.run([sys.executable, "-m", "moedeploy.cli", "check", str(artifact.path)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "bitwise" in done.stdout and "Traceback" not in done.stderr


def test_attention_with_two_d_mask_is_restricted(decoder: Artifact, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(decoder.path, tmp_path / "dec", ignore=DERIVED))
    model = onnx.load(str(copy / "model.onnx"))
    attention = next(n for n in model.graph.node if n.op_type == "Attention")
    mask2d = helper.make_tensor_value_info("mask2d", TensorProto.BOOL, ["seq", "past_seq"])  # dims the manifest ranges
    model.graph.input.append(mask2d)
    attention.input[3] = "mask2d"
    _replace_model(Artifact.load(copy, verify=False), model)
    report = check_tensorrt(copy)
    assert [f.verdict for f in report.blocking] == ["restricted"]
    assert "4-D" in report.blocking[0].detail


def test_check_unknown_target_is_one_line(decoder: Artifact) -> None:
    done = subprocess.run([sys.executable, "-m", "moedeploy.cli", "check", str(decoder.path), "--target", "xla"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("error:") and len(done.stderr.strip().splitlines()) == 1


def _with_hidden(decoder: Artifact, tmp_path: Path, hidden: int) -> Artifact:
    """A copy of the decoder whose manifest says `hidden` (all the note reads), re-sealed."""
    copy = Path(shutil.copytree(decoder.path, tmp_path / f"h{hidden}", ignore=DERIVED))
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["config"]["hidden_size"] = hidden
    rewrite_manifest(copy, manifest)
    return Artifact.load(copy)


def test_the_aot_moe_kernels_rereads_are_its_block_of_outputs() -> None:
    pytest.importorskip("triton")
    from moedeploy.export.preflight import AOT_MOE_BLOCK_H
    from moedeploy.plugins.kernels.moe_fused import FUSED_BLOCKS

    assert FUSED_BLOCKS["BLOCK_H"] == AOT_MOE_BLOCK_H


def test_check_notes_when_an_aot_engine_would_reread_the_experts(decoder: Artifact, tmp_path: Path) -> None:
    """The AOT plugin's one kernel reads a token's gate/up weights once per 256 outputs: 16 times at
    Mixtral's hidden 4096, where it measured 73 ms a token on an H100. `check` says so, and to build
    --jit; a model with 3 rereads or fewer (hidden 768) gets no note, nor does the tiny decoder."""
    from typer.testing import CliRunner

    from moedeploy.cli import app
    from moedeploy.export.preflight import aot_moe_note

    assert check_tensorrt(decoder).notes == []
    assert aot_moe_note(_with_hidden(decoder, tmp_path, 768)) is None
    assert "4 times at hidden size 1024" in aot_moe_note(_with_hidden(decoder, tmp_path, 1024))
    mixtral_sized = _with_hidden(decoder, tmp_path, 4096)
    result = CliRunner().invoke(app, ["check", str(mixtral_sized.path)])
    text = " ".join(result.output.split())
    assert "note: the AOT moe::MoE plugin is one fused kernel, which reads each token's gate/up expert weights " \
           "16 times at hidden size 4096 (once per 256 outputs)" in text
    assert "Build with --jit" in text
