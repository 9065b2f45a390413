"""Half-precision artifacts: fp16 runs on ONNX Runtime within the documented tolerance of
eager fp16 PyTorch; bf16 exports and checks, but the CPU provider refuses it clearly."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from moedeploy.export.blocks import DIM, TOLERANCES
from moedeploy.runtime.ort import SessionError, create_session
from tests.export.artifacts import BLOCK_SIZES, eager_block

FP16_BLOCKS = ["layernorm", "rmsnorm", "batchnorm_mlp", "swiglu", "moe", "decoder_layer"]


def test_documented_tolerances() -> None:
    # fp16 keeps 10 mantissa bits (eps ~1e-3), bf16 7 (eps ~8e-3): the tolerances must be
    # looser than fp32's and ordered by precision.
    assert TOLERANCES["fp32"] == (1e-5, 1e-5)
    assert TOLERANCES["fp32"] < TOLERANCES["fp16"] < TOLERANCES["bf16"]


@pytest.mark.parametrize("batch,seq", BLOCK_SIZES)
@pytest.mark.parametrize("name", FP16_BLOCKS)
def test_fp16_block_matches_eager_fp16(store, name: str, batch: int, seq: int) -> None:
    artifact = store.block(name, dtype="fp16")
    assert artifact.manifest["inputs"][0]["dtype"] == "float16"
    reference = eager_block(name, dtype="fp16")
    g = torch.Generator().manual_seed(batch + seq)
    x = torch.randn(batch, seq, DIM, generator=g).half()
    with torch.no_grad():
        expected = reference(x)
    assert expected.dtype == torch.float16

    session = create_session(artifact, ["CPUExecutionProvider"])
    if name in ("moe", "decoder_layer"):  # com.microsoft::MoE has no fp16 CPU kernel
        assert session.lowering["moe_contrib"] == 0 and session.lowering["moe_function"] == 1
    (y,) = session.run({"x": x.numpy()})
    assert y.dtype == np.float16
    atol, rtol = TOLERANCES["fp16"]
    np.testing.assert_allclose(y.astype(np.float32), expected.float().numpy(), rtol=rtol, atol=atol)

    # Not trivially close: fp16 differs from the fp32 model by more than fp32's tolerance
    # somewhere, so the fp16 graph really computes in half precision.
    with torch.no_grad():
        fp32 = eager_block(name)(x.float()).numpy()
    assert np.abs(y.astype(np.float32) - fp32).max() > 1e-5


@pytest.mark.parametrize("name", ["rmsnorm", "moe"])
def test_bf16_exports_checks_and_is_refused_on_cpu(store, name: str) -> None:
    artifact = store.block(name, dtype="bf16")
    model = onnx.load(str(artifact.model_path))
    onnx.checker.check_model(model, full_check=True)
    assert [i.type.tensor_type.elem_type for i in model.graph.input] == [onnx.TensorProto.BFLOAT16]
    assert [o.type.tensor_type.elem_type for o in model.graph.output] == [onnx.TensorProto.BFLOAT16]
    assert artifact.dtype == "bf16"
    assert artifact.manifest["inputs"][0]["dtype"] == "bfloat16"

    # Golden outputs are eager bf16 PyTorch (stored as the fp32 values they equal).
    (feed,) = artifact.golden_inputs()
    (golden,) = artifact.golden_outputs()
    x = torch.from_numpy(feed["x"])
    assert torch.equal(x.bfloat16().float(), x)  # the inputs are exact bf16 values
    with torch.no_grad():
        expected = eager_block(name, dtype="bf16")(x.bfloat16()).float().numpy()
    np.testing.assert_array_equal(golden["y"], expected)

    with pytest.raises(SessionError, match="bfloat16") as info:
        create_session(artifact, ["CPUExecutionProvider"])
    assert "\n" not in str(info.value)
    assert "fp16" in str(info.value)  # it names a way out
