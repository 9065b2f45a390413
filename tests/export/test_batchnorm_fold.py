"""BatchNorm with frozen EMA statistics: calibration, folding in PyTorch, and what reaches ONNX."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from moedeploy.export.blocks import BLOCKS, DIM, TransposedBatchNorm1dMLP, build_block
from moedeploy.export.fold import BATCHNORM_TYPES, ChannelAffine, calibrate, fold_batchnorms
from moedeploy.models import BatchNorm, BatchNormMLP
from moedeploy.runtime.ort import create_session
from tests.export.artifacts import BLOCK_SIZES, all_nodes, eager_block

BN_BLOCKS = ["batchnorm", "batchnorm_mlp", "batchnorm1d_transposed_mlp"]


def batches(n: int, seed: int = 0, shape=(4, 16, DIM)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Non-zero mean and non-unit spread, so EMA statistics differ clearly from their init.
    return [1.5 + 2.0 * torch.randn(*shape, generator=g) for _ in range(n)]


def bn_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, BATCHNORM_TYPES)]


# --- the exported graphs ------------------------------------------------------------------


@pytest.mark.parametrize("name", BN_BLOCKS)
def test_exported_graph_has_no_batchnormalization(store, name: str) -> None:
    model = onnx.load(str(store.block(name).model_path))
    op_types = {n.op_type for n in all_nodes(model)}
    assert "BatchNormalization" not in op_types
    assert op_types  # the walk saw the graph


def test_unfolded_transposed_batchnorm1d_does_reach_the_graph(store) -> None:
    """The contrast that makes the test above meaningful: without folding, nn.BatchNorm1d
    exports as a BatchNormalization node that the walk finds."""
    model = onnx.load(str(store.block("batchnorm1d_transposed_mlp", fold_bn=False).model_path))
    assert "BatchNormalization" in {n.op_type for n in all_nodes(model)}


def test_transposed_mlp_folds_into_the_linear(store) -> None:
    artifact = store.block("batchnorm1d_transposed_mlp")
    assert artifact.manifest["config"]["batchnorm_folding"] == {"into_linear": {"bn": "up"}, "to_affine": []}
    model = onnx.load(str(artifact.model_path))
    # Folded into the first Linear: MatMul/Add -> Relu -> MatMul/Add, no per-channel Mul.
    assert sorted(n.op_type for n in model.graph.node) == ["Add", "Add", "MatMul", "MatMul", "Relu"]


def test_standalone_batchnorm_becomes_an_affine(store) -> None:
    artifact = store.block("batchnorm")
    folding = artifact.manifest["config"]["batchnorm_folding"]
    assert folding["into_linear"] == {}
    assert len(folding["to_affine"]) == 1
    model = onnx.load(str(artifact.model_path))
    assert {n.op_type for n in model.graph.node} <= {"Mul", "Add", "Sub"}


def test_batchnorm_mlp_folds_into_the_linear(store) -> None:
    """moedeploy's own BatchNorm (not a torch.nn leaf module) folds into the Linear too."""
    artifact = store.block("batchnorm_mlp")
    assert artifact.manifest["config"]["batchnorm_folding"] == {"into_linear": {"bn": "up"}, "to_affine": []}
    model = onnx.load(str(artifact.model_path))
    assert sorted(n.op_type for n in model.graph.node) == ["Add", "Add", "MatMul", "MatMul", "Relu"]


def test_manifest_records_no_folding_when_disabled(store) -> None:
    for name in BN_BLOCKS:
        assert store.block(name, fold_bn=False).manifest["config"]["batchnorm_folding"] is None


@pytest.mark.parametrize("batch,seq", BLOCK_SIZES)
@pytest.mark.parametrize("name", BN_BLOCKS)
def test_no_fold_export_matches_eager(store, name: str, batch: int, seq: int) -> None:
    artifact = store.block(name, fold_bn=False)
    x = torch.randn(batch, seq, DIM, generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():
        expected = eager_block(name)(x).numpy()
    (y,) = create_session(artifact, ["CPUExecutionProvider"]).run({"x": x.numpy()})
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


# --- fold_batchnorms ------------------------------------------------------------------------


@pytest.mark.parametrize("name", BN_BLOCKS)
def test_folding_preserves_eval_outputs(name: str) -> None:
    model = eager_block(name)  # calibrated, eval
    folded = copy.deepcopy(model)
    folded, report = fold_batchnorms(folded)
    assert report.count == 1
    x = 3.0 * torch.randn(5, 33, DIM, generator=torch.Generator().manual_seed(1)) + 0.5
    with torch.no_grad():
        want, got = model(x), folded(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - model.eval()(x) == 0).all()  # the original was left alone


@pytest.mark.parametrize("name", ["batchnorm_mlp", "batchnorm1d_transposed_mlp"])
def test_folded_mlps_keep_no_batchnorm_module(name: str) -> None:
    folded, _ = fold_batchnorms(eager_block(name))
    assert bn_modules(folded) == []


def test_fold_into_linear_weights_by_hand() -> None:
    model = eager_block("batchnorm1d_transposed_mlp")
    bn, up = model.bn, model.up
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    w = scale[:, None] * up.weight
    b = (up.bias - bn.running_mean) * scale + bn.bias
    model, report = fold_batchnorms(model)
    assert report.into_linear == {"bn": "up"}
    assert isinstance(model.bn, nn.Identity)
    torch.testing.assert_close(model.up.weight.detach(), w.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.up.bias.detach(), b.detach(), rtol=1e-6, atol=1e-6)


def test_affine_fold_of_a_nested_batchnorm_by_hand() -> None:
    model = nn.Sequential(nn.Identity(), BatchNorm(DIM)).eval()
    bn = model[1]
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(DIM, generator=g))
        bn.running_var.copy_(torch.rand(DIM, generator=g) + 0.5)
        bn.weight.copy_(torch.randn(DIM, generator=g))
        bn.bias.copy_(torch.randn(DIM, generator=g))
    x = torch.randn(2, 3, DIM, generator=g)
    expected = (x - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps) * bn.weight + bn.bias
    model, report = fold_batchnorms(model)
    assert report.to_affine == ["1"] and report.into_linear == {}
    assert isinstance(model[1], ChannelAffine)
    torch.testing.assert_close(model(x).detach(), expected.detach(), rtol=1e-5, atol=1e-5)


