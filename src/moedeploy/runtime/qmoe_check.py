"""Whether this ONNX Runtime's com.microsoft::QMoE computes what the quantized lowering asks of it.

QMoE's block-wise form (the `block_size` and `accuracy_level` attributes, zero points as inputs
11 and 12) is recent: ONNX Runtime 1.30 refuses the node ("Unrecognized attribute:
accuracy_level for operator QMoE"), so a quantized artifact lowered onto it would not load in an
environment that holds an older onnxruntime than pyproject asks for (a GPU machine's image did).
A release whose QMoE read the same bytes differently would be worse: a silent wrong answer. So
before the lowering puts a quantized artifact's experts on QMoE, `qmoe_refusal` runs one tiny QMoE
node with the attributes and inputs the lowering would write for them (the same bits, block
size, zero points or signed codes, accuracy level, activation and its parameters, and biases;
plugins/moe.lower_to_contrib's attribute helpers) against the eager MoE (`moe_reference`) on the
dequantized weights in float64. Where ONNX Runtime refuses it or disagrees, the experts stay off
QMoE (per expert on MatMulNBits, or com.microsoft::MoE over the dequantized weights) and one
warning says why. Each answer is cached for the process: a probe costs milliseconds.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from moedeploy.models.blockquant import QuantScheme, pack, quantize
from moedeploy.plugins.moe import (
    ExpertActivation,
    Routing,
    contrib_activation_attributes,
    moe_reference,
    qmoe_attributes,
)
from moedeploy.runtime.ort import TESTED_ONNXRUNTIME
from moedeploy.runtime.quantized import SIGN_FLIP

log = logging.getLogger(__name__)

_E, _N, _K = 4, 3, 2  # experts, tokens, top-k


@dataclass(frozen=True)
class QMoENode:
    """What of a QMoE node the lowering would write can change what ONNX Runtime does with it."""

    bits: int
    block_size: int
    zero_points: bool  # unsigned codes with zero points; else signed codes, sign-flipped
    accuracy_level: int
    activation: ExpertActivation = field(default_factory=ExpertActivation)
    fc1_bias: bool = False
    fc2_bias: bool = False

    def describe(self) -> str:
        biases = " with biases" if self.fc1_bias or self.fc2_bias else ""
        return (f"int{self.bits} experts in blocks of {self.block_size} "
                f"({'with' if self.zero_points else 'without'} zero points, accuracy level {self.accuracy_level}, "
                f"{self.activation.activation}{biases})")


def _probe(node: QMoENode, extra: dict):
    """A one-node QMoE model over random blocked weights, its inputs, and the eager MoE's output
    on the dequantized weights in float64. fc1 rows hold two blocks, fc2 rows one (an odd
    count: zero points packed per row)."""
    from onnx import TensorProto, helper, numpy_helper

    hidden, inter = 2 * node.block_size, node.block_size
    swiglu = node.activation.activation == "swiglu"
    rows = 2 * inter if swiglu else inter
    g = torch.Generator().manual_seed(node.bits)
    x, logits = torch.randn(_N, hidden, generator=g), torch.randn(_N, _E, generator=g)
    scheme = QuantScheme(node.bits, node.block_size, symmetric=not node.zero_points)
    q1 = quantize(torch.randn(_E, rows, hidden, generator=g) / 4, scheme)
    q2 = quantize(torch.randn(_E, hidden, inter, generator=g) / 4, scheme)
    b1 = torch.randn(_E, rows, generator=g) / 4 if node.fc1_bias else None
    b2 = torch.randn(_E, hidden, generator=g) / 4 if node.fc2_bias else None
    if node.zero_points:
        parts = [(q1.packed_codes(), "w1"), (q1.scale, "s1"), (q2.packed_codes(), "w2"), (q2.scale, "s2"),
                 (pack(q1.zero_point, node.bits), "z1"), (pack(q2.zero_point, node.bits), "z2")]
    else:  # signed codes reach QMoE as unsigned ones around 2^(bits-1), as runtime/quantized feeds them
        parts = [(q1.packed_codes() ^ SIGN_FLIP[node.bits], "w1"), (q1.scale, "s1"),
                 (q2.packed_codes() ^ SIGN_FLIP[node.bits], "w2"), (q2.scale, "s2")]
    parts += [(b, name) for b, name in ((b1, "b1"), (b2, "b2")) if b is not None]
    inputs = ["x", "r", "w1", "s1", "b1" if node.fc1_bias else "", "w2", "s2", "b2" if node.fc2_bias else "",
              "", "", "", *(["z1", "z2"] if node.zero_points else [])]
    attributes = {"k": _K, "normalize_routing_weights": 1, **contrib_activation_attributes(node.activation),
                  **qmoe_attributes(node.bits, node.block_size, node.accuracy_level), **extra}
    onnx_node = helper.make_node("QMoE", inputs, ["y"], domain="com.microsoft", **attributes)
    graph = helper.make_graph(
        [onnx_node], "qmoe_check",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [_N, hidden]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, [_N, _E])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [_N, hidden])],
        [numpy_helper.from_array(t.contiguous().numpy(), name) for t, name in parts])
    # IR 10 and opset 21: what every ONNX Runtime of recent years reads
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                    helper.make_opsetid("com.microsoft", 1)])
    w1, w2 = q1.dequantize().double(), q2.dequantize().double()
    f64 = (lambda t: None if t is None else t.double())  # noqa: E731
    if swiglu:  # interleaved fc1 rows: gate even, up odd
        w_gate, w_up = w1[:, 0::2], w1[:, 1::2]
        b_gate, b_up = (None, None) if b1 is None else (f64(b1[:, 0::2]), f64(b1[:, 1::2]))
    else:
        w_gate, w_up, b_gate, b_up = None, w1, None, f64(b1)
    expected = moe_reference(x.double(), logits.double(), w_gate, w_up, w2, Routing(_K, True),
                             activation=node.activation, b_gate=b_gate, b_up=b_up, b_down=f64(b2))
    return model, {"x": x.numpy(), "r": logits.numpy()}, expected.numpy()


@functools.cache
def qmoe_refusal(node: QMoENode, extra: tuple = ()) -> str | None:
    """None where this ONNX Runtime's CPU QMoE loads such a node and computes what the
    dequantized weights give (within 5%: int8 activations cost a few percent, a misread byte
    costs all); else why not, in one line. `extra`: attributes to add or override, as (name,
    value) pairs (a test's way to make a node the runtime refuses or misreads)."""
    import onnxruntime as ort

    model, inputs, expected = _probe(node, dict(extra))
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        got = session.run(None, inputs)[0].astype(np.float64)
    except Exception as e:  # onnxruntime raises its own exception types
        lines = str(e).strip().splitlines() or [type(e).__name__]
        detail = lines[-1].rsplit(" Error ", 1)[-1]  # past the node's signature
        reason = f"it refuses the node ({detail})"
    else:
        error = float(np.abs(got - expected).max()) / float(np.abs(expected).max())
        reason = None if error <= 0.05 else f"its output differs from the dequantized weights' by {error:.0%}"
    if reason is None:
        return None
    message = f"ONNX Runtime {ort.__version__}'s QMoE cannot run {node.describe()}: {reason}"
    log.warning("%s; those experts stay off QMoE (slower; onnxruntime >= %s has it)", message,
                ".".join(map(str, TESTED_ONNXRUNTIME)))
    return message
