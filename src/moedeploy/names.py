"""The names a user types on the command line (blocks, the decoder, dtypes, presets, compare's
backends), and what makes a folder an artifact.

They live here, in a module that imports nothing, so that `moedeploy export --list` answers at
once and a mistyped block, dtype, preset or artifact path is refused in half a second rather than
after the four seconds torch and the exporter take to import. The modules that build what these names
stand for (export/blocks.py, export/artifact.py, models/config.py, compare/api.py) call `check_same_names` when
they load, so a name added on one side only fails at import, never as a block the command line
refuses or lists without being able to build it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

#: The file that makes a folder an artifact (export writes it last)
MANIFEST = "manifest.json"
DECODER = "decoder"
DTYPES = ("fp32", "fp16", "bf16")
PRESETS = ("tiny", "small")

#: What `compare --backend` and `all --backend` take after "torch" (the reference the others are
#: compared with): ONNX Runtime on each lowering (runtime/runners.py), TensorRT, and the in-flight
#: batching check (compare/inflight.py); compare/api.py checks it against those at import.
COMPARE_BACKENDS = ("torch", "ort", "ort-contrib", "ort-experts", "ort-gqa", "ort-skipnorm", "trt", "ort-inflight")
#: Those of them with nothing to do on a block: lowerings of a decoder's attention or residual
#: norms (runtime/runners.py's DECODER_ONLY) and the in-flight batching check.
DECODER_ONLY_BACKENDS = ("ort-gqa", "ort-skipnorm", "ort-inflight")

#: Every exportable block, in `--list` order, with the line that says what it is.
BLOCKS = {
    "layernorm": "LayerNorm over the features of [B, S, H]",
    "rmsnorm": "RMSNorm (fp32 statistics) -> one moe::RMSNorm node",
    "batchnorm": "BatchNorm over features with frozen EMA stats, folded to scale+shift",
    "batchnorm_mlp": "Linear -> BatchNorm -> ReLU -> Linear, BatchNorm folded into the Linear",
    "batchnorm1d_transposed_mlp": "Linear -> transposed nn.BatchNorm1d -> ReLU -> Linear, folded into the Linear",
    "mlp": "Linear(d, 4d) -> ReLU -> Linear(4d, d)",
    "ffn_relu": "FeedForward: Linear -> ReLU -> Linear -> Dropout",
    "ffn_gelu": "FeedForward: Linear -> GELU -> Linear -> Dropout",
    "swiglu": "SwiGLU FFN with multiple_of rounding",
    "moe": "Sparse MoE, 4 SwiGLU experts, top-2 -> one moe::MoE node",
    "encoder_layer_postln": "Encoder layer, post-LN (Attention Is All You Need)",
    "encoder_layer_preln": "Encoder layer, pre-LN",
    "decoder_layer": "Decoder layer: pre-RMSNorm, causal GQA + RoPE, MoE FFN",
    "decoder_layer_dense": "Decoder layer: pre-RMSNorm, causal GQA + RoPE, SwiGLU FFN",
}
#: The blocks with BatchNorm: calibrated (--calibration-batches) and folded (--fold-bn).
BATCHNORM_BLOCKS = frozenset({"batchnorm", "batchnorm_mlp", "batchnorm1d_transposed_mlp"})


def dtype_problem(name: str) -> str | None:
    """Why `name` is not a graph precision, or None when it is one."""
    return None if name in DTYPES else f"invalid dtype {name!r}; choose one of: {', '.join(DTYPES)}"


def preset_problem(name: str) -> str | None:
    """Why `name` is not a decoder preset, or None when it is one."""
    return None if name in PRESETS else f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}"


def artifact_folder_problem(path: Path) -> str | None:
    """Why `path` cannot be an artifact at a glance (no folder, no manifest), or None: the first
    checks of Artifact.load, which the command line makes before importing it."""
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a folder"
        return f"artifact {path} {what}; create one with `moedeploy export`"
    if not (path / MANIFEST).is_file():
        return f"{path} has no {MANIFEST}; is it an artifact made by `moedeploy export`?"
    return None


def checkpoint_folder_problem(path: Path) -> str | None:
    """Why `path` cannot be a checkpoint at a glance (no folder, no config.json), or None: the
    first checks of reading a checkpoint, which the command line makes before importing torch."""
    if not path.exists():
        return f"checkpoint folder {path} does not exist"
    if not path.is_dir():
        return f"checkpoint {path} is not a folder (expected config.json + *.safetensors)"
    if not (path / "config.json").is_file():
        return f"{path} has no config.json; is it a checkpoint folder?"
    return None


def export_options_problem(target: str, *, preset: str | None, checkpoint: bool, max_seq_len: bool,
                           quantize: bool) -> str | None:
    """Why these `export` options do not go together (one line), or None. The exporter asks, and
    the command line before importing it. `checkpoint`, `max_seq_len`, `quantize`: whether given."""
    if target == DECODER:
        if preset is not None and checkpoint:
            return "--preset and --checkpoint both given: a checkpoint brings its own shape; drop --preset"
        return None
    if checkpoint:
        return "--checkpoint applies to the decoder only (`moedeploy export decoder --checkpoint DIR`)"
    if preset is not None:
        return f"--preset applies to the decoder only; block {target!r} has one fixed shape"
    if max_seq_len:
        return "--max-seq-len applies to the decoder only (`moedeploy export decoder --max-seq-len N`)"
    if quantize:
        return "--quantize applies to the decoder only (`moedeploy export decoder --quantize int8`)"
    return None


def check_same_names(what: str, built: Iterable[str], named: Iterable[str]) -> None:
    """Fail at import when a module builds other `what` than this module names (order included)."""
    built, named = list(built), list(named)
    if built != named:
        raise RuntimeError(f"moedeploy's {what} are out of step: built {built}, named in moedeploy/names.py {named}")
