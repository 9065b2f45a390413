"""moedeploy.models loads each public name's module on first use, so that reading a checkpoint's
config.json (moedeploy.models.families, .config, .checkpoint_config) needs no torch."""

from __future__ import annotations

import importlib

import pytest


def test_every_public_name_resolves_to_what_its_module_defines() -> None:
    import moedeploy.models as models

    assert sorted(models.__all__) == sorted(models._WHERE)
    for name, module in models._WHERE.items():
        assert getattr(models, name) is getattr(importlib.import_module(f"moedeploy.models.{module}"), name)
    with pytest.raises(AttributeError, match="no attribute 'NotAModel'"):
        models.NotAModel  # noqa: B018
    assert importlib.import_module("moedeploy.plugins.moe").Routing is importlib.import_module("moedeploy.moe_attributes").Routing


def test_the_plugins_package_loads_its_op_modules_on_first_use(tmp_path) -> None:
    """moedeploy.plugins.native (`moedeploy version` asks it whether the kernel is built) is
    imported without torch, also where it looks at headers and the build cache (and so imports
    onnxruntime); the op modules, which need torch, come with CUSTOM_OPS."""
    import os
    import subprocess
    import sys

    (tmp_path / "onnxruntime_c_api.h").write_text("#define ORT_API_VERSION 17\n")
    env = {k: v for k, v in os.environ.items() if k != "MOEDEPLOY_NATIVE"} | {
        "MOEDEPLOY_ORT_INCLUDE": str(tmp_path), "MOEDEPLOY_CACHE": str(tmp_path / "cache"), "CXX": "/bin/false"}
    script = ("import sys, moedeploy.plugins.native as n; print(n.status().startswith('not built yet')); "
              "print('torch' in sys.modules); from moedeploy.plugins import CUSTOM_OPS; print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True,
                          env=env)
    assert done.stdout.split() == ["True", "False", "True"], done.stderr
    import moedeploy.plugins as plugins

    rmsnorm, moe = (importlib.import_module(f"moedeploy.plugins.{name}") for name in ("rmsnorm", "moe"))
    assert {("moe", "RMSNorm"): rmsnorm, ("moe", "MoE"): moe} == plugins.CUSTOM_OPS
    assert plugins.moe is moe and plugins.rmsnorm is rmsnorm
    with pytest.raises(AttributeError, match="no attribute 'NotAnOp'"):
        plugins.NotAnOp  # noqa: B018
