"""How many bytes and flops one decode step of a MoE decoder needs: its speed floor on a machine."""

from __future__ import annotations

from moedeploy.models.config import DecoderConfig


def _attention_params(c: DecoderConfig) -> int:
    """Every weight of one layer's attention (projections, biases, q/k norms, sinks; latent
    attention's low-rank projections): counted on a meta-device module, so no variant is missed."""
    import torch

    from moedeploy.models.layers import DecoderLayer

    with torch.device("meta"):
        return sum(p.numel() for p in DecoderLayer.from_config(c, 0).attn.parameters())


def _attention_macs_per_position(c: DecoderConfig) -> int:
    """Multiply-adds one query spends per cached position: scores and the weighted values.
    Latent attention scores against [latent ; rotary key] and sums latents."""
    if c.kv_lora_rank:
        return c.n_heads * (2 * c.kv_lora_rank + c.rotary_dim)
    return 2 * c.n_heads * c.head_dim


def _ffn_params(c: DecoderConfig, layer: int, experts: int) -> int:
    """FFN weights of `layer` that a step touches when `experts` routed experts run there: a dense
    SwiGLU's, or the router, those experts and any shared expert (with its gate)."""
    if not c.is_moe_layer(layer):
        return 3 * c.hidden_size * (c.dense_hidden or c.expert_hidden)
    shared = 3 * c.hidden_size * c.shared_expert_hidden + (c.hidden_size if c.shared_expert_gate else 0)
    return c.hidden_size * c.n_experts + experts * 3 * c.hidden_size * c.expert_hidden + shared


def _context(c: DecoderConfig, layer: int, context: int) -> int:
    """Cached positions a query of `layer` reads (a sliding window reads at most its width)."""
    window = c.window(layer)
    return min(context, window) if window else context


def quantized_bytes_per_param(bits: int, block_size: int, scale_bytes: int, zero_point: bool = True) -> float:
    """What one weight of a blocked int8/int4 tensor costs in bytes: its code, and its share of
    its block's scale (in the artifact's dtype) and zero point (as wide as a code; signed codes
    have none)."""
    return bits / 8 + (scale_bytes + (bits / 8 if zero_point else 0)) / block_size


def quantization_saving(c: DecoderConfig, batch: int, quantization: dict, bytes_per_param: int) -> float:
    """Bytes a decode step does not read because the tensors a quantized artifact records
    (manifest "quantization": each tensor's bits and blocks) are blocked int8/int4 instead of float: the
    expert stacks in the share of experts the step touches, the rest whole."""
    import torch

    from moedeploy.export.quantize import manifest_formats
    from moedeploy.models.decoder import MoEDecoder

    with torch.device("meta"):
        shapes = {name: t.shape for name, t in MoEDecoder(c).state_dict().items()}
    touched = min(c.n_experts, c.top_k * batch) / c.n_experts
    zero_point = not (quantization.get("format", 1) >= 2 and quantization.get("symmetric", True))
    saved = 0.0
    for name, f in manifest_formats(quantization).items():
        numel = shapes[name].numel() * (touched if len(shapes[name]) == 3 else 1)
        saved += numel * (bytes_per_param - quantized_bytes_per_param(f.bits, f.block_size, bytes_per_param, zero_point))
    return saved


def decode_step_bytes(c: DecoderConfig, batch: int = 1, context: int = 0, bytes_per_param: int = 4,
                      quantization: dict | None = None) -> int:
    """Weights one new token touches (attention, router, its k experts, shared experts or a dense
    FFN, norms, LM head) plus the KV cache it reads. With batch > 1 the experts touched are at
    most min(E, k * batch). `quantization`: a quantized artifact's manifest section, whose
    tensors cost their codes, scales and zero points instead of `bytes_per_param`."""
    experts_touched = min(c.n_experts, c.top_k * batch)
    weights = sum(_attention_params(c) + _ffn_params(c, i, experts_touched) + 2 * c.hidden_size
                  for i in range(c.n_layers))
    weights += c.hidden_size * c.vocab_size + c.hidden_size * (batch + 1)
    (k_heads, k_dim), (v_heads, v_dim) = c.kv_cache_dims
    kv_cache = sum(batch * (k_heads * k_dim + v_heads * v_dim) * _context(c, i, context) for i in range(c.n_layers))
    total = (weights + kv_cache) * bytes_per_param
    return round(total - quantization_saving(c, batch, quantization, bytes_per_param)) if quantization else total


def weight_bytes(c: DecoderConfig, bytes_per_param: int = 4) -> int:
    """Every weight of the model once (a tied LM head is the embedding), counted on the meta device."""
    import torch

    from moedeploy.models.decoder import MoEDecoder

    with torch.device("meta"):
        return sum(p.numel() for p in MoEDecoder(c).parameters()) * bytes_per_param


def decode_step_flops(c: DecoderConfig, batch: int = 1, context: int = 0) -> int:
    matmuls = batch * (sum(_attention_params(c) + _ffn_params(c, i, c.top_k) for i in range(c.n_layers))
                       + c.hidden_size * c.vocab_size)
    attn_scores = batch * sum(_attention_macs_per_position(c) * _context(c, i, context) for i in range(c.n_layers))
    return 2 * (matmuls + attn_scores)
