"""Every family exported in half precision from its Hugging Face folder.

fp16 runs on ONNX Runtime's CPU provider (the MoE on its function body: com.microsoft::MoE has
no fp16 CPU kernel) and must compute in fp16 yet stay as close to transformers as fp16 allows.
bf16 cannot run here (the CPU provider has no bfloat16 kernels), so its artifact is checked
for what can be checked without running it: the full ONNX checker, bf16 inputs and outputs,
and weights that are exactly the checkpoint's values rounded to bf16.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from moedeploy.export.exporter import export

from .cases import EXPORT_CASES, cases, make_model, prompt, save_checkpoint

CASES = cases(n_layers=2)
#: fp16 keeps 11 significant bits; through two layers and an LM head of logits O(4), transformers'
#: own fp16 run drifts up to 0.03 from its fp32 run on these models.
FP16_ATOL = 0.03


#: the bf16 checks (no run: the graph, its types and the rounded weights) on the families whose
#: graphs differ most: a sliding window with a shared expert, sigmoid group routing with a shared
#: expert, sparsemixer routing; fp16 runs on every export case
BF16_CASES = ("qwen2_moe-window-mqa", "glm4_moe-groups", "phimoe")


def _export(case: str, dtype: str, tmp_path_factory):
    """(transformers fp32 model, artifact in `dtype`), exported from a saved folder."""
    hf = make_model(CASES[case], seed=1)
    root = tmp_path_factory.mktemp(f"{case}-{dtype}")
    checkpoint = save_checkpoint(hf, root / "checkpoint")
    return hf, export("decoder", root / dtype, checkpoint=checkpoint, dtype=dtype, golden=False)


@pytest.fixture(scope="module", params=EXPORT_CASES)
def half(request, tmp_path_factory):
    """(transformers fp32 model, fp16 artifact, case id)."""
    return *_export(request.param, "fp16", tmp_path_factory), request.param


@pytest.fixture(scope="module", params=BF16_CASES)
def bf16(request, tmp_path_factory):
    """(transformers fp32 model, bf16 artifact)."""
    return _export(request.param, "bf16", tmp_path_factory)


@torch.no_grad()
def test_fp16_runs_in_half_precision_and_agrees_with_transformers(half) -> None:
    hf, artifact, case = half
    ids = prompt(hf.config.vocab_size, seed=7)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # fp16 constants it cannot fold on CPU are not our concern here
    session = ort.InferenceSession(str(artifact.model_path), options, providers=["CPUExecutionProvider"])
    feed = {"input_ids": ids.numpy()}
    for i in session.get_inputs()[1:]:  # an empty cache: (batch, heads, 0, features)
        feed[i.name] = np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), np.float16)
    got = session.run(["logits"], feed)[0]
    assert got.dtype == np.float16
    got = got.astype(np.float32)

    fp32 = hf(ids).logits.numpy()
    fp16 = make_model(CASES[case], seed=1).half()(ids).logits.float().numpy()
    # A routing near-tie may resolve either way in fp16 (transformers' fp16 run flips one on
    # some of these models), so the artifact must agree closely with one of the two references.
    error = min(np.abs(got - fp32).max(), np.abs(got - fp16).max())
    assert error < FP16_ATOL, (np.abs(got - fp32).max(), np.abs(got - fp16).max())
    assert np.abs(got - fp32).max() > 1e-4  # it really computed in fp16


def test_bf16_checks_and_holds_the_checkpoint_rounded_to_bf16(bf16) -> None:
    hf, artifact = bf16
    model = onnx.load(str(artifact.model_path))
    onnx.checker.check_model(model, full_check=True)
    bf16 = onnx.TensorProto.BFLOAT16
    assert [i.type.tensor_type.elem_type for i in model.graph.input][1:] == [bf16] * (len(model.graph.input) - 1)
    assert {o.type.tensor_type.elem_type for o in model.graph.output} == {bf16}
    assert artifact.manifest["config"]["family"] == hf.config.model_type

    weights = {i.name: i for i in model.graph.initializer}
    embed = numpy_helper.to_array(weights["decoder.embed.weight"]).astype(np.float32)
    expected = hf.get_input_embeddings().weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(embed, expected)
    norm = numpy_helper.to_array(weights["decoder.norm.weight"]).astype(np.float32)
    np.testing.assert_array_equal(norm, hf.model.norm.weight.detach().to(torch.bfloat16).float().numpy())
