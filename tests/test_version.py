"""`moedeploy version`: every library moedeploy uses or can use, read against importlib.metadata."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

# distribution name -> import name: the libraries issue 11 found missing from the listing
EXPECTED = {"numpy": "numpy", "polygraphy": "polygraphy", "transformers": "transformers",
            "nvidia-pytriton": "pytriton", "tritonclient": "tritonclient", "tensorrt": "tensorrt"}


def printed_versions() -> dict[str, str]:
    from moedeploy.cli import app

    done = CliRunner().invoke(app, ["version"])
    assert done.exit_code == 0, done.output
    return dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())


def metadata_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_version_lists_every_library_with_its_installed_version() -> None:
    printed = printed_versions()
    assert printed["python"] == platform.python_version()
    for distribution in EXPECTED:
        expected = metadata_version(distribution)
        if expected is None:
            assert printed[distribution].startswith("not installed (pip install "), printed[distribution]
        else:
            assert printed[distribution] == expected
    assert printed["moedeploy"] and printed["torch"]  # the manifest's libraries are still listed first
    # read from metadata, they are the versions the imported modules (and so the manifest) say
    from moedeploy.export.exporter import library_versions

    assert list(printed)[:5] == list(library_versions())
    assert {k: printed[k] for k in library_versions()} == library_versions()


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_a_missing_library_reads_not_installed_with_its_extra() -> None:
    assert printed_versions()["tensorrt"] == "not installed (pip install 'moedeploy[gpu]')"


def test_a_distribution_is_found_by_the_module_it_provides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorRT's module comes from wheels of other names (tensorrt-cu12): a fake such wheel on sys.path."""
    from moedeploy.utils.versions import installed_version

    info = tmp_path / "fakert_cu99-10.99.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakert-cu99\nVersion: 10.99.1\n")
    (info / "top_level.txt").write_text("fakert\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert importlib.metadata.version("fakert-cu99") == "10.99.1"
    assert installed_version("fakert") == "10.99.1"
    assert installed_version("no_such_module_anywhere") is None
