"""Checkpoints: safetensors only (pickle can run code), in our layout or Hugging Face Mixtral's.

Hugging Face Mixtral folders come in two tensor layouts:
  per-expert  model.layers.{i}.block_sparse_moe.experts.{j}.w1/w2/w3.weight   (gate/down/up)
  fused       model.layers.{i}.mlp.experts.gate_up_proj  (E, 2*I, H)  gate rows first
              model.layers.{i}.mlp.experts.down_proj     (E, H, I)
Both map onto our stacked (E, out, in) expert weights; anything unexpected is an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moedeploy.models.attention import RotaryEmbedding
from moedeploy.models.config import DecoderConfig
from moedeploy.utils.io import atomic_directory, atomic_write_json

FORMAT = "moedeploy"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A folder that is not a loadable checkpoint; the message says what is wrong with it."""


def save_decoder(model: torch.nn.Module, path: str | Path) -> None:
    """config.json + model.safetensors in moedeploy's own tensor names, written atomically."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses aliased tensors
    with atomic_directory(path, owned=_is_moedeploy_checkpoint) as tmp:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        atomic_write_json(
            tmp / "config.json",
            {"format": FORMAT, "architecture": "MoEDecoder", "config": model.config.to_dict()},
        )


def _is_moedeploy_checkpoint(path: Path) -> bool:
    """A folder `save_decoder` wrote (its config.json says format "moedeploy"): safe to replace."""
    try:
        return json.loads((path / "config.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def load_decoder(path: str | Path, dtype: torch.dtype | None = None):
    """Build an eval-mode MoEDecoder from a moedeploy or Hugging Face Mixtral folder.

    dtype: None keeps the checkpoint's dtype (a bf16 Mixtral stays bf16).
    """
    from moedeploy.models.decoder import MoEDecoder

    path = Path(path)
    raw_config = _read_config(path)
    if raw_config.get("format") == FORMAT:
        config = _parse(lambda: DecoderConfig.from_dict(raw_config["config"]), path)
        tensors = _read_tensors(path)
    elif raw_config.get("model_type") == "mixtral":
        config = _parse(lambda: DecoderConfig.from_hf_mixtral(raw_config), path)
        try:
            tensors = _hf_mixtral_to_ours(_read_tensors(path), config)
        except CheckpointError as e:  # name the folder: the weights and its config.json disagree
            raise CheckpointError(f"{path}: {e}") from None
    else:
        kind = raw_config.get("model_type", "<no model_type>")
        raise CheckpointError(
            f"{path / 'config.json'}: model_type {kind!r} is not supported; "
            "expected a Hugging Face Mixtral checkpoint (model_type 'mixtral') or one saved by moedeploy"
        )

    if config.tie_embeddings:
        # torch's state_dict() and some exporters keep the tied copy; the embedding is the truth.
        tensors.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = MoEDecoder(config)
    _check_tensors(model, tensors, path)
    model.load_state_dict(tensors, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    # Non-persistent buffers were built on the meta device: rebuild them for real.
    model.rope = RotaryEmbedding(config.head_dim, config.max_positions, config.rope_theta)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def _parse(make: Callable[[], DecoderConfig], path: Path) -> DecoderConfig:
    try:
        return make()
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:
        detail = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise CheckpointError(f"{path / 'config.json'}: invalid config: {detail}") from None


def _read_config(path: Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a folder (expected config.json + *.safetensors)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json; is it a checkpoint folder?")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_file} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} must hold a JSON object")
    return config


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickles:
        raise CheckpointError(
            f"{path} holds only pickle weights ({', '.join(pickles)}); moedeploy loads safetensors "
            "only, because unpickling can run arbitrary code. Re-save with save_pretrained(..., "
            "safe_serialization=True)"
        )
    raise CheckpointError(f"{path} has no *.safetensors weight files")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensors[name] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None
    return tensors


_HF_DIRECT = {
    r"model\.embed_tokens\.weight": "embed.weight",
    r"model\.norm\.weight": "norm.weight",
    r"lm_head\.weight": "lm_head.weight",
    r"model\.layers\.(\d+)\.input_layernorm\.weight": r"layers.\1.attn_norm.weight",
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": r"layers.\1.ffn_norm.weight",
    r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight": r"layers.\1.attn.wq.weight",
    r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight": r"layers.\1.attn.wk.weight",
    r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight": r"layers.\1.attn.wv.weight",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight": r"layers.\1.attn.wo.weight",
    r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight": r"layers.\1.ffn.router.weight",
    r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.down_proj": r"layers.\1.ffn.w_down",
}
_HF_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_HF_GATE_UP = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.gate_up_proj")
_W_NAME = {"w1": "w_gate", "w3": "w_up", "w2": "w_down"}


def _hf_mixtral_to_ours(hf: dict[str, torch.Tensor], config: DecoderConfig) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors to ours and stack per-expert weights into (E, out, in)."""
    ours: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    unknown = []
    for name, tensor in hf.items():
        if m := _HF_PER_EXPERT.fullmatch(name):
            layer, expert, w = int(m[1]), int(m[2]), m[3]
            per_expert.setdefault((layer, _W_NAME[w]), {})[expert] = tensor
        elif m := _HF_GATE_UP.fullmatch(name):
            # transformers' Mixtral layout (E, 2I, H), gate rows first. Shapes cannot tell it
            # from a transposed (E, H, 2I) one when H == 2I, so no other layout is guessed at:
            # anything else fails the shape check below with a clear message.
            I = config.expert_hidden  # noqa: E741
            if tensor.dim() != 3 or tensor.shape[1] != 2 * I:
                raise CheckpointError(
                    f"{name} has shape {tuple(tensor.shape)}; expected (num_experts, "
                    f"2 * intermediate_size = {2 * I}, hidden_size) as transformers writes it"
                )
            ours[f"layers.{m[1]}.ffn.w_gate"] = tensor[:, :I]
            ours[f"layers.{m[1]}.ffn.w_up"] = tensor[:, I:]
        else:
            for pattern, target in _HF_DIRECT.items():
                if re.fullmatch(pattern, name):
                    ours[re.sub(pattern, target, name)] = tensor
                    break
            else:
                unknown.append(name)
    if unknown:
        raise CheckpointError(
            f"unexpected tensors for a Mixtral checkpoint: {_few(unknown)}"
        )
    for (layer, w), experts in per_expert.items():
        missing = sorted(set(range(config.n_experts)) - set(experts))
        if missing or len(experts) != config.n_experts:
            raise CheckpointError(
                f"layer {layer} {w}: config.json says num_local_experts={config.n_experts}, but the weights "
                f"hold {len(experts)}: {_few([str(j) for j in sorted(experts)], 8)}"
                + (f" (missing {_few([str(j) for j in missing])})" if missing else "")
                + "; fix config.json or the weight files"
            )
        ours[f"layers.{layer}.ffn.{w}"] = torch.stack([experts[j] for j in range(config.n_experts)])
    return ours


def _check_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [
        f"{k} {tuple(tensors[k].shape)} (expected {tuple(expected[k])})"
        for k in sorted(set(expected) & set(tensors))
        if tensors[k].shape != expected[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_few(unexpected)}")
    if wrong:
        problems.append(f"shape mismatch: {_few(wrong)}")
    if problems:
        raise CheckpointError(f"{path} does not match its config.json: " + "; ".join(problems))


def _few(names: list[str], n: int = 4) -> str:
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more
