"""ONNX Runtime lowering: moe::MoE -> com.microsoft::MoE when its kernel computes the same
thing (and ONNX Runtime really runs it), the dense function body otherwise."""

from __future__ import annotations

import copy
import gc
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from moedeploy.export.blocks import TOLERANCES
from moedeploy.plugins import moe as moe_op
from moedeploy.runtime.lowering import LoweringError, lower_for_ort
from moedeploy.runtime.ort import SessionError, create_session, profile_events
from tests.export.artifacts import (
    eager_block,
    moe_node_model,
    moe_weights,
    naive_moe,
    plain_session,
)

CPU = ["CPUExecutionProvider"]


def executed_ops(lowered, feed: dict) -> set[str]:
    """The op names in ONNX Runtime's own profile of one run."""
    lowered.run(feed)
    events = profile_events(lowered.session)
    return {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})}


def moe_block_input(batch: int, seq: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(batch, seq, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- the exported artifacts -------------------------------------------------------------------


def test_fp32_moe_block_lowers_to_contrib_and_ort_runs_it(store, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # where ONNX Runtime would write its profile unless told otherwise
    artifact = store.block("moe")
    feed = {"x": moe_block_input(2, 5).numpy()}
    contrib = create_session(artifact, CPU, moe_lowering="contrib", profile=True)
    assert contrib.lowering["moe_contrib"] == 1 and contrib.lowering["moe_function"] == 0
    ops = executed_ops(contrib, feed)
    assert "MoE" in ops
    assert not {"TopK", "ScatterElements"} & ops  # no dense routing ran

    function = create_session(artifact, CPU, moe_lowering="function", profile=True)
    assert function.lowering["moe_contrib"] == 0 and function.lowering["moe_function"] == 1
    ops = executed_ops(function, feed)
    assert "MoE" not in ops
    assert {"TopK", "ScatterElements"} <= ops  # the inlined dense body ran instead

    experts = create_session(artifact, CPU, profile=True)  # the default on CPU fp32
    assert experts.lowering["moe_experts"] == 1 and experts.lowering["moe_contrib"] == 0
    ops = executed_ops(experts, feed)
    assert "MoE" not in ops and {"If", "Gemm", "ScatterND"} <= ops
    # three profiles read, and nothing left of them: not in the working folder, not in a temporary one
    assert list(tmp_path.iterdir()) == []
    folder = Path(experts.session.get_session_options().profile_file_prefix).parent
    assert folder.name.startswith("moedeploy-ort-profile-") and not folder.exists()


def test_split_experts_live_as_long_as_the_bare_session(store) -> None:
    """The experts moe_split re-lays, which ONNX Runtime reads in place, belong to the
    InferenceSession itself: a caller that keeps only `.session` (the runners, the decoders)
    still reads them once the wrapper is gone and freed memory has been handed out again."""
    artifact = store.decoder("fp32")
    c = artifact.manifest["config"]
    ids = torch.randint(0, c["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(3))
    feed = {"input_ids": ids.numpy()}
    for name in artifact.input_names()[1:]:
        feed[name] = np.zeros((2, c["n_kv_heads"], 0, c["head_dim"]), np.float32)
    bare = create_session(artifact, CPU, threads=2).session
    gc.collect()
    reused = [np.full(1 << 20, 7.0, np.float32) for _ in range(96)]  # 384 MB, where freed arrays were
    got = bare.run(["logits"], feed)[0]
    del reused
    expected = create_session(artifact, CPU, threads=1).session.run(["logits"], feed)[0]  # one If per expert
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_decoder_lowering_counts(store) -> None:
    lowered = create_session(store.decoder("fp32"), CPU, threads=1)
    assert create_session(store.decoder("fp32"), CPU, threads=2).lowering["moe_split"] == 2  # the experts in pieces
    assert lowered.lowering == {"moe_contrib": 0, "moe_routed": 0, "moe_experts": 2, "moe_native": 0, "moe_split": 0, "moe_function": 0,
                                "rmsnorm_native": 5, "rmsnorm_function": 0, "attention_gqa": 0, "attention_graph": 2, "logits_last": 0, "rmsnorm_skip": 0,
                                "matmul_nbits": 0, "moe_qmoe": 0, "matmul_nbits_fused": 0, "packed_qkv": 0, "sign_flips": 0,
                                "greedy_token": 0}
    assert lowered.provider == "CPUExecutionProvider"


def test_the_moe_path_variable_chooses_between_split_and_if_per_expert(store, monkeypatch) -> None:
    artifact = store.decoder("fp32")
    monkeypatch.setenv("MOEDEPLOY_MOE_PATH", "experts")
    lowered = create_session(artifact, CPU, threads=2).lowering
    assert (lowered["moe_experts"], lowered["moe_split"]) == (2, 0)
    # it chooses the default lowering's path only: asked for com.microsoft::MoE, the experts are still cut
    assert create_session(artifact, CPU, moe_lowering="contrib", threads=2).lowering["moe_split"] == 2
    monkeypatch.setenv("MOEDEPLOY_MOE_PATH", " Split ")
    lowered = create_session(artifact, CPU, threads=2).lowering
    assert (lowered["moe_experts"], lowered["moe_split"]) == (0, 2)
    monkeypatch.setenv("MOEDEPLOY_MOE_PATH", "fast")
    with pytest.raises(SessionError, match=r"^MOEDEPLOY_MOE_PATH='fast' is not a MoE path: set it to native \(the "
                                           r"project's kernel, the default where it builds\), split \(each expert cut "
                                           r"into one piece per thread\) or experts"):
        create_session(artifact, CPU, threads=2)


def test_lowering_never_changes_the_artifact(store) -> None:
    artifact = store.block("decoder_layer")
    before = (artifact.model_path).read_bytes()
    create_session(artifact, CPU)
    assert artifact.model_path.read_bytes() == before
    artifact.verify()


@pytest.mark.parametrize("batch,seq", [(1, 1), (3, 11)])  # N = 1 and N = 33 tokens
def test_contrib_and_function_agree_with_eager(store, batch: int, seq: int) -> None:
    artifact = store.block("moe")
    x = moe_block_input(batch, seq, seed=seq)
    with torch.no_grad():
        expected = eager_block("moe")(x).numpy()
    (contrib,) = create_session(artifact, CPU, moe_lowering="contrib").run({"x": x.numpy()})
    (function,) = create_session(artifact, CPU, moe_lowering="function").run({"x": x.numpy()})
    np.testing.assert_allclose(contrib, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(function, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(contrib, function, rtol=1e-5, atol=1e-5)


def test_fp16_falls_back_to_the_function_body_and_matches_eager(store) -> None:
    artifact = store.block("moe", dtype="fp16")
    lowered = create_session(artifact, CPU)
    assert lowered.lowering["moe_contrib"] == 0 and lowered.lowering["moe_function"] == 1
    x = moe_block_input(3, 11, seed=4, dtype=torch.float16)
    (y,) = lowered.run({"x": x.numpy()})
    with torch.no_grad():
        expected = eager_block("moe", dtype="fp16")(x).float().numpy()
    atol, rtol = TOLERANCES["fp16"]
    np.testing.assert_allclose(y.astype(np.float32), expected, rtol=rtol, atol=atol)


def test_contrib_on_fp16_is_refused(store) -> None:
    with pytest.raises(LoweringError, match=r"com\.microsoft::MoE"):
        create_session(store.block("moe", dtype="fp16"), CPU, moe_lowering="contrib")


def test_unknown_lowering_is_refused(store) -> None:
    with pytest.raises(LoweringError, match="invalid MoE lowering"):
        create_session(store.block("moe"), CPU, moe_lowering="fastest")  # type: ignore[arg-type]


# --- one-node models: biases, awkward token counts, every eligible activation ---------------

E, H, I = 5, 16, 24  # noqa: E741


@pytest.mark.parametrize(
    "activation,normalize,bias", list(itertools.product(("swiglu", "relu"), (0, 1), (False, True)))
)
def test_contrib_lowering_matches_hand_math(activation: str, normalize: int, bias: bool) -> None:
    w = moe_weights(E, H, I, activation, bias, seed=normalize)
    model = moe_node_model(w, 2, normalize, activation)
    lowered, counts = lower_for_ort(model, "CPUExecutionProvider", "contrib")
    assert counts["moe_contrib"] == 1
    domains = {(n.domain, n.op_type) for n in lowered.graph.node}
    assert ("com.microsoft", "MoE") in domains and ("moe", "MoE") not in domains
    contrib = plain_session(lowered)
    args = {
        "w_gate": w["w_gate"] if activation == "swiglu" else None,
        "w_up": w["w_up"], "w_down": w["w_down"],
        "b_gate": w["b_gate"] if bias and activation == "swiglu" else None,
        "b_up": w["b_up"] if bias else None,
        "b_down": w["b_down"] if bias else None,
    }
    for n in (1, 33):
        g = torch.Generator().manual_seed(n)
        x, logits = torch.randn(n, H, generator=g), 2.0 * torch.randn(n, E, generator=g)
        feed = {"X": x.numpy(), "router_logits": logits.numpy()}
        (y,) = contrib.run(None, feed)
        by_hand = naive_moe(x, logits, **args, top_k=2, normalize_topk=bool(normalize), activation=activation)
        np.testing.assert_allclose(y, by_hand.numpy(), rtol=1e-5, atol=1e-5)
        reference = moe_op.moe_reference(
            x, logits, top_k=2, normalize_topk=bool(normalize), activation=activation, **args
        )
        np.testing.assert_allclose(y, reference.numpy(), rtol=1e-5, atol=1e-5)
        if activation == "swiglu":  # the function body loads for swiglu (see test_function_bodies)
            (y_function,) = plain_session(model).run(None, feed)
            np.testing.assert_allclose(y, y_function, rtol=1e-5, atol=1e-5)


def test_gelu_is_not_contrib_eligible() -> None:
    model = moe_node_model(moe_weights(E, H, I, "gelu", True, seed=0), 2, 1, "gelu")
    with pytest.raises(LoweringError):
        lower_for_ort(model, "CPUExecutionProvider", "contrib")
    lowered, counts = lower_for_ort(model, "CPUExecutionProvider", "auto")
    assert counts["moe_contrib"] == 0 and counts["moe_function"] == 1
    assert [(n.domain, n.op_type) for n in lowered.graph.node] == [("moe", "MoE")]


def test_fp16_node_is_not_contrib_eligible_on_cpu() -> None:
    model = moe_node_model(moe_weights(E, H, I, "swiglu", True, seed=0), 2, 1, "swiglu", dtype=np.float16)
    with pytest.raises(LoweringError, match="CPUExecutionProvider"):
        lower_for_ort(model, "CPUExecutionProvider", "contrib")
    _, counts = lower_for_ort(model, "CPUExecutionProvider", "auto")
    assert counts["moe_contrib"] == 0 and counts["moe_function"] == 1


def test_session_works_when_the_cache_cannot_be_written(store, tmp_path) -> None:
    """A read-only artifact (simulated: a file where cache/ would go, which defeats root too)
    still loads, lowered the same way, and matches a session built from the cached file."""
    import shutil

    import numpy as np

    from moedeploy.export.artifact import Artifact
    from moedeploy.runtime.ort import CACHE_DIR, create_session

    def private_copy(name: str) -> Artifact:  # of the session's moe export, without any cache/ others wrote
        dest = shutil.copytree(store.block("moe").path, tmp_path / name, ignore=shutil.ignore_patterns("cache", "report", "engines"))
        return Artifact.load(dest)

    writable = private_copy("ok")
    blocked = private_copy("blocked")
    assert not (writable.path / CACHE_DIR).exists()  # both start without a cache: the first session writes it
    (blocked.path / CACHE_DIR).write_text("not a folder")
    cached, uncached = create_session(writable), create_session(blocked)
    assert uncached.lowering == cached.lowering and uncached.lowering["moe_experts"] == 1
    feed = blocked.golden_inputs()[0]
    np.testing.assert_allclose(uncached.run(feed)[0], blocked.golden_outputs()[0]["y"], rtol=1e-5, atol=1e-5)
    assert (blocked.path / CACHE_DIR).is_file()  # left alone


# --- non-finite inputs: NaN in, NaN out, as eager PyTorch -------------------------------------

NAN, INF = float("nan"), float("inf")


def _contrib_outputs(model, feed: dict, monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, np.ndarray]:
    """(lowered as shipped, lowered without the non-finite guard: the bare com.microsoft::MoE)."""
    (guarded,) = plain_session(lower_for_ort(model, "CPUExecutionProvider", "contrib")[0]).run(None, feed)
    with monkeypatch.context() as m:
        m.setattr(moe_op, "nan_where_not_finite", lambda add, y, *_: y)
        (bare,) = plain_session(lower_for_ort(model, "CPUExecutionProvider", "contrib")[0]).run(None, feed)
    return guarded, bare


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_contrib_propagates_non_finite_tokens_like_eager(activation: str, monkeypatch) -> None:
    w = moe_weights(E, H, I, activation, True, seed=3)
    model = moe_node_model(w, 2, 1, activation)
    g = torch.Generator().manual_seed(7)
    x, router = torch.randn(9, H, generator=g), torch.randn(E, H, generator=g)
    x[1, 3], x[2, 5], x[3, 0] = NAN, INF, -INF  # a NaN, a +Inf and a -Inf token
    logits = x @ router.T  # as the router computes them: non-finite on those rows
    logits[5, 2] = NAN  # finite tokens whose routing is not: a NaN, a +Inf logit
    logits[6, 0] = INF
    logits[7, 4] = -INF  # a -Inf logit masks an expert: finite, in eager as here
    feed = {"X": x.numpy(), "router_logits": logits.numpy()}
    gate = w["w_gate"] if activation == "swiglu" else None
    eager = moe_op.moe_reference(
        x, logits, gate, w["w_up"], w["w_down"], 2, True, activation,
        w["b_gate"] if gate is not None else None, w["b_up"], w["b_down"],
    ).numpy()
    nan_rows = [1, 2, 3, 5, 6]
    assert np.isnan(eager[nan_rows]).all() and np.isfinite(np.delete(eager, nan_rows, 0)).all()

    guarded, bare = _contrib_outputs(model, feed, monkeypatch)
    assert np.isnan(guarded[nan_rows]).all()  # not zeros
    assert np.isfinite(np.delete(guarded, nan_rows, 0)).all()
    np.testing.assert_allclose(np.delete(guarded, nan_rows, 0), np.delete(eager, nan_rows, 0), rtol=1e-5, atol=1e-5)
    # Finite tokens: bit for bit what the bare contrib op returns.
    np.testing.assert_array_equal(np.delete(guarded, nan_rows, 0), np.delete(bare, nan_rows, 0))
    if activation == "swiglu":  # the function body, for comparison, already gave NaN
        (function,) = plain_session(model).run(None, feed)
        assert np.isnan(function[nan_rows]).all()



def _router_in_graph(model, router: np.ndarray, how: str):
    """The one-node model with its logits made in the graph, as a decoder's router makes them:
    x @ router^T by a Gemm (transB) or a MatMul by a constant, by a Gemm whose weight is fed as an
    input, or (not x's own product) by a Gemm of relu(x)."""
    import onnx

    model = copy.deepcopy(model)
    graph = model.graph
    kept = [value for value in graph.input if value.name != "router_logits"]
    del graph.input[:]
    graph.input.extend(kept)
    nodes = []
    if how == "matmul":
        graph.initializer.append(onnx.numpy_helper.from_array(np.ascontiguousarray(router.T), "router"))
        nodes.append(onnx.helper.make_node("MatMul", ["X", "router"], ["router_logits"]))
    else:
        source = "X"
        if how == "gemm-of-relu":
            nodes.append(onnx.helper.make_node("Relu", ["X"], ["relu_x"]))
            source = "relu_x"
        nodes.append(onnx.helper.make_node("Gemm", [source, "router"], ["router_logits"], transB=1))
        if how == "gemm-weight-input":
            graph.input.append(onnx.helper.make_tensor_value_info("router", onnx.TensorProto.FLOAT, list(router.shape)))
        else:
            graph.initializer.append(onnx.numpy_helper.from_array(router, "router"))
    for i, node in enumerate(nodes):
        graph.node.insert(i, node)
    return model


@pytest.mark.parametrize("how", ["gemm", "matmul", "gemm-weight-input", "gemm-of-relu"])
def test_contrib_guard_behind_a_router_still_propagates_non_finite_tokens(how: str, monkeypatch) -> None:
    """Logits that are x @ W carry every non-finite x into the routing, so the guard checks the
    routing alone (no x - x): the same NaN rows as eager PyTorch, among them an -Inf meeting only
    positive router weights (every logit -Inf) and an +Inf meeting a zero one (a NaN logit). A
    router that reads something else than x (relu(x): relu(-Inf) = 0) keeps the check of x."""
    w = moe_weights(E, H, I, "swiglu", True, seed=5)
    g = torch.Generator().manual_seed(9)
    router = torch.randn(E, H, generator=g)
    router[:, 7] = router[:, 7].abs() + 0.1
    router[2, 9] = 0.0
    model = _router_in_graph(moe_node_model(w, 2, 1, "swiglu"), router.numpy(), how)
    x = torch.randn(8, H, generator=g)
    x[1, 3], x[2, 5], x[3, 0], x[4, 7], x[5, 9] = NAN, INF, -INF, -INF, INF
    feed = {"X": x.numpy()} | ({"router": router.numpy()} if how == "gemm-weight-input" else {})
    lowered, counts = lower_for_ort(model, "CPUExecutionProvider", "contrib")
    assert counts["moe_contrib"] == 1
    subs = [n for n in lowered.graph.node if n.op_type == "Sub"]
    assert len(subs) == (1 if how == "gemm-of-relu" else 0)  # x - x: the check of x
    router_input = torch.relu(x) if how == "gemm-of-relu" else x
    eager = moe_op.moe_reference(x, router_input @ router.T, w["w_gate"], w["w_up"], w["w_down"], 2, True,
                                 "swiglu", w["b_gate"], w["b_up"], w["b_down"]).numpy()
    nan_rows = [1, 2, 3, 4, 5]
    assert np.isnan(eager[nan_rows]).all() and np.isfinite(np.delete(eager, nan_rows, 0)).all()

    guarded, bare = _contrib_outputs(model, feed, monkeypatch)
    assert not np.isnan(bare[nan_rows]).all()  # the bare op loses some: the guard is what keeps them
    assert np.isnan(guarded[nan_rows]).all()
    np.testing.assert_allclose(np.delete(guarded, nan_rows, 0), np.delete(eager, nan_rows, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.delete(guarded, nan_rows, 0), np.delete(bare, nan_rows, 0))


@pytest.mark.parametrize(("op", "attributes", "reads_x", "expected"), [
    ("MatMul", {}, True, True),
    ("Gemm", {"transB": 1}, True, True),
    ("Gemm", {"transB": 1, "beta": 0.5}, True, True),
    ("Gemm", {"transA": 1}, True, False),  # x^T: rows of the logits are not rows of x
    ("Gemm", {"alpha": 0.0}, True, False),  # alpha 0 may skip A @ B altogether
    ("Gemm", {"transB": 1}, False, False),  # the product of another tensor
    ("Add", {}, True, False),
])
def test_routes_from_only_a_row_for_row_product_of_x(op, attributes, reads_x, expected) -> None:
    import onnx_ir as ir

    x, other, weight = ir.Value(name="x"), ir.Value(name="other"), ir.Value(name="w")
    node = ir.node(op, [x if reads_x else other, weight], attributes)
    assert moe_op.routes_from(x, node.outputs[0]) is expected


def test_contrib_guard_off_the_cpu_keeps_the_check_of_x() -> None:
    """Elsewhere than on the CPU (where the test above holds ONNX Runtime's Softmax to it) the
    guard does not lean on the provider's Softmax to carry a non-finite x: x is checked."""
    w = moe_weights(E, H, I, "swiglu", True, seed=5)
    model = _router_in_graph(moe_node_model(w, 2, 1, "swiglu"), np.ones((E, H), np.float32), "gemm")
    for provider, checks_x in (("CPUExecutionProvider", False), ("CUDAExecutionProvider", True)):
        lowered, counts = lower_for_ort(model, provider, "contrib")
        assert counts["moe_contrib"] == 1
        subs = [list(n.input) for n in lowered.graph.node if n.op_type == "Sub"]
        assert subs == ([["X", "X"]] if checks_x else []), provider  # x - x: the check of x


# --- routings com.microsoft::MoE cannot compute: routed on graph ops, experts on the contrib op --

ROUTED = {  # name -> (Routing over 8 experts, with a selection bias)
    "deepseek-v3": (moe_op.Routing(3, True, "sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5), True),
    "deepseek-v2-groups": (moe_op.Routing(3, False, n_group=4, topk_group=2, routed_scaling_factor=1.5,
                                          group_scoring="max"), False),
    "deepseek-v2-greedy": (moe_op.Routing(2, False, routed_scaling_factor=1.5), False),
    "minimax-sigmoid-bias": (moe_op.Routing(2, True, "sigmoid"), True),
    "sparsemixer": (moe_op.Routing(2, scoring="sparsemixer", jitter_eps=0.3), False),
}


@pytest.mark.parametrize("name", list(ROUTED))
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_routed_contrib_lowering_matches_eager_and_the_function_body(name: str, activation: str) -> None:
    routing, has_bias = ROUTED[name]
    n_experts = 8
    w = moe_weights(n_experts, H, I, activation, True, seed=11)
    g = torch.Generator().manual_seed(12)
    bias = 0.5 * torch.randn(n_experts, generator=g) if has_bias else None
    model = moe_node_model(w, 0, 0, activation, routing=routing, score_bias=None if bias is None else bias.numpy())
    lowered, counts = lower_for_ort(model, "CPUExecutionProvider", "contrib" if activation == "swiglu" else "auto")
    assert counts["moe_routed"] == 1 and counts["moe_contrib"] == counts["moe_function"] == 0
    ops = [(n.domain, n.op_type) for n in lowered.graph.node]
    assert ops.count(("com.microsoft", "MoE")) == 1 and ops.count(("moe", "MoE")) == 1  # + the routing probe
    gate = w["w_gate"] if activation == "swiglu" else None
    b_gate = w["b_gate"] if activation == "swiglu" else None
    for n in (1, 37):
        x, logits = torch.randn(n, H, generator=g), 2.0 * torch.randn(n, n_experts, generator=g)
        logits[0, 1] = logits[0, 5]  # an exact tie: the lower index wins everywhere
        feed = {"X": x.numpy(), "router_logits": logits.numpy()}
        (y,) = plain_session(lowered).run(None, feed)
        eager = moe_op.moe_reference(x, logits, gate, w["w_up"], w["w_down"], routing, activation=activation,
                                     b_gate=b_gate, b_up=w["b_up"], b_down=w["b_down"], score_bias=bias)
        np.testing.assert_allclose(y, eager.numpy(), rtol=1e-5, atol=1e-5)
        if activation == "swiglu":  # the function body loads for swiglu (see test_function_bodies)
            (function,) = plain_session(model).run(None, feed)
            np.testing.assert_allclose(y, function, rtol=1e-5, atol=1e-5)


def test_routed_contrib_propagates_non_finite_tokens_like_eager() -> None:
    routing, _ = ROUTED["deepseek-v3"]
    w = moe_weights(8, H, I, "swiglu", True, seed=13)
    g = torch.Generator().manual_seed(14)
    bias = 0.5 * torch.randn(8, generator=g)
    model = moe_node_model(w, 0, 0, "swiglu", routing=routing, score_bias=bias.numpy())
    x, logits = torch.randn(6, H, generator=g), torch.randn(6, 8, generator=g)
    x[1, 3] = NAN
    logits[2, 4], logits[3, 0] = NAN, INF
    (y,) = plain_session(lower_for_ort(model, "CPUExecutionProvider", "auto")[0]).run(
        None, {"X": x.numpy(), "router_logits": logits.numpy()})
    eager = moe_op.moe_reference(x, logits, w["w_gate"], w["w_up"], w["w_down"], routing, b_gate=w["b_gate"],
                                 b_up=w["b_up"], b_down=w["b_down"], score_bias=bias).numpy()
    nan_rows = [1, 2]  # sigmoid(+Inf) = 1: that token's routing is finite, in eager as here
    assert np.isnan(eager[nan_rows]).all() and np.isnan(y[nan_rows]).all()
    assert np.isfinite(np.delete(y, nan_rows, 0)).all()
    np.testing.assert_allclose(np.delete(y, nan_rows, 0), np.delete(eager, nan_rows, 0), rtol=1e-5, atol=1e-5)



def test_a_profile_written_elsewhere_is_read_and_left_alone(tmp_path) -> None:
    """profile_events removes only what moedeploy's profiling options wrote (a temporary folder
    of its own): a session profiled into a folder of the caller's keeps its file."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "add",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    options = ort.SessionOptions()
    options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "mine")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=CPU)
    session.run(None, {"x": np.ones(2, np.float32)})
    events = profile_events(session)
    assert any(e.get("name") == "model_run" for e in events)
    (kept,) = tmp_path.iterdir()
    assert kept.name.startswith("mine") and kept.suffix == ".json"
