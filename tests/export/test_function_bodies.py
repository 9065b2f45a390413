"""The standard-op function bodies of moe::MoE and moe::RMSNorm, run by ONNX Runtime in a
one-node model, against the eager references and against hand-written math."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from moedeploy.export.blocks import TOLERANCES
from moedeploy.plugins import moe as moe_op
from moedeploy.plugins import rmsnorm as rmsnorm_op
from moedeploy.runtime.lowering import lower_for_ort
from tests.export.artifacts import (
    moe_node_model,
    moe_weights,
    naive_moe,
    plain_session,
    rmsnorm_node_model,
)

E, H, I = 5, 16, 24  # noqa: E741
TOKEN_COUNTS = (1, 33)


def moe_case_inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, generator=g), 2.0 * torch.randn(n, E, generator=g)


def reference_args(w: dict[str, torch.Tensor], activation: str, bias: bool) -> dict:
    return {
        "w_gate": w["w_gate"] if activation == "swiglu" else None,
        "w_up": w["w_up"],
        "w_down": w["w_down"],
        "b_gate": w["b_gate"] if bias and activation == "swiglu" else None,
        "b_up": w["b_up"] if bias else None,
        "b_down": w["b_down"] if bias else None,
    }


CASES = list(itertools.product(("swiglu", "relu", "gelu"), (0, 1), (False, True), (1, 2)))


@pytest.mark.parametrize("activation,normalize,bias,top_k", CASES)
def test_moe_function_body_matches_reference(activation: str, normalize: int, bias: bool, top_k: int) -> None:
    w = moe_weights(E, H, I, activation, bias, seed=top_k)
    session = plain_session(moe_node_model(w, top_k, normalize, activation))
    args = reference_args(w, activation, bias)
    for n in TOKEN_COUNTS:
        x, logits = moe_case_inputs(n, seed=n)
        (y,) = session.run(None, {"X": x.numpy(), "router_logits": logits.numpy()})
        by_hand = naive_moe(x, logits, **args, top_k=top_k, normalize_topk=bool(normalize), activation=activation)
        reference = moe_op.moe_reference(
            x, logits, top_k=top_k, normalize_topk=bool(normalize), activation=activation, **args
        )
        assert y.shape == (n, H)
        np.testing.assert_allclose(y, by_hand.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y, reference.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(reference.numpy(), by_hand.numpy(), rtol=1e-5, atol=1e-5)


def test_normalize_topk_and_bias_really_change_the_result() -> None:
    """Guards the case grid above: each attribute must matter for these inputs."""
    x, logits = moe_case_inputs(33, seed=33)
    w = moe_weights(E, H, I, "swiglu", True, seed=2)
    run = {}
    for normalize, bias in itertools.product((0, 1), (False, True)):
        ww = w if bias else {**w, **{k: torch.zeros_like(w[k]) for k in ("b_gate", "b_up", "b_down")}}
        (run[normalize, bias],) = plain_session(moe_node_model(ww, 2, normalize, "swiglu")).run(
            None, {"X": x.numpy(), "router_logits": logits.numpy()}
        )
    assert np.abs(run[0, True] - run[1, True]).max() > 1e-2
    assert np.abs(run[1, False] - run[1, True]).max() > 1e-2


def test_moe_function_body_fp16_matches_eager_fp16() -> None:
    w = moe_weights(E, H, I, "swiglu", True, seed=9)
    session = plain_session(moe_node_model(w, 2, 1, "swiglu", dtype=np.float16))
    x, logits = moe_case_inputs(33, seed=4)
    x, logits = x.half(), logits.half()
    (y,) = session.run(None, {"X": x.numpy(), "router_logits": logits.numpy()})
    assert y.dtype == np.float16
    half = {k: v.half() for k, v in reference_args(w, "swiglu", True).items()}
    expected = moe_op.moe_reference(x, logits, top_k=2, normalize_topk=True, activation="swiglu", **half)
    atol, rtol = TOLERANCES["fp16"]
    np.testing.assert_allclose(y.astype(np.float32), expected.float().numpy(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("epsilon", [1e-5, 0.5])
def test_rmsnorm_function_body_matches_reference(epsilon: float) -> None:
    g = torch.Generator().manual_seed(0)
    scale = 1 + 0.3 * torch.randn(48, generator=g)
    x = 0.3 * torch.randn(3, 11, 48, generator=g)  # small values: a large epsilon shows
    model = rmsnorm_node_model(scale.numpy(), epsilon)
    (y,) = plain_session(model).run(None, {"X": x.numpy()})
    x64 = x.double().numpy()
    by_hand = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + epsilon) * scale.double().numpy()
    np.testing.assert_allclose(y, by_hand, rtol=1e-5, atol=1e-6)
    reference = rmsnorm_op.rms_norm_reference(x, scale, epsilon).numpy()
    np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-6)

    lowered, counts = lower_for_ort(model)
    assert counts["rmsnorm_native"] == 1 and counts["rmsnorm_function"] == 0
    assert [n.op_type for n in lowered.graph.node] == ["RMSNormalization"]
    (y_native,) = plain_session(lowered).run(None, {"X": x.numpy()})
    np.testing.assert_allclose(y_native, by_hand, rtol=1e-5, atol=1e-6)


def test_rmsnorm_epsilon_attribute_is_honoured() -> None:
    x = 0.3 * torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(1))
    scale = np.ones(48, dtype=np.float32)
    (a,) = plain_session(rmsnorm_node_model(scale, 1e-5)).run(None, {"X": x.numpy()})
    (b,) = plain_session(rmsnorm_node_model(scale, 0.5)).run(None, {"X": x.numpy()})
    assert np.abs(a - b).max() > 0.1


def test_rmsnorm_function_body_fp16_matches_eager_fp16() -> None:
    g = torch.Generator().manual_seed(2)
    scale = (1 + 0.3 * torch.randn(64, generator=g)).half()
    x = (3 * torch.randn(4, 9, 64, generator=g)).half()
    model = rmsnorm_node_model(scale.numpy(), 1e-5, dtype=np.float16)
    (y,) = plain_session(model).run(None, {"X": x.numpy()})
    assert y.dtype == np.float16
    expected = rmsnorm_op.rms_norm_reference(x, scale, 1e-5).float().numpy()
    atol, rtol = TOLERANCES["fp16"]
    np.testing.assert_allclose(y.astype(np.float32), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("activation", ["swiglu", "relu", "gelu"])
def test_eager_moe_reference_matches_hand_math(activation: str) -> None:
    """The eager reference itself, for every activation."""
    w = moe_weights(E, H, I, activation, True, seed=5)
    args = reference_args(w, activation, True)
    x, logits = moe_case_inputs(33, seed=6)
    for normalize in (False, True):
        got = moe_op.moe_reference(x, logits, top_k=2, normalize_topk=normalize, activation=activation, **args)
        want = naive_moe(x, logits, **args, top_k=2, normalize_topk=normalize, activation=activation)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


class GeluExperts(torch.nn.Module):
    """A model with gelu experts (no gate) calling the op the way SparseMoE does."""

    def __init__(self) -> None:
        super().__init__()
        w = moe_weights(E, H, I, "gelu", False, seed=8)
        self.router = torch.nn.Linear(H, E)
        self.w_up = torch.nn.Parameter(w["w_up"])
        self.w_down = torch.nn.Parameter(w["w_down"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return moe_op.moe(x, self.router(x), None, self.w_up, self.w_down, 2, True, "gelu")


def test_exported_gelu_experts_run_on_onnxruntime() -> None:
    from moedeploy.export.onnx_export import to_onnx

    module = GeluExperts().eval()
    model = to_onnx(module, (torch.randn(5, H),), ["x"], ["y"], ({0: "n"},))
    x = torch.randn(33, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = module(x).numpy()
    (y,) = plain_session(model).run(None, {"x": x.numpy()})
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_function_bodies_are_the_same_bytes_in_every_process() -> None:
    """An artifact exported twice from the same weights is the same file: the bodies do not
    depend on Python's string hashing, which differs between processes (onnxscript orders an
    If's outputs by a set of names; each If of the bodies now has one output)."""
    import hashlib
    import os
    import subprocess
    import sys

    code = ("import hashlib; from moedeploy.plugins import moe, rmsnorm; "
            "print(*(hashlib.sha256(m.function_proto().SerializeToString()).hexdigest() for m in (moe, rmsnorm)))")
    here = " ".join(hashlib.sha256(m.function_proto().SerializeToString()).hexdigest() for m in (moe_op, rmsnorm_op))
    for seed in ("1", "2", "3"):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert run.stdout.split() == here.split(), seed
