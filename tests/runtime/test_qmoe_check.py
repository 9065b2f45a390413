"""runtime/qmoe_check: the probe that decides whether a quantized artifact's experts may run on this
ONNX Runtime's com.microsoft::QMoE. ONNX Runtime 1.30 (a GPU machine's, 2026-11-27) refused the
block-wise node the lowering writes ("Unrecognized attribute: accuracy_level"), so the lowering
must ask first, for the node it would write; a QMoE that loads but computes something else must be
caught too. The probe's reference is the eager MoE (moe_reference, itself checked against
transformers) on the dequantized weights."""

from __future__ import annotations

import logging

import onnxruntime as ort
import pytest

from moedeploy.plugins.moe import ExpertActivation
from moedeploy.runtime.qmoe_check import QMoENode, qmoe_refusal

GPT_OSS = ExpertActivation("swiglu", 1.702, 1.0, 7.0)


@pytest.mark.parametrize("accuracy_level", [0, 4])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_this_onnxruntime_runs_the_lowerings_qmoe_node_as_the_dequantized_weights(bits, zero_points,
                                                                                 accuracy_level) -> None:
    assert qmoe_refusal(QMoENode(bits, 32, zero_points, accuracy_level)) is None


@pytest.mark.parametrize("node", [
    QMoENode(4, 16, False, 0), QMoENode(4, 128, True, 4), QMoENode(8, 64, False, 4),
    QMoENode(4, 32, False, 0, GPT_OSS, fc1_bias=True, fc2_bias=True),  # clamped SwiGLU with biases
    QMoENode(4, 32, True, 4, ExpertActivation("relu")),
], ids=["block16", "block128-zp", "int8-block64", "gpt-oss", "relu"])
def test_every_variant_the_lowering_writes_is_probed_as_written(node) -> None:
    assert qmoe_refusal(node) is None


def test_a_node_the_runtime_refuses_is_named_and_warned_once(caplog) -> None:
    """An attribute this ONNX Runtime does not know, as accuracy_level was to 1.30."""
    node = QMoENode(4, 32, False, 0)
    with caplog.at_level(logging.WARNING, logger="moedeploy.runtime.qmoe_check"):
        reason = qmoe_refusal(node, (("not_an_attribute", 1),))
        assert qmoe_refusal(node, (("not_an_attribute", 1),)) == reason  # cached: asked once
    assert reason == (f"ONNX Runtime {ort.__version__}'s QMoE cannot run int4 experts in blocks of 32 (without "
                      "zero points, accuracy level 0, swiglu): it refuses the node (Unrecognized attribute: "
                      "not_an_attribute for operator QMoE)")
    assert [r.getMessage() for r in caplog.records] == [
        f"{reason}; those experts stay off QMoE (slower; onnxruntime >= 1.32 has it)"]


@pytest.mark.parametrize("override", [("activation_alpha", 0.5), ("activation_beta", 0.0), ("swiglu_limit", 1.0)])
def test_a_node_that_loads_but_computes_something_else_is_refused(override) -> None:
    """gpt-oss's SwiGLU with alpha 0.5 for 1.702, beta 0 for 1, or a clamp at 1 for 7, behind the reference's back:
    the node loads and runs, and its answer is not the dequantized weights' (as a release that
    read the bytes or the attributes differently would give)."""
    reason = qmoe_refusal(QMoENode(4, 32, True, 0, GPT_OSS, fc1_bias=True), (override,))
    assert reason is not None and "its output differs from the dequantized weights' by" in reason
