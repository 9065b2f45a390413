"""The native MoE kernel (plugins/native/moe_experts.cc) and its lowering (plugins/moe_native.py)
against eager PyTorch and a by-hand sum: both weight layouts, sizes that leave vector tails,
token counts that leave partial blocks, every routing variant, gpt-oss's clamped SwiGLU,
non-finite tokens, concurrent runs of one session, and shape errors; each on the kernel built for
this CPU, for AVX2 and for baseline x86-64 (MARCHES), so the code paths of CPUs other than the
one running the suite are tested too."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from moedeploy.plugins import moe as moe_op
from moedeploy.plugins.moe import ExpertActivation
from moedeploy.runtime.lowering import lower_for_ort
from tests.export.artifacts import moe_node_model, moe_weights
from tests.plugins.test_moe_experts import GPT_OSS, ROUTINGS

# H 137: past dot's 64-wide loop, with a 16-wide and a scalar tail; I 70: a 64-row task block and a
# partial one, and (2I or I) rows not a multiple of the 4-row blocks
E, H, I = 8, 137, 70  # noqa: E741
NAN, INF = float("nan"), float("inf")
SILU = ExpertActivation()  # silu(g) * u


#: every build the kernel's code paths take: this CPU's (AVX-512 here), AVX2 with FMA (x86-64-v3:
#: 2 x 2 row blocks, 4-token panel groups; most users' CPUs) and baseline x86-64 (the portable
#: vector fallback, as on Arm): sessions build -march=native, so only the first would be tested
MARCHES = ("native", "x86-64-v3", "x86-64")
#: what x86-64-v3 needs of the CPU that runs it (its flags in /proc/cpuinfo)
V3_FLAGS = {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "xsave", "abm"}


@pytest.fixture(scope="module", params=MARCHES)
def native_kernels(native_kernels, request, tmp_path_factory):
    """conftest's native kernels, rebuilt for each of MARCHES this CPU can run (a fresh cache each;
    -march is part of the build key)."""
    import platform

    march = request.param
    if march == "native":  # conftest's build
        yield native_kernels
        return
    flags = {word for line in native_kernels.cpu_identity() if line.startswith("flags=") for word in line[6:].split()}
    if platform.machine() != "x86_64" or (march == "x86-64-v3" and not flags.issuperset(V3_FLAGS)):
        pytest.skip(f"-march={march} does not run on this CPU")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_kernels, "FLAGS", tuple(f"-march={march}" if f == "-march=native" else f
                                                     for f in native_kernels.FLAGS))
        patch.setenv("MOEDEPLOY_CACHE", str(tmp_path_factory.mktemp(f"native-{march}")))
        native_kernels.forget()
        try:
            try:
                native_kernels.library_path()
            except native_kernels.NativeUnavailable as e:
                # a compiler too old to know it (GCC < 11 for x86-64-v3): "bad value ('x86-64-v3') for '-march='"
                if "march" in str(e) and march in str(e):
                    pytest.skip(f"this compiler cannot build -march={march}: {e}")
                raise
            yield native_kernels
        finally:
            native_kernels.forget()


def native_session(model: onnx.ModelProto, native, threads: int = 2) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    options.register_custom_ops_library(str(native.library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def in_panels(matrix: np.ndarray) -> np.ndarray:
    """(rows, cols) as the kernel's panels=1 takes it: panel p is rows 16p..16p+15, column by column."""
    return np.stack([matrix[16 * p:16 * p + 16].T for p in range(matrix.shape[0] // 16)])


def kernel_model(w: dict, interleaved: bool, activation: ExpertActivation = SILU, panels: bool = False,
                 **attributes) -> onnx.ModelProto:
    """One MoEExperts node on per-expert weight initializers, as lower_to_native feeds it."""
    inits, names = [], []
    experts, inter, hidden = w["w_gate"].shape

    def add(name: str, matrix: np.ndarray) -> None:
        array = in_panels(matrix) if panels else matrix
        inits.append(numpy_helper.from_array(np.ascontiguousarray(array, dtype=np.float32), name))
        names.append(name)

    for e in range(experts):
        if interleaved:  # gate row 2i, up row 2i+1
            add(f"w1_{e}", torch.stack([w["w_gate"][e], w["w_up"][e]], dim=1).reshape(2 * inter, hidden).numpy())
        else:
            add(f"w1_{e}", w["w_gate"][e].numpy())
    if not interleaved:
        for e in range(experts):
            add(f"w3_{e}", w["w_up"][e].numpy())
    for e in range(experts):
        add(f"w2_{e}", w["w_down"][e].numpy())
    node = helper.make_node("MoEExperts", ["x", "r", *names], ["y"], domain="moedeploy.cpu",
                            interleaved=int(interleaved), activation_alpha=activation.activation_alpha,
                            activation_beta=activation.activation_beta, swiglu_limit=activation.swiglu_limit,
                            panels=int(panels), **attributes)
    graph = helper.make_graph([node], "kernel", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", hidden]),
                                                 helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", experts])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", hidden])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("moedeploy.cpu", 1)])


