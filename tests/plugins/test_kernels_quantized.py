"""The MoE kernels on int8/int4 blocked expert weights (dequantized in the kernel) against the
eager reference on the dequantized weights: what a quantized artifact's DequantizeLinear nodes
feed its moe::MoE node. On CPU through Triton's interpreter (compiled on CUDA when present)."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # not importorskip: see tests/conftest.py
    pytest.skip("triton is not installed (it comes with the dev extra)", allow_module_level=True)

from moedeploy.export.quantize import dequantized
from moedeploy.models.blockquant import PackedWeight, QuantScheme
from moedeploy.plugins.kernels import TileConfig, moe
from moedeploy.plugins.kernels.moe_fused import moe_fused
from moedeploy.plugins.moe import ExpertActivation, Routing, moe_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (2e-6, 2e-6), torch.float16: (2e-3, 2e-3)}
# Each path named, not left to default_config (which sends int4 at a row per expert or fewer to
# gemv): "grouped" the row tiles of the grouped GEMMs (int8 codes in tl.dot, int4 tiles
# dequantized); "gemv" the grouped pipeline's experts as one matrix-vector product per routed
# slot (moe_gemv), a K step of 64 values: several blocks of 16 or 32 a step, and H = 3 blocks
# leaves a step half masked
RUNS = {"grouped": functools.partial(moe, config=TileConfig(16, 64, 64, 4)), "fused": moe_fused,
        "gemv": functools.partial(moe, config=TileConfig(block_n=32, block_k=64, gemv=True))}


def _case(n: int, h: int, i: int, e: int, seed: int, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    logits = 2 * torch.randn(n, e, generator=g)
    stacks = [torch.randn(e, i, h, generator=g) / h**0.5, torch.randn(e, i, h, generator=g) / h**0.5,
              torch.randn(e, h, i, generator=g) / i**0.5]
    biases = [0.1 * torch.randn(s, generator=g) for s in ((e, i), (e, i), (e, h))] if bias else [None] * 3
    return x, logits, stacks, biases


def _quantized(stacks: list[torch.Tensor], scheme: QuantScheme, dtype: torch.dtype):
    """(PackedWeights for the kernel, the float weights DequantizeLinear gives: the reference's)."""
    packed = [PackedWeight.from_weight(w.to(dtype), scheme).to(DEVICE) for w in stacks]
    return packed, [dequantized(w.to(dtype), scheme) for w in stacks]


# the grouped kernel multiplies int8 codes in tl.dot (dequant.codes_chunk) and dequantizes
# int4 tiles; uint4 in blocks of 32 too (zero points packed across rows, a tile of two blocks)
SCHEMES = [(8, True, 32), (4, True, 32), (8, False, 16), (4, False, 16), (4, False, 32)]
SHAPES = [(1, 2, 1, 4, 2), (5, 3, 2, 3, 2)]  # n, H and I in blocks, e, k
# block 128 spans two of the grouped kernels' 64-wide K tiles (one scale per column per tile):
# the small shape only, the interpreter is slow on the large one
CASES = [(*shape, *scheme) for shape in SHAPES for scheme in SCHEMES] + [(*SHAPES[0], 4, True, 128)]


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "h_blocks", "i_blocks", "e", "k", "bits", "symmetric", "block"), CASES)
def test_quantized_experts_match_dequantized_reference(
    n: int, h_blocks: int, i_blocks: int, e: int, k: int, bits: int, symmetric: bool, block: int, dtype: torch.dtype,
    run: str,
) -> None:
    """H and I in whole blocks; 3 blocks per gate/up row: 4-bit zero points share a byte across rows."""
    h, i = h_blocks * block, i_blocks * block
    x, logits, stacks, _ = _case(n, h, i, e, seed=n * 31 + bits + block)
    packed, reference = _quantized(stacks, QuantScheme(bits, block, symmetric), dtype)
    x, logits = x.to(dtype), logits.to(dtype)
    expected = moe_reference(x, logits, *reference, k, True)
    actual = RUNS[run](x.to(DEVICE), logits.to(DEVICE), *packed, k, True).cpu()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)
    # the answer is the quantized model's, well away from the float one's
    float_model = moe_reference(x, logits, *(w.to(dtype) for w in stacks), k, True).float()
    assert (actual.float() - float_model).abs().max() > 2 * atol + 4 * (actual.float() - expected.float()).abs().max()


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_quantized_experts_with_biases_routing_and_activations(run: str, activation: str) -> None:
    """DeepSeek-style sigmoid routing with a selection bias and groups; gpt-oss's clamped SwiGLU;
    relu experts have no gate stack."""
    x, logits, stacks, biases = _case(4, 32, 32, 8, seed=5, bias=True)
    routing = Routing(2, True, "sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    score_bias = torch.linspace(-0.5, 0.5, 8)
    act = ExpertActivation("swiglu", 1.702, 1.0, 7.0) if activation == "swiglu" else ExpertActivation("relu")
    gated = activation == "swiglu"
    packed, reference = _quantized(stacks if gated else stacks[1:], QuantScheme(4, 16, True), torch.float32)
    if not gated:
        packed, reference = [None, *packed], [None, *reference]
    b_gate = biases[0] if gated else None
    expected = moe_reference(x, logits, *reference, routing, activation=act, b_gate=b_gate, b_up=biases[1],
                             b_down=biases[2], score_bias=score_bias)
    dev = [None if t is None else t.to(DEVICE) for t in (x, logits, b_gate, biases[1], biases[2], score_bias)]
    actual = RUNS[run](dev[0], dev[1], *packed, routing, activation=act, b_gate=dev[2], b_up=dev[3], b_down=dev[4],
                       score_bias=dev[5]).cpu()
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("scheme", [None, QuantScheme(4, 16, True), QuantScheme(8, 16, False), QuantScheme(4, 16, False),
                                    QuantScheme(4, 32, True), QuantScheme(4, 32, False)],
                         ids=["float", "int4", "uint8", "uint4", "int4-32", "uint4-32"])
def test_interleaved_gate_up_stack_reads_gate_from_even_rows_and_up_from_odd(run: str, scheme: QuantScheme | None) -> None:
    """A streamed export stores gate and up as one (E, 2I, H) stack, rows alternating gate, up
    (moe::MoENBits takes it as it is): `interleaved=True` gives the experts of the separate
    stacks, with biases and gpt-oss's clamped SwiGLU. Zero points of the fused stack are
    indexed by its own rows: H is 3 blocks a row, so 4-bit zero points share bytes across rows."""
    block = 16 if scheme is None else scheme.block_size
    h = 3 * block
    x, logits, (w_gate, w_up, w_down), biases = _case(3, h, 32, 4, seed=11, bias=True)
    fused = torch.stack([w_gate, w_up], dim=2).reshape(4, 64, h)  # (E, I, 2, H): row 2r gate, 2r + 1 up
    act = ExpertActivation("swiglu", 1.702, 1.0, 7.0)
    if scheme is None:
        weights, reference = [fused, w_down], [w_gate, w_up, w_down]
    else:
        weights, (fused_dq, down_dq) = _quantized([fused, w_down], scheme, torch.float32)
        reference = [fused_dq[:, 0::2], fused_dq[:, 1::2], down_dq]
    expected = moe_reference(x, logits, *reference, 2, activation=act, b_gate=biases[0], b_up=biases[1], b_down=biases[2])
    dev = [t.to(DEVICE) for t in (x, logits, *biases)]
    actual = RUNS[run](dev[0], dev[1], None, weights[0].to(DEVICE), weights[1].to(DEVICE), 2, activation=act,
                       b_gate=dev[2], b_up=dev[3], b_down=dev[4], interleaved=True).cpu()
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="interleaved gate/up weights"):
        RUNS[run](dev[0], dev[1], None, weights[0].to(DEVICE), weights[1].to(DEVICE), 2, activation="relu",
                  interleaved=True)


