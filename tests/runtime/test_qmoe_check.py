"""runtime/qmoe_check: the probe that decides whether a quantized artifact's experts may run on this
ONNX Runtime's com.microsoft::QMoE. ONNX Runtime 1.30 (a GPU machine's, 2026-11-27) refused the
block-wise node the lowering writes ("Unrecognized attribute: accuracy_level"), so the lowering
must ask first; a QMoE that loads but computes something else must be caught too."""

from __future__ import annotations

import logging

import onnxruntime as ort
import pytest

from moedeploy.runtime.qmoe_check import qmoe_refusal


@pytest.mark.parametrize("accuracy_level", [0, 4])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_this_onnxruntime_runs_the_lowerings_qmoe_node_as_the_dequantized_weights(bits, zero_points,
                                                                                 accuracy_level) -> None:
    assert qmoe_refusal(bits, zero_points, accuracy_level) is None


def test_a_node_the_runtime_refuses_is_named_and_warned_once(caplog) -> None:
    """An attribute this ONNX Runtime does not know, as accuracy_level was to 1.30."""
    with caplog.at_level(logging.WARNING, logger="moedeploy.runtime.qmoe_check"):
        reason = qmoe_refusal(4, False, 0, (("not_an_attribute", 1),))
        assert qmoe_refusal(4, False, 0, (("not_an_attribute", 1),)) == reason  # cached: asked once
    assert reason == (f"ONNX Runtime {ort.__version__}'s QMoE cannot run int4 experts (without zero points, "
                      "accuracy level 0): it refuses the node (Unrecognized attribute: not_an_attribute for "
                      "operator QMoE)")
    assert [r.getMessage() for r in caplog.records] == [
        f"{reason}; they run per expert on MatMulNBits instead (slower; a newer onnxruntime has QMoE)"]


def test_a_node_that_loads_but_computes_something_else_is_refused() -> None:
    """SwiGLU's alpha doubled behind the reference's back: the node loads and runs, and its answer
    is not the dequantized weights' (as a release that read the bytes differently would be)."""
    reason = qmoe_refusal(4, True, 0, (("activation_alpha", 2.0),))
    assert reason is not None and "its output differs from the dequantized weights' by" in reason