def test_fold_refuses_a_training_model() -> None:
    with pytest.raises(ValueError, match="eval"):
        fold_batchnorms(BatchNormMLP(DIM).train())


def test_fold_of_a_root_batchnorm1d_leaves_no_batchnorm() -> None:
    model = nn.BatchNorm1d(8).eval()
    with torch.no_grad():
        model.running_mean.copy_(torch.arange(8.0))
        model.running_var.copy_(torch.arange(8.0) + 1)
    x = torch.randn(4, 8, 3)
    expected = (x - model.running_mean[:, None]) / torch.sqrt(model.running_var[:, None] + model.eps)
    folded, report = fold_batchnorms(model)
    assert report.to_affine == [""]
    assert bn_modules(folded) == []
    torch.testing.assert_close(folded(x), expected, rtol=1e-5, atol=1e-5)


# --- calibrate: EMA statistics ---------------------------------------------------------------


def test_calibrate_matches_torch_batchnorm1d() -> None:
    ours = BatchNorm(DIM)
    theirs = nn.BatchNorm1d(DIM)  # pools over (B*S) when fed the flattened tokens
    data = batches(8)
    calibrate(ours, lambda i: (data[i],), 8)
    with torch.no_grad():
        for x in data:
            theirs(x.reshape(-1, DIM))
    assert not ours.training
    torch.testing.assert_close(ours.running_mean, theirs.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.running_var, theirs.running_var, rtol=1e-5, atol=1e-6)
    assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == 8
    # far from the (0, 1) init: the batches really moved the EMA
    assert (ours.running_mean - 0).abs().mean() > 0.5 and (ours.running_var - 1).abs().mean() > 1.0


def test_calibrate_cumulative_average_matches_torch() -> None:
    ours = BatchNorm(DIM, momentum=None)
    theirs = nn.BatchNorm1d(DIM, momentum=None)
    data = batches(5, seed=3, shape=(2, 3, DIM))  # few rows: the unbiased n/(n-1) factor is 6/5
    calibrate(ours, lambda i: (data[i],), 5)
    with torch.no_grad():
        for x in data:
            theirs(x.reshape(-1, DIM))
    torch.testing.assert_close(ours.running_mean, theirs.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.running_var, theirs.running_var, rtol=1e-5, atol=1e-6)
    # cumulative average of the unbiased batch variances, by hand
    by_hand = torch.stack([x.reshape(-1, DIM).var(0, unbiased=True) for x in data]).mean(0)
    torch.testing.assert_close(ours.running_var, by_hand, rtol=1e-5, atol=1e-6)


def test_calibrate_batchnorm_mlp_matches_torch_on_the_linear_outputs() -> None:
    model = build_block(BLOCKS["batchnorm_mlp"], 0)
    data = batches(8, seed=4)
    theirs = nn.BatchNorm1d(model.bn.weight.shape[0])
    with torch.no_grad():
        for x in data:
            theirs(model.up(x).reshape(-1, theirs.num_features))
    calibrate(model, lambda i: (data[i],), 8)
    torch.testing.assert_close(model.bn.running_mean, theirs.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.bn.running_var, theirs.running_var, rtol=1e-5, atol=1e-6)
    # and eval mode then normalises exactly like nn.BatchNorm1d in eval mode
    with torch.no_grad():
        theirs.weight.copy_(model.bn.weight)
        theirs.bias.copy_(model.bn.bias)
        h = model.up(data[0])
        torch.testing.assert_close(
            model.bn(h), theirs.eval()(h.reshape(-1, h.shape[-1])).reshape(h.shape), rtol=1e-5, atol=1e-5
        )


def test_calibrate_transposed_batchnorm1d_by_hand() -> None:
    model = TransposedBatchNorm1dMLP(DIM)
    data = batches(6, seed=5)
    mean = torch.zeros(4 * DIM)
    var = torch.ones(4 * DIM)
    with torch.no_grad():
        for x in data:
            h = model.up(x).reshape(-1, 4 * DIM)  # pooled over batch and sequence
            mean = 0.9 * mean + 0.1 * h.mean(0)
            var = 0.9 * var + 0.1 * h.var(0, unbiased=True)
    calibrate(model, lambda i: (data[i],), 6)
    assert not model.training
    torch.testing.assert_close(model.bn.running_mean, mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.bn.running_var, var, rtol=1e-5, atol=1e-6)
