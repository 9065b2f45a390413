"""Routing flips: tokens whose top-k expert set differs between backends, and when they are
explained as rounding near-ties (router logits agree) rather than a broken router."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import numpy_helper

from moedeploy.compare.api import compare
from moedeploy.compare.layerwise import (
    ModuleResult,
    flipped_tokens,
    layer_of,
    routing_explanation,
    routing_flips,
    tokens_out_of_tolerance,
)
from moedeploy.compare.report import routing_note
from moedeploy.export.artifact import MANIFEST, Artifact, sha256
from moedeploy.plugins.moe import Routing
from tests.compare.helpers import fresh_copy
from tests.export.artifacts import rewrite_manifest


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


def test_routing_flips_follow_the_moe_s_own_selection() -> None:
    """With a selection bias the chosen experts are not the largest logits: a flip is judged on
    the MoE's own choice (sigmoid(logit) + bias), by hand."""
    bias = np.array([2.0, 0.0, 0.0, 0.0], np.float32)  # expert 0 is always chosen
    ref = np.array([[0.0, 3.0, 2.0, 1.0]], np.float32)  # sigmoid + bias: 0 first, then 1
    act = np.array([[0.0, 2.0, 3.0, 1.0]], np.float32)  # then 2: a flip
    same = np.array([[-5.0, 3.0, 2.0, 1.0]], np.float32)  # logit top-2 unchanged, choice unchanged
    sigmoid = Routing(2, True, "sigmoid")
    assert flipped_tokens(ref, act, sigmoid, bias) == [0]
    assert flipped_tokens(ref, same, sigmoid, bias) == []
    assert flipped_tokens(ref, same, 2) == []  # plain top-2 of the logits: {1, 2} both times
    assert flipped_tokens(ref, act, 2) == []  # plain top-2 misses what the biased choice sees


def test_note_only_when_router_logits_agree() -> None:
    assert routing_note({"first_divergent_routing_flips": None, "first_divergent_module": "layers.0.ffn"}) is None
    note = routing_note({"first_divergent_routing_flips": 2, "first_divergent_module": "layers.0.ffn"})
    assert note and "2 token(s)" in note and "layers.0.ffn" in note
    upstream = routing_note({"first_divergent_routing_flips": 1, "first_divergent_module": "norm",
                             "first_divergent_routing_modules": ["layers.1.ffn"]})
    assert upstream and "in `norm`" in upstream and "upstream, in `layers.1.ffn`" in upstream


def test_a_broken_router_is_not_called_a_near_tie(artifacts, tmp_path) -> None:
    artifact = Artifact.load(fresh_copy(artifacts.decoder(), tmp_path / "dec"))  # the session's tiny decoder
    model = onnx.load(str(artifact.model_path))
    for init in model.graph.initializer:
        if init.name == "decoder.layers.1.ffn.router.weight":
            init.CopyFrom(numpy_helper.from_array(-3 * numpy_helper.to_array(init), init.name))
    onnx.save(model, str(artifact.model_path))
    manifest = json.loads((artifact.path / MANIFEST).read_text())
    manifest["files"]["model.onnx"] = sha256(artifact.model_path)
    rewrite_manifest(artifact.path, manifest)

    report = compare(artifact.path, iterations=1)
    assert report["passed"] is False and report["first_divergent_module"] == "layers.1.ffn"
    moe = {m["module"]: m for m in report["comparisons"][0]["layerwise"]["modules"]}
    assert moe["layers.0.ffn"]["routing_flips"] == 0 and moe["layers.0.ffn"]["router_logits_passed"]
    assert moe["layers.1.ffn"]["routing_flips"] > 0 and not moe["layers.1.ffn"]["router_logits_passed"]
    assert report["first_divergent_routing_flips"] is None  # the router is wrong: no rounding excuse
    assert "routing flips" in (artifact.path / "report" / "report.md").read_text()


# --- when routing near-ties account for the first divergence ---------------------------


def _moe(module: str, flipped: list[int], tokens: int = 8, logits_agree: bool = True, passed: bool = True) -> ModuleResult:
    return ModuleResult(module, layer_of(module), {
        "passed": passed, "routing_flips": len(flipped), "routed_tokens": tokens,
        "router_logits_passed": logits_agree, "flipped_tokens": flipped,
    })


def _other(module: str, passed: bool = True) -> ModuleResult:
    return ModuleResult(module, layer_of(module), {"passed": passed})


def test_tokens_out_of_tolerance_by_hand() -> None:
    expected = np.zeros((2, 3, 4))  # 6 tokens of 4 values
    actual = expected.copy()
    actual[0, 1, 2] = 0.5  # token 1
    actual[1, 2, 0] = np.nan  # token 5: NaN is out of tolerance
    actual[1, 0, 3] = 1e-3  # token 3, within atol 1e-2
    assert tokens_out_of_tolerance(expected, actual, 1e-2, 0.0) == {1, 5}


def test_flips_in_the_divergent_moe_explain_it() -> None:
    modules = [_other("layers.0.attn"), _moe("layers.0.ffn", [2, 5], passed=False)]
    assert routing_explanation(modules, 8, {2, 5}) == (2, ["layers.0.ffn"])
    assert routing_explanation(modules, 8, {5}) == (1, ["layers.0.ffn"])


def test_upstream_flips_explain_a_later_module() -> None:
    """The tiny fp16 decoder's case: one near-tie in layers.1.ffn, out of tolerance first at `norm`."""
    modules = [_moe("layers.0.ffn", []), _moe("layers.1.ffn", [59], tokens=128), _other("norm", passed=False)]
    assert routing_explanation(modules, 128, {59}) == (1, ["layers.1.ffn"])


def test_a_token_that_did_not_flip_leaves_it_unexplained() -> None:
    modules = [_moe("layers.0.ffn", [2]), _other("layers.0", passed=False)]
    assert routing_explanation(modules, 8, {2, 3}) is None


def test_flips_with_disagreeing_router_logits_explain_nothing() -> None:
    modules = [_moe("layers.0.ffn", [2], logits_agree=False, passed=False)]
    assert routing_explanation(modules, 8, {2}) is None


def test_flips_over_other_tokens_explain_nothing() -> None:
    """Token numbers mean the same rows only when the MoE routes as many tokens as the module has."""
    modules = [_moe("ffn", [2], tokens=8), _other("out", passed=False)]
    assert routing_explanation(modules, 16, {2}) is None


def test_no_tokens_out_of_tolerance_is_no_explanation() -> None:
    assert routing_explanation([_moe("ffn", [1], passed=False)], 8, set()) is None
