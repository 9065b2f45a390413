"""A corrupted weight in decoder layer k: compare fails and localises layer k.

The weight is edited in model.onnx and the manifest's sha256 recomputed, as a buggy
exporter would have written it, so the artifact loads and the comparison has to catch it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moedeploy.compare.api import compare
from moedeploy.export.artifact import Artifact, ArtifactError
from tests.compare.helpers import (
    assert_one_error_line,
    edit_initializer,
    fresh_copy,
    initializer,
    initializer_of_module,
    rehash_model,
    run_cli,
)

DELTA = 1.0  # weights are ~N(0, 0.02) (norms ~1): +1 on one element is a gross error


def bump_one_element(value: np.ndarray) -> np.ndarray:
    value = value.copy()
    value.flat[value.size // 3] += DELTA
    return value


def corrupt(source: Artifact, dest: Path, weight: str, rehash: bool = True) -> Path:
    """Copy `source`, add DELTA to one element of a weight; `weight` is an initializer name
    or `module:<scope>` for a projection whose initializer the optimizer renamed."""
    folder = fresh_copy(source, dest)
    name = initializer_of_module(folder, weight.split(":", 1)[1]) if weight.startswith("module:") else weight
    before = initializer(folder, name)
    edit_initializer(folder, name, bump_one_element)
    after = initializer(folder, name)
    assert after.shape == before.shape
    assert np.count_nonzero(after != before) == 1  # one weight, and it really changed
    if rehash:
        rehash_model(folder)
    return folder


# (artifact, layer k, weight, the module expected to diverge first)
CASES = [
    ("tiny", 0, "decoder.layers.0.ffn.w_gate_up", "layers.0.ffn"),
    ("tiny", 1, "module:decoder.layers.1.attn.wq", "layers.1.attn"),
    ("deep", 0, "decoder.layers.0.attn_norm.weight", "layers.0.attn_norm"),
    ("deep", 1, "module:decoder.layers.1.attn.wk", "layers.1.attn"),
    ("deep", 2, "decoder.layers.2.ffn.w_down", "layers.2.ffn"),
    ("deep", 2, "decoder.layers.2.ffn_norm.weight", "layers.2.ffn_norm"),
    ("deep", 3, "decoder.layers.3.ffn.router.weight", "layers.3.ffn"),
]


def _source(artifacts, which: str) -> Artifact:
    return artifacts.decoder() if which == "tiny" else artifacts.deep_decoder()


@pytest.mark.parametrize(("which", "k", "weight", "module"), CASES, ids=[f"{c[0]}-{c[2].split(':')[-1]}" for c in CASES])
def test_compare_fails_and_names_the_corrupted_layer(artifacts, tmp_path, which, k, weight, module):
    source = _source(artifacts, which)
    n_layers = source.manifest["config"]["n_layers"]
    folder = corrupt(source, tmp_path / "corrupt", weight)
    Artifact.load(folder)  # the integrity check passes: the sha256 was "correctly" recorded

    report = compare(folder, iterations=1)

    assert report["passed"] is False
    assert report["first_divergent_layer"] == f"layers.{k}"
    assert report["first_divergent_module"] == module
    on_disk = json.loads((folder / "report" / "report.json").read_text())
    assert on_disk["passed"] is False
    assert on_disk["first_divergent_layer"] == f"layers.{k}"
    assert on_disk["first_divergent_module"] == module

    (comparison,) = on_disk["comparisons"]
    outputs = comparison["outputs"]
    assert outputs["logits"]["passed"] is False
    # the KV caches of the layers before k never see the corrupted weight
    for j in range(k):
        assert outputs[f"present.{j}.key"]["passed"] is True
        assert outputs[f"present.{j}.value"]["passed"] is True
    if module.endswith(".ffn") or module.endswith(".ffn_norm"):  # runs after layer k's attention
        assert outputs[f"present.{k}.key"]["passed"] is True
    for j in range(k + 1, n_layers):  # every later layer sees a different hidden state
        assert outputs[f"present.{j}.key"]["passed"] is False

    modules = comparison["layerwise"]["modules"]
    names = [m["module"] for m in modules]
    first_failure = next(i for i, m in enumerate(modules) if not m["passed"])
    assert names[first_failure] == module
    assert all(m["passed"] for m in modules[:first_failure])
    assert all(m["passed"] for m in modules if m["layer"] in {f"layers.{j}" for j in range(k)} | {"embed"})
    assert not next(m for m in modules if m["module"] == f"layers.{k}")["passed"]

    assert f"First divergent layer: `layers.{k}`" in (folder / "report" / "report.md").read_text()
    html = (folder / "report" / "report.html").read_text()
    assert f"<code>layers.{k}</code>" in html and "FAIL" in html


def test_cli_compare_exits_nonzero_and_names_the_layer(artifacts, tmp_path):
    k = 2
    folder = corrupt(artifacts.deep_decoder(), tmp_path / "corrupt", f"decoder.layers.{k}.ffn.w_gate_up")
    result = run_cli("compare", folder, "--iterations", "1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert f"first divergent layer: layers.{k} " in result.stdout
    assert "FAIL" in result.stdout
    report = json.loads((folder / "report" / "report.json").read_text())
    assert report["passed"] is False and report["first_divergent_layer"] == f"layers.{k}"


def test_cli_compare_passes_on_the_intact_decoder(artifacts, tmp_path):
    folder = fresh_copy(artifacts.deep_decoder(), tmp_path / "intact")
    result = run_cli("compare", folder, "--iterations", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout and "first divergent layer" not in result.stdout
    assert json.loads((folder / "report" / "report.json").read_text())["passed"] is True


# --- an artifact modified after export is refused --------------------------------------


@pytest.fixture
def tampered(artifacts, tmp_path) -> Path:
    """model.onnx edited without updating manifest.json's sha256."""
    return corrupt(artifacts.decoder(), tmp_path / "tampered", "decoder.layers.1.ffn.w_gate_up", rehash=False)


