"""OpenVINO's own int8/int4 peer (NNCF weight compression of the artifact's graph): every weight,
the experts' in the per-expert If branches included, is NNCF's format of exactly these weights,
checked against that format written out by hand; and the cached IR is reused only when it
records these weights."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

HAS_OPENVINO_NNCF = all(importlib.util.find_spec(m) is not None for m in ("openvino", "nncf"))
pytestmark = pytest.mark.skipif(not HAS_OPENVINO_NNCF, reason="openvino and nncf are not installed "
                                "(pip install 'moedeploy[peers]')")


@pytest.fixture(scope="module")
def tiny_fp32(tmp_path_factory):
    from tests.export.artifacts import ArtifactStore

    return ArtifactStore.for_session(tmp_path_factory).decoder("fp32")


def _signed_symmetric(w: torch.Tensor, bits: int) -> torch.Tensor:
    """NNCF's symmetric format over the last axis: the value of largest magnitude maps to
    -2^(bits-1) (its scale is signed), codes clipped to [-2^(bits-1), 2^(bits-1) - 1], the scale
    stored in fp16."""
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = torch.where(low.abs() >= high, low.abs(), -high) / 2 ** (bits - 1)
    codes = torch.clamp(torch.round(w / scale), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return codes * scale.half().float()


def _asymmetric_int8(w: torch.Tensor) -> torch.Tensor:
    """NNCF's asymmetric int8 per row: the range widened to hold 0, 255 steps, a rounded zero point."""
    low, high = w.amin(-1, keepdim=True).clamp(max=0), w.amax(-1, keepdim=True).clamp(min=0)
    scale = (high - low) / 255
    zero = torch.clamp(-torch.round(low / scale), 0, 255)
    codes = torch.clamp(torch.round(w / scale + zero), 0, 255)
    return (codes - zero) * scale.half().float()


def _nncf_by_hand(model: torch.nn.Module, bits: int, block: int) -> torch.nn.Module:
    """The eager model with each matrix (embedding, attention, router, experts, LM head) replaced
    by its NNCF round trip. int8: symmetric per row. int4: symmetric in groups of `block`, except
    the embedding and the LM head, which NNCF keeps at asymmetric int8 by default."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2:
                continue
            if bits == 8:
                p.copy_(_signed_symmetric(p, 8))
            elif name in ("embed.weight", "lm_head.weight"):
                p.copy_(_asymmetric_int8(p))
            else:
                groups = p.reshape(*p.shape[:-1], p.shape[-1] // block, block)
                p.copy_(_signed_symmetric(groups, 4).reshape(p.shape))
    return model


def _logits(path, prompts: torch.Tensor) -> torch.Tensor:
    """Last-position logits of the IR, computed in f32 on the dequantized weights (no dynamic
    quantization of activations, OpenVINO's default fast path for compressed weights)."""
    import openvino as ov

    compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32",
                                                           "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
    out = compiled.create_infer_request().infer({"input_ids": prompts.numpy()})
    return torch.from_numpy(out[compiled.output("logits")][:, -1].copy())


@pytest.mark.parametrize("bits", [8, 4])
def test_openvino_compression_is_nncf_format_of_every_weight(tiny_fp32, tmp_path, bits: int) -> None:
    from moedeploy.bench.openvino_peer import compressed_ir
    from moedeploy.models.blockquant import QuantScheme
    from tests.export.artifacts import eager_decoder

    said: list[str] = []
    path = compressed_ir(tiny_fp32, QuantScheme(bits, 32), tmp_path, said.append)
    prompts = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    theirs = _logits(path, prompts)
    with torch.inference_mode():
        fp32 = eager_decoder("fp32")
        reference = fp32(prompts, fp32.new_cache(2, 40), 0)[:, -1]
        by_hand = _nncf_by_hand(eager_decoder("fp32"), bits, 32)
        expected = by_hand(prompts, by_hand.new_cache(2, 40), 0)[:, -1]
    # a weight left in f32 (an expert inside an If branch, say) would leave the quantization's
    # error in the difference: it is 1e-3 or more, the tolerance far below it
    assert (theirs - reference).abs().max() > 1e-3
    torch.testing.assert_close(theirs, expected, rtol=0, atol=2e-5)
    assert said == [f"openvino: compressing the weights to {path.stem.split('-', 2)[2]} with NNCF into {path}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.with_suffix(".bin").name, path.name]


def test_a_cached_ir_is_reused_only_when_it_records_these_weights(tiny_fp32, tmp_path) -> None:
    import openvino as ov
    import openvino.opset13 as ops

    from moedeploy.bench.openvino_peer import RT_COMPRESSION, RT_FINGERPRINT, compressed_ir
    from moedeploy.models.blockquant import QuantScheme

    scheme = QuantScheme(8, 32)
    path = compressed_ir(tiny_fp32, scheme, tmp_path, lambda _: None)
    said: list[str] = []
    assert compressed_ir(tiny_fp32, scheme, tmp_path, said.append) == path
    assert said == [f"openvino: reading the cached {path} (it records this artifact's weights and int8-channel-sym)"]

    # a file at that name made from other weights is not trusted: it is made again
    parameter = ops.parameter([1], np.float32)
    stranger = ov.Model([ops.relu(parameter)], [parameter])
    stranger.set_rt_info("0" * 64, RT_FINGERPRINT)
    stranger.set_rt_info("int8-channel-sym", RT_COMPRESSION)
    ov.save_model(stranger, str(path), compress_to_fp16=False)
    said.clear()
    assert compressed_ir(tiny_fp32, scheme, tmp_path, said.append) == path
    assert said[0].startswith("openvino: compressing the weights to int8-channel-sym")
    assert ov.Core().read_model(str(path)).get_rt_info(RT_FINGERPRINT).astype(str) == \
        tiny_fp32.manifest["config"]["source"]["weights_sha256"]


def test_an_unwritable_cache_is_refused_in_one_line(tiny_fp32, tmp_path) -> None:
    from moedeploy.bench.openvino_peer import compressed_ir
    from moedeploy.models.blockquant import QuantScheme

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=r"cannot be written .*; set MOEDEPLOY_CACHE to a writable folder"):
        compressed_ir(tiny_fp32, QuantScheme(8, 32), blocker / "cache", lambda _: None)
    assert blocker.read_text() == "not a folder"
