"""What ONNX Runtime's com.microsoft::QMoE computes on the CPU, pinned, because the quantized
contrib lowering (plugins/moe.lower_to_contrib) relies on it: it reads a quantized artifact's
own bytes (codes (E, N, K * bits / 8) raw, scales (E, N, K / block), zero points packed per
row; without zero points, unsigned codes around 2^(bits-1): signed codes with their top bit
flipped), int4 at accuracy level 0 is the dequantized products, and it renormalises the top-k
routing weights even when normalize_routing_weights is 0 (so the lowering routes such nodes
on graph ops). The reference is a token-by-token float64 loop, independent of moedeploy's MoE."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from moedeploy.models.blockquant import QuantScheme, pack, quantize
from moedeploy.runtime.ort import older_than_tested
from moedeploy.runtime.qmoe_check import QMoENode, qmoe_refusal

E, H, I, N, K = 4, 64, 96, 5, 2  # noqa: E741  (down rows: 96 / 32 = 3 blocks, zero points repacked per row)


def _hand_moe(x, logits, w1, w2, renormalise: bool) -> np.ndarray:
    """SwiGLU experts on interleaved fc1 rows (gate 2i, up 2i+1), softmax top-k routing."""
    x, logits, w1, w2 = (t.double() for t in (x, logits, w1, w2))
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        probs = torch.softmax(logits[n], -1)
        top = torch.topk(probs, K).indices.tolist()
        total = sum(probs[e] for e in top) if renormalise else 1.0
        for e in top:
            h = w1[e] @ x[n]
            gate, up = h[0::2], h[1::2]
            out[n] += probs[e] / total * (w2[e] @ (gate * torch.sigmoid(gate) * up))
    return out.numpy()


def _qmoe(x, logits, q1, q2, bits: int, normalize: int, accuracy: int) -> np.ndarray:
    if q1.zero_point is None:  # signed codes: flip each value's top bit, no zero points
        flip = 0x88 if bits == 4 else 0x80
        parts = ((q1.packed_codes() ^ flip, "w1"), (q1.scale, "s1"), (q2.packed_codes() ^ flip, "w2"), (q2.scale, "s2"))
        zero_points = ["", ""]
    else:
        parts = ((q1.packed_codes(), "w1"), (q1.scale, "s1"), (q2.packed_codes(), "w2"), (q2.scale, "s2"),
                 (pack(q1.zero_point, bits), "z1"), (pack(q2.zero_point, bits), "z2"))
        zero_points = ["z1", "z2"]
    inits = [numpy_helper.from_array(a.numpy(), n) for a, n in parts]
    node = helper.make_node(
        "QMoE", ["x", "r", "w1", "s1", "", "w2", "s2", "", "", "", "", *zero_points], ["y"], domain="com.microsoft",
        k=K, normalize_routing_weights=normalize, activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0,
        activation_beta=0.0, expert_weight_bits=bits, block_size=32, accuracy_level=accuracy, weights_prepacked=0)
    graph = helper.make_graph(
        [node], "qmoe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, H]),
                         helper.make_tensor_value_info("r", TensorProto.FLOAT, [N, E])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, H])], inits)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x.numpy(), "r": logits.numpy()})[0]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("normalize", [1, 0])
def test_qmoe_reads_our_bytes_and_always_renormalises(bits: int, normalize: int, symmetric: bool) -> None:
    reason = qmoe_refusal(QMoENode(bits, 32, not symmetric, 0))
    if reason and older_than_tested(ort.__version__):  # (1.30's) the lowering keeps off QMoE there
        pytest.skip(reason)
    g = torch.Generator().manual_seed(bits)
    x, logits = torch.randn(N, H, generator=g), torch.randn(N, E, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) / 8
    w2 = torch.randn(E, H, I, generator=g) / 10
    q1, q2 = quantize(w1, QuantScheme(bits, 32, symmetric)), quantize(w2, QuantScheme(bits, 32, symmetric))
    got = _qmoe(x, logits, q1, q2, bits, normalize, accuracy=0)
    renormalised = _hand_moe(x, logits, q1.dequantize(), q2.dequantize(), renormalise=True)
    plain = _hand_moe(x, logits, q1.dequantize(), q2.dequantize(), renormalise=False)
    # int4 at level 0: the dequantized products; int8 has int8 activations at every level
    tolerance = 1e-5 if bits == 4 else 0.05
    np.testing.assert_allclose(got, renormalised, atol=tolerance)
    # normalize_routing_weights=0 is not honoured: far from the plain weights' answer
    assert np.abs(got - plain).max() > 5 * np.abs(got - renormalised).max() + 1e-3