def test_codes_chunk_is_one_block_or_64_and_at_least_16_along_k_for_tl_dot() -> None:
    """The K chunk the grouped kernel multiplies int8 codes by: inside one block, at most 64,
    at least the 16 tl.dot needs; int4 is dequantized in tiles (0)."""
    from moedeploy.plugins.kernels.dequant import codes_chunk

    assert [codes_chunk(8, b) for b in (8, 16, 32, 64, 128, 256)] == [0, 16, 32, 64, 64, 64]
    assert [codes_chunk(4, b) for b in (16, 32, 64)] == [0, 0, 0]
    assert codes_chunk(0, 32) == 0 and codes_chunk(8, 48) == 0  # float weights; a block that is no power of two


@pytest.mark.parametrize("codes_in_dot", [True, False])
def test_int8_codes_in_dot_and_dequantized_tiles_agree_with_the_reference(codes_in_dot: bool) -> None:
    """Both ways the grouped kernel takes int8 experts (TileConfig.codes_in_dot) against the eager
    MoE on the dequantized weights, signed and unsigned; blocks of 256 (taken in 64-wide chunks, or
    wider than a 64-wide tile) two to a gate/up row, so a tile past the first block reads the second's scale."""
    for symmetric, block in ((True, 256), (False, 32)):
        x, logits, stacks, _ = _case(3, 512, 256, 4, seed=block)
        packed, reference = _quantized(stacks, QuantScheme(8, block, symmetric), torch.float32)
        expected = moe_reference(x, logits, *reference, 2, True)
        actual = moe(x.to(DEVICE), logits.to(DEVICE), *packed, 2, True,
                     config=TileConfig(codes_in_dot=codes_in_dot)).cpu()
        torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("symmetric", [False, True])
