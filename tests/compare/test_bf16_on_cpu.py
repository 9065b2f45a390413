"""bf16 artifacts on a machine whose ONNX Runtime has only the CPU provider (no bf16 kernels):
said once, up front, in one line; nothing exported, compared or written."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from moedeploy.compare.api import compare
from moedeploy.compare.suite import run_all
from moedeploy.runtime.ort import SessionError
from tests.compare.helpers import assert_one_error_line, fresh_copy, run_cli

pytestmark = pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(), reason="ONNX Runtime has CUDA here: bf16 can run"
)
POLYGRAPHY_PREFIXES = ("[W]", "[E]", "[I]", "[!]", "[V]")


@pytest.fixture(scope="module")
def bf16_block(artifacts) -> Path:
    return artifacts.block("rmsnorm", "bf16").path


def test_the_reason_names_the_provider_and_the_ways_out():
    from moedeploy.compare.api import not_runnable_here

    reason = not_runnable_here("bf16", ["ort"])
    assert reason and "CPU provider has no bfloat16 kernels" in reason
    assert "--backend trt" in reason and "--dtype fp32 or fp16" in reason
    assert not_runnable_here("fp16", ["ort"]) is None and not_runnable_here("bf16", ["trt"]) is None


def test_compare_refuses_before_running_anything(bf16_block, tmp_path):
    folder = fresh_copy(bf16_block, tmp_path / "rmsnorm-bf16")
    with pytest.raises(SessionError, match="no bfloat16 kernels"):
        compare(folder)
    assert not (folder / "report").exists()


def test_compare_cli_is_one_line(bf16_block, tmp_path):
    folder = fresh_copy(bf16_block, tmp_path / "rmsnorm-bf16")
    result = run_cli("compare", folder)
    assert_one_error_line(result, str(folder), "bf16", "no bfloat16 kernels", "--backend trt")
    assert not [line for line in result.stdout.splitlines() if line.startswith(POLYGRAPHY_PREFIXES)], result.stdout
    assert result.stdout.strip() == ""
    assert not (folder / "report").exists()


def test_all_stops_before_exporting(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SessionError, match="no bfloat16 kernels"):
        run_all(out, dtype="bf16")
    assert not out.exists()


def test_all_cli_is_one_line(tmp_path):
    out = tmp_path / "out"
    result = run_cli("all", "--dtype", "bf16", "--out", out)
    assert_one_error_line(result, "--dtype bf16", "before exporting", "no bfloat16 kernels")
    assert "match eager PyTorch" not in result.stdout  # no table of 15 failures
    assert not out.exists()
