"""Routing of every family, token by token: our `route` against transformers' own router
modules (the reference), and the moe::MoE function body (what plain ONNX Runtime runs)
against the eager op for every scoring, group-limited selection and scaling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moedeploy.models.families import family_for
from moedeploy.plugins.moe import MoE, Routing, moe_reference, route

from .cases import cases

N_TOKENS = 300  # past the size where torch.topk switches algorithm on CPU


def _hf_router(case: str):
    """transformers' router of the case's family, with random weights and selection bias."""
    import transformers.models as M

    config = cases()[case]
    kind = config.model_type
    module = {
        "mixtral": lambda c: M.mixtral.modeling_mixtral.MixtralTopKRouter(c),
        "qwen2_moe": lambda c: M.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter(c),
        "qwen3_moe": lambda c: M.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(c),
        "olmoe": lambda c: M.olmoe.modeling_olmoe.OlmoeTopKRouter(c),
        "granitemoe": lambda c: M.granitemoe.modeling_granitemoe.GraniteMoeTopKRouter(c),
        "phimoe": lambda c: M.phimoe.modeling_phimoe.PhimoeTopKRouter(c),
        "glm4_moe": lambda c: M.glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter(c),
        "minimax_m2": lambda c: M.minimax_m2.modeling_minimax_m2.MiniMaxM2TopKRouter(c),
        "gpt_oss": lambda c: M.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(c),
        "deepseek_v2": lambda c: M.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(c),
        "deepseek_v3": lambda c: M.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(c),
    }[kind](config).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=g))
    bias = 0.5 * torch.randn(module.weight.shape[0], generator=g) - 0.3  # often below 0: a masked expert must lose
    if hasattr(module, "e_score_correction_bias"):
        module.e_score_correction_bias.copy_(bias)
    return config, module, bias


@pytest.mark.parametrize("case", sorted(cases()))
@torch.no_grad()
def test_route_matches_transformers_router(case: str) -> None:
    config, router, bias = _hf_router(case)
    ours = family_for(config.model_type).config(config.to_dict())
    x = torch.randn(N_TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(4))
    if config.model_type == "minimax_m2":
        logits, hf_weights, hf_experts = router(x, bias)
    else:
        logits, hf_weights, hf_experts = router(x)
    weights, experts = route(logits, ours.routing, score_bias=bias if ours.score_bias else None)
    # the same experts with the same weights (the order within a token's k does not matter)
    hf_order, our_order = hf_experts.argsort(-1), experts.argsort(-1)
    assert torch.equal(hf_experts.gather(1, hf_order), experts.gather(1, our_order))
    torch.testing.assert_close(weights.gather(1, our_order), hf_weights.float().gather(1, hf_order),
                               atol=1e-6, rtol=1e-5)


ROUTINGS = {
    "softmax": Routing(3, True),
    "softmax-unnormalised": Routing(2, False),
    "sigmoid-bias-scaled": Routing(3, True, "sigmoid", routed_scaling_factor=2.5),
    "sigmoid-unnormalised": Routing(2, False, "sigmoid"),
    "sigmoid-groups": Routing(3, True, "sigmoid", n_group=4, topk_group=2, routed_scaling_factor=1.5),
    "softmax-groups": Routing(2, True, "softmax", n_group=2, topk_group=1),
    "sparsemixer": Routing(2, scoring="sparsemixer", jitter_eps=0.3),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_function_body_matches_eager(name: str) -> None:
    """The standard-op body, evaluated op by op, against the eager op on many tokens; with a
    selection bias (ignored by sparsemixer) and, for one case, exact ties (ties go to the lower index)."""
    r = ROUTINGS[name]
    E, H, I = 8, 6, 5  # noqa: E741
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N_TOKENS, H, generator=g)
    logits = 2 * torch.randn(N_TOKENS, E, generator=g)
    logits[:20, 4:] = logits[:20, :4]  # exact ties between experts j and j + 4
    w_gate, w_up = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g)
    w_down = torch.randn(E, H, I, generator=g)
    bias = torch.zeros(E) if r.scoring == "softmax" and "groups" not in name else 0.3 * torch.randn(E, generator=g)
    expected = moe_reference(x, logits, w_gate, w_up, w_down, r, score_bias=bias).numpy()
    zeros = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    got = MoE(x.numpy(), logits.numpy(), w_gate.numpy(), w_up.numpy(), w_down.numpy(), zeros(E, I), zeros(E, I),
              zeros(E, H), bias.numpy(), **{**r.attributes(), "activation": "swiglu"})
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-5)


def test_routing_refuses_what_it_cannot_follow() -> None:
    with pytest.raises(ValueError, match="sparsemixer routing picks exactly 2"):
        Routing(3, scoring="sparsemixer")
    with pytest.raises(ValueError, match="n_group 3 must divide"):
        Routing(2, n_group=3, topk_group=1).check(8)
    with pytest.raises(ValueError, match="exceeds the experts of 1 groups"):
        Routing(3, n_group=4, topk_group=1).check(8)
    # every lowering takes an expert where its dense weight is > 0: a factor <= 0 (or NaN) would
    # drop the picked experts there and not in the eager reference, so no Routing holds one
    for factor in (-2.5, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"routed_scaling_factor must be a positive number, got {factor}"):
            Routing(2, routed_scaling_factor=factor)
