"""Model configuration: one dataclass for every MoE decoder family, with derived fields and presets.

The field names follow our own model. Defaults are Mixtral's; each family module in
`moedeploy.models.families` maps a Hugging Face `config.json` onto these fields, so one
decoder covers them all through its config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from moedeploy import names
from moedeploy.moe_attributes import NO_LIMIT, ExpertActivation, Routing

NORMS = ("rms", "layer")
QK_NORMS = ("none", "head", "full")


@dataclass
class DecoderConfig:
    """Shape of a pre-norm MoE decoder: GQA + RoPE attention, top-k routed SwiGLU experts.

    Everything after `head_dim` is a family variant; the defaults give Mixtral.
    """

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

    # --- family variants --------------------------------------------------------------------
    family: str = "mixtral"  # the Hugging Face model_type this config describes
    norm: str = "rms"  # "layer": LayerNorm with bias (PhiMoE)
    # attention
    qkv_bias: bool = False  # biases on q/k/v (Qwen2-MoE, GLM-4-MoE, PhiMoE)
    o_bias: bool = False  # a bias on the output projection (PhiMoE)
    qk_norm: str = "none"  # RMSNorm of q and k: per head ("head") or over the whole projection ("full")
    clip_qkv: float = 0.0  # OLMoE: clamp q, k, v to [-clip, clip]; 0 = off
    rotary_dim: int = 0  # features of each head that rotate (partial rotary); 0 = head_dim
    attention_scale: float = 0.0  # softmax scale; 0 = 1 / sqrt(head_dim)
    sliding_window: int = 0  # a query sees the last `sliding_window` positions; 0 = all
    sliding_layers: list[int] | None = None  # layers with the window; None = all (when set)
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit joins every softmax's denominator
    rope_interleaved: bool = False  # DeepSeek: rotary pairs are neighbours (x0, x1), not i and i + d/2
    # YaRN RoPE scaling (gpt-oss, DeepSeek); yarn_factor 0 = plain RoPE
    yarn_factor: float = 0.0
    yarn_original_positions: int = 0  # the context the model was pretrained on
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = True
    yarn_attention_factor: float = 1.0  # cos and sin are scaled by this
    # multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank 0 = ordinary attention. The
    # rotary part of a query/key head is rotary_dim wide, the rest qk_nope_head_dim.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: the query is one projection (DeepSeek-V2-Lite)
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # feed-forward
    dense_layers: list[int] = field(default_factory=list)  # layers with a dense SwiGLU, not MoE
    dense_hidden: int = 0  # that SwiGLU's width; 0 = expert_hidden
    shared_expert_hidden: int = 0  # a shared SwiGLU expert every token runs; 0 = none
    shared_expert_gate: bool = False  # Qwen2-MoE scales it by sigmoid(w x)
    expert_bias: bool = False  # gpt-oss: biases on every expert projection
    router_bias: bool = False  # gpt-oss: a bias on the router
    # the experts' SwiGLU, (clamp(up, -limit, limit) + beta) * g * sigmoid(alpha * g) with
    # g = min(gate, limit); the defaults (limit 0 = no clamp) give silu(gate) * up
    swiglu_alpha: float = 1.0
    swiglu_beta: float = 0.0
    swiglu_limit: float = 0.0
    # routing (see moedeploy.moe_attributes.Routing)
    scoring: str = "softmax"
    score_bias: bool = False  # a per-expert bias that only selects (e_score_correction_bias)
    n_group: int = 1
    topk_group: int = 1
    group_scoring: str = "top2_sum"  # how groups rank: their two best experts' sum, or "max" (DeepSeek-V2)
    routed_scaling_factor: float = 1.0
    jitter_eps: float = 0.01
    # scalings (GraniteMoE) and the LM head
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0  # logits are divided by this
    lm_head_bias: bool = False

    def __post_init__(self) -> None:
        # a float size (5.0 for a window) got as far as the artifact's own manifest check, after
        # the artifact was written
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{f.name} must be an integer, got {value!r}")
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "n_experts",
                     "top_k", "expert_hidden", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("head_dim", "rotary_dim", "sliding_window", "dense_hidden", "shared_expert_hidden",
                     "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "yarn_original_positions"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = off or derived), got {getattr(self, name)}")
        if self.kv_lora_rank:
            # MLA: the query/key head is its no-RoPE part plus its rotary part.
            if not (self.qk_nope_head_dim and self.rotary_dim and self.v_head_dim):
                raise ValueError("multi-head latent attention needs qk_nope_head_dim, rotary_dim and v_head_dim")
            self.head_dim = self.head_dim or self.qk_nope_head_dim + self.rotary_dim
            if self.head_dim != self.qk_nope_head_dim + self.rotary_dim:
                raise ValueError(f"head_dim {self.head_dim} must be qk_nope_head_dim + rotary_dim with MLA")
        if self.yarn_factor and not self.yarn_original_positions:
            raise ValueError("YaRN needs yarn_original_positions (the pretraining context)")
        if self.head_dim == 0:
            if self.hidden_size % self.n_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by n_heads {self.n_heads}; "
                    "set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.n_heads
        if self.rotary_dim == 0:
            self.rotary_dim = self.head_dim
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads} "
                "(grouped-query attention shares each KV head among n_heads // n_kv_heads queries)"
            )
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must lie in [1, n_experts={self.n_experts}]")
        if self.rotary_dim == self.head_dim and self.head_dim % 2:  # the whole head rotated, as most families do
            raise ValueError(f"head_dim {self.head_dim} must be even: the rotary embedding turns pairs of features")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and at most head_dim {self.head_dim}")
        if self.norm not in NORMS:
            raise ValueError(f"norm {self.norm!r} must be one of {NORMS}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {self.qk_norm!r} must be one of {QK_NORMS}")
        for name in ("dense_layers", "sliding_layers"):
            layers = getattr(self, name)
            if layers is not None:
                layers = sorted({int(i) for i in layers})
                if any(not 0 <= i < self.n_layers for i in layers):
                    raise ValueError(f"{name} {layers} name layers outside 0..{self.n_layers - 1}")
                setattr(self, name, layers)
        self.routing.check(self.n_experts)
        self.expert_activation  # noqa: B018 (checks the SwiGLU parameters)

    @property
    def kv_groups(self) -> int:
        """How many query heads share one KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def routing(self) -> Routing:
        """The moe::MoE routing attributes of every MoE layer."""
        return Routing(self.top_k, self.normalize_topk, self.scoring, self.n_group, self.topk_group,
                       self.routed_scaling_factor, self.jitter_eps, self.group_scoring)

    @property
    def expert_activation(self) -> ExpertActivation:
        """The moe::MoE activation attributes of every MoE layer (swiglu_limit 0 here = no clamp)."""
        return ExpertActivation("swiglu", self.swiglu_alpha, self.swiglu_beta, self.swiglu_limit or NO_LIMIT)

    @property
    def kv_cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, features) of each layer's cached "key" and "value" tensors.

        Multi-head latent attention caches what its keys and values are made from, not them:
        the compressed latent (kv_lora_rank, after its norm) as "key" and the rotary key that
        all heads share (rotary_dim) as "value", as vLLM and SGLang do.
        """
        if self.kv_lora_rank:
            return (1, self.kv_lora_rank), (1, self.rotary_dim)
        return (self.n_kv_heads, self.head_dim), (self.n_kv_heads, self.head_dim)

    def kv_cache_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token adds over all layers."""
        (kh, kd), (vh, vd) = self.kv_cache_dims
        return self.n_layers * (kh * kd + vh * vd) * dtype_bytes

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def window(self, layer: int) -> int:
        """The sliding window of `layer`, 0 for full attention."""
        if not self.sliding_window or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return 0
        return self.sliding_window

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
    def from_manifest(cls, data: dict[str, Any]) -> DecoderConfig:
        """The config an artifact's manifest records (which adds where the weights came from)."""
        return cls.from_dict({k: v for k, v in data.items() if k != "source"})


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


names.check_same_names("presets", PRESETS, names.PRESETS)


def preset(name: str) -> DecoderConfig:
    """A fresh copy of a named preset (mutating it never changes the table)."""
    if problem := names.preset_problem(name):
        raise ValueError(problem)
    return dataclasses.replace(PRESETS[name])
