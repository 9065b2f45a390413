"""Triton kernels vs the eager references, on CPU through Triton's interpreter (on CUDA when present).

The eager references (`rms_norm_reference`, `moe_reference`) are themselves checked against
torch.nn.RMSNorm, Hugging Face Mixtral and per-token loops in tests/models.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # not importorskip: see tests/conftest.py
    pytest.skip("triton is not installed (it comes with the dev extra)", allow_module_level=True)

from moedeploy.plugins.kernels import TileConfig, default_config, moe, rms_norm
from moedeploy.plugins.kernels.moe import route as kernel_route
from moedeploy.plugins.moe import ExpertActivation, Routing, moe_reference, route
from moedeploy.plugins.rmsnorm import rms_norm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"
# Interpreter limits (numpy has no bfloat16): it truncates fp32 -> bf16 instead of rounding,
# twice in RMSNorm, so allow two bf16 ulps there (bit-exact on a GPU); it cannot run bf16
# tl.dot at all, so bf16 MoE is checked on GPUs only (scripts/gpu_check.sh).
RMS_TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (0.0, 0.0), torch.bfloat16: (0.0, 2**-6 if INTERPRETED else 0.0)}
MOE_TOL = {torch.float32: (2e-6, 2e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("shape"), [(1, 1), (2, 7), (3, 5, 64), (4, 1000), (2, 4097)])
def test_rms_norm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = _gen(sum(shape))
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(dtype)
    expected = rms_norm_reference(x, w, 1e-5)
    actual = rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5).cpu()
    assert actual.dtype == dtype and actual.shape == x.shape
    atol, rtol = RMS_TOL[dtype]
    if dtype == torch.float16 or (dtype == torch.bfloat16 and not INTERPRETED):
        assert torch.equal(actual, expected)  # fp32 statistics, one rounding, exact product
    else:
        torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def test_rms_norm_against_torch_builtin() -> None:
    x = torch.randn(6, 48, generator=_gen(1))
    norm = torch.nn.RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=_gen(2)) + 0.5)
        expected = norm(x)
    torch.testing.assert_close(rms_norm(x.to(DEVICE), norm.weight.detach().to(DEVICE), 1e-6).cpu(), expected)


def test_rms_norm_empty_and_bad_weight() -> None:
    assert rms_norm(torch.empty(0, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-5).shape == (0, 8)
    with pytest.raises(ValueError, match="features"):
        rms_norm(torch.ones(2, 8, device=DEVICE), torch.ones(9, device=DEVICE), 1e-5)


def _moe_case(n: int, h: int, i: int, e: int, dtype: torch.dtype, seed: int, bias: bool, dead_expert: bool = False):
    g = _gen(seed)
    x = torch.randn(n, h, generator=g)
    logits = 2 * torch.randn(n, e, generator=g)
    if dead_expert:  # expert 0 never wins a slot: an empty group in every kernel
        logits[:, 0] = -1e4
    w_gate = torch.randn(e, i, h, generator=g) / h**0.5
    w_up = torch.randn(e, i, h, generator=g) / h**0.5
    w_down = torch.randn(e, h, i, generator=g) / i**0.5
    biases = [0.1 * torch.randn(s, generator=g) for s in ((e, i), (e, i), (e, h))] if bias else [None] * 3
    cast = [t if t is None else t.to(dtype) for t in (x, logits, w_gate, w_up, w_down, *biases)]
    return cast


CASES = [
    # n, h, i, e, k        (N=1 decode; 33 = two tiles + 1; odd H/I; k = E; single expert)
    (1, 16, 32, 4, 2),
    (2, 24, 40, 3, 3),
    (33, 40, 24, 5, 2),
    (17, 7, 9, 8, 1),
    (5, 32, 16, 1, 1),
    (64, 48, 80, 8, 2),
]


MOE_DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])


@pytest.mark.parametrize("dtype", MOE_DTYPES)
@pytest.mark.parametrize(("n", "h", "i", "e", "k"), CASES)
def test_moe_swiglu_matches_reference(n: int, h: int, i: int, e: int, k: int, dtype: torch.dtype) -> None:
    x, logits, wg, wu, wd, *_ = _moe_case(n, h, i, e, dtype, seed=n * 7 + e, bias=False)
    expected = moe_reference(x, logits, wg, wu, wd, k, True)
    actual = moe(*(t.to(DEVICE) for t in (x, logits, wg, wu, wd)), k, True).cpu()
    assert actual.dtype == dtype and actual.shape == (n, h)
    atol, rtol = MOE_TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("activation", ["swiglu", "relu", "gelu"])
@pytest.mark.parametrize("normalize", [True, False])
def test_moe_activations_biases_and_normalisation(activation: str, normalize: bool) -> None:
    x, logits, wg, wu, wd, bg, bu, bd = _moe_case(9, 24, 20, 4, torch.float32, seed=3, bias=True)
    gate = wg if activation == "swiglu" else None
    expected = moe_reference(x, logits, gate, wu, wd, 2, normalize, activation, bg if gate is not None else None, bu, bd)
    dev = [None if t is None else t.to(DEVICE) for t in (x, logits, gate, wu, wd)]
    actual = moe(*dev, 2, normalize, activation, *(None if t is None else t.to(DEVICE) for t in (bg if gate is not None else None, bu, bd))).cpu()
    torch.testing.assert_close(actual, expected, atol=2e-6, rtol=2e-6)


def test_moe_expert_with_no_tokens() -> None:
    x, logits, wg, wu, wd, *_ = _moe_case(12, 16, 16, 4, torch.float32, seed=5, bias=False, dead_expert=True)
    expected = moe_reference(x, logits, wg, wu, wd, 2, True)
    torch.testing.assert_close(moe(*(t.to(DEVICE) for t in (x, logits, wg, wu, wd)), 2, True).cpu(), expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("config", [TileConfig(16, 16, 16, 1), TileConfig(32, 32, 16, 2), TileConfig(64, 64, 32, 4),
                                    TileConfig(block_n=32, block_k=32, gemv=True)],
                         ids=["16x16x16", "32x32x16", "64x64x32", "gemv"])
def test_moe_tile_configs_agree(config: TileConfig) -> None:
    """H = 56 and I = 72 are no multiple of any tile: every K loop ends in a masked tile. (The gemv
    path runs a program per routed slot: 12 tokens, not 40, keep it to seconds under the interpreter.)"""
    x, logits, wg, wu, wd, *_ = _moe_case(12 if config.gemv else 40, 56, 72, 6, torch.float32, seed=11, bias=False)
    expected = moe_reference(x, logits, wg, wu, wd, 2, True)
    actual = moe(*(t.to(DEVICE) for t in (x, logits, wg, wu, wd)), 2, True, config=config).cpu()
    torch.testing.assert_close(actual, expected, atol=2e-6, rtol=2e-6)


def test_moe_matches_independent_dense_formula() -> None:
    """Independent of moe_reference: every expert on every token, weighted by top-k routing."""
    x, logits, wg, wu, wd, *_ = _moe_case(7, 16, 24, 5, torch.float64, seed=13, bias=False)
    probs = logits.softmax(-1)
    top_w, top_i = probs.topk(2, dim=-1)
    dense = torch.zeros_like(probs).scatter(-1, top_i, top_w / top_w.sum(-1, keepdim=True))  # (N, E)
    experts = torch.stack([torch.nn.functional.silu(x @ wg[j].T) * (x @ wu[j].T) @ wd[j].T for j in range(5)])
    expected = torch.einsum("ne,enh->nh", dense, experts)
    actual = moe(*(t.float().to(DEVICE) for t in (x, logits, wg, wu, wd)), 2, True).cpu().double()
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_moe_empty_batch_and_bad_shapes() -> None:
    _, _, wg, wu, wd, *_ = _moe_case(1, 16, 16, 4, torch.float32, seed=1, bias=False)
    wg, wu, wd = wg.to(DEVICE), wu.to(DEVICE), wd.to(DEVICE)
    empty = moe(torch.empty(0, 16, device=DEVICE), torch.empty(0, 4, device=DEVICE), wg, wu, wd, 2)
    assert empty.shape == (0, 16)
    with pytest.raises(ValueError, match="inconsistent"):
        moe(torch.ones(3, 16, device=DEVICE), torch.ones(3, 5, device=DEVICE), wg, wu, wd, 2)
    with pytest.raises(ValueError, match="top_k"):
        moe(torch.ones(3, 16, device=DEVICE), torch.ones(3, 4, device=DEVICE), wg, wu, wd, 5)


def test_default_config_grows_tiles_with_rows_per_expert() -> None:
    decode, prefill = default_config(1, 2, 8), default_config(4096, 2, 8)
    assert decode.block_m == 16 and prefill.block_m == 64
    assert all(v >= 16 for v in (decode.block_m, decode.block_n, decode.block_k))
    # int4 experts at a row per expert or fewer: matrix-vector products per slot (faster on an H100)
    assert default_config(4, 2, 8, bits=4).gemv and not default_config(5, 2, 8, bits=4).gemv
    assert not default_config(1, 2, 8, bits=8).gemv and not decode.gemv


# The single-kernel MoE that TensorRT's AOT plugin launches (one program per token and
# output tile). H = 300 > BLOCK_H = 256 spans two output tiles; E = 5 pads BLOCK_E to 8.
FUSED_CASES = [(1, 16, 32, 4, 2), (3, 300, 24, 5, 2), (7, 24, 40, 3, 3), (4, 8, 16, 1, 1)]


@pytest.mark.parametrize("dtype", MOE_DTYPES)
@pytest.mark.parametrize(("n", "h", "i", "e", "k"), FUSED_CASES)
def test_fused_moe_matches_reference(n: int, h: int, i: int, e: int, k: int, dtype: torch.dtype) -> None:
    from moedeploy.plugins.kernels.moe_fused import moe_fused

    x, logits, wg, wu, wd, *_ = _moe_case(n, h, i, e, dtype, seed=n + h, bias=False)
    expected = moe_reference(x, logits, wg, wu, wd, k, True)
    actual = moe_fused(*(t.to(DEVICE) for t in (x, logits, wg, wu, wd)), k, True).cpu()
    atol, rtol = MOE_TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("activation", ["swiglu", "relu", "gelu"])
@pytest.mark.parametrize("normalize", [True, False])
def test_fused_moe_activations_biases_and_normalisation(activation: str, normalize: bool) -> None:
    from moedeploy.plugins.kernels.moe_fused import moe_fused

    x, logits, wg, wu, wd, bg, bu, bd = _moe_case(5, 24, 20, 4, torch.float32, seed=7, bias=True)
    gate = wg if activation == "swiglu" else None
    b_gate = bg if gate is not None else None
    expected = moe_reference(x, logits, gate, wu, wd, 2, normalize, activation, b_gate, bu, bd)
    dev = [None if t is None else t.to(DEVICE) for t in (x, logits, gate, wu, wd, b_gate, bu, bd)]
    actual = moe_fused(*dev[:5], 2, normalize, activation, *dev[5:]).cpu()
    torch.testing.assert_close(actual, expected, atol=2e-6, rtol=2e-6)


def test_fused_moe_writes_into_out_and_handles_no_tokens() -> None:
    from moedeploy.plugins.kernels.moe_fused import moe_fused

    x, logits, wg, wu, wd, *_ = _moe_case(6, 16, 16, 4, torch.float32, seed=2, bias=False, dead_expert=True)
    out = torch.empty(6, 16, device=DEVICE)
    result = moe_fused(*(t.to(DEVICE) for t in (x, logits, wg, wu, wd)), 2, True, out=out)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.cpu(), moe_reference(x, logits, wg, wu, wd, 2, True), atol=2e-6, rtol=2e-6)
    assert moe_fused(x[:0].to(DEVICE), logits[:0].to(DEVICE), *(t.to(DEVICE) for t in (wg, wu, wd)), 2).shape == (0, 16)


# Routing variants of the op contract (opset "moe" version 3), against the eager `route` and
# `moe_reference`. Dropped groups are masked with -inf, so a signed score_bias is fine; exact
# ties go to the lower index in eager, the kernels and ONNX TopK alike (the ties test below).
ROUTINGS = {
    "softmax-bias-raw": (Routing(3, False), "signed"),
    "softmax-scaled": (Routing(2, True, routed_scaling_factor=1.5), None),
    "sigmoid-bias-norm": (Routing(2, True, "sigmoid"), "signed"),
    "sigmoid-bias-raw-scaled": (Routing(2, False, "sigmoid", routed_scaling_factor=2.5), "signed"),
    "sigmoid-grouped": (Routing(3, True, "sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5), "signed"),
    "softmax-grouped": (Routing(2, False, "softmax", n_group=2, topk_group=1), None),
    # group_scoring "max": DeepSeek-V2 (unnormalised, scaled), with a selection bias, groups of one
    "softmax-grouped-max": (Routing(3, False, "softmax", n_group=4, topk_group=2, routed_scaling_factor=16.0,
                                    group_scoring="max"), None),
    "sigmoid-grouped-max-bias": (Routing(2, True, "sigmoid", n_group=4, topk_group=2, group_scoring="max"), "signed"),
    "softmax-groups-of-1-max": (Routing(2, False, "softmax", n_group=8, topk_group=3, group_scoring="max"), None),
    "sparsemixer": (Routing(2, scoring="sparsemixer", jitter_eps=0.3), None),
    "sparsemixer-tight": (Routing(2, scoring="sparsemixer", jitter_eps=0.01), None),
}


def _routing_case(name: str, n: int, e: int = 8, seed: int = 17):
    routing, bias_kind = ROUTINGS[name]
    g = _gen(seed)
    logits = 2 * torch.randn(n, e, generator=g)
    logits[::3] -= 6  # rows of negative logits (sparsemixer's relative band around a negative max)
    bias = 0.1 * torch.randn(e, generator=g)
    score_bias = {None: None, "signed": bias}[bias_kind]
    return routing, logits, score_bias


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_route_kernel_matches_eager_route(name: str) -> None:
    routing, logits, score_bias = _routing_case(name, n=24)
    expected_w, expected_i = route(logits, routing, score_bias=score_bias)
    sb = None if score_bias is None else score_bias.to(DEVICE)
    weights, ids = kernel_route(logits.to(DEVICE), routing, score_bias=sb)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu().long(), expected_i)
    torch.testing.assert_close(weights.cpu(), expected_w, atol=1e-6, rtol=1e-5)
    if name == "sparsemixer":  # the band is wide enough that weights are not all 1
        assert (expected_w < 0.99).any()


@pytest.mark.parametrize("fused", [False, True], ids=["grouped", "fused"])
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_moe_routing_variants_match_reference(name: str, fused: bool) -> None:
    from moedeploy.plugins.kernels.moe_fused import moe_fused

    routing, logits, score_bias = _routing_case(name, n=6)
    x, _, wg, wu, wd, bg, bu, bd = _moe_case(6, 24, 20, 8, torch.float32, seed=19, bias=True)
    expected = moe_reference(x, logits, wg, wu, wd, routing, activation="swiglu", b_gate=bg, b_up=bu, b_down=bd,
                             score_bias=score_bias)
    dev = [None if t is None else t.to(DEVICE) for t in (x, logits, wg, wu, wd, bg, bu, bd, score_bias)]
    run = moe_fused if fused else moe
    actual = run(*dev[:5], routing, activation="swiglu", b_gate=dev[5], b_up=dev[6], b_down=dev[7],
                 score_bias=dev[8]).cpu()
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("group_scoring", "first_row"), [("top2_sum", [0, 1, 4]), ("max", [0, 1, 7])])
def test_group_limited_ties_pick_lower_index(group_scoring: str, first_row: list[int]) -> None:
    """Every choice negative: only the kept groups' experts are picked (the dropped ones are
    masked with -inf, as transformers 5 does); with every logit equal, groups and experts tie
    and the lower index wins, in the kernel and in eager `route` alike."""
    routing = Routing(3, True, "sigmoid", n_group=4, topk_group=2, group_scoring=group_scoring)
    score_bias = torch.full((8,), -1.0)
    # row 0, choices sigmoid - 1: groups {0, 1} and {4, 5} have the best two-expert sums,
    # groups {0, 1} and {6, 7} the best single experts (-0.05 and -0.27); row 1: all tied,
    # so groups 0 and 1, then experts 0, 1, 2
    logits = torch.tensor([[3.0, 2.0, -1.0, -2.0, 0.5, 0.2, -0.3, 1.0], [0.0] * 8])
    weights, ids = kernel_route(logits.to(DEVICE), routing, score_bias=score_bias.to(DEVICE))
    assert ids.cpu().tolist() == [first_row, [0, 1, 2]]
    chosen = torch.sigmoid(logits).gather(1, ids.cpu().long())
    torch.testing.assert_close(weights.cpu(), chosen / chosen.sum(-1, keepdim=True))
    assert route(logits, routing, score_bias=score_bias)[1].tolist() == [first_row, [0, 1, 2]]


# gpt-oss's clamped SwiGLU (activation_alpha, activation_beta, swiglu_limit), in both kernels.
GPT_OSS = ExpertActivation("swiglu", activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
SWIGLUS = {
    "gpt-oss": GPT_OSS,
    "other-params": ExpertActivation("swiglu", activation_alpha=0.5, activation_beta=-0.25, swiglu_limit=3.0),
    "unclamped": ExpertActivation("swiglu", activation_alpha=1.702, activation_beta=1.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", [False, True], ids=["grouped", "fused"])
@pytest.mark.parametrize("name", list(SWIGLUS))
def test_moe_clamped_swiglu_matches_reference(name: str, fused: bool, dtype: torch.dtype) -> None:
    from moedeploy.plugins.kernels.moe_fused import moe_fused

    activation = SWIGLUS[name]
    x, logits, wg, wu, wd, bg, bu, bd = _moe_case(9, 24, 20, 4, torch.float32, seed=23, bias=True)
    wg, wu, bg, bu = 8 * wg, 8 * wu, 8 * bg, 8 * bu  # gate and up reach well past the limits
    gate, up = torch.einsum("eih,nh->nei", wg, x) + bg, torch.einsum("eih,nh->nei", wu, x) + bu
    assert (gate > 7).any() and (up > 7).any() and (up < -7).any()
    x, logits, wg, wu, wd, bg, bu, bd = (t.to(dtype) for t in (x, logits, wg, wu, wd, bg, bu, bd))
    expected = moe_reference(x, logits, wg, wu, wd, 2, True, activation, bg, bu, bd)
    if activation.clamped:  # the clamp changes the answer on these inputs
        plain = ExpertActivation("swiglu", activation.activation_alpha, activation.activation_beta)
        assert (moe_reference(x, logits, wg, wu, wd, 2, True, plain, bg, bu, bd) - expected).abs().max() > 1.0
    run = moe_fused if fused else moe
    actual = run(*(t.to(DEVICE) for t in (x, logits, wg, wu, wd)), 2, True, activation,
                 *(t.to(DEVICE) for t in (bg, bu, bd))).cpu()
    # outputs reach ~100 here: tolerances scale with them (in fp16, eager also rounds alpha * gate
    # and the sigmoid, the kernels only their product: a unit in the last place of the output)
    scale = expected.abs().max().item()
    atol, rtol = {torch.float32: (1e-6 * scale, 1e-5), torch.float16: (1e-3 * scale, 2e-3)}[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def test_moe_refuses_bad_score_bias_and_routing() -> None:
    _, logits, wg, wu, wd, *_ = _moe_case(2, 16, 16, 4, torch.float32, seed=1, bias=False)
    x, logits, wg, wu, wd = (t.to(DEVICE) for t in (torch.ones(2, 16), logits, wg, wu, wd))
    with pytest.raises(ValueError, match="score_bias"):
        moe(x, logits, wg, wu, wd, 2, score_bias=torch.zeros(5, device=DEVICE))
    with pytest.raises(ValueError, match="n_group"):
        moe(x, logits, wg, wu, wd, Routing(2, n_group=4, topk_group=2))  # groups of 1 expert
