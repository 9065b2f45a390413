"""`moedeploy compare` as a user runs it: exit codes gate CI, user errors are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.compare.helpers import assert_one_error_line, fresh_copy, run_cli


@pytest.fixture(scope="module")
def block(artifacts) -> Path:
    """The rmsnorm block (ORT differs from eager by ~1e-6: passes 1e-5, fails 0)."""
    return artifacts.block("rmsnorm").path


def _report(folder: Path) -> dict:
    return json.loads((folder / "report" / "report.json").read_text())


def test_passing_compare_exits_zero(block, tmp_path):
    folder = fresh_copy(block, tmp_path / "rmsnorm")
    result = run_cli("compare", folder, "--iterations", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout and "FAIL" not in result.stdout
    report = _report(folder)
    assert report["passed"] is True and report["iterations"] == 2
    assert report["comparisons"][0]["outputs"]["y"]["atol"] == 1e-5


def test_zero_tolerance_exits_nonzero(block, tmp_path):
    folder = fresh_copy(block, tmp_path / "rmsnorm")
    result = run_cli("compare", folder, "--atol", "0", "--rtol", "0")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "FAIL" in result.stdout
    stats = _report(folder)["comparisons"][0]["outputs"]["y"]
    assert (stats["atol"], stats["rtol"]) == (0.0, 0.0)
    assert stats["passed"] is False and stats["max_abs"] > 0


def test_cli_tolerances_override_the_manifest(block, tmp_path):
    folder = fresh_copy(block, tmp_path / "rmsnorm")
    result = run_cli("compare", folder, "--atol", "0.5", "--rtol", "0.25", "--iterations", "1", "--seed", "7")
    assert result.returncode == 0, result.stdout + result.stderr
    report = _report(folder)
    stats = report["comparisons"][0]["outputs"]["y"]
    assert (stats["atol"], stats["rtol"]) == (0.5, 0.25)
    assert report["seed"] == 7 and report["iterations"] == 1


@pytest.mark.parametrize("case", ["missing", "no-manifest"])
def test_bad_artifact_path_is_one_error_line(tmp_path, case):
    path = tmp_path / "artifact"
    if case == "no-manifest":
        path.mkdir()
    assert_one_error_line(run_cli("compare", path), str(path))
    assert not (path / "report").exists()


def test_unknown_backend_is_one_error_line(block):
    assert_one_error_line(run_cli("compare", block, "--backend", "ort,tensorflow"), "'tensorflow'")
    assert not (block / "report").exists()


def test_a_backend_listed_twice_is_refused_before_any_work(block):
    """It ran twice, and the report listed it twice; bench already refused the same."""
    from typer.testing import CliRunner

    from moedeploy.cli import app

    result = CliRunner().invoke(app, ["compare", str(block), "--backend", "ort,ort-contrib,ort"])
    assert result.exit_code == 1, result.output
    assert "backend 'ort' is listed twice in --backend; name each once" in " ".join(result.output.split())
    assert not (block / "report").exists()


def test_negative_tolerance_is_one_usage_error_line(block):
    """Refused as the options are parsed: exit 2, as typer's own range checks."""
    result = run_cli("compare", block, "--atol", "-1")
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        "error: Invalid value for '--atol': -1.0 is not a finite number >= 0 (see `moedeploy compare --help`)"]
    assert not (block / "report").exists()


def test_trt_backend_without_an_engine_is_one_error_line(block, tmp_path):
    """No TensorRT, no GPU or no engine built: each is a user error naming TensorRT, said before
    any other backend runs, and nothing is written into the artifact."""
    assert_one_error_line(run_cli("compare", block, "--backend", "trt"), "TensorRT")
    assert not (block / "report").exists()
    folder = fresh_copy(block, tmp_path / "rmsnorm")
    assert_one_error_line(run_cli("compare", folder, "--backend", "trt,ort"), "TensorRT")
    assert sorted(p.name for p in folder.iterdir()) == ["golden", "manifest.json", "model.onnx", "reference.safetensors"]


def test_only_moedeploy_speaks(block, tmp_path):
    """A failing comparison prints moedeploy's table once: none of Polygraphy's own log lines
    (its `[E] FAILED` repeats, its hint to install `colored`)."""
    folder = fresh_copy(block, tmp_path / "rmsnorm")
    result = run_cli("compare", folder, "--atol", "0", "--rtol", "0", "--iterations", "2")
    assert result.returncode == 1 and "FAIL" in result.stdout
    printed = result.stdout + result.stderr
    assert "colored" not in printed
    polygraphy = [line for line in printed.splitlines() if line.lstrip().startswith(("[W]", "[E]", "[I]", "[!]", "[V]"))]
    assert polygraphy == []


def test_polygraphy_logging_is_restored_after_compare(block, tmp_path):
    """compare() silences Polygraphy only while it runs: other tools keep their logging."""
    from polygraphy.logger import G_LOGGER

    from moedeploy.compare.api import compare

    severity, colors = G_LOGGER.module_severity.get(), G_LOGGER.colors
    compare(fresh_copy(block, tmp_path / "rmsnorm"), iterations=1)
    assert (G_LOGGER.module_severity.get(), G_LOGGER.colors) == (severity, colors)


def test_an_artifact_that_takes_no_new_files_is_refused_before_the_work(block, tmp_path, monkeypatch):
    """A read-only artifact (a mount, or one a user may not write) ran the whole comparison, then
    failed writing the report: "Permission denied: .report.<pid>.tmp", no fix named. The folder is
    probed first. (Root writes through any mode, so the refusal is simulated at the probe, the
    same call a read-only folder fails in.)"""
    import errno
    import tempfile

    from moedeploy.compare.api import compare
    from moedeploy.utils.io import OutputRefused

    folder = fresh_copy(block, tmp_path / "rmsnorm")
    real = tempfile.mkdtemp

    def read_only(*args, **kwargs):
        if Path(kwargs.get("dir", "")) == folder:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    with pytest.raises(OutputRefused, match=r"compare writes its report into .*rmsnorm/report, but .*rmsnorm does not "
                                             r"accept new folders \(Permission denied\); make the artifact writable"):
        compare(folder, ["ort"])
    assert sorted(p.name for p in folder.iterdir()) == ["golden", "manifest.json", "model.onnx", "reference.safetensors"]
