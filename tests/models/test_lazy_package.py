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