def by_hand(x: torch.Tensor, r: torch.Tensor, w: dict, activation: ExpertActivation = SILU) -> np.ndarray:
    """sum over experts with weight > 0, in index order, of weight * W2 act(W1 x, W3 x)."""
    y = torch.zeros_like(x)
    for e in range(w["w_gate"].shape[0]):
        g, u = x @ w["w_gate"][e].T, x @ w["w_up"][e].T
        g, u = g.clamp(max=activation.swiglu_limit), u.clamp(-activation.swiglu_limit, activation.swiglu_limit)
        h = g * torch.sigmoid(activation.activation_alpha * g) * (u + activation.activation_beta)
        y += torch.where(r[:, e:e + 1] > 0, (h @ w["w_down"][e].T) * r[:, e:e + 1], 0.0)
    return y.numpy()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tokens", [1, 2, 7, 13])
def test_the_kernel_is_the_routed_experts_weighted_sum(native_kernels, interleaved: bool, tokens: int) -> None:
    w = moe_weights(E, H, I, "swiglu", False, seed=31)
    g = torch.Generator().manual_seed(32)
    x = torch.randn(tokens, H, generator=g)
    r = torch.zeros(tokens, E)
    for n in range(tokens):  # two experts a token, one weight negative on the last token: not taken, as the Ifs
        picked = torch.randperm(E, generator=g)[:3]
        r[n, picked] = torch.tensor([0.7, 0.3, -0.4 if n == tokens - 1 else 0.0])
    (y,) = native_session(kernel_model(w, interleaved), native_kernels).run(None, {"x": x.numpy(), "r": r.numpy()})
    np.testing.assert_allclose(y, by_hand(x, r, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 8, 13, 20])
def test_the_kernel_on_panels_is_the_routed_experts_weighted_sum(native_kernels, interleaved: bool, tokens: int) -> None:
    """Weights re-laid in 16-row panels (panels=1): H 80 and I 48 (2I 96) multiples of 16, a
    64-row task block and a partial one. Every token takes experts 1 and 5 (and the last also 6),
    so an expert's tokens make whole and partial groups of 8 (AVX-512) and of 4."""
    w = moe_weights(E, 80, 48, "swiglu", False, seed=33)
    g = torch.Generator().manual_seed(34)
    x, r = torch.randn(tokens, 80, generator=g), torch.zeros(tokens, E)
    r[:, 1], r[:, 5], r[-1, 6] = 0.65, 0.35, 0.2
    model = kernel_model(w, interleaved, panels=True)
    (y,) = native_session(model, native_kernels).run(None, {"x": x.numpy(), "r": r.numpy()})
    np.testing.assert_allclose(y, by_hand(x, r, w), rtol=1e-5, atol=1e-5)


def test_panels_of_the_wrong_shape_are_refused_with_the_reason(native_kernels) -> None:
    w = moe_weights(E, 80, 48, "swiglu", False, seed=35)
    feed = {"x": np.ones((1, 80), np.float32), "r": np.ones((1, E), np.float32)}
    model = kernel_model(w, True)  # 2-D rows, told they are panels
    next(a for a in model.graph.node[0].attribute if a.name == "panels").i = 1
    with pytest.raises(Exception, match=r"with panels=1 each expert's weight must be \(rows / 16, cols, 16\)"):
        native_session(model, native_kernels).run(None, feed)
    model = kernel_model(w, True, panels=True)
    w2 = model.graph.initializer[E]  # expert 0's W2: (H / 16, I, 16) as (H / 16, I / 2, 32)
    w2.dims[:] = [w2.dims[0], w2.dims[1] // 2, 32]
    with pytest.raises(Exception, match=r"MoEExperts: expert 0's W2 is not \(H, I\) in 16-row panels"):
        native_session(model, native_kernels).run(None, feed)


def test_a_prompt_longer_than_the_scratch_goes_through_in_chunks(native_kernels) -> None:
    """scratch_floats small enough for a few pairs a chunk: the same answer as in one piece."""
    w = moe_weights(E, H, I, "swiglu", False, seed=30)
    g = torch.Generator().manual_seed(29)
    x, r = torch.randn(23, H, generator=g), torch.zeros(23, E)
    for n in range(23):
        r[n, torch.randperm(E, generator=g)[:2]] = torch.tensor([0.6, 0.4])
    x[5, 0] = NAN  # a NaN row inside a chunk
    chunked = native_session(kernel_model(w, True, scratch_floats=5 * (3 * I + H)), native_kernels)
    (y,) = chunked.run(None, {"x": x.numpy(), "r": r.numpy()})
    rows = [n for n in range(23) if n != 5]
    assert np.isnan(y[5]).all()
    np.testing.assert_allclose(y[rows], by_hand(x[rows], r[rows], w), rtol=1e-5, atol=1e-5)


def test_the_kernel_takes_the_clamped_swiglu_attributes(native_kernels) -> None:
    w = moe_weights(E, H, I, "swiglu", False, seed=33)
    for key in ("w_gate", "w_up"):
        w[key] = 6 * w[key]
    g = torch.Generator().manual_seed(34)
    x, r = torch.randn(5, H, generator=g), torch.rand(5, E, generator=g)
    (y,) = native_session(kernel_model(w, False, GPT_OSS), native_kernels).run(None, {"x": x.numpy(), "r": r.numpy()})
    expected = by_hand(x, r, w, GPT_OSS)
    assert not np.allclose(expected, by_hand(x, r, w), atol=1e-3)  # the clamp and alpha/beta matter here
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-4)  # outputs of order 10: float32 sums of 137


