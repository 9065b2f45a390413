"""Block quantization against hand-computed blocks, a brute force of the int4 search, llama.cpp's
q8_0/q4_0 (gguf's reference quantizer), ONNX's reference DequantizeLinear, and ONNX Runtime's
MatMulNBits on our bytes."""

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
    # round(w / 0.01), halves away from zero: 127, -63.5 -> -64, 0.4 -> 0, 1.5 -> 2, -100; signed, no zero point
    assert q.codes.dtype == torch.int8 and q.codes[0, :5].tolist() == [127, -64, 0, 2, -100]
    assert q.zero_point is None
    assert q.dequantize()[0, :5].tolist() == pytest.approx([1.27, -0.64, 0.0, 0.02, -1.0])


def test_int4_symmetric_blocks_of_tenths_come_back_exact_whatever_the_sign_of_their_largest_magnitude() -> None:
    w = torch.zeros(2, 16)
    w[0, :4] = torch.tensor([-0.8, -0.4, 0.2, 0.7])  # largest magnitude negative: scale max / 8
    w[1, :3] = torch.tensor([0.7, -0.3, 0.1])  # largest magnitude positive: scale max / 7
    q = quantize(w, QuantScheme(4, 16))
    # only codes proportional to these values are exact, and in [-8, 7] only these: the search
    # finds them (divisor 8 for row 0, 7 for row 1) and their least-squares scale, 0.1
    assert q.scale.flatten().tolist() == pytest.approx([0.1, 0.1])
    assert q.zero_point is None
    assert q.codes[0, :4].tolist() == [-8, -4, 2, 7] and q.codes[1, :3].tolist() == [7, -3, 1]
    d = q.dequantize()
    assert d[0, :4].tolist() == pytest.approx([-0.8, -0.4, 0.2, 0.7])
    assert d[1, :3].tolist() == pytest.approx([0.7, -0.3, 0.1])
    assert d[0, 4:].abs().max() == 0 and d[1, 3:].abs().max() == 0
    # a fixed max / 8 (q4_0's magnitude with a positive scale) could not: 0.7 / 0.0875 = 8 clamps to 7
    assert abs(0.7 / 8 * 7 - 0.7) > 0.08


def _int4_search_by_brute_force(block: np.ndarray) -> tuple[np.ndarray, float]:
    """The documented int4 search, written out per block in float64: each divisor's codes, their
    least-squares scale, the squared error computed directly; the first smallest wins."""
    amax = np.abs(block).max()
    if amax == 0:
        return np.zeros_like(block), 0.0
    best = None
    for d in np.arange(6.5, 9.01, 0.25):
        x = block * (d / amax)
        q = np.clip(np.sign(x) * np.floor(np.abs(x) + 0.5), -8, 7)
        s = (block * q).sum() / (q * q).sum()
        error = ((block - q * s) ** 2).sum()
        if best is None or error < best[2] - 1e-12 * (block ** 2).sum():
            best = (q, s, error)
    return best[0], best[1]


def test_int4_symmetric_search_matches_a_brute_force_of_its_definition() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 64)).astype(np.float32) * rng.uniform(0.01, 2, (64, 1)).astype(np.float32)
    q = quantize(torch.from_numpy(w), QuantScheme(4, 32))
    codes, scale = q.codes.numpy(), q.scale.numpy()
    mismatched = 0
    for row in range(64):
        for b in range(2):
            block = w[row, 32 * b:32 * (b + 1)].astype(np.float64)
            want_codes, want_scale = _int4_search_by_brute_force(block)
            ours = ((block - codes[row, 32 * b:32 * (b + 1)] * float(scale[row, b])) ** 2).sum()
            theirs = ((block - want_codes * want_scale) ** 2).sum()
            assert ours <= theirs * (1 + 1e-5) + 1e-12  # never a worse block (float32 against float64)
            mismatched += not np.array_equal(codes[row, 32 * b:32 * (b + 1)], want_codes)
    assert mismatched <= 2  # a float32 near-tie between two divisors may pick the other, equally good


