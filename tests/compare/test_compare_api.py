"""compare() on correct exports: every comparison passes and every report says so.

The statistics in report.json are recomputed here with numpy from Polygraphy's saved
RunResults, and the runners' outputs are checked against references built independently
of the runners (numpy formulas, an eager model rebuilt here, a plain ONNX Runtime session).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from polygraphy.comparator import RunResults
from safetensors.numpy import load_file

from moedeploy.compare.api import compare
from moedeploy.compare.data import ArtifactDataLoader
from moedeploy.export.artifact import Artifact
from moedeploy.export.decoder import DecoderWithPast
from moedeploy.models import MoEDecoder, preset
from moedeploy.runtime.ort import default_threads
from tests.compare.helpers import BLOCK_NAMES, COMPARED_ITERATIONS, fresh_copy, numpy_stats

ITERATIONS = COMPARED_ITERATIONS
SEED = 0  # as in the session's compared_decoder
STAT_KEYS = ("max_abs", "mean_abs", "median_abs", "p99_abs", "max_rel", "mean_rel", "median_rel", "p99_rel", "cosine")


@pytest.fixture(scope="module")
def compared_store(artifacts, compared_decoder, tmp_path_factory) -> Callable[[str], tuple[Path, dict]]:
    """name -> (a private copy of that artifact, compare()'s return), each compared once."""
    done: dict[str, tuple[Path, dict]] = {"decoder": compared_decoder}
    root = tmp_path_factory.mktemp("compared-blocks")

    def get(name: str) -> tuple[Path, dict]:
        if name not in done:
            copy = fresh_copy(artifacts.block(name), root / name)
            done[name] = (copy, compare(str(copy), iterations=ITERATIONS, seed=SEED))
        return done[name]

    return get


@pytest.fixture(params=[*BLOCK_NAMES, "decoder"])
def compared(request, compared_store) -> tuple[Path, dict]:
    return compared_store(request.param)


def test_correct_export_passes(compared):
    folder, report = compared
    manifest = json.loads((folder / "manifest.json").read_text())
    assert report["passed"] is True
    assert report["first_divergent_layer"] is None
    assert report["reference"] == "torch-eager"
    assert report["iterations"] == ITERATIONS and report["seed"] == SEED
    (comparison,) = report["comparisons"]
    assert comparison["backend"] == "onnxrt" and comparison["passed"] is True
    assert list(comparison["outputs"]) == [o["name"] for o in manifest["outputs"]]
    for name, stats in comparison["outputs"].items():
        assert stats["passed"] is True and stats["polygraphy_passed"] is True, name
        assert stats["atol"] == manifest["tolerances"][name]["atol"]
        assert stats["rtol"] == manifest["tolerances"][name]["rtol"]


def test_report_files_are_written_and_agree(compared):
    folder, report = compared
    report_dir = folder / "report"
    assert {p.name for p in report_dir.iterdir()} >= {
        "report.json", "report.md", "report.html", "run_results.json", "accuracy.json"
    }
    on_disk = json.loads((report_dir / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    markdown = (report_dir / "report.md").read_text()
    assert "PASS" in markdown.splitlines()[0] and "FAIL" not in markdown
    for name in report["comparisons"][0]["outputs"]:
        assert f"`{name}`" in markdown
    html = (report_dir / "report.html").read_text()
    assert "PASS" in html and "FAIL" not in html


def test_report_statistics_match_numpy_on_the_saved_run_results(compared):
    folder, report = compared
    results = RunResults.load(str(folder / "report" / "run_results.json"))
    eager, onnxrt = results["torch-eager"], results["onnxrt"]
    assert len(eager) == len(onnxrt) == ITERATIONS
    for name, stats in report["comparisons"][0]["outputs"].items():
        ref = np.concatenate([np.asarray(it[name], dtype=np.float64).ravel() for it in eager])
        act = np.concatenate([np.asarray(it[name], dtype=np.float64).ravel() for it in onnxrt])
        assert stats["elements"] == ref.size
        expected = numpy_stats(ref, act)
        for key in STAT_KEYS:
            assert math.isclose(stats[key], expected[key], rel_tol=1e-9, abs_tol=1e-300), (name, key)
        assert stats["passed"] is bool(np.all(np.abs(act - ref) <= stats["atol"] + stats["rtol"] * np.abs(ref)))
        # the outputs are real (not empty, not constant) and really close
        assert ref.size > 0 and np.std(ref) > 0
        assert stats["cosine"] > 0.999999


def test_eager_results_are_eager_pytorch_rmsnorm(compared_store):
    """torch-eager's outputs are the RMSNorm formula on the loader's inputs."""
    folder, _ = compared_store("rmsnorm")
    weight = load_file(str(folder / "reference.safetensors"))["weight"].astype(np.float64)
    results = RunResults.load(str(folder / "report" / "run_results.json"))
    loader = ArtifactDataLoader(Artifact.load(folder), ITERATIONS, seed=SEED)
    for feed, eager, onnxrt in zip(loader, results["torch-eager"], results["onnxrt"], strict=True):
        x = feed["x"].astype(np.float64)
        expected = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * weight
        np.testing.assert_allclose(eager["y"], expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(onnxrt["y"], expected, rtol=1e-5, atol=1e-5)


def test_eager_and_ort_results_of_the_decoder(compared_decoder):
    """torch-eager = the tiny MoEDecoder rebuilt here from preset + seed; onnxrt = a plain
    ONNX Runtime session on model.onnx (its custom ops run as their function bodies)."""
    folder, _ = compared_decoder
    artifact = Artifact.load(folder)
    n = artifact.manifest["config"]["n_layers"]
    results = RunResults.load(str(folder / "report" / "run_results.json"))
    torch.manual_seed(0)
    model = DecoderWithPast(MoEDecoder(preset("tiny")).eval()).eval()
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    output_names = [o.name for o in session.get_outputs()]
    loader = ArtifactDataLoader(artifact, ITERATIONS, seed=SEED)
    for feed, eager, onnxrt in zip(loader, results["torch-eager"], results["onnxrt"], strict=True):
        past = [torch.from_numpy(feed[f"past_key_values.{i}.{kv}"]) for i in range(n) for kv in ("key", "value")]
        with torch.no_grad():
            logits, present = model(torch.from_numpy(feed["input_ids"]), list(zip(past[0::2], past[1::2], strict=True)))
        expected = {"logits": logits.numpy()}
        for i, (k, v) in enumerate(present):
            expected[f"present.{i}.key"], expected[f"present.{i}.value"] = k.numpy(), v.numpy()
        plain = dict(zip(output_names, session.run(output_names, dict(feed)), strict=True))
        assert list(eager) == list(expected)
        for name, value in expected.items():
            np.testing.assert_allclose(eager[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
            np.testing.assert_allclose(onnxrt[name], plain[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_layerwise_on_a_correct_decoder_localises_nothing(compared_decoder):
    folder, report = compared_decoder
    assert report["passed"] is True
    assert report["first_divergent_layer"] is None and report["first_divergent_module"] is None
    layerwise = report["comparisons"][0]["layerwise"]
    modules = [m["module"] for m in layerwise["modules"]]
    n = json.loads((folder / "manifest.json").read_text())["config"]["n_layers"]
    for i in range(n):
        assert f"layers.{i}" in modules and f"layers.{i}.ffn" in modules and f"layers.{i}.attn" in modules
    assert modules.index("layers.0") < modules.index("layers.1") < modules.index("lm_head")
    assert all(m["passed"] for m in layerwise["modules"])
    assert all(m["layer"] == ".".join(m["module"].split(".")[:2]) for m in layerwise["modules"] if m["module"].startswith("layers."))


def test_every_ort_lowering_of_the_decoder_passes_compare(artifacts, tmp_path):
    """ort-contrib, ort-experts, ort-gqa and ort-skipnorm: each lowering checked against eager
    PyTorch, the report naming the path that ran."""
    decoder = fresh_copy(artifacts.decoder(), tmp_path / "decoder")
    report = compare(decoder, ["ort-contrib", "ort-experts", "ort-gqa", "ort-skipnorm"], iterations=2)
    assert report["passed"] is True
    paths = {c["backend"]: c["path"] for c in report["comparisons"]}
    assert set(paths) == {"onnxrt-contrib", "onnxrt-experts", "onnxrt-gqa", "onnxrt-skipnorm"}
    on_contrib = "2 moe::MoE on com.microsoft::MoE"  # each expert in one piece per thread on 2+ CPUs
    assert paths["onnxrt-contrib"].startswith(on_contrib if default_threads() < 2 else f"{on_contrib}, each expert cut")
    assert paths["onnxrt-experts"].startswith("2 moe::MoE on one If per expert")
    assert "2 attention on com.microsoft::GroupQueryAttention" in paths["onnxrt-gqa"]
    assert "4 residual Add + moe::RMSNorm on SkipSimplifiedLayerNormalization" in paths["onnxrt-skipnorm"]
    with pytest.raises(ValueError, match="--backend ort-gqa lowers a decoder's attention"):
        compare(artifacts.block("moe"), ["ort", "ort-gqa"])


def test_unknown_backend_is_rejected(artifacts):
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        compare(artifacts.block("moe"), ["cuda"])
