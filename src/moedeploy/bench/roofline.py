"""How many bytes and flops one decode step of a MoE decoder needs: its speed floor on a machine."""

from __future__ import annotations

from moedeploy.models.config import DecoderConfig


def decode_step_bytes(c: DecoderConfig, batch: int = 1, context: int = 0, bytes_per_param: int = 4) -> int:
    """Weights one new token touches (attention, router, its k experts, final norm, LM head) plus
    the KV cache it reads. With batch > 1 the experts touched are at most min(E, k * batch)."""
    hd = c.head_dim
    attention = c.hidden_size * (c.n_heads * hd) * 2 + c.hidden_size * (c.n_kv_heads * hd) * 2
    experts_touched = min(c.n_experts, c.top_k * batch)
    expert = 3 * c.hidden_size * c.expert_hidden
    per_layer = attention + c.hidden_size * c.n_experts + experts_touched * expert + 2 * c.hidden_size
    weights = c.n_layers * per_layer + c.hidden_size * c.vocab_size + c.hidden_size * (batch + 1)
    kv_cache = c.n_layers * 2 * batch * c.n_kv_heads * context * hd
    return (weights + kv_cache) * bytes_per_param


def decode_step_flops(c: DecoderConfig, batch: int = 1, context: int = 0) -> int:
    hd = c.head_dim
    attention = c.hidden_size * (c.n_heads * hd) * 2 + c.hidden_size * (c.n_kv_heads * hd) * 2
    per_token_layer = attention + c.hidden_size * c.n_experts + c.top_k * 3 * c.hidden_size * c.expert_hidden
    matmuls = batch * (c.n_layers * per_token_layer + c.hidden_size * c.vocab_size)
    attn_scores = batch * c.n_layers * 2 * c.n_heads * hd * context
    return 2 * (matmuls + attn_scores)
