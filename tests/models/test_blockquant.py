"""Block quantization against hand-computed blocks, llama.cpp's q8_0/q4_0 (gguf's reference
quantizer), ONNX's reference DequantizeLinear, and ONNX Runtime's MatMulNBits on our bytes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from moedeploy.models.blockquant import (
    BlockQuantized,
    QuantScheme,
    pack,
    quantize,
    round_half_away,
    unpack,
)

SCHEMES = [QuantScheme(8), QuantScheme(4), QuantScheme(8, 32, False), QuantScheme(4, 16, False)]


def test_int8_symmetric_block_by_hand() -> None:
    w = torch.zeros(1, 16)
    w[0, :5] = torch.tensor([1.27, -0.635, 0.004, 0.015, -1.0])
    q = quantize(w, QuantScheme(8, 16))
    assert q.scale.item() == pytest.approx(0.01)  # max|w| / 127
    # round(w / 0.01) + 128, halves away from zero: 127, -63.5 -> -64, 0.4 -> 0, 1.5 -> 2, -100
    assert q.codes[0, :5].tolist() == [255, 64, 128, 130, 28]
    assert q.zero_point.tolist() == [[128]]
    assert q.dequantize()[0, :5].tolist() == pytest.approx([1.27, -0.64, 0.0, 0.02, -1.0])


def test_int4_symmetric_blocks_by_hand_keep_the_largest_magnitude_exact() -> None:
    w = torch.zeros(2, 16)
    w[0, :5] = torch.tensor([-0.8, 0.75, 0.25, -0.25, 0.04])  # largest magnitude negative
    w[1, :3] = torch.tensor([0.8, -0.75, 0.25])  # largest magnitude positive
    q = quantize(w, QuantScheme(4, 16))
    assert q.scale.flatten().tolist() == pytest.approx([0.1, 0.1])  # max|w| / 8, positive
    assert q.zero_point.flatten().tolist() == [8, 7]
    # row 0: round(w / 0.1) + 8, clamped to 0..15: -8 -> 0, 7.5 -> 8 -> 15, 2.5 -> 3 -> 11, -3 -> 5, 0.4 -> 8
    assert q.codes[0, :5].tolist() == [0, 15, 11, 5, 8]
    # row 1: round(w / 0.1) + 7: 8 -> 15, -7.5 -> -8 -> 0 (clamped: q4_0's one-sided range), 3 -> 10
    assert q.codes[1, :3].tolist() == [15, 0, 10]
    d = q.dequantize()
    assert d[0, :5].tolist() == pytest.approx([-0.8, 0.7, 0.3, -0.3, 0.0])
    assert d[1, :3].tolist() == pytest.approx([0.8, -0.7, 0.3])
    assert d[0, 5:].abs().max() == 0 and d[1, 3:].abs().max() == 0


def test_asymmetric_uint4_block_by_hand() -> None:
    w = torch.zeros(1, 16)
    w[0, :4] = torch.tensor([-0.5, 1.0, 0.25, 0.6])  # range [-0.5, 1.0]: 15 steps of 0.1
    q = quantize(w, QuantScheme(4, 16, symmetric=False))
    assert q.scale.item() == pytest.approx(0.1)
    assert q.zero_point.item() == 5  # round(0.5 / 0.1)
    assert q.codes[0, :4].tolist() == [0, 15, 8, 11]  # 2.5 -> 3, 6 -> 6, + 5
    assert q.codes[0, 4:].tolist() == [5] * 12  # zero stays exact
    assert q.dequantize()[0, :4].tolist() == pytest.approx([-0.5, 1.0, 0.3, 0.6])


def test_positive_only_asymmetric_block_widens_to_include_zero() -> None:
    w = torch.linspace(1.0, 2.5, 16).reshape(1, 16)
    q = quantize(w, QuantScheme(8, 16, symmetric=False))
    assert q.zero_point.item() == 0
    assert q.scale.item() == pytest.approx(2.5 / 255)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.name}-{s.block_size}-{'sym' if s.symmetric else 'asym'}")
def test_an_all_zero_block_has_scale_zero_and_dequantizes_to_zero(scheme: QuantScheme) -> None:
    w = torch.zeros(3, 2 * scheme.block_size)
    w[1, scheme.block_size:] = torch.randn(scheme.block_size)
    q = quantize(w, scheme)
    assert q.scale[0].abs().max() == 0 and q.scale[1, 0] == 0
    d = q.dequantize()
    assert torch.isfinite(d).all() and d[0].abs().max() == 0 and d[1, : scheme.block_size].abs().max() == 0


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.name}-{s.block_size}-{'sym' if s.symmetric else 'asym'}")
def test_error_is_at_most_half_a_step_inside_the_range(scheme: QuantScheme) -> None:
    w = torch.randn(8, 4, 128)  # stacked experts (E, N, K)
    q = quantize(w, scheme)
    assert q.codes.shape == w.shape and q.codes.dtype == torch.uint8
    assert q.scale.shape == q.zero_point.shape == (8, 4, 128 // scheme.block_size)
    assert int(q.codes.max()) < scheme.levels
    step = q.scale.repeat_interleave(scheme.block_size, -1)
    error = (q.dequantize() - w).abs()
    # q4_0's range is one-sided by a step: the far end opposite the largest magnitude clamps
    slack = 1.0 if scheme.symmetric and scheme.bits == 4 else 0.5
    assert (error <= slack * step * (1 + 1e-5) + 1e-7).all()


def test_a_block_size_that_does_not_divide_k_is_refused() -> None:
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        quantize(torch.randn(2, 48), QuantScheme(8, 32))
    with pytest.raises(ValueError, match="power of two"):
        QuantScheme(4, 24)
    with pytest.raises(ValueError, match="choose 8 or 4"):
        QuantScheme(2)


def test_round_half_away_from_zero() -> None:
    x = torch.tensor([2.5, -2.5, 0.5, -0.5, 1.49, -1.51])
    assert round_half_away(x).tolist() == [3.0, -3.0, 1.0, -1.0, 1.0, -2.0]


def test_uint4_packing_puts_the_lower_index_in_the_low_nibble() -> None:
    codes = torch.tensor([[1, 2, 3, 4, 15]], dtype=torch.uint8)
    packed = pack(codes, 4)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert unpack(packed, 4, 5).tolist() == codes.tolist()
    assert pack(codes, 8).tolist() == codes.tolist()


# --- llama.cpp's own quantizers (gguf-py's numpy port of ggml-quants.c)


def _gguf_codes(weights: np.ndarray, qtype) -> np.ndarray:
    """The unsigned codes of each value in gguf's Q8_0 / Q4_0 blocks of 32: (rows, K)."""
    from gguf import GGMLQuantizationType, quants

    raw = quants.quantize(weights, qtype).reshape(weights.shape[0], -1)
    if qtype == GGMLQuantizationType.Q8_0:  # per block: fp16 d, then 32 int8
        blocks = raw.reshape(weights.shape[0], -1, 34)[..., 2:]
        return (blocks.view(np.int8).astype(np.int16) + 128).reshape(weights.shape)
    blocks = raw.reshape(weights.shape[0], -1, 18)[..., 2:]  # Q4_0: fp16 d, then byte j holds j and j + 16
    return np.concatenate([blocks & 0x0F, blocks >> 4], axis=-1).reshape(weights.shape).astype(np.int16)


