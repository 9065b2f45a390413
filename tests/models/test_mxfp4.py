"""MXFP4 unpacking (gpt-oss's released expert format) against an independent decoding of the
format, and a tiny MXFP4 gpt-oss checkpoint loaded and exported against transformers' own
model of the same folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file, save_file

from moedeploy.models import CheckpointError, load_decoder
from moedeploy.models.mxfp4 import dequantize

#: OCP MX spec, table of FP4 (E2M1) values, written out by hand: code -> value.
E2M1_BY_HAND = {
    0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5, 0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0, 0b0111: 6.0,
    0b1000: -0.0, 0b1001: -0.5, 0b1010: -1.0, 0b1011: -1.5, 0b1100: -2.0, 0b1101: -3.0, 0b1110: -4.0, 0b1111: -6.0,
}


def e2m1_from_bits(code: int) -> float:
    """The same values from the bit layout: sign, 2 exponent bits (bias 1), 1 mantissa bit;
    exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 0b1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


def e8m0(byte: int) -> float:
    """OCP E8M0: 2**(byte - 127), and 0xFF is NaN."""
    return math.nan if byte == 0xFF else math.ldexp(1.0, byte - 127)


def reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Element by element: weight 2i of a block is byte i's low nibble, 2i+1 its high nibble."""
    out = np.empty((*scales.shape, 32), np.float64)
    for index in np.ndindex(*scales.shape):
        for i, byte in enumerate(blocks[index]):
            out[(*index, 2 * i)] = E2M1_BY_HAND[int(byte) & 0x0F] * e8m0(int(scales[index]))
            out[(*index, 2 * i + 1)] = E2M1_BY_HAND[int(byte) >> 4] * e8m0(int(scales[index]))
    return out.reshape(*scales.shape[:-1], -1)


def test_the_hand_table_is_the_bit_layout() -> None:
    for code, value in E2M1_BY_HAND.items():
        assert e2m1_from_bits(code) == value and math.copysign(1, e2m1_from_bits(code)) == math.copysign(1, value)


def test_every_byte_at_every_kind_of_scale() -> None:
    """All 256 bytes (every pair of codes) under the smallest, unit, large and NaN scales."""
    scales = np.array([0, 1, 100, 126, 127, 128, 140, 254, 255], np.uint8)
    blocks = np.arange(256, dtype=np.uint8).reshape(16, 16)
    blocks = np.broadcast_to(blocks, (len(scales), 16, 16)).copy()  # (scale, G=16, 16)
    scales_g = np.broadcast_to(scales[:, None], (len(scales), 16)).copy()
    got = dequantize(torch.from_numpy(blocks), torch.from_numpy(scales_g)).double().numpy()
    expected = reference(blocks, scales_g)
    assert got.shape == (len(scales), 512)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    assert np.isnan(got[-1]).all()  # scale 0xFF: NaN, never a plausible number
    finite = ~np.isnan(expected)
    # float32 holds every product exactly except |value| >= 2 at 2**127, which overflows as it must
    overflow = np.abs(expected) > np.finfo(np.float32).max
    np.testing.assert_array_equal(got[finite & ~overflow], expected[finite & ~overflow])
    assert np.isinf(got[overflow]).all() and overflow.sum() == 256  # codes 4-7 and 12-15 at scale 254
    np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(expected[finite]))  # -0.0 kept


def test_random_blocks_keep_their_order_along_rows_and_groups() -> None:
    g = np.random.default_rng(0)
    blocks = g.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    scales = g.integers(110, 140, (3, 5, 4), dtype=np.uint8)
    got = dequantize(torch.from_numpy(blocks), torch.from_numpy(scales))
    assert got.shape == (3, 5, 128) and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), reference(blocks, scales))
    half = dequantize(torch.from_numpy(blocks), torch.from_numpy(scales), torch.bfloat16)
    assert torch.equal(half, got.to(torch.bfloat16))