def test_packed_weight_is_the_artifacts_bytes(symmetric: bool) -> None:
    """PackedWeight holds what the export writes for an expert stack (export/quantize.part_chunks,
    one expert at a time) and dequantizes to what its DequantizeLinear gives."""
    from moedeploy.export.quantize import part_chunks

    w = torch.randn(3, 8, 48, generator=torch.Generator().manual_seed(3))
    scheme = QuantScheme(4, 16, symmetric)
    packed = PackedWeight.from_weight(w, scheme)

    class OneStack:  # the two WeightSource methods an expert stack's chunks read
        def shape(self, name: str) -> tuple[int, ...]:
            return tuple(w.shape)

        def experts(self, name: str):
            yield from w

    source = OneStack()
    names = ("codes", "scale") if symmetric else ("codes", "scale", "zero_point")  # signed codes: no zero point
    parts = {p: torch.cat([c.flatten() for c in part_chunks(p, "rows", ("experts.w_up",), source, torch.float32, scheme)])
             for p in names}
    assert torch.equal(parts["codes"], packed.codes.flatten())
    assert torch.equal(parts["scale"], packed.scale.flatten())
    if symmetric:
        assert packed.zero_point is None
    else:
        assert torch.equal(parts["zero_point"], packed.zero_point.flatten())
        assert packed.zero_point.numel() == (3 * 8 * 3 + 1) // 2  # 72 four-bit zero points, two to a byte
    assert torch.equal(packed.dequantize(), dequantized(w, scheme))


def test_mixed_or_mistyped_quantized_experts_are_refused() -> None:
    x, logits, stacks, _ = _case(2, 32, 32, 4, seed=1)
    packed, _ = _quantized(stacks, QuantScheme(8, 16, True), torch.float32)
    with pytest.raises(ValueError, match="all quantized in one scheme"):
        moe_fused(x.to(DEVICE), logits.to(DEVICE), packed[0], stacks[1].to(DEVICE), packed[2], 2)
    other = PackedWeight.from_weight(stacks[2], QuantScheme(4, 16, True)).to(DEVICE)
    with pytest.raises(ValueError, match="all quantized in one scheme"):
        moe(x.to(DEVICE), logits.to(DEVICE), packed[0], packed[1], other, 2)
    with pytest.raises(ValueError, match="x's dtype"):
        moe_fused(x.half().to(DEVICE), logits.half().to(DEVICE), *packed, 2)
