"""The MoE decoder as an ONNX graph with a KV cache: past keys/values in, present out.

One graph serves prefill (past length 0) and decode (one new token): every dim that
changes between them is dynamic. Names follow Hugging Face Optimum's convention.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moedeploy.export.blocks import DynamicRange
from moedeploy.models import MoEDecoder
from moedeploy.models.config import DecoderConfig


def past_names(n_layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


def present_names(n_layers: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


class ConcatLayerCache:
    """Export-time KV cache: this step's keys/values are appended to the past tensors.

    The static in-place cache of eager generation cannot be expressed as a pure function
    of its inputs; an ONNX graph returns the grown cache (`present`) instead.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def update(self, start_pos, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = torch.cat([self.k, k], dim=2)  # (B, nkv, past + S, hd)
        self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v


#: Module-path prefix of the decoder's modules inside DecoderWithPast (its `.decoder`):
#: graph scopes read `decoder.layers.0.ffn` where `named_modules()` of the model says `layers.0.ffn`.
WRAPPER_PREFIX = "decoder."


class DecoderWithPast(nn.Module):
    """forward(input_ids, [(k, v) per layer]) -> (logits, [(k, v) per layer]); positions follow the past."""

    def __init__(self, decoder: MoEDecoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]]):
        caches = [ConcatLayerCache(k, v) for k, v in past]
        start_pos = past[0][0].shape[2]
        logits = self.decoder(input_ids, caches, start_pos)
        return logits, [(c.k, c.v) for c in caches]


#: Positions (cache + new tokens) the TensorRT profile covers when the model allows more.
#: An engine is built for its profile's maxima; a 128k-token profile for every export would
#: be a poor default. `export(..., max_seq_len=N)` asks for more, up to max_positions.
DEFAULT_MAX_SEQ_LEN = 4096


def profile_positions(max_positions: int, max_seq_len: int | None = None) -> int:
    """How many positions (past_seq + seq) the profile spans: max_seq_len, or the default cap."""
    if max_seq_len is None:
        return min(max_positions, DEFAULT_MAX_SEQ_LEN)
    if not 1 <= max_seq_len <= max_positions:
        raise ValueError(
            f"max_seq_len (--max-seq-len) must lie in [1, max_positions={max_positions}] (the model has no "
            f"position beyond that), got {max_seq_len}"
        )
    return max_seq_len


def decoder_dynamic_ranges(max_positions: int, max_seq_len: int | None = None) -> dict[str, DynamicRange]:
    """min/opt/max of batch, seq and past_seq: a TensorRT profile runnable at every corner.

    A profile is a box, and TensorRT may run any point of it, so seq.max + past_seq.max must
    not exceed the positions it covers. They are split evenly: a prefill of up to half the
    positions, and a cache of the rest.
    """
    total = profile_positions(max_positions, max_seq_len)
    seq_max = max(1, total // 2)
    past_max = total - seq_max
    return {
        "batch": DynamicRange(1, 1, 8),
        "seq": DynamicRange(1, min(128, seq_max), seq_max),
        "past_seq": DynamicRange(0, min(128, past_max), past_max),
    }


def past_shapes(config: DecoderConfig, batch: int, past_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (key, value) shapes of one layer's cache: (B, heads, past_len, features) each; see
    DecoderConfig.kv_cache_dims for what latent attention keeps in them."""
    (k_heads, k_dim), (v_heads, v_dim) = config.kv_cache_dims
    return (batch, k_heads, past_len, k_dim), (batch, v_heads, past_len, v_dim)


def kv_cache_summary(config: DecoderConfig, dtype_bytes: int) -> dict[str, Any]:
    """The manifest's account of the KV cache: each layer's tensors and the bytes a token adds."""
    (k_heads, k_dim), (v_heads, v_dim) = config.kv_cache_dims
    holds = ("the compressed latent (key) and the shared rotary key (value) of latent attention"
             if config.kv_lora_rank else "keys and values per KV head")
    return {"key": [k_heads, k_dim], "value": [v_heads, v_dim], "holds": holds,
            "bytes_per_token": config.kv_cache_bytes_per_token(dtype_bytes)}


def empty_past(decoder: MoEDecoder, batch: int, past_len: int = 0, dtype: torch.dtype | None = None):
    dtype = dtype or decoder.lm_head.weight.dtype
    k, v = past_shapes(decoder.config, batch, past_len)
    return [(torch.zeros(k, dtype=dtype), torch.zeros(v, dtype=dtype)) for _ in range(decoder.config.n_layers)]


@torch.no_grad()
def decoder_feed(
    decoder: MoEDecoder, batch: int, past_len: int, seq: int, generator: torch.Generator
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Realistic decoder inputs: a real KV cache from running `past_len` random tokens, then `seq` new ones."""
    vocab = decoder.config.vocab_size
    ids = torch.randint(0, vocab, (batch, past_len + seq), generator=generator)
    wrapper = DecoderWithPast(decoder)
    past = empty_past(decoder, batch)
    if past_len:
        _, past = wrapper(ids[:, :past_len], past)
    return ids[:, past_len:], past