def test_tampered_model_is_rejected_by_artifact_load(tampered):
    with pytest.raises(ArtifactError, match=r"model\.onnx does not match its sha256"):
        Artifact.load(tampered)
    Artifact.load(tampered, verify=False)  # only the integrity check objects
    rehash_model(tampered)
    Artifact.load(tampered)


def test_tampered_model_is_rejected_by_compare(tampered):
    with pytest.raises(ArtifactError, match=r"model\.onnx"):
        compare(tampered)
    assert not (tampered / "report").exists()


def test_tampered_model_is_rejected_by_the_cli(tampered):
    assert_one_error_line(run_cli("compare", tampered), "model.onnx", "sha256")
    assert not (tampered / "report").exists()


def test_tampered_golden_file_is_named(artifacts, tmp_path):
    folder = fresh_copy(artifacts.decoder(), tmp_path / "golden")
    with (folder / "golden" / "outputs.json").open("a") as f:
        f.write(" ")
    with pytest.raises(ArtifactError, match=r"golden/outputs\.json"):
        Artifact.load(folder)


# --- a backend that produces NaN -----------------------------------------------------------


def _nan_weight(artifacts, dest: Path, which: str) -> Path:
    """The rmsnorm block with one (or every) scale element NaN: that column (or all) is NaN on ORT."""
    folder = fresh_copy(artifacts.block("rmsnorm"), dest)

    def poison(value: np.ndarray) -> np.ndarray:
        value = value.copy()
        if which == "one":
            value[3] = np.nan
        else:
            value[:] = np.nan
        return value

    edit_initializer(folder, "weight", poison)
    rehash_model(folder)
    return folder


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nan_in_a_backend_output_fails(artifacts, tmp_path):
    folder = _nan_weight(artifacts, tmp_path / "nan", "one")
    report = compare(folder, iterations=2)
    stats = report["comparisons"][0]["outputs"]["y"]
    assert report["passed"] is False
    assert stats["nan_or_inf"] is True and stats["passed"] is False and stats["polygraphy_passed"] is False
    assert (folder / "report" / "report.html").is_file()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_report_json_is_strict_json_when_an_output_has_nan(artifacts, tmp_path):
    folder = _nan_weight(artifacts, tmp_path / "nan", "one")
    compare(folder, iterations=1)

    def reject(token: str):
        raise ValueError(f"non-standard JSON token {token}")

    json.loads((folder / "report" / "report.json").read_text(), parse_constant=reject)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_all_nan_backend_output_is_reported_not_raised(artifacts, tmp_path):
    folder = _nan_weight(artifacts, tmp_path / "nan", "all")
    report = compare(folder, iterations=1)
    assert report["passed"] is False
    assert report["comparisons"][0]["outputs"]["y"]["nan_or_inf"] is True
    assert (folder / "report" / "report.html").is_file()
