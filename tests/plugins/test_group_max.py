"""DeepSeek-V2's group_limited_greedy routing (opset "moe" 3: group_scoring="max"): groups
ranked by their best softmax score, the topk_group best kept, no renormalisation, scaled.
Checked against transformers' own DeepseekV2TopkRouter token by token, and the function body
on plain ONNX Runtime against the eager op (the Triton kernels: test_kernels.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from moedeploy.compare.layerwise import flipped_tokens
from moedeploy.plugins.moe import Routing, moe_reference, route
from moedeploy.runtime.lowering import lower_for_ort
from tests.export.artifacts import moe_node_model, moe_weights, plain_session

N_TOKENS = 300

# (n_experts, top_k, n_group, topk_group): several groups; top_k = every kept expert; groups of one
HF_CASES = {
    "16e-4g": (16, 3, 4, 2),
    "12e-4g-all-kept": (12, 6, 4, 2),
    "24e-8g": (24, 4, 8, 3),
    "8e-groups-of-1": (8, 2, 8, 3),
}


@pytest.mark.parametrize("case", list(HF_CASES))
@torch.no_grad()
def test_route_matches_transformers_deepseek_v2_router(case: str) -> None:
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    n_experts, top_k, n_group, topk_group = HF_CASES[case]
    config = DeepseekV2Config(
        hidden_size=32, n_routed_experts=n_experts, num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group,
        topk_method="group_limited_greedy", routed_scaling_factor=16.0, num_hidden_layers=1, num_attention_heads=2,
    )
    router = DeepseekV2TopkRouter(config).eval()
    g = torch.Generator().manual_seed(n_experts + top_k)
    router.weight.copy_(torch.randn(router.weight.shape, generator=g) / 2)
    x = torch.randn(N_TOKENS, 32, generator=g)
    logits, hf_weights, hf_experts = router(x)

    routing = Routing(top_k, False, "softmax", n_group=n_group, topk_group=topk_group, routed_scaling_factor=16.0,
                      group_scoring="max")
    weights, experts = route(logits, routing)
    hf_order, our_order = hf_experts.argsort(-1), experts.argsort(-1)
    assert torch.equal(hf_experts.gather(1, hf_order), experts.gather(1, our_order))
    torch.testing.assert_close(weights.gather(1, our_order), hf_weights.gather(1, hf_order), atol=1e-6, rtol=1e-5)
    if n_experts // n_group > 1:  # the rule matters on these tokens: the sum of two best picks otherwise
        _, by_sum = route(logits, Routing(top_k, False, n_group=n_group, topk_group=topk_group))
        assert not torch.equal(by_sum.sort(-1).values, experts.sort(-1).values)


def test_max_scoring_by_hand() -> None:
    """Group scores are the best member's, not the sum of the best two."""
    probs = torch.tensor([[0.40, 0.01, 0.30, 0.29]])  # groups {0, 1}: max .40, sum .41; {2, 3}: max .30, sum .59
    logits = probs.log()
    by_max = Routing(2, False, n_group=2, topk_group=1, group_scoring="max")
    weights, experts = route(logits, by_max)
    assert experts.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.tensor([[0.40, 0.01]]))
    assert route(logits, Routing(2, False, n_group=2, topk_group=1))[1].tolist() == [[2, 3]]
    # the layer-wise compare's flip count routes with the MoE's Routing, group scoring included
    moved = probs[:, [2, 1, 0, 3]].log()  # the best single score moves into the second group
    assert flipped_tokens(logits.numpy(), moved.numpy(), by_max) == [0]
    assert flipped_tokens(logits.numpy(), moved.numpy(), Routing(2, False, n_group=2, topk_group=1)) == []


def test_routing_checks_for_max_scoring() -> None:
    Routing(2, n_group=8, topk_group=2, group_scoring="max").check(8)  # groups of one: max of one
    with pytest.raises(ValueError, match="groups of at least 2"):
        Routing(2, n_group=8, topk_group=2).check(8)
    with pytest.raises(ValueError, match="exceeds the experts of 2 groups"):
        Routing(5, n_group=4, topk_group=2, group_scoring="max").check(8)  # transformers' 0.0 mask would pick a dropped expert
    with pytest.raises(ValueError, match="unknown MoE group_scoring"):
        Routing(2, n_group=2, group_scoring="top2")
    assert Routing.from_attributes({"top_k": 2}).group_scoring == "top2_sum"  # a version 2 node
    assert Routing.from_attributes({"group_scoring": b"max"}).group_scoring == "max"


BODY_CASES = {  # n_experts, n_group, topk_group, selection bias
    "deepseek-v2": (12, 4, 2, False),
    "signed-score-bias": (12, 4, 2, True),
    "groups-of-1": (12, 12, 5, False),  # the top2_sum branch, not taken, must still load in ORT
}


@pytest.mark.parametrize("case", list(BODY_CASES))
def test_function_body_matches_eager(case: str) -> None:
    E, n_group, topk_group, bias = BODY_CASES[case]
    H, I = 16, 8  # noqa: E741
    routing = Routing(3, False, n_group=n_group, topk_group=topk_group, routed_scaling_factor=16.0, group_scoring="max")
    w = moe_weights(E, H, I, "swiglu", True, seed=1)
    model = moe_node_model(w, routing.top_k, int(routing.normalize_topk), "swiglu")
    node = model.graph.node[0]
    for name, value in routing.attributes().items():
        if name not in ("top_k", "normalize_topk"):
            node.attribute.append(onnx.helper.make_attribute(name, value))
    g = torch.Generator().manual_seed(2)
    score_bias = 0.1 * torch.randn(E, generator=g) if bias else torch.zeros(E)
    (init,) = [t for t in model.graph.initializer if t.name == "score_bias"]
    init.CopyFrom(onnx.numpy_helper.from_array(score_bias.numpy(), "score_bias"))
    onnx.checker.check_model(model, full_check=True)

    x, logits = torch.randn(N_TOKENS, H, generator=g), 2 * torch.randn(N_TOKENS, E, generator=g)
    logits[:10, 6:] = logits[:10, :6]  # exact ties between groups: the lower group wins, in both
    args = {k: w[k] for k in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")}
    expected = moe_reference(x, logits, top_k=routing, score_bias=score_bias, **args).numpy()
    lowered, counts = lower_for_ort(model, "CPUExecutionProvider", "function")  # the body itself
    assert counts == {"moe_contrib": 0, "moe_routed": 0, "moe_experts": 0, "moe_native": 0, "moe_split": 0, "moe_function": 1,
                      "rmsnorm_native": 0,
                      "rmsnorm_function": 0, "attention_gqa": 0, "attention_graph": 0, "logits_last": 0, "rmsnorm_skip": 0,
                      "matmul_nbits": 0, "moe_qmoe": 0, "matmul_nbits_fused": 0, "packed_qkv": 0, "sign_flips": 0,
                      "greedy_token": 0}
    (y,) = plain_session(lowered).run(None, {"X": x.numpy(), "router_logits": logits.numpy()})
    np.testing.assert_allclose(y, expected, atol=1e-4, rtol=1e-5)
    # and it is not the top2_sum rule's answer
    if E // n_group > 1:
        other = moe_reference(x, logits, top_k=Routing(3, False, n_group=n_group, topk_group=topk_group,
                                                        routed_scaling_factor=16.0), score_bias=score_bias, **args)
        assert np.abs(other.numpy() - expected).max() > 1.0
