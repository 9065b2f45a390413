"""gpt-oss's clamped SwiGLU (opset "moe" 3: activation_alpha, activation_beta, swiglu_limit)
in every facet but the kernels (test_kernels.py): the eager op against transformers' own
GptOssMLP and against a hand formula, the function body on plain ONNX Runtime, and the
com.microsoft::MoE lowering, whose attributes of the same names ONNX Runtime defines itself.

swiglu(g, u) = (clamp(u, -limit, limit) + beta) * g' * sigmoid(alpha * g'), g' = min(g, limit).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch

from moedeploy.plugins.moe import ExpertActivation, Routing, moe_reference
from moedeploy.runtime.lowering import lower_for_ort
from tests.export.artifacts import moe_node_model, moe_weights, plain_session

GPT_OSS = ExpertActivation("swiglu", activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
E, H, I = 6, 16, 12  # noqa: E741


def _hand_moe(x, logits, w, top_k: int, alpha: float, beta: float, limit: float | None) -> torch.Tensor:
    """Token by token in float64: softmax, top-k renormalised, the clamped SwiGLU as gpt-oss
    writes it. Independent of moedeploy."""
    x, logits = x.double(), logits.double()
    w = {k: v.double() for k, v in w.items()}
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        probs = torch.softmax(logits[n], -1)
        top = sorted(range(probs.numel()), key=lambda e: -probs[e].item())[:top_k]
        total = sum(probs[e] for e in top)
        for e in top:
            gate = w["w_gate"][e] @ x[n] + w["b_gate"][e]
            up = w["w_up"][e] @ x[n] + w["b_up"][e]
            if limit is not None:
                gate = torch.minimum(gate, torch.tensor(limit, dtype=gate.dtype))
                up = torch.maximum(torch.minimum(up, torch.tensor(limit, dtype=up.dtype)), torch.tensor(-limit, dtype=up.dtype))
            hidden = (up + beta) * gate / (1 + torch.exp(-alpha * gate))
            out[n] += probs[e] / total * (w["w_down"][e] @ hidden + w["b_down"][e])
    return out


def _clamped_case(n: int, seed: int):
    """Inputs and weights large enough that the clamp at 7 bites on gate and up, both ways."""
    g = torch.Generator().manual_seed(seed)
    w = moe_weights(E, H, I, "swiglu", True, seed=seed)
    for name in ("w_gate", "w_up", "b_gate", "b_up"):
        w[name] = 6 * w[name]
    x, logits = torch.randn(n, H, generator=g), 2 * torch.randn(n, E, generator=g)
    gate = torch.einsum("eih,nh->nei", w["w_gate"], x) + w["b_gate"]
    up = torch.einsum("eih,nh->nei", w["w_up"], x) + w["b_up"]
    assert (gate > 7).float().mean() > 0.05 and (up > 7).float().mean() > 0.05 and (up < -7).float().mean() > 0.05
    return x, logits, w


def _args(w: dict) -> dict:
    return {k: w[k] for k in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")}


# --- eager ---------------------------------------------------------------------------------


@torch.no_grad()
def test_eager_matches_transformers_gpt_oss_mlp() -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    mlp = GptOssMLP(config).eval()
    # the experts' alpha and limit: from the config in recent transformers, constants of the
    # module before (5.17 has no config.swiglu_limit), so read them off the module
    assert (mlp.experts.alpha, mlp.experts.limit) == (1.702, 7.0)
    g = torch.Generator().manual_seed(0)
    for p in mlp.parameters():
        p.copy_(torch.randn(p.shape, generator=g))
    mlp.experts.gate_up_proj.mul_(6 / H**0.5)  # |gate|, |up| of a few units to ~20: the clamp bites
    mlp.experts.down_proj.mul_(1 / I**0.5)
    x = torch.randn(1, 200, H, generator=g)

    expected, _ = mlp(x)
    logits, _, _ = mlp.router(x[0])  # the router's own bias is an ordinary Add before the op
    experts = mlp.experts
    gate_up = torch.einsum("nh,ehk->nek", x[0], experts.gate_up_proj) + experts.gate_up_proj_bias
    assert (gate_up[..., ::2] > 7).any() and (gate_up[..., 1::2].abs() > 7).any()
    # transformers stores (E, H, 2I) with gate and up interleaved on the last axis; ours is (E, out, in)
    ours = moe_reference(
        x[0], logits, experts.gate_up_proj[..., ::2].transpose(1, 2), experts.gate_up_proj[..., 1::2].transpose(1, 2),
        experts.down_proj.transpose(1, 2), Routing(2, True), activation=GPT_OSS,
        b_gate=experts.gate_up_proj_bias[:, ::2], b_up=experts.gate_up_proj_bias[:, 1::2],
        b_down=experts.down_proj_bias,
    )
    torch.testing.assert_close(ours, expected[0], atol=1e-4, rtol=1e-5)
    unclamped = moe_reference(
        x[0], logits, experts.gate_up_proj[..., ::2].transpose(1, 2), experts.gate_up_proj[..., 1::2].transpose(1, 2),
        experts.down_proj.transpose(1, 2), Routing(2, True), activation=ExpertActivation("swiglu", 1.702, 1.0),
        b_gate=experts.gate_up_proj_bias[:, ::2], b_up=experts.gate_up_proj_bias[:, 1::2],
        b_down=experts.down_proj_bias,
    )
    assert (unclamped - expected[0]).abs().max() > 1.0  # the limit matters on these inputs


@pytest.mark.parametrize(
    "activation,limit",
    [(GPT_OSS, 7.0), (ExpertActivation("swiglu", 0.5, -0.25, 3.0), 3.0), (ExpertActivation("swiglu", 1.702, 1.0), None)],
    ids=["gpt-oss", "other-params", "no-limit"],
)
def test_eager_matches_hand_formula(activation: ExpertActivation, limit: float | None) -> None:
    x, logits, w = _clamped_case(40, seed=1)
    expected = _hand_moe(x, logits, w, 2, activation.activation_alpha, activation.activation_beta, limit)
    actual = moe_reference(x, logits, top_k=Routing(2, True), activation=activation, **_args(w))
    torch.testing.assert_close(actual.double(), expected, atol=1e-4, rtol=1e-5)


def test_defaults_are_plain_swiglu_and_version_2_nodes_read_as_them() -> None:
    x, logits, w = _clamped_case(20, seed=2)
    silu = torch.nn.functional.silu
    expected = _hand_moe(x, logits, w, 2, 1.0, 0.0, None)
    for act in ("swiglu", ExpertActivation(), ExpertActivation.from_attributes({"activation": b"swiglu"})):
        torch.testing.assert_close(moe_reference(x, logits, top_k=2, activation=act, **_args(w)).double(), expected,
                                   atol=1e-4, rtol=1e-5)
    assert ExpertActivation.from_attributes({}) == ExpertActivation()
    assert ExpertActivation().swiglu_limit == math.inf and not ExpertActivation().parametrised
    g, u = torch.randn(50), torch.randn(50)
    from moedeploy.plugins.moe import swiglu

    assert torch.equal(swiglu(g, u, ExpertActivation()), silu(g) * u)  # bit for bit: version 2's math


def test_activation_refuses_what_it_cannot_mean() -> None:
    for limit in (0.0, -7.0, math.nan):
        with pytest.raises(ValueError, match="swiglu_limit must be > 0"):
            ExpertActivation("swiglu", swiglu_limit=limit)
    with pytest.raises(ValueError, match="swiglu only"):
        ExpertActivation("relu", activation_beta=1.0)
    with pytest.raises(ValueError, match="unknown MoE activation"):
        ExpertActivation("tanh")
    with pytest.raises(ValueError, match="finite"):
        ExpertActivation("swiglu", activation_alpha=math.inf)


# --- ONNX: function body, com.microsoft::MoE ----------------------------------------------


def _node_model(w: dict, activation: ExpertActivation, explicit: bool = True) -> onnx.ModelProto:
    """A one-node moe::MoE model (the exported node's inputs, the op's function body) with the
    activation's attributes; `explicit=False` leaves them off, as a version 2 node."""
    model = moe_node_model(w, 2, 1, activation.activation)
    if explicit:
        node = model.graph.node[0]
        for name, value in activation.attributes().items():
            if name != "activation":
                node.attribute.append(onnx.helper.make_attribute(name, value))
        onnx.checker.check_model(model, full_check=True)
    return model


