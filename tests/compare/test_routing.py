"""Routing flips: tokens whose top-k expert set differs between backends, and when they are
explained as rounding near-ties (router logits agree) rather than a broken router."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import numpy_helper

from moedeploy.compare.api import compare
from moedeploy.compare.layerwise import routing_flips
from moedeploy.compare.report import routing_note
from moedeploy.export import export
from moedeploy.export.artifact import MANIFEST, sha256


def test_routing_flips_by_hand() -> None:
    ref = np.array([[3.0, 2.0, 1.0, 0.0],     # top-2 {0, 1}
                    [0.0, 1.0, 2.0, 3.0],     # top-2 {2, 3}
                    [1.0, 1.0 + 1e-6, 0.0, 0.0]])  # top-2 {0, 1}
    act = np.array([[2.0, 3.0, 1.0, 0.0],     # {0, 1}: same set, other order -> not a flip
                    [0.0, 2.5, 2.0, 3.0],     # {1, 3}: flip
                    [1.0, 1.0 + 1e-6, 0.0, 0.0]])
    assert routing_flips(ref, act, top_k=2) == 1
    assert routing_flips(ref, act, top_k=1) == 1  # argmax changes in row 0 only (row 1 keeps expert 3)
    assert routing_flips(ref, ref, top_k=3) == 0


def test_note_only_when_router_logits_agree() -> None:
    assert routing_note({"first_divergent_routing_flips": None, "first_divergent_module": "layers.0.ffn"}) is None
    note = routing_note({"first_divergent_routing_flips": 2, "first_divergent_module": "layers.0.ffn"})
    assert note and "2 token(s)" in note and "layers.0.ffn" in note


def test_a_broken_router_is_not_called_a_near_tie(tmp_path) -> None:
    artifact = export("decoder", tmp_path / "dec")
    model = onnx.load(str(artifact.model_path))
    for init in model.graph.initializer:
        if init.name == "decoder.layers.1.ffn.router.weight":
            init.CopyFrom(numpy_helper.from_array(-3 * numpy_helper.to_array(init), init.name))
    onnx.save(model, str(artifact.model_path))
    manifest = json.loads((artifact.path / MANIFEST).read_text())
    manifest["files"]["model.onnx"] = sha256(artifact.model_path)
    (artifact.path / MANIFEST).write_text(json.dumps(manifest))

    report = compare(artifact.path, iterations=1)
    assert report["passed"] is False and report["first_divergent_module"] == "layers.1.ffn"
    moe = {m["module"]: m for m in report["comparisons"][0]["layerwise"]["modules"]}
    assert moe["layers.0.ffn"]["routing_flips"] == 0 and moe["layers.0.ffn"]["router_logits_passed"]
    assert moe["layers.1.ffn"]["routing_flips"] > 0 and not moe["layers.1.ffn"]["router_logits_passed"]
    assert report["first_divergent_routing_flips"] is None  # the router is wrong: no rounding excuse
    assert "routing flips" in (artifact.path / "report" / "report.md").read_text()
