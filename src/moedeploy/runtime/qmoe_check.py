"""Whether this ONNX Runtime's com.microsoft::QMoE computes what the quantized lowering asks of it.

QMoE's block-wise form (the `block_size` and `accuracy_level` attributes, zero points as inputs
11 and 12) is recent: ONNX Runtime 1.30 refuses the node ("Unrecognized attribute:
accuracy_level for operator QMoE"), so a quantized artifact lowered onto it would not load there,
although pyproject admits older releases. A release whose QMoE read the same bytes differently
would be worse: a silent wrong answer. So before the lowering puts a quantized artifact's experts
on QMoE, `qmoe_refusal` runs one tiny QMoE node with the attributes and inputs the lowering writes
(plugins/moe.lower_to_contrib) against a float64 loop over the dequantized weights. Where ONNX
Runtime refuses it or disagrees, the experts take the per-expert lowering instead (MatMulNBits,
in every release the project admits; about 0.7x QMoE's decode on the `small` preset) and one
warning says why. The answer is cached for the process: a probe costs a few milliseconds.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from moedeploy.models.blockquant import QuantScheme, pack, quantize
from moedeploy.runtime.quantized import SIGN_FLIP

log = logging.getLogger(__name__)

# Two blocks per fc1 row, one (an odd count: zero points packed per row) per fc2 row.
_E, _H, _I, _N, _K, _BLOCK = 4, 64, 32, 3, 2, 32


def _reference(x: np.ndarray, logits: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """Softmax top-k routing, renormalised; SwiGLU experts on interleaved fc1 rows (gate 2i, up 2i+1)."""
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        probs = np.exp(logits[n] - logits[n].max())
        probs /= probs.sum()
        top = np.argsort(-probs)[:_K]
        for e in top:
            h = w1[e] @ x[n]
            gate, up = h[0::2], h[1::2]
            out[n] += probs[e] / probs[top].sum() * (w2[e] @ (gate / (1 + np.exp(-gate)) * up))
    return out


def _probe_model(bits: int, zero_points: bool, accuracy_level: int, extra: dict | None):
    """A one-node QMoE model over random blocked weights, and the float64 reference output."""
    from onnx import TensorProto, helper, numpy_helper

    g = torch.Generator().manual_seed(bits)
    x, logits = torch.randn(_N, _H, generator=g), torch.randn(_N, _E, generator=g)
    scheme = QuantScheme(bits, _BLOCK, symmetric=not zero_points)
    q1 = quantize(torch.randn(_E, 2 * _I, _H, generator=g) / 8, scheme)
    q2 = quantize(torch.randn(_E, _H, _I, generator=g) / 6, scheme)
    if zero_points:
        parts = [(q1.packed_codes(), "w1"), (q1.scale, "s1"), (q2.packed_codes(), "w2"), (q2.scale, "s2"),
                 (pack(q1.zero_point, bits), "z1"), (pack(q2.zero_point, bits), "z2")]
    else:  # signed codes reach QMoE as unsigned ones around 2^(bits-1), as runtime/quantized feeds them
        parts = [(q1.packed_codes() ^ SIGN_FLIP[bits], "w1"), (q1.scale, "s1"),
                 (q2.packed_codes() ^ SIGN_FLIP[bits], "w2"), (q2.scale, "s2")]
    zp_inputs = ["z1", "z2"] if zero_points else []
    attributes = {"k": _K, "normalize_routing_weights": 1, "activation_type": "swiglu", "swiglu_fusion": 1,
                  "activation_alpha": 1.0, "activation_beta": 0.0, "expert_weight_bits": bits,
                  "block_size": _BLOCK, "accuracy_level": accuracy_level, "weights_prepacked": 0, **(extra or {})}
    node = helper.make_node("QMoE", ["x", "r", "w1", "s1", "", "w2", "s2", "", "", "", "", *zp_inputs], ["y"],
                            domain="com.microsoft", **attributes)
    graph = helper.make_graph(
        [node], "qmoe_check",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [_N, _H]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, [_N, _E])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [_N, _H])],
        [numpy_helper.from_array(t.numpy(), name) for t, name in parts])
    # IR 10 and opset 21: what every ONNX Runtime the project admits reads
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                    helper.make_opsetid("com.microsoft", 1)])
    inputs = {"x": x.numpy(), "r": logits.numpy()}
    expected = _reference(x.double().numpy(), logits.double().numpy(), q1.dequantize().double().numpy(),
                          q2.dequantize().double().numpy())
    return model, inputs, expected


@functools.cache
def qmoe_refusal(bits: int, zero_points: bool, accuracy_level: int, extra: tuple = ()) -> str | None:
    """None where this ONNX Runtime's CPU QMoE loads the lowering's node for `bits`-bit blocked
    experts (with or without zero points, at `accuracy_level`) and computes what the dequantized
    weights give; else why not, in one line. `extra`: attributes to add, as (name, value) pairs
    (a test's way to make a node the runtime refuses)."""
    import onnxruntime as ort

    model, inputs, expected = _probe_model(bits, zero_points, accuracy_level, dict(extra))
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        got = session.run(None, inputs)[0].astype(np.float64)
    except Exception as e:  # onnxruntime raises its own exception types
        detail = str(e).strip().splitlines()[-1].rsplit(" Error ", 1)[-1]  # past the node's signature
        reason = f"it refuses the node ({detail})"
    else:
        # int8 activations (int8 experts, or level 4) cost a few percent; a misread byte costs all
        error = float(np.abs(got - expected).max()) / float(np.abs(expected).max())
        reason = None if error <= 0.05 else f"its output differs from the dequantized weights' by {error:.0%}"
    if reason is None:
        return None
    message = (f"ONNX Runtime {ort.__version__}'s QMoE cannot run int{bits} experts "
               f"({'with' if zero_points else 'without'} zero points, accuracy level {accuracy_level}): {reason}")
    log.warning("%s; they run per expert on MatMulNBits instead (slower; a newer onnxruntime has QMoE)", message)
    return message
