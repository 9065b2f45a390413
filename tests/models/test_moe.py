"""SparseMoE against hand routing, a per-token per-expert loop, and transformers' Mixtral MoE block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moedeploy.models import SparseMoE, SwiGLU

from .helpers import randomize_, tiny_mixtral_config


def _experts(n: int, dim: int, hidden: int, bias: bool = False) -> list[SwiGLU]:
    """Separately built experts, each with its own random weights (unlike the seed's SMoE)."""
    return [randomize_(SwiGLU(dim, hidden, bias=bias), seed=100 + e) for e in range(n)]


def _swiglu_by_hand(x: torch.Tensor, expert: SwiGLU) -> torch.Tensor:
    def lin(v: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        return v @ layer.weight.T + (0 if layer.bias is None else layer.bias)

    gate = lin(x, expert.w1)
    return lin(gate * torch.sigmoid(gate) * lin(x, expert.w3), expert.w2)


def _loop_reference(
    x: torch.Tensor, router: nn.Linear, experts: list[SwiGLU], top_k: int, normalize: bool
) -> torch.Tensor:
    """The seed SMoE done right, one token and one chosen expert at a time."""
    flat = x.reshape(-1, x.shape[-1])
    rows = []
    for n in range(flat.shape[0]):
        probs = torch.softmax(router(flat[n]), dim=-1)
        weights, chosen = probs.topk(top_k)
        if normalize:
            weights = weights / weights.sum()
        rows.append(
            sum(
                weights[j] * _swiglu_by_hand(flat[n], experts[int(chosen[j])]) for j in range(top_k)
            )
        )
    return torch.stack(rows).reshape(x.shape)


def _moe(experts: list[SwiGLU], router: nn.Linear, top_k: int, normalize: bool = True) -> SparseMoE:
    return SparseMoE.from_experts(router, experts, top_k, normalize)


# ---------------------------------------------------------------- (a) routing by hand

# Router = identity on 4 features, so each token's router logits are the token itself.
HAND_LOGITS = torch.tensor(
    [
        [2.0, 1.0, 0.0, -1.0],  # top-2: experts 0, 1
        [0.0, 3.0, 3.5, -2.0],  # top-2: experts 2, 1
        [-1.0, -1.5, 0.5, 2.5],  # top-2: experts 3, 2
    ]
)
HAND_TOP2 = [(0, 1), (2, 1), (3, 2)]
# Worked by hand. Raw: p_e = exp(l_e) / sum_j exp(l_j), e.g. token 0: e^2 / (e^2 + e + 1 + 1/e)
# = 7.389056 / 11.475217. Renormalised top-2: p_a / (p_a + p_b) = sigmoid(l_a - l_b), e.g.
# token 0: sigmoid(1) = 0.7310586, token 1: sigmoid(0.5), token 2: sigmoid(2).
HAND_WEIGHTS = {
    False: [(0.6439143, 0.2368828), (0.6094533, 0.3696521), (0.8447028, 0.1143181)],
    True: [(0.7310586, 0.2689414), (0.6224593, 0.3775407), (0.8807971, 0.1192029)],
}


@pytest.mark.parametrize("normalize", [True, False])
def test_routing_by_hand(normalize: bool) -> None:
    dim = 4
    experts = _experts(4, dim, 6)
    router = nn.Linear(dim, 4, bias=False)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    moe = _moe(experts, router, top_k=2, normalize=normalize)

    x = HAND_LOGITS.clone()
    expected = torch.stack(
        [
            wa * _swiglu_by_hand(x[n], experts[a]) + wb * _swiglu_by_hand(x[n], experts[b])
            for n, ((a, b), (wa, wb)) in enumerate(
                zip(HAND_TOP2, HAND_WEIGHTS[normalize], strict=True)
            )
        ]
    )
    torch.testing.assert_close(moe(x), expected, atol=1e-5, rtol=1e-5)
    if not normalize:
        # Switch-style: the k weights do not sum to one, so the output is not a convex mix.
        renormed = _moe(experts, router, top_k=2, normalize=True)(x)
        assert not torch.allclose(moe(x), renormed, atol=1e-3)


# ---------------------------------------------------------------- (b) per-token loop


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 11), (33, 1)])
@pytest.mark.parametrize(("n_experts", "top_k"), [(5, 1), (5, 2), (5, 5), (4, 3)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_per_token_loop(
    shape: tuple[int, int], n_experts: int, top_k: int, normalize: bool, bias: bool
) -> None:
    dim, hidden = 12, 20
    experts = _experts(n_experts, dim, hidden, bias=bias)
    router = randomize_(nn.Linear(dim, n_experts, bias=bias), seed=7)
    moe = _moe(experts, router, top_k, normalize)
    assert moe.n_experts == n_experts
    assert (moe.b_gate is None) == (not bias)
    x = torch.randn(*shape, dim)
    torch.testing.assert_close(
        moe(x), _loop_reference(x, router, experts, top_k, normalize), atol=1e-5, rtol=1e-5
    )


def test_gradients_match_per_token_loop() -> None:
    dim, hidden, n_experts = 8, 12, 4
    experts = _experts(n_experts, dim, hidden, bias=True)
    router = randomize_(nn.Linear(dim, n_experts), seed=3)
    moe = _moe(experts, router, top_k=2)
    x = torch.randn(2, 9, dim)
    g = torch.randn(2, 9, dim)
    (moe(x) * g).sum().backward()
    (_loop_reference(x, router, experts, 2, True) * g).sum().backward()
    torch.testing.assert_close(
        moe.w_gate.grad, torch.stack([e.w1.weight.grad for e in experts]), atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(
        moe.w_up.grad, torch.stack([e.w3.weight.grad for e in experts]), atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(
        moe.w_down.grad, torch.stack([e.w2.weight.grad for e in experts]), atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(
        moe.b_down.grad, torch.stack([e.w2.bias.grad for e in experts]), atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(moe.router.weight.grad, router.weight.grad, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- (c) transformers Mixtral block


@pytest.mark.parametrize(
    ("n_experts", "top_k", "tokens"),
    [(4, 2, (2, 9)), (5, 1, (1, 1)), (3, 3, (3, 5)), (8, 2, (1, 33))],
)
def test_matches_transformers_mixtral_block(
    n_experts: int, top_k: int, tokens: tuple[int, int]
) -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hidden_size, inter = 16, 24
    config = tiny_mixtral_config(
        hidden_size=hidden_size,
        intermediate_size=inter,
        num_local_experts=n_experts,
        num_experts_per_tok=top_k,
    )
    hf = randomize_(MixtralSparseMoeBlock(config), seed=5).eval()
    # transformers 5 stores experts fused: gate_up_proj (E, 2I, H) with the gate rows first.
    assert hf.experts.gate_up_proj.shape == (n_experts, 2 * inter, hidden_size)
    ours = SparseMoE(hidden_size, inter, n_experts, top_k, normalize_topk=True)
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        ours.w_gate.copy_(hf.experts.gate_up_proj[:, :inter])
        ours.w_up.copy_(hf.experts.gate_up_proj[:, inter:])
        ours.w_down.copy_(hf.experts.down_proj)
    x = torch.randn(*tokens, hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- (d) experts are distinct


def _forced_router(dim: int, n_experts: int, expert: int) -> nn.Linear:
    """A router that sends every token to `expert` first, whatever the token."""
    router = nn.Linear(dim, n_experts)
    with torch.no_grad():
        router.weight.zero_()
        router.bias.copy_(-10.0 * torch.ones(n_experts))
        router.bias[expert] = 10.0
    return router


def test_each_expert_has_its_own_weights() -> None:
    dim, hidden, n_experts = 8, 16, 4
    experts = _experts(n_experts, dim, hidden)
    x = torch.randn(2, 5, dim)
    outputs = []
    for e in range(n_experts):
        moe = _moe(experts, _forced_router(dim, n_experts, e), top_k=1)
        y = moe(x)
        torch.testing.assert_close(y, _swiglu_by_hand(x, experts[e]), atol=1e-5, rtol=1e-5)
        outputs.append(y)
    for i in range(n_experts):
        for j in range(i + 1, n_experts):
            assert not torch.allclose(outputs[i], outputs[j], atol=1e-3), (i, j)


def test_shared_expert_seed_bug_is_detected() -> None:
    # Negative control: the seed notebook's SMoE (one module in every slot) makes forced
    # routing to different experts indistinguishable, which the test above would catch.
    shared = _experts(1, 8, 16)[0]
    x = torch.randn(3, 8)
    y0 = _moe([shared] * 3, _forced_router(8, 3, 0), top_k=1)(x)
    y2 = _moe([shared] * 3, _forced_router(8, 3, 2), top_k=1)(x)
    torch.testing.assert_close(y0, y2)


def test_stacked_parameters_are_distinct_and_not_aliased() -> None:
    n_experts = 4
    for moe in (
        SparseMoE(8, 16, n_experts, 2, bias=True),
        _moe(_experts(n_experts, 8, 16, True), nn.Linear(8, 4), 2),
    ):
        for name in ("w_gate", "w_up", "w_down"):
            w = getattr(moe, name)
            for i in range(n_experts):
                for j in range(i + 1, n_experts):
                    assert not torch.equal(w[i], w[j]), (name, i, j)
        # Writing one expert's slice leaves every other expert, and the other matrices, alone.
        before = {n: p.detach().clone() for n, p in moe.named_parameters()}
        with torch.no_grad():
            moe.w_gate[1].fill_(123.0)
        for n, p in moe.named_parameters():
            if n == "w_gate":
                assert torch.equal(p[[0, 2, 3]], before[n][[0, 2, 3]])
                assert (p[1] == 123.0).all()
            else:
                assert torch.equal(p, before[n]), n
        ptrs = {p.data_ptr() for p in (moe.w_gate, moe.w_up, moe.w_down)}
        assert len(ptrs) == 3


def test_from_experts_copies_weights() -> None:
    experts = _experts(3, 8, 16)
    router = nn.Linear(8, 3)
    moe = _moe(experts, router, 2)
    x = torch.randn(4, 8)
    y = moe(x)
    with torch.no_grad():
        experts[0].w1.weight.mul_(2.0)
        router.weight.zero_()
    torch.testing.assert_close(moe(x), y)


# ---------------------------------------------------------------- (e) edge cases


def test_experts_with_no_tokens() -> None:
    dim, hidden, n_experts = 8, 12, 6
    experts = _experts(n_experts, dim, hidden, bias=True)
    router = randomize_(nn.Linear(dim, n_experts), seed=9)
    with torch.no_grad():
        router.bias.copy_(torch.tensor([5.0, 5.0, 5.0, -20.0, -20.0, -20.0]))
    moe = _moe(experts, router, top_k=2)
    x = torch.randn(3, 4, dim)
    chosen = torch.softmax(router(x.reshape(-1, dim)), -1).topk(2).indices
    assert set(chosen.unique().tolist()) <= {0, 1, 2}  # experts 3, 4, 5 see no token
    torch.testing.assert_close(
        moe(x), _loop_reference(x, router, experts, 2, True), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("n_experts", [1, 3])
def test_top_k_equal_to_experts_is_dense_softmax_mixture(n_experts: int) -> None:
    dim = 6
    experts = _experts(n_experts, dim, 10)
    router = randomize_(nn.Linear(dim, n_experts), seed=2)
    x = torch.randn(5, dim)
    probs = F.softmax(router(x), dim=-1)  # (N, E): every expert, weights summing to 1
    dense = sum(probs[:, e : e + 1] * _swiglu_by_hand(x, experts[e]) for e in range(n_experts))
    for normalize in (True, False):
        torch.testing.assert_close(
            _moe(experts, router, n_experts, normalize)(x), dense, atol=1e-5, rtol=1e-5
        )


def test_top_1_normalised_uses_the_argmax_expert_with_weight_one() -> None:
    dim, n_experts = 6, 4
    experts = _experts(n_experts, dim, 10)
    router = randomize_(nn.Linear(dim, n_experts), seed=4)
    x = torch.randn(7, dim)
    best = router(x).argmax(-1)
    expected = torch.stack([_swiglu_by_hand(x[n], experts[int(best[n])]) for n in range(7)])
    torch.testing.assert_close(_moe(experts, router, 1, True)(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [0, 5])
def test_invalid_top_k(top_k: int) -> None:
    with pytest.raises(ValueError, match="top_k"):
        SparseMoE(8, 16, 4, top_k)
