"""The decoder's weights as an f32 GGUF file, so llama.cpp can be timed on exactly the same model.

llama.cpp runs a Mixtral-shaped model as its "llama" architecture with experts. Its rotary
embedding rotates neighbouring pairs (x0, x1), where Hugging Face's and ours rotate x_i with
x_{i + d/2}; the standard conversion therefore reorders each head's rows of wq and wk so that
row 2i is our row i and row 2i + 1 our row i + d/2 (the same model, not an approximation:
greedy tokens are compared in the benchmark). Anything beyond Mixtral's maths (biases,
q/k norms, other routings, windows, ...) is refused in one line: llama.cpp would run a
different model.

The file is written one tensor at a time (header first, from shapes alone), so a model is
never held twice, and atomically. It records the weights fingerprint of the artifact it was
made for, and a sidecar `<file>.sha256` the digest of its bytes: a cached file is reused only
when both match (the fingerprint is a header field, so a file damaged in its tensor data kept it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from moedeploy.models.config import DecoderConfig
from moedeploy.models.weights import WeightSource

FINGERPRINT_KEY = "moedeploy.weights_sha256"

#: The fields a Mixtral config may set; every other field must be what Mixtral's is
_CORE = {"vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "n_experts", "top_k", "expert_hidden",
         "max_positions", "rope_theta", "norm_eps", "tie_embeddings", "head_dim", "family"}


def unsupported_features(config: DecoderConfig) -> list[str]:
    """The config's options that llama.cpp's llama architecture does not compute (empty: it can run it)."""
    mixtral = DecoderConfig(**{name: getattr(config, name) for name in _CORE})  # derived fields derived alike
    return [f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(mixtral, f.name)]


def require_llama_shaped(config: DecoderConfig) -> None:
    if config.family != "mixtral" or (extra := unsupported_features(config)):
        what = f"family {config.family!r}" if config.family != "mixtral" else "options " + ", ".join(extra)
        raise ValueError(f"llama.cpp is benchmarked on Mixtral-shaped decoders only, and this one has {what}; "
                         "bench it without the llama.cpp peer")


def rotary_rows_for_llama_cpp(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's output rows from half-split rotary pairs (i, i + d/2) to neighbours (2i, 2i + 1)."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def _tensor_plan(config: DecoderConfig) -> Iterator[tuple[str, str, Callable[[torch.Tensor], torch.Tensor] | None]]:
    """(GGUF name, our name, transform) in the order the file holds them."""
    yield "token_embd.weight", "embed.weight", None
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"blk.{i}."
        yield theirs + "attn_norm.weight", ours + "attn_norm.weight", None
        yield theirs + "attn_q.weight", ours + "attn.wq.weight", lambda w: rotary_rows_for_llama_cpp(w, config.n_heads)
        yield theirs + "attn_k.weight", ours + "attn.wk.weight", lambda w: rotary_rows_for_llama_cpp(w, config.n_kv_heads)
        yield theirs + "attn_v.weight", ours + "attn.wv.weight", None
        yield theirs + "attn_output.weight", ours + "attn.wo.weight", None
        yield theirs + "ffn_norm.weight", ours + "ffn_norm.weight", None
        yield theirs + "ffn_gate_inp.weight", ours + "ffn.router.weight", None
        yield theirs + "ffn_gate_exps.weight", ours + "ffn.w_gate", None
        yield theirs + "ffn_up_exps.weight", ours + "ffn.w_up", None
        yield theirs + "ffn_down_exps.weight", ours + "ffn.w_down", None
    yield "output_norm.weight", "norm.weight", None
    if not config.tie_embeddings:  # llama.cpp falls back to token_embd when output is absent
        yield "output.weight", "lm_head.weight", None


def _vocabulary(vocab_size: int) -> tuple[list[str], list[int]]:
    """A placeholder SentencePiece vocabulary: bench feeds token ids, so only the count matters.

    <unk>, <s>, </s>, the 256 byte tokens llama.cpp's SPM tokenizer looks up, then names.
    """
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    if vocab_size >= len(tokens) + 256:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [TokenType.BYTE] * 256
    tokens += [f"<tok{i}>" for i in range(len(tokens), vocab_size)]
    types += [TokenType.NORMAL] * (vocab_size - len(types))
    return tokens[:vocab_size], [int(t) for t in types[:vocab_size]]


def digest_sidecar(path: Path) -> Path:
    return path.with_name(f"{path.name}.sha256")


def record_digest(tmp: Path, path: Path) -> None:
    """Move the finished `tmp` to `path` with its sha256 in the sidecar: the old sidecar goes first
    and the new one comes last, so no reader ever finds a digest beside bytes it was not made of."""
    from moedeploy.export.artifact import sha256
    from moedeploy.utils.io import atomic_write_text

    digest = sha256(tmp)
    digest_sidecar(path).unlink(missing_ok=True)
    os.replace(tmp, path)
    atomic_write_text(digest_sidecar(path), digest + "\n")


def digest_problem(path: Path) -> str | None:
    """Why the cached `path` is not the file written there (None: its bytes are the recorded ones)."""
    from moedeploy.export.artifact import sha256

    try:
        recorded = digest_sidecar(path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return f"{path} has no readable {digest_sidecar(path).name} (the digest written with it)"
    if sha256(path) != recorded:
        return f"{path} does not match the sha256 recorded when it was written"
    return None


def recorded_fingerprint(path: Path) -> str | None:
    """The weights fingerprint a GGUF file written here records (None: unreadable or not ours)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(path).get_field(FINGERPRINT_KEY)
        return None if field is None else field.contents()
    except Exception:  # a truncated or foreign file: not reusable
        return None


def write_gguf(config: DecoderConfig, weights: WeightSource, path: Path, weights_sha256: str,
               progress: Callable[[str], None] | None = None) -> Path:
    """Write `weights` (our names) as an f32 GGUF at `path`, atomically, one tensor in memory at a time."""
    import gguf

    require_llama_shaped(config)
    plan = list(_tensor_plan(config))
    head_dim = config.head_dim or config.hidden_size // config.n_heads
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    try:
        writer.add_name("moedeploy decoder")
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        writer.add_context_length(config.max_positions)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.n_layers)
        writer.add_feed_forward_length(config.expert_hidden)
        writer.add_head_count(config.n_heads)
        writer.add_head_count_kv(config.n_kv_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(config.rope_theta)
        writer.add_layer_norm_rms_eps(config.norm_eps)
        writer.add_expert_count(config.n_experts)
        writer.add_expert_used_count(config.top_k)
        writer.add_vocab_size(config.vocab_size)
        tokens, types = _vocabulary(config.vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_string(FINGERPRINT_KEY, weights_sha256)
        for name, ours, _ in plan:
            shape = weights.shape(ours)
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for n, (_name, ours, transform) in enumerate(plan):
            tensor = weights.tensor(ours).to(torch.float32)
            if transform is not None:
                tensor = transform(tensor)
            writer.write_tensor_data(np.ascontiguousarray(tensor.numpy()))
            if progress and n % 11 == 0:
                progress(f"writing {path.name}: {n + 1}/{len(plan)} tensors")
        writer.close()
        record_digest(tmp, path)
    finally:
        writer.close()  # idempotent
        tmp.unlink(missing_ok=True)
    return path