def test_the_kernel_gives_nan_rows_where_eager_does(native_kernels) -> None:
    w = moe_weights(E, H, I, "swiglu", False, seed=35)
    g = torch.Generator().manual_seed(36)
    x, r = torch.randn(7, H, generator=g), torch.zeros(7, E)
    r[:, 1], r[:, 6] = 0.6, 0.4
    x[1, 3], x[2, 0] = NAN, -INF
    r[3, 2], r[4, 5] = NAN, INF
    r[5, :] = -INF  # softmax over only -inf is NaN
    r[6, 0] = -INF  # one -inf among finite weights is a valid mask
    (y,) = native_session(kernel_model(w, True), native_kernels).run(None, {"x": x.numpy(), "r": r.numpy()})
    assert np.isnan(y[1:6]).all() and np.isfinite(y[[0, 6]]).all()
    np.testing.assert_allclose(y[[0, 6]], by_hand(x[[0, 6]], r[[0, 6]].clamp(min=0), w), rtol=1e-5, atol=1e-5)


def test_one_session_run_from_two_threads_at_once_gives_each_its_own_answer(native_kernels) -> None:
    w = moe_weights(E, H, I, "swiglu", False, seed=37)
    session = native_session(kernel_model(w, True), native_kernels)
    g = torch.Generator().manual_seed(38)
    feeds = [(torch.randn(n, H, generator=g), torch.rand(n, E, generator=g)) for n in (1, 3, 1, 5, 2, 1)]
    results: dict[int, list] = {}

    def worker(k: int) -> None:
        results[k] = [session.run(None, {"x": x.numpy(), "r": r.numpy()})[0] for x, r in feeds[k::2] * 20]

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in (0, 1):
        expected = [by_hand(x, r, w) for x, r in feeds[k::2]] * 20
        for got, want in zip(results[k], expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_weights_of_the_wrong_count_or_shape_are_refused_with_the_reason(native_kernels) -> None:
    w = moe_weights(E, H, I, "swiglu", False, seed=39)
    model = kernel_model(w, True)
    node = model.graph.node[0]
    del node.input[-1]  # one W2 short
    with pytest.raises(Exception, match=r"MoEExperts: takes X, R and 2 weights for each of R's 8 experts, got 17"):
        native_session(model, native_kernels).run(None, {"x": np.ones((1, H), np.float32), "r": np.ones((1, E), np.float32)})
    model = kernel_model(w, True)
    model.graph.initializer[E].CopyFrom(numpy_helper.from_array(np.ones((H, I + 1), np.float32), model.graph.initializer[E].name))
    with pytest.raises(Exception, match=r"MoEExperts: expert 0's W2 is not \(H, I\)"):
        native_session(model, native_kernels).run(None, {"x": np.ones((1, H), np.float32), "r": np.ones((1, E), np.float32)})


def test_weights_given_as_graph_inputs_are_checked_at_every_run(native_kernels) -> None:
    """A weight that is a graph input can come back at the same address with another shape (a
    view of the same buffer): the kernel must not keep the first run's I for it (it read past
    the smaller matrices and returned a wrong sum). Initializers, the lowering's, cannot."""
    names = ["x", "r", "w1", "w3", "w2"]
    node = helper.make_node("MoEExperts", names, ["y"], domain="moedeploy.cpu")
    graph = helper.make_graph([node], "kernel", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("moedeploy.cpu", 1)])
    session = native_session(model, native_kernels, threads=1)
    rng = np.random.default_rng(40)
    hidden, buffers = 16, [rng.standard_normal(64 * 16, dtype=np.float32) for _ in range(3)]
    x, r = rng.standard_normal((1, hidden), dtype=np.float32), np.ones((1, 1), np.float32)
    for inter in (64, 16, 64):
        w1, w3 = (b[:inter * hidden].reshape(inter, hidden) for b in buffers[:2])
        w2 = buffers[2][:hidden * inter].reshape(hidden, inter)
        (y,) = session.run(None, {"x": x, "r": r, "w1": w1, "w3": w3, "w2": w2})
        g, u = w1 @ x[0], w3 @ x[0]
        np.testing.assert_allclose(y[0], w2 @ (g / (1 + np.exp(-g)) * u), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match=r"MoEExperts: H and I must be at least 1"):
        session.run(None, {"x": np.ones((1, 0), np.float32), "r": r, "w1": np.ones((0, 0), np.float32),
                           "w3": np.ones((0, 0), np.float32), "w2": np.ones((0, 0), np.float32)})


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_the_lowering_matches_eager_for_one_token_and_for_many(native_kernels, name: str) -> None:
    """One node for every token count: a decode step's GEMV and a prompt's blocks of rows x
    tokens (37 tokens leave partial blocks), both as the eager op."""
    routing, has_bias = ROUTINGS[name]
    w = moe_weights(E, H, I, "swiglu", False, seed=41)
    g = torch.Generator().manual_seed(42)
    bias = 0.5 * torch.randn(E, generator=g) if has_bias else None
    model = moe_node_model(w, 0, 0, "swiglu", routing=routing, score_bias=None if bias is None else bias.numpy())
    lowered, counts = lower_for_ort(model, "CPUExecutionProvider", "native")
    assert counts["moe_native"] == 1 and counts["moe_experts"] == 0
    ops = [n.op_type for n in lowered.graph.node]
    assert ops.count("MoEExperts") == 1 and "If" not in ops and "IsNaN" not in ops  # the kernel guards NaN rows
    inits = {i.name for i in lowered.graph.initializer}
    assert len([n for n in inits if ".expert" in n]) == 3 * E  # one initializer an expert and matrix
    session = native_session(lowered, native_kernels)
    for n in (1, 1, 6, 37):
        x, logits = torch.randn(n, H, generator=g), 2.0 * torch.randn(n, E, generator=g)
        (y,) = session.run(None, {"X": x.numpy(), "router_logits": logits.numpy()})
        eager = moe_op.moe_reference(x, logits, w["w_gate"], w["w_up"], w["w_down"], routing, score_bias=bias).numpy()
        np.testing.assert_allclose(y, eager, rtol=1e-5, atol=1e-5)


