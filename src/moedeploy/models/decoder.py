"""MoEDecoder: one decoder-only MoE language model for every supported family, with a static KV cache."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from moedeploy.models.attention import (
    LayerCache,
    RotaryEmbedding,
    StaticLayerCache,
    Yarn,
    causal_mask,
)
from moedeploy.models.config import DecoderConfig
from moedeploy.models.generation import TokenIds, as_prompt, generate
from moedeploy.models.layers import DecoderLayer, make_norm
from moedeploy.models.mla import LatentAttention
from moedeploy.models.moe import SparseMoE
from moedeploy.models.norms import LayerNorm, RMSNorm


def rotary_embedding(config: DecoderConfig) -> RotaryEmbedding:
    """The decoder's rotary tables (rotary_dim wide: narrower than a head for partial rotary),
    YaRN-scaled when the config says so."""
    c = config
    yarn = None
    if c.yarn_factor:
        yarn = Yarn(c.yarn_factor, c.yarn_original_positions, c.yarn_beta_fast, c.yarn_beta_slow, c.yarn_truncate,
                    c.yarn_attention_factor)
    return RotaryEmbedding(c.rotary_dim, c.max_positions, c.rope_theta, yarn)


class MoEDecoder(nn.Module):
    """Token embedding -> N pre-norm decoder layers (MoE or dense FFN) -> final norm -> LM head.

    One model for every supported family: the config says which attention, norm, routing and
    FFN variant each layer has (see DecoderConfig and moedeploy.models.families).
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer.from_config(c, i) for i in range(c.n_layers))
        self.norm = make_norm(c.norm, c.hidden_size, c.norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=c.lm_head_bias)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = rotary_embedding(c)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module, std: float = 0.02) -> None:
        # Hugging Face's initializer_range: keeps random-weight logits in a sane range.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, (RMSNorm, LayerNorm)):
            # Not all ones (a checkpoint sets them anyway): random models must exercise the scale,
            # or an exported graph that dropped it would still match.
            nn.init.normal_(module.weight, mean=1.0, std=0.1)
        elif isinstance(module, LatentAttention):
            for w in (module.w_uk, module.w_uv):
                nn.init.normal_(w, std=std)
        elif isinstance(module, SparseMoE):
            for w in (module.w_gate, module.w_up, module.w_down):
                nn.init.normal_(w, std=std)
            if module.score_bias is not None:
                nn.init.normal_(module.score_bias, std=0.1)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: list[LayerCache] | None = None,
        start_pos: int | torch.SymInt = 0,
    ) -> torch.Tensor:
        """(B, S) token ids at absolute positions start_pos.. -> (B, S, vocab) logits.

        With a cache, each layer appends this step's keys/values to it and attends over the
        whole history; without one, start_pos must be 0 (a full forward).
        """
        c = self.config
        S = input_ids.shape[1]
        x = self.embed(input_ids)  # (B, S, D)
        if c.embedding_multiplier != 1.0:
            x = x * c.embedding_multiplier
        positions = torch.arange(S, device=input_ids.device) + start_pos
        rope = self.rope(positions)
        # (1, 1, S, start_pos + S): 4-D because TensorRT's ONNX Attention takes no other mask rank.
        # One mask per distinct window (full attention is window 0), built once for all layers.
        masks: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            window = c.window(i)
            if window not in masks:
                masks[window] = causal_mask(start_pos, S, input_ids.device, window)[None, None]
            x = layer(x, masks[window], rope, None if cache is None else cache[i], start_pos)
        logits = self.lm_head(self.norm(x))
        return logits / c.logits_scaling if c.logits_scaling != 1.0 else logits

    def new_cache(self, batch: int, max_len: int | None = None) -> list[StaticLayerCache]:
        """One preallocated KV cache per layer, in the model's dtype and device."""
        c = self.config
        max_len = max_len or c.max_positions
        p = self.lm_head.weight
        (k_heads, k_dim), value = c.kv_cache_dims
        return [
            StaticLayerCache(batch, k_heads, max_len, k_dim, p.dtype, p.device, value_dims=value)
            for _ in range(c.n_layers)
        ]

    @torch.inference_mode()
    def generate(
        self,
        input_ids: TokenIds,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | None = None,
    ) -> torch.Tensor:
        """Greedy (temperature 0) or sampled continuation over the KV cache.

        input_ids: a torch tensor, NumPy array or list of token ids, (B, S) or one sequence (S,).
        Returns the prompt and the new tokens, (B, S + new), or (S + new,) for one sequence.
        """
        prompt = as_prompt(input_ids, self.config.vocab_size)
        ids = prompt.ids.to(self.lm_head.weight.device)
        cache = self.new_cache(ids.shape[0], min(ids.shape[1] + max_new_tokens, self.config.max_positions))

        def step(ids: torch.Tensor, start_pos: int) -> torch.Tensor:
            return self(ids, cache, start_pos)

        tokens = generate(step, ids, self.config.max_positions, max_new_tokens, temperature, top_k, top_p,
                          seed, eos_token_id)
        return prompt.result(tokens)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> MoEDecoder:
        """Load a moedeploy checkpoint folder or a Hugging Face one of a supported family (eval mode)."""
        from moedeploy.models.checkpoint import load_decoder

        return load_decoder(path)

    def save_pretrained(self, path: str | Path) -> None:
        """Write config.json + model.safetensors (moedeploy layout) atomically."""
        from moedeploy.models.checkpoint import save_decoder

        save_decoder(self, path)
