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


def native_line(monkeypatch: pytest.MonkeyPatch, **env: str | None) -> str:
    """`moedeploy version`'s native-kernel line under these environment variables (None: unset)."""
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    from moedeploy.cli import NATIVE_KERNEL_LINE

    printed = printed_versions()
    assert list(printed)[-1] == NATIVE_KERNEL_LINE  # the last line, after every library
    return printed[NATIVE_KERNEL_LINE]


def test_version_says_the_native_kernel_is_off_where_it_is_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert native_line(monkeypatch, MOEDEPLOY_NATIVE="off") == (
        "not available (MOEDEPLOY_NATIVE=off turns the native kernels off); sessions take the other MoE paths")


def test_version_names_missing_headers_and_builds_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    line = native_line(monkeypatch, MOEDEPLOY_NATIVE=None, MOEDEPLOY_CACHE=str(cache), MOEDEPLOY_ORT_INCLUDE=str(tmp_path))
    assert line == f"not available (MOEDEPLOY_ORT_INCLUDE={tmp_path} holds no onnxruntime_c_api.h); sessions take the other MoE paths"
    assert not cache.exists()


@pytest.mark.parametrize("api", [17, 999])
def test_version_says_a_session_would_build_the_kernel_or_why_the_headers_do_not_fit(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, api: int) -> None:
    """Headers of a C API version between 17 and the installed runtime's and a compiler: the next
    session compiles it (version itself never does: /bin/false as the compiler would fail)."""
    import onnxruntime

    include, cache = tmp_path / "include", tmp_path / "cache"
    include.mkdir()
    (include / "onnxruntime_c_api.h").write_text(f"#pragma once\n#define ORT_API_VERSION {api}\n")
    line = native_line(monkeypatch, MOEDEPLOY_NATIVE=None, MOEDEPLOY_CACHE=str(cache), MOEDEPLOY_ORT_INCLUDE=str(include),
                       CXX="/bin/false")
    runtime = int(onnxruntime.__version__.split(".")[1])
    if api <= runtime:
        assert line == (f"not built yet: the first session compiles it, a few seconds once (headers {include}, "
                        "C API 17; /bin/false)")
    else:
        assert line == (f"not available (the ONNX Runtime headers in {include} are of C API version 999; the kernel "
                        f"needs 17 to {runtime} (this onnxruntime's)); sessions take the other MoE paths")
    assert not cache.exists()