def test_the_lowering_hands_the_clamped_swiglu_to_the_kernel(native_kernels) -> None:
    """gpt-oss's activation attributes through lower_to_native, against the eager op."""
    from tests.plugins.test_moe_experts import _model

    routing = ROUTINGS["softmax-renormalised"][0]
    w = moe_weights(E, H, I, "swiglu", False, seed=44)
    for key in ("w_gate", "w_up"):
        w[key] = 6 * w[key]
    lowered, counts = lower_for_ort(_model(w, routing, None, GPT_OSS), "CPUExecutionProvider", "native")
    assert counts["moe_native"] == 1
    g = torch.Generator().manual_seed(45)
    x, logits = torch.randn(9, H, generator=g), 2 * torch.randn(9, E, generator=g)
    (y,) = native_session(lowered, native_kernels).run(None, {"X": x.numpy(), "router_logits": logits.numpy()})
    expected = moe_op.moe_reference(x, logits, w["w_gate"], w["w_up"], w["w_down"], routing, activation=GPT_OSS).numpy()
    assert not np.allclose(expected, moe_op.moe_reference(x, logits, w["w_gate"], w["w_up"], w["w_down"], routing).numpy(),
                           atol=1e-3)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_what_the_kernel_does_not_take_goes_to_the_per_expert_ifs(native_kernels) -> None:
    """Expert biases: the kernel has none, so the per-expert lowering takes the node."""
    w = moe_weights(E, H, I, "swiglu", True, seed=43)
    _, counts = lower_for_ort(moe_node_model(w, 2, 1, "swiglu"), "CPUExecutionProvider", "native")
    assert counts["moe_native"] == 0 and counts["moe_experts"] == 1