def test_int4_symmetric_is_no_worse_per_block_than_max_over_8_or_7() -> None:
    w = torch.randn(256, 64)
    q = quantize(w, QuantScheme(4, 32))
    blocks = w.unflatten(-1, (-1, 32))
    ours = ((q.dequantize() - w) ** 2).unflatten(-1, (-1, 32)).sum(-1)
    amax = blocks.abs().amax(-1, keepdim=True)
    for d in (8.0, 7.0):
        fixed = (round_half_away(blocks * d / amax).clamp(-8, 7) * amax / d - blocks).pow(2).sum(-1)
        assert (ours <= fixed * (1 + 1e-5)).all()


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
def test_an_all_zero_block_dequantizes_to_zero(scheme: QuantScheme) -> None:
    w = torch.zeros(3, 2 * scheme.block_size)
    w[1, scheme.block_size:] = torch.randn(scheme.block_size)
    q = quantize(w, scheme)
    # symmetric: scale 1 (TensorRT takes positive scales only); asymmetric: 0. Codes 0 either way
    empty = 1.0 if scheme.symmetric else 0.0
    assert (q.scale[0] == empty).all() and q.scale[1, 0] == empty
    d = q.dequantize()
    assert torch.isfinite(d).all() and d[0].abs().max() == 0 and d[1, : scheme.block_size].abs().max() == 0


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.name}-{s.block_size}-{'sym' if s.symmetric else 'asym'}")
def test_error_is_at_most_half_a_step_inside_the_range(scheme: QuantScheme) -> None:
    w = torch.randn(8, 4, 128)  # stacked experts (E, N, K)
    q = quantize(w, scheme)
    assert q.codes.shape == w.shape and q.scale.shape == (8, 4, 128 // scheme.block_size)
    if scheme.signed:
        assert q.codes.dtype == torch.int8 and q.zero_point is None
        assert -scheme.levels // 2 <= int(q.codes.min()) and int(q.codes.max()) < scheme.levels // 2
    else:
        assert q.codes.dtype == torch.uint8 and q.zero_point.shape == q.scale.shape
        assert int(q.codes.max()) < scheme.levels
    step = q.scale.repeat_interleave(scheme.block_size, -1)
    error = (q.dequantize() - w).abs()
    # int4's searched scale may leave the block's largest values past the last level (7 s < max|w|
    # for a divisor above 7: up to 9 / 7 of the range, so 2 s and the half step); inside, half a step
    slack = 2.5 if scheme.symmetric and scheme.bits == 4 else 0.5
    assert (error <= slack * step * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_weight_with_nan_or_infinity_is_refused(bad: float) -> None:
    w = torch.randn(2, 32)
    w[1, 5] = bad
    for scheme in SCHEMES:
        with pytest.raises(ValueError, match="NaN or infinite values"):
            quantize(w, scheme)


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


def test_signed_codes_pack_in_twos_complement() -> None:
    codes = torch.tensor([[-8, 7, -1, 0, 3]], dtype=torch.int8)
    packed = pack(codes, 4)
    assert packed.tolist() == [[0x78, 0x0F, 0x03]]  # -8 = 0b1000 low, 7 high; -1 = 0b1111; 3, pad 0
    assert unpack(packed, 4, 5, signed=True).tolist() == codes.tolist()
    eight = torch.tensor([[-127, -1, 0, 127]], dtype=torch.int8)
    assert pack(eight, 8).tolist() == [[0x81, 0xFF, 0x00, 0x7F]]
    assert unpack(pack(eight, 8), 8, 4, signed=True).tolist() == eight.tolist()


# --- llama.cpp's own quantizers (gguf-py's numpy port of ggml-quants.c)


def test_int8_codes_are_llama_cpp_q8_0s() -> None:
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    ours = quantize(torch.from_numpy(w), QuantScheme(8, 32)).codes.numpy()
    raw = quants.quantize(w, gguf.GGMLQuantizationType.Q8_0).reshape(64, -1, 34)  # per block: fp16 d, 32 int8
    theirs = raw[..., 2:].copy().view(np.int8).reshape(w.shape)
    # x / d here, x * (1 / d) and half-up ties there: a code may differ by one at a near-tie
    assert np.abs(ours.astype(np.int16) - theirs).max() <= 1
    assert (ours == theirs).mean() > 0.999


def test_int4_error_is_within_one_percent_of_llama_cpp_q4_0s_on_gaussian_weights() -> None:
    """q4_0 has 16 levels with its block's largest magnitude exact at either end (a signed scale);
    signed codes with a positive scale (what TensorRT takes) search the scale instead."""
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    rng = np.random.default_rng(0)
    w = rng.standard_normal((512, 256)).astype(np.float32)
    q4_0 = quants.dequantize(quants.quantize(w, gguf.GGMLQuantizationType.Q4_0), gguf.GGMLQuantizationType.Q4_0)
    theirs = ((q4_0.reshape(w.shape) - w) ** 2).mean()
    ours = ((quantize(torch.from_numpy(w), QuantScheme(4, 32)).dequantize().numpy() - w) ** 2).mean()
    assert ours <= 1.01 * theirs


# --- the bytes as ONNX DequantizeLinear (reference evaluator, ONNX Runtime) and MatMulNBits read them


def _dequantize_model(q: BlockQuantized) -> onnx.ModelProto:
    n, k = q.codes.shape
    elem = {(4, True): TensorProto.INT4, (8, True): TensorProto.INT8,
            (4, False): TensorProto.UINT4, (8, False): TensorProto.UINT8}[q.scheme.bits, q.scheme.signed]
    codes = helper.make_tensor("codes", elem, [n, k], q.packed_codes().numpy().tobytes(), raw=True)
    scale = onnx.numpy_helper.from_array(q.scale.numpy(), "scale")
    inits = [codes, scale]
    if q.zero_point is not None:
        # ONNX packs a tensor's 4-bit values flattened (MatMulNBits packs zero points per row): with an
        # odd number of blocks per row the two differ, as here for int4 in blocks of 32 over 96
        inits.append(helper.make_tensor("zero", elem, list(q.zero_point.shape),
                                        pack(q.zero_point.flatten(), q.scheme.bits).numpy().tobytes(), raw=True))
    node = helper.make_node("DequantizeLinear", [i.name for i in inits], ["w"], axis=1,
                            block_size=q.scheme.block_size)
    graph = helper.make_graph([node], "dq", [], [helper.make_tensor_value_info("w", TensorProto.FLOAT, [n, k])],
                              inits)
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
    if scheme.signed:  # MatMulNBits reads unsigned codes around 2^(bits-1): the top bit of each flipped
        b = b ^ (0x88 if scheme.bits == 4 else 0x80)
    inits = [onnx.numpy_helper.from_array(b.numpy(), "b"), onnx.numpy_helper.from_array(q.scale.numpy(), "scales")]
    if not scheme.signed:
        inits.append(onnx.numpy_helper.from_array(q.packed_zero_points().numpy(), "zero_points"))
    node = helper.make_node("MatMulNBits", ["a", *[i.name for i in inits]], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=scheme.bits, block_size=scheme.block_size, accuracy_level=0)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    a = torch.randn(3, k)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a.numpy()})[0]
    np.testing.assert_allclose(y, (a @ q.dequantize().T).numpy(), rtol=1e-4, atol=1e-4)
