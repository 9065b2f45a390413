"""An ONNX Runtime older than the lowerings need is named, with the upgrade, when a session fails:
1.30 (a GPU machine's image, 2026-11-27) refused the lowered GroupQueryAttention's 17 inputs with
only "input size 17 not in range [min=7, max=16]"."""

from __future__ import annotations

import onnxruntime as ort
import pytest

from moedeploy.runtime import ort as runtime_ort


@pytest.mark.parametrize(("version", "older"), [
    ("1.30.0", True), ("1.31.2", True), ("0.99.0", True), ("1.32.0", False), ("1.32.1", False),
    ("1.33.0.dev20260101", False), ("2.0.0", False), ("1.9.0", True),
])
def test_versions_compare_as_numbers_not_strings(version, older) -> None:
    assert runtime_ort.older_than_tested(version) is older


def test_the_hint_names_the_installed_version_and_the_upgrade(monkeypatch) -> None:
    assert runtime_ort.upgrade_hint() == ""  # this suite's onnxruntime is the tested one
    monkeypatch.setattr(ort, "__version__", "1.30.0")
    assert runtime_ort.upgrade_hint() == (" (this onnxruntime 1.30.0 is older than the 1.32 moedeploy's lowerings "
                                          "need: pip install -U 'onnxruntime>=1.32')")


def test_the_upgrade_names_the_package_onnxruntime_came_from(monkeypatch) -> None:
    """On onnxruntime-gpu (the GPU machine's), upgrading plain "onnxruntime" would install a second,
    conflicting copy of the module beside it."""
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(ort, "__version__", "1.30.0")
    monkeypatch.setattr(metadata, "version", lambda name: "1.30.0" if name == "onnxruntime-gpu" else real(name))
    assert runtime_ort.upgrade_hint().endswith("pip install -U 'onnxruntime-gpu>=1.32')")
