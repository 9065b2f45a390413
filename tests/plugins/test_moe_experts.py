"""moe::MoE lowered to one If per expert (plugins/moe_experts.py) against the eager op: every
routing variant, biases, gpt-oss's clamped SwiGLU, token counts from one (a decode step) to
many, exact ties, non-finite tokens; what it refuses; and that untaken experts do not run."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from moedeploy.plugins import moe as moe_op
from moedeploy.plugins.moe import ExpertActivation, Routing
from moedeploy.runtime.lowering import LoweringError, lower_for_ort
from moedeploy.runtime.ort import profile_events, session_options
from tests.export.artifacts import moe_node_model, moe_weights, plain_session

E, H, I = 8, 16, 24  # noqa: E741
NAN, INF = float("nan"), float("inf")

ROUTINGS = {  # name -> (Routing, whether it has a selection bias)
    "softmax-renormalised": (Routing(2, True), False),
    "softmax-top3-plain": (Routing(3, False), False),
    "deepseek-v3": (Routing(3, True, "sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5), True),
    "deepseek-v2-groups": (Routing(3, False, n_group=4, topk_group=2, routed_scaling_factor=1.5, group_scoring="max"),
                           False),
    "minimax-sigmoid-bias": (Routing(2, True, "sigmoid"), True),
    "sparsemixer": (Routing(2, scoring="sparsemixer", jitter_eps=0.3), False),
}
GPT_OSS = ExpertActivation("swiglu", activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)


def _model(w: dict, routing: Routing, bias: torch.Tensor | None, activation: ExpertActivation | None = None):
    model = moe_node_model(w, 0, 0, "swiglu", routing=routing, score_bias=None if bias is None else bias.numpy())
    if activation is not None:
        node = model.graph.node[0]
        for name, value in activation.attributes().items():
            if name != "activation":
                node.attribute.append(onnx.helper.make_attribute(name, value))
    return model


def _eager(x, logits, w, routing, bias, activation: ExpertActivation | str = "swiglu") -> np.ndarray:
    return moe_op.moe_reference(x, logits, w["w_gate"], w["w_up"], w["w_down"], routing, activation=activation,
                                b_gate=w["b_gate"], b_up=w["b_up"], b_down=w["b_down"], score_bias=bias).numpy()


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("biases", [False, True])
def test_every_routing_matches_eager_and_the_function_body(name: str, biases: bool) -> None:
    routing, has_bias = ROUTINGS[name]
    w = moe_weights(E, H, I, "swiglu", biases, seed=21)
    g = torch.Generator().manual_seed(22)
    bias = 0.5 * torch.randn(E, generator=g) if has_bias else None
    model = _model(w, routing, bias)
    lowered, counts = lower_for_ort(model, "CPUExecutionProvider", "auto")
    assert counts["moe_experts"] == 1 and counts["moe_contrib"] == counts["moe_routed"] == counts["moe_function"] == 0
    ops = [(n.domain, n.op_type) for n in lowered.graph.node]
    assert ops.count(("", "If")) == E and ("com.microsoft", "MoE") not in ops
    # plain softmax routing on five graph ops, the others on the op's function body (the probe)
    assert ops.count(("moe", "MoE")) == (0 if name.startswith("softmax") else 1)
    session = plain_session(lowered)
    for n in (1, 2, 5, 64):  # a decode step, a few, a prefill's worth
        x, logits = torch.randn(n, H, generator=g), 2.0 * torch.randn(n, E, generator=g)
        logits[0, 1] = logits[0, 5]  # an exact tie: the lower index wins everywhere
        feed = {"X": x.numpy(), "router_logits": logits.numpy()}
        (y,) = session.run(None, feed)
        np.testing.assert_allclose(y, _eager(x, logits, w, routing, bias), rtol=1e-5, atol=1e-5)
        (function,) = plain_session(model).run(None, feed)
        np.testing.assert_allclose(y, function, rtol=1e-5, atol=1e-5)


def test_clamped_swiglu_of_gpt_oss_matches_eager() -> None:
    """Weights large enough that the clamp at 7 bites on gate and up, both ways."""
    routing = Routing(2, True)
    w = moe_weights(E, H, I, "swiglu", True, seed=23)
    for key in ("w_gate", "w_up", "b_gate", "b_up"):
        w[key] = 6 * w[key]
    g = torch.Generator().manual_seed(24)
    x, logits = torch.randn(40, H, generator=g), 2 * torch.randn(40, E, generator=g)
    up = torch.einsum("eih,nh->nei", w["w_up"], x) + w["b_up"]
    assert (up > 7).float().mean() > 0.05 and (up < -7).float().mean() > 0.05
    lowered, counts = lower_for_ort(_model(w, routing, None, GPT_OSS), "CPUExecutionProvider", "experts")
    assert counts["moe_experts"] == 1
    (y,) = plain_session(lowered).run(None, {"X": x.numpy(), "router_logits": logits.numpy()})
    expected = _eager(x, logits, w, routing, None, GPT_OSS)
    assert not np.allclose(expected, _eager(x, logits, w, routing, None), atol=1e-3)  # the clamp matters
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["softmax-renormalised", "deepseek-v3"])
def test_non_finite_tokens_come_out_as_in_eager(name: str) -> None:
    routing, has_bias = ROUTINGS[name]
    w = moe_weights(E, H, I, "swiglu", True, seed=25)
    g = torch.Generator().manual_seed(26)
    bias = 0.5 * torch.randn(E, generator=g) if has_bias else None
    x, logits = torch.randn(8, H, generator=g), torch.randn(8, E, generator=g)
    x[1, 3] = NAN
    x[2, 0] = INF
    logits[3, 4], logits[4, 0], logits[5, 2] = NAN, INF, -INF
    (y,) = plain_session(lower_for_ort(_model(w, routing, bias), "CPUExecutionProvider", "auto")[0]).run(
        None, {"X": x.numpy(), "router_logits": logits.numpy()})
    eager = _eager(x, logits, w, routing, bias)
    nan_rows = np.isnan(eager).any(axis=1)
    assert nan_rows[[1, 2, 3]].all()  # NaN or Inf inputs and a NaN logit: NaN, never zeros
    # +Inf under softmax is NaN in eager, under sigmoid it is finite: either way as eager says
    assert nan_rows[4] == (routing.scoring == "softmax") and not nan_rows[5]
    np.testing.assert_array_equal(np.isnan(y).any(axis=1), nan_rows)
    np.testing.assert_allclose(y[~nan_rows], eager[~nan_rows], rtol=1e-5, atol=1e-5)


def test_untaken_experts_do_not_run() -> None:
    """One token routes to two experts: ONNX Runtime's profile shows two experts' Gemms run."""
    w = moe_weights(E, H, I, "swiglu", False, seed=27)
    lowered, _ = lower_for_ort(_model(w, Routing(2, True), None), "CPUExecutionProvider", "experts")
    session = ort.InferenceSession(lowered.SerializeToString(), session_options(profile=True),
                                   providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(28)
    session.run(None, {"X": torch.randn(1, H, generator=g).numpy(), "router_logits": torch.randn(1, E, generator=g).numpy()})
    events = profile_events(session)
    gemms = [e for e in events if e.get("cat") == "Node" and e.get("args", {}).get("op_name") == "Gemm"
             and e["name"].endswith("_kernel_time")]
    assert len(gemms) == 2 * 3  # two experts, gate + up + down each (separate gate and up weights here)


def test_what_it_does_not_take_is_refused_or_left_to_the_others() -> None:
    relu = moe_node_model(moe_weights(E, H, I, "relu", True, seed=29), 2, 1, "relu")
    _, counts = lower_for_ort(relu, "CPUExecutionProvider", "auto")
    assert counts["moe_experts"] == 0 and counts["moe_contrib"] == 1  # com.microsoft::MoE takes relu experts
    with pytest.raises(LoweringError, match="per-expert lowering does not take node 'moe_0'"):
        lower_for_ort(relu, "CPUExecutionProvider", "experts")
    half = moe_node_model(moe_weights(E, H, I, "swiglu", True, seed=30), 2, 1, "swiglu", dtype=np.float16)
    assert lower_for_ort(half, "CPUExecutionProvider", "auto")[1]["moe_experts"] == 0  # fp32 only
