"""`moedeploy all` with backends that cannot compare every target: refused in one line before
anything is exported, or applied where they apply. Before, `--backend ort-gqa` exported all 15
targets and failed each block with IndexError (no backend left to compare it), and `--backend
trt` without TensorRT exported all 15 and failed each at its build."""

from __future__ import annotations

import json

import pytest

from moedeploy.compare.suite import run_all
from moedeploy.runtime.tensorrt import tensorrt_available
from tests.compare.helpers import assert_one_error_line, run_cli


def test_decoder_only_backends_alone_are_refused_before_exporting(tmp_path) -> None:
    out = tmp_path / "out"
    result = run_cli("all", "--backend", "ort-gqa", "--out", out)
    assert_one_error_line(result, "--backend ort-gqa runs the decoder only", "add ort (--backend ort,ort-gqa)")
    assert not out.exists()


@pytest.mark.skipif(tensorrt_available(), reason="TensorRT is installed here")
def test_trt_without_tensorrt_is_refused_before_exporting(tmp_path) -> None:
    out = tmp_path / "out"
    result = run_cli("all", "--backend", "ort,trt", "--out", out)
    assert_one_error_line(result, "moedeploy all --backend trt stops before exporting", "TensorRT is not installed")
    assert not out.exists()


def test_a_block_is_compared_on_the_backends_that_apply_to_it(tmp_path) -> None:
    """ort-inflight batches a decoder's requests; a block is compared on ort alone."""
    summary = run_all(tmp_path / "out", ["ort", "ort-inflight"], targets=["rmsnorm"])
    assert summary["passed"], summary["results"]
    report = json.loads((tmp_path / "out" / "rmsnorm" / "report" / "report.json").read_text())
    assert [c["backend"] for c in report["comparisons"]] == ["onnxrt"]  # ort, as Polygraphy names its runner
