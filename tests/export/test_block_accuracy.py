"""Every exported block, fp32: ONNX Runtime matches eager PyTorch at sizes unlike the trace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moedeploy.export import BLOCKS
from moedeploy.export.blocks import DIM
from moedeploy.runtime.ort import create_session
from tests.export.artifacts import BLOCK_SIZES, eager_block, plain_session

ATOL = RTOL = 1e-5


def test_the_registry_covers_the_seed_blocks() -> None:
    # A hand-written list: if a block silently disappeared, the parametrised tests would shrink.
    assert set(BLOCKS) == {
        "layernorm", "rmsnorm", "batchnorm", "batchnorm_mlp", "batchnorm1d_transposed_mlp", "mlp",
        "ffn_relu", "ffn_gelu", "swiglu", "moe", "encoder_layer_postln", "encoder_layer_preln",
        "decoder_layer", "decoder_layer_dense",
    }


@pytest.mark.parametrize("name", list(BLOCKS))
def test_golden_outputs_are_the_eager_model(store, name: str) -> None:
    """The golden I/O is the independently rebuilt eager model (unfolded for BatchNorm) on
    the golden inputs; this also proves `eager_block` reproduces what export built."""
    artifact = store.block(name)
    (feed,) = artifact.golden_inputs()
    (golden,) = artifact.golden_outputs()
    assert feed["x"].shape == (2, 16, DIM)
    with torch.no_grad():
        expected = eager_block(name)(torch.from_numpy(feed["x"])).numpy()
    np.testing.assert_allclose(golden["y"], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("batch,seq", BLOCK_SIZES)
@pytest.mark.parametrize("name", list(BLOCKS))
def test_ort_matches_eager_at_new_sizes(store, name: str, batch: int, seq: int) -> None:
    artifact = store.block(name)
    reference = eager_block(name)
    g = torch.Generator().manual_seed(1000 + batch * seq)
    x = torch.randn(batch, seq, DIM, generator=g)
    with torch.no_grad():
        expected = reference(x).numpy()
    assert np.abs(expected).max() > 0.1  # a real signal, not a tolerance-sized one

    lowered = create_session(artifact, ["CPUExecutionProvider"])
    (y,) = lowered.run({"x": x.numpy()})
    assert y.shape == (batch, seq, DIM)
    np.testing.assert_allclose(y, expected, rtol=RTOL, atol=ATOL)

    # The artifact as written, custom nodes running as their function bodies.
    (y_plain,) = plain_session(artifact.model_path).run(None, {"x": x.numpy()})
    np.testing.assert_allclose(y_plain, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["encoder_layer_postln", "decoder_layer"])
def test_sequence_mixing_blocks_see_the_whole_sequence(store, name: str) -> None:
    """Attention blocks: changing one token changes other tokens' outputs in ORT exactly as
    in eager (a graph with the trace's sequence length baked in would not get this right)."""
    artifact = store.block(name)
    reference = eager_block(name)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 12, DIM, generator=g)
    x2 = x.clone()
    x2[:, 0] += 1.0  # the first token: in a causal layer every later token attends to it
    session = create_session(artifact, ["CPUExecutionProvider"])
    (y1,) = session.run({"x": x.numpy()})
    (y2,) = session.run({"x": x2.numpy()})
    with torch.no_grad():
        e1, e2 = reference(x).numpy(), reference(x2).numpy()
    assert np.abs(e2[:, -1] - e1[:, -1]).max() > 1e-3
    np.testing.assert_allclose(y2 - y1, e2 - e1, rtol=1e-4, atol=1e-4)
