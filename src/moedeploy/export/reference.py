"""Rebuild the eager PyTorch model an artifact was exported from: the ground truth to compare with.

Blocks store their (unfolded, eval-mode) weights in `reference.safetensors` (a few hundred
KB). Decoders are rebuilt from what made them: the preset and seed (random weights are a
pure function of both) or the checkpoint folder, so a 500 MB model is not stored twice.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from moedeploy.export.artifact import Artifact, ArtifactError, parse_dtype
from moedeploy.export.quantize import reference_weights
from moedeploy.models.checkpoint import CheckpointWeights
from moedeploy.models.config import DecoderConfig
from moedeploy.models.weights import ModuleWeights, WeightSource, fingerprint, layered_decoder

REFERENCE_FILE = "reference.safetensors"


def save_reference_weights(module: nn.Module, folder: Path) -> list[str]:
    state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(folder / REFERENCE_FILE))
    return [REFERENCE_FILE]


def weights_fingerprint(module: nn.Module) -> str:
    """sha256 over every tensor of the state dict, in order: proves a rebuild is the exported model."""
    return fingerprint(ModuleWeights(module))


def build_decoder(preset_name: str | None, checkpoint: str | Path | None, seed: int, dtype: torch.dtype):
    """The eager MoEDecoder for a preset + seed or a checkpoint, in eval mode and `dtype`."""
    from moedeploy.models import MoEDecoder, load_decoder, preset

    if checkpoint is not None:
        decoder = load_decoder(checkpoint)
    else:
        torch.manual_seed(seed)
        decoder = MoEDecoder(preset(preset_name))
    return decoder.eval().to(dtype)


def eager_decoder(weights: WeightSource, manifest: dict, dtype: torch.dtype, module: nn.Module | None = None,
                  progress: Callable[[str], None] | None = None) -> nn.Module:
    """The eager decoder over `weights` as the artifact computes with them (dequantized when it
    is quantized): `module` itself when it holds them whole and nothing is quantized, else a
    dequantized copy of it, else the weights loaded one layer at a time (a checkpoint may
    barely fit in memory)."""
    reference = reference_weights(weights, manifest, dtype)
    if module is None:
        return layered_decoder(reference, dtype, progress)
    if reference is not weights:  # a preset: small, so a dequantized copy
        module = copy.deepcopy(module)
        module.load_state_dict({name: reference.tensor(name) for name in reference.names()})
    return module


def unquantized(manifest: dict) -> dict:
    """The manifest of the artifact as if it were not quantized: its eager model on the weights
    as the checkpoint (or preset) holds them, what quantization is measured against."""
    return {k: v for k, v in manifest.items() if k != "quantization"}


def load_reference(artifact: Artifact, dequantized: bool = True) -> nn.Module:
    """The eager module behind `artifact`, eval mode, in the artifact's dtype.

    For a decoder this is the DecoderWithPast wrapper, whose inputs and outputs are the graph's.
    A quantized decoder's runs on its dequantized weights, or with `dequantized=False` on the
    float weights it was quantized from.
    """
    dtype = parse_dtype(artifact.dtype)
    config = artifact.manifest["config"]
    if artifact.kind == "decoder":
        from moedeploy.export.decoder import DecoderWithPast

        source = config.get("source", {})
        checkpoint = source.get("checkpoint")
        if checkpoint is not None and not Path(checkpoint).is_dir():
            raise ArtifactError(
                f"{artifact.path} was exported from checkpoint {checkpoint}, which is gone; "
                "the eager reference needs it"
            )
        if checkpoint is not None:
            weights: WeightSource = CheckpointWeights(checkpoint)
            check_same_config(artifact, weights.config, checkpoint)
            decoder = None
        else:
            decoder = build_decoder(source.get("preset"), None, artifact.manifest["seed"], dtype)
            weights = ModuleWeights(decoder)
        expected = source.get("weights_sha256")
        if expected and fingerprint(weights, dtype) != expected:
            origin = f"checkpoint {checkpoint}" if checkpoint else f"preset {source.get('preset')!r}, seed {artifact.manifest['seed']}"
            raise ArtifactError(
                f"the eager model rebuilt from {origin} is not the one {artifact.path} was exported from "
                "(its weights fingerprint differs: the checkpoint changed, or another moedeploy version "
                "made the artifact); re-export it"
            )
        manifest = artifact.manifest if dequantized else unquantized(artifact.manifest)
        return DecoderWithPast(eager_decoder(weights, manifest, dtype, decoder)).eval()
    from moedeploy.export.blocks import build_block, get_block

    module = build_block(get_block(config["block"]), artifact.manifest["seed"])
    weights = artifact.path / REFERENCE_FILE
    if not weights.is_file():
        raise ArtifactError(f"{artifact.path} has no {REFERENCE_FILE}; re-export it")
    module.load_state_dict(load_file(str(weights)))
    return module.eval().to(dtype)


def check_same_config(artifact: Artifact, config: DecoderConfig, checkpoint: str | Path) -> None:
    """The checkpoint's config.json must still describe the model the artifact was exported
    from: the weights fingerprint covers the weights only, and an eager reference built on an
    edited config (another norm epsilon, RoPE theta, routing) fails compare at the first layer
    it touches, blaming the artifact instead of the edit."""
    from moedeploy.models.checkpoint import config_json_name

    recorded = DecoderConfig.from_manifest(artifact.manifest["config"])
    if changed := [f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(recorded, f.name)]:
        name = changed[0]
        shown = config_json_name(Path(checkpoint), name, recorded.family)
        raise ArtifactError(
            f"the config.json of checkpoint {checkpoint} does not describe the model {artifact.path} was exported "
            f"from ({shown}: {getattr(recorded, name)!r} at export, {getattr(config, name)!r} now"
            + (f"; {len(changed) - 1} more fields differ" if len(changed) > 1 else "")
            + "); if it is that model's checkpoint, restore its config.json or re-export the artifact, else pass "
            "the checkpoint the artifact was exported from")