def _feed(x: torch.Tensor, logits: torch.Tensor) -> dict[str, np.ndarray]:
    return {"X": x.numpy(), "router_logits": logits.numpy()}


def test_function_body_matches_eager() -> None:
    x, logits, w = _clamped_case(64, seed=3)
    for act in (GPT_OSS, ExpertActivation("swiglu", 0.5, -0.25, 3.0)):
        (y,) = plain_session(_node_model(w, act)).run(None, _feed(x, logits))
        expected = moe_reference(x, logits, top_k=Routing(2, True), activation=act, **_args(w))
        np.testing.assert_allclose(y, expected.numpy(), atol=1e-4, rtol=1e-5)
    # defaults spelled out = a version 2 node without them, bit for bit
    (explicit,) = plain_session(_node_model(w, ExpertActivation())).run(None, _feed(x, logits))
    (implicit,) = plain_session(_node_model(w, ExpertActivation(), explicit=False)).run(None, _feed(x, logits))
    np.testing.assert_array_equal(explicit, implicit)


def _contrib_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if (n.domain, n.op_type) == ("com.microsoft", "MoE")]


@pytest.mark.parametrize("activation", [GPT_OSS, ExpertActivation("swiglu", 1.702, 1.0)], ids=["clamped", "unclamped"])
def test_contrib_lowering_keeps_the_clamp(activation: ExpertActivation) -> None:
    x, logits, w = _clamped_case(64, seed=4)
    model = _node_model(w, activation)
    lowered, counts = lower_for_ort(model, "CPUExecutionProvider", "contrib")
    assert counts["moe_contrib"] == 1 and counts["moe_function"] == 0
    (node,) = _contrib_nodes(lowered)
    assert not [n for n in lowered.graph.node if n.domain == "moe"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["activation_type"] == b"swiglu" and attrs["swiglu_fusion"] == 1
    assert attrs["activation_alpha"] == pytest.approx(1.702) and attrs["activation_beta"] == 1.0
    # ONNX Runtime reads a missing swiglu_limit as no clamp (and 0 as clamp to 0: see below)
    assert attrs.get("swiglu_limit") == (7.0 if activation.clamped else None)
    (contrib,) = plain_session(lowered).run(None, _feed(x, logits))
    (function,) = plain_session(model).run(None, _feed(x, logits))
    np.testing.assert_allclose(contrib, function, atol=1e-4, rtol=1e-5)
    limit = activation.swiglu_limit if activation.clamped else None
    np.testing.assert_allclose(contrib, _hand_moe(x, logits, w, 2, 1.702, 1.0, limit).numpy(), atol=1e-4, rtol=1e-5)


def test_onnxruntime_swiglu_limit_semantics() -> None:
    """The evidence for the lowering: com.microsoft::MoE (CPU) clamps gate to <= limit and up
    to [-limit, limit] before G * sigmoid(alpha G) * (L + beta); no attribute or +inf is no
    clamp; a limit of 0 is a clamp to 0, not "no clamp"."""
    x, logits, w = _clamped_case(32, seed=5)
    lowered, _ = lower_for_ort(_node_model(w, GPT_OSS), "CPUExecutionProvider", "contrib")
    (node,) = _contrib_nodes(lowered)

    def run(limit: float | None) -> np.ndarray:
        kept = [a for a in node.attribute if a.name != "swiglu_limit"]
        del node.attribute[:]
        node.attribute.extend(kept)
        if limit is not None:
            node.attribute.append(onnx.helper.make_attribute("swiglu_limit", limit))
        return plain_session(lowered).run(None, _feed(x, logits))[0]

    def hand(limit: float | None) -> np.ndarray:
        return _hand_moe(x, logits, w, 2, 1.702, 1.0, limit).numpy()

    for limit, means in [(7.0, 7.0), (1.0, 1.0), (None, None), (math.inf, None), (0.0, 0.0)]:
        np.testing.assert_allclose(run(limit), hand(means), atol=1e-4, rtol=1e-5, err_msg=f"swiglu_limit={limit}")
    assert np.abs(hand(0.0) - hand(None)).max() > 1.0  # so 0 cannot stand for "no clamp" there