def test_transformers_unpacks_the_same_numbers() -> None:
    """transformers' own converter, which returns the (E, in, out) layout of its unquantized experts."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = np.random.default_rng(1)
    blocks = torch.from_numpy(g.integers(0, 256, (2, 6, 3, 16), dtype=np.uint8))
    scales = torch.from_numpy(g.integers(115, 135, (2, 6, 3), dtype=np.uint8))
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize(blocks, scales), expected.transpose(1, 2))


@pytest.mark.parametrize(("blocks", "scales"), [
    (torch.zeros(2, 3, 16, dtype=torch.int8), torch.zeros(2, 3, dtype=torch.uint8)),
    (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.float32)),
    (torch.zeros(2, 3, 15, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8)),
    (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8)),
])
def test_malformed_blocks_are_refused(blocks, scales) -> None:
    with pytest.raises(ValueError, match="MXFP4"):
        dequantize(blocks, scales)


# --- a tiny MXFP4 gpt-oss checkpoint -------------------------------------------------------------

H, I, E = 64, 32, 4  # noqa: E741 (MXFP4 needs the input dims to be multiples of 32)


def _config():
    from transformers import GptOssConfig

    config = GptOssConfig(vocab_size=80, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=E,
                          num_experts_per_tok=2, sliding_window=5, max_position_embeddings=64,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "truncate": False})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def _packed(g: np.random.Generator, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes, and scales (2**-5 .. 2**-3) that keep the activations O(1)."""
    blocks = g.integers(0, 256, (E, rows, cols // 32, 16), dtype=np.uint8)
    scales = g.integers(122, 125, (E, rows, cols // 32), dtype=np.uint8)
    return torch.from_numpy(blocks), torch.from_numpy(scales)


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory) -> Path:
    """save_pretrained of a random model, its experts replaced by MXFP4 blocks and scales under
    the released names, and quantization_config as the released config.json has it."""
    from transformers import AutoModelForCausalLM

    from .helpers import randomize_

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    randomize_(AutoModelForCausalLM.from_config(_config()).eval(), 3).save_pretrained(folder)
    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights)
    g = np.random.default_rng(2)
    for layer in range(2):
        experts = f"model.layers.{layer}.mlp.experts."
        del tensors[experts + "gate_up_proj"], tensors[experts + "down_proj"]
        for name, (rows, cols) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
            tensors[experts + name + "_blocks"], tensors[experts + name + "_scales"] = _packed(g, rows, cols)
    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def transformers_model(mxfp4_folder):
    """transformers' own loader unpacks the folder (to float32: dequantize=True on the CPU)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(mxfp4_folder, dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True)).eval()
    model.config._attn_implementation = "eager"
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    return model


def _ids(batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(0, 80, (batch, length), generator=torch.Generator().manual_seed(4))


@torch.no_grad()
def test_mxfp4_checkpoint_loads_as_transformers_unpacks_it(mxfp4_folder, transformers_model) -> None:
    ours = load_decoder(mxfp4_folder)
    ids = _ids()
    expected = transformers_model(ids).logits
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(ours(ids), expected, atol=1e-4, rtol=0)
    got = ours.generate(ids, max_new_tokens=16)
    assert torch.equal(got, transformers_model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False))


@torch.no_grad()
def test_mxfp4_checkpoint_exports_and_runs_on_plain_onnxruntime(mxfp4_folder, transformers_model, tmp_path) -> None:
    from typer.testing import CliRunner

    from moedeploy.cli import app
    from moedeploy.export.artifact import Artifact

    result = CliRunner().invoke(app, ["export", "decoder", "--checkpoint", str(mxfp4_folder),
                                      "--out", str(tmp_path / "artifact")])
    assert result.exit_code == 0, result.output
    artifact = Artifact.load(tmp_path / "artifact")
    session = ort.InferenceSession(str(artifact.model_path), providers=["CPUExecutionProvider"])
    ids = _ids(length=11)
    feed = {"input_ids": ids.numpy()}
    for i in session.get_inputs()[1:]:
        feed[i.name] = np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), np.float32)
    np.testing.assert_allclose(session.run(["logits"], feed)[0], transformers_model(ids).logits.numpy(),
                               atol=1e-4, rtol=0)


def _rewrite(folder: Path, out: Path, change) -> Path:
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights)
    change(tensors)
    save_file(tensors, out / weights.name, metadata={"format": "pt"})
    return out


def test_blocks_of_the_wrong_shape_are_refused_before_reading(mxfp4_folder, tmp_path) -> None:
    name = "model.layers.1.mlp.experts.down_proj_blocks"
    folder = _rewrite(mxfp4_folder, tmp_path / "bad", lambda t: t.update({name: t[name][:, :, :, :8].clone()}))
    with pytest.raises(CheckpointError, match=rf"{name} has shape \(4, 64, 1, 8\); config.json implies"):
        load_decoder(folder)


def test_blocks_of_the_wrong_dtype_are_refused(mxfp4_folder, tmp_path) -> None:
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    folder = _rewrite(mxfp4_folder, tmp_path / "bad", lambda t: t.update({name: t[name].float()}))
    with pytest.raises(CheckpointError, match=r"gate_up_proj_scales in model.safetensors is stored as F32, where its format keeps U8"):
        load_decoder(folder)


def test_other_quantizations_stay_refused(mxfp4_folder, tmp_path) -> None:
    folder = _rewrite(mxfp4_folder, tmp_path / "fp8", lambda t: None)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method='fp8' is not supported"):
        load_decoder(folder)
