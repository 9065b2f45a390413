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


def test_the_plugins_package_loads_its_op_modules_on_first_use() -> None:
    """moedeploy.plugins.native (`moedeploy version` asks it whether the kernel is built) is
    imported without torch; the op modules, which need it, come with CUSTOM_OPS."""
    import subprocess
    import sys

    script = ("import sys, moedeploy.plugins.native as n; n.status(); print('torch' in sys.modules); "
              "from moedeploy.plugins import CUSTOM_OPS; print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["False", "True"], done.stderr
    import moedeploy.plugins as plugins

    rmsnorm, moe = (importlib.import_module(f"moedeploy.plugins.{name}") for name in ("rmsnorm", "moe"))
    assert {("moe", "RMSNorm"): rmsnorm, ("moe", "MoE"): moe} == plugins.CUSTOM_OPS
    assert plugins.moe is moe and plugins.rmsnorm is rmsnorm
    with pytest.raises(AttributeError, match="no attribute 'NotAnOp'"):
        plugins.NotAnOp  # noqa: B018