def test_symmetric_codes_are_llama_cpp_q8_0_and_q4_0() -> None:
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    ours8 = quantize(torch.from_numpy(w), QuantScheme(8, 32)).codes.numpy().astype(np.int16)
    theirs8 = _gguf_codes(w, gguf.GGMLQuantizationType.Q8_0)
    q4 = quantize(torch.from_numpy(w), QuantScheme(4, 32))
    ours4 = q4.codes.numpy().astype(np.int16)
    theirs4 = _gguf_codes(w, gguf.GGMLQuantizationType.Q4_0)
    # q4_0 scales by max / -8: where that max is positive its codes count the other way round
    positive = (q4.zero_point == 7).numpy().repeat(32, axis=-1)
    theirs4 = np.where(positive, 15 - theirs4, theirs4)
    for ours, theirs in ((ours8, theirs8), (ours4, theirs4)):
        # x / d here, x * (1 / d) and half-up ties there: a code may differ by one at a near-tie
        assert np.abs(ours - theirs).max() <= 1
        assert (ours == theirs).mean() > 0.999


# --- the bytes as ONNX DequantizeLinear (reference evaluator, ONNX Runtime) and MatMulNBits read them


def _dequantize_model(q: BlockQuantized) -> onnx.ModelProto:
    n, k = q.codes.shape
    elem = TensorProto.UINT4 if q.scheme.bits == 4 else TensorProto.UINT8
    codes = helper.make_tensor("codes", elem, [n, k], q.packed_codes().numpy().tobytes(), raw=True)
    # ONNX packs a tensor's 4-bit values flattened (MatMulNBits packs zero points per row): with an
    # odd number of blocks per row the two differ, as here for int4 in blocks of 32 over 96
    zero = helper.make_tensor("zero", elem, list(q.zero_point.shape),
                              pack(q.zero_point.flatten(), q.scheme.bits).numpy().tobytes(), raw=True)
    scale = onnx.numpy_helper.from_array(q.scale.numpy(), "scale")
    node = helper.make_node("DequantizeLinear", ["codes", "scale", "zero"], ["w"], axis=1,
                            block_size=q.scheme.block_size)
    graph = helper.make_graph([node], "dq", [], [helper.make_tensor_value_info("w", TensorProto.FLOAT, [n, k])],
                              [codes, scale, zero])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.name}-{s.block_size}-{'sym' if s.symmetric else 'asym'}")
def test_dequantize_linear_reads_the_packed_bytes_as_we_do(scheme: QuantScheme) -> None:
    import onnxruntime as ort

    q = quantize(torch.randn(6, 96), scheme)
    model = _dequantize_model(q)
    onnx.checker.check_model(model)
    expected = q.dequantize().numpy()
    np.testing.assert_allclose(ReferenceEvaluator(model).run(None, {})[0], expected, rtol=0, atol=1e-6)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {})[0], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.name}-{s.block_size}-{'sym' if s.symmetric else 'asym'}")
def test_matmul_nbits_on_our_bytes_equals_the_dequantized_matmul(scheme: QuantScheme) -> None:
    import onnxruntime as ort

    n, k = 48, 128
    weight = torch.randn(n, k)
    q = quantize(weight, scheme)
    blocks = k // scheme.block_size
    b = q.packed_codes().reshape(n, blocks, scheme.block_size * scheme.bits // 8)  # a view, no reordering
    inits = [onnx.numpy_helper.from_array(b.numpy(), "b"), onnx.numpy_helper.from_array(q.scale.numpy(), "scales"),
             onnx.numpy_helper.from_array(q.packed_zero_points().numpy(), "zero_points")]
    node = helper.make_node("MatMulNBits", ["a", "b", "scales", "zero_points"], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=scheme.bits, block_size=scheme.block_size, accuracy_level=0)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    a = torch.randn(3, k)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a.numpy()})[0]
    np.testing.assert_allclose(y, (a @ q.dequantize().T).numpy(), rtol=1e-4, atol=1e-4)
