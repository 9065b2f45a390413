"""Model configuration: one dataclass for the MoE decoder, with derived fields and presets.

The field names follow our own model; `from_hf_mixtral` maps a Hugging Face
`config.json` onto them so a Mixtral checkpoint loads without guessing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DecoderConfig:
    """Shape of a Mixtral-style decoder: pre-RMSNorm layers, GQA + RoPE attention, top-k MoE FFN."""

    vocab_size: int = 32000
    hidden_size: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 2
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 1024
    max_positions: int = 2048
    rope_theta: float = 1e6
    norm_eps: float = 1e-5
    # Mixtral renormalises the k routing weights so they sum to 1; Switch-style MoEs do not.
    normalize_topk: bool = True
    tie_embeddings: bool = False
    head_dim: int = field(default=0)  # 0 = derived as hidden_size // n_heads

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "n_experts",
                     "top_k", "expert_hidden", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim < 0:
            raise ValueError(f"head_dim must be >= 0 (0 = derived), got {self.head_dim}")
        if self.head_dim == 0:
            if self.hidden_size % self.n_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by n_heads {self.n_heads}; "
                    "set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads} "
                "(grouped-query attention shares each KV head among n_heads // n_kv_heads queries)"
            )
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must lie in [1, n_experts={self.n_experts}]")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def kv_groups(self) -> int:
        """How many query heads share one KV head."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DecoderConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown DecoderConfig fields: {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def from_hf_mixtral(cls, hf: dict[str, Any]) -> DecoderConfig:
        """Map a Hugging Face MixtralConfig dict (config.json) onto our fields."""
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default' RoPE)")
        window = hf.get("sliding_window")
        # A window at least max_positions long never bites; a shorter one we would not honour.
        if window not in (None, 0) and window < hf.get("max_position_embeddings", 0):
            raise ValueError("sliding-window attention is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (Mixtral uses silu)")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            n_experts=hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            expert_hidden=hf["intermediate_size"],
            max_positions=hf.get("max_position_embeddings", 4096),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 1e6))),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            normalize_topk=True,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            head_dim=hf.get("head_dim") or 0,
        )


PRESETS: dict[str, DecoderConfig] = {
    # Small enough that every test builds it in milliseconds, odd enough to catch shape bugs.
    "tiny": DecoderConfig(
        vocab_size=256,
        hidden_size=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        n_experts=4,
        top_k=2,
        expert_hidden=96,
        max_positions=256,
        rope_theta=10000.0,
    ),
    "small": DecoderConfig(
        vocab_size=32000,
        hidden_size=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=2,
        n_experts=8,
        top_k=2,
        expert_hidden=1024,
        max_positions=2048,
    ),
}


def preset(name: str) -> DecoderConfig:
    """A fresh copy of a named preset (mutating it never changes the table)."""
    try:
        return dataclasses.replace(PRESETS[name])
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
