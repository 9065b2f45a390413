"""The moe::MoE op's routing and expert-activation attributes, in one torch-free module.

Why apart from the op (moedeploy/plugins/moe.py, which re-exports them): DecoderConfig checks a
checkpoint's routing and activation with these, and the command line reads a checkpoint's
config.json before torch is imported, so a model it cannot take is refused in half a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ACTIVATIONS = ("swiglu", "relu", "gelu")
SCORINGS = ("softmax", "sigmoid", "sparsemixer")
GROUP_SCORINGS = ("top2_sum", "max")
NO_LIMIT = math.inf  #: swiglu_limit's default: no clamp


@dataclass(frozen=True)
class Routing:
    """How a token picks and weighs its experts: the op's routing attributes in one place."""

    top_k: int = 2
    normalize_topk: bool = True
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    jitter_eps: float = 0.01
    group_scoring: str = "top2_sum"

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"unknown MoE scoring {self.scoring!r}; choose one of {SCORINGS}")
        if self.group_scoring not in GROUP_SCORINGS:
            raise ValueError(f"unknown MoE group_scoring {self.group_scoring!r}; choose one of {GROUP_SCORINGS}")
        if self.scoring == "sparsemixer" and self.top_k != 2:
            raise ValueError(f"sparsemixer routing picks exactly 2 experts, not top_k={self.top_k}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"need 1 <= topk_group ({self.topk_group}) <= n_group ({self.n_group})")
        # every lowering takes an expert where its dense routing weight is > 0 (unpicked ones are
        # 0): a factor <= 0 would drop every picked expert there and not in the eager reference
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise ValueError(f"routed_scaling_factor must be a positive number, got {self.routed_scaling_factor}")

    def check(self, n_experts: int) -> None:
        """Refuse a routing these experts cannot follow (before any node is built)."""
        if not 1 <= self.top_k <= n_experts:
            raise ValueError(f"top_k {self.top_k} must lie in [1, n_experts={n_experts}]")
        if self.n_group > 1:
            smallest = 2 if self.group_scoring == "top2_sum" else 1  # a group's two best need two
            if n_experts % self.n_group or n_experts // self.n_group < smallest:
                raise ValueError(
                    f"n_group {self.n_group} must divide n_experts {n_experts} into groups of at least {smallest}"
                )
            # Picks come from the kept groups only: the dropped experts' -inf never wins (and
            # transformers' 0.0 mask of DeepSeek-V2 picks the same experts).
            if self.top_k > self.topk_group * (n_experts // self.n_group):
                raise ValueError(f"top_k {self.top_k} exceeds the experts of {self.topk_group} groups")

    def attributes(self) -> dict[str, int | float | str]:
        """The node attributes (defaults included, so a reader never needs ours)."""
        return {
            "top_k": int(self.top_k),
            "normalize_topk": int(self.normalize_topk),
            "scoring": self.scoring,
            "n_group": int(self.n_group),
            "topk_group": int(self.topk_group),
            "routed_scaling_factor": float(self.routed_scaling_factor),
            "jitter_eps": float(self.jitter_eps),
            "group_scoring": self.group_scoring,
        }

    @classmethod
    def from_attributes(cls, attrs: dict) -> Routing:
        """From a node's attributes (name -> Python value); missing ones take their defaults,
        so nodes of every earlier version read as they meant."""
        known = {k: _text(attrs[k]) for k in cls.__dataclass_fields__ if k in attrs}
        if "normalize_topk" in known:
            known["normalize_topk"] = bool(known["normalize_topk"])
        return cls(**known)


def _text(value):
    """A STRING attribute as str (onnx gives bytes); any other value as it is."""
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class ExpertActivation:
    """What each expert computes between its linears: the op's activation attributes in one place.

    `activation` is "swiglu", "relu" or "gelu"; the other three parametrise swiglu only (see
    the module docstring): swiglu(g, u) = g' * sigmoid(activation_alpha * g') *
    (u' + activation_beta), g' = min(g, swiglu_limit), u' = clamp(u, -swiglu_limit,
    swiglu_limit). The defaults (1, 0, +inf: no clamp) are silu(g) * u.
    """

    activation: str = "swiglu"
    activation_alpha: float = 1.0
    activation_beta: float = 0.0
    swiglu_limit: float = NO_LIMIT

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown MoE activation {self.activation!r}; choose one of {ACTIVATIONS}")
        if not (math.isfinite(self.activation_alpha) and math.isfinite(self.activation_beta)):
            raise ValueError("activation_alpha and activation_beta must be finite")
        if not self.swiglu_limit > 0:  # NaN included
            raise ValueError(f"swiglu_limit must be > 0 (+inf: no clamp), not {self.swiglu_limit}")
        if self.activation != "swiglu" and self.parametrised:
            raise ValueError(f"activation_alpha, activation_beta and swiglu_limit apply to swiglu only, not {self.activation}")

    @property
    def parametrised(self) -> bool:
        """Whether any swiglu parameter differs from its default (plain silu(g) * u)."""
        return (self.activation_alpha, self.activation_beta, self.swiglu_limit) != (1.0, 0.0, NO_LIMIT)

    @property
    def clamped(self) -> bool:
        return self.swiglu_limit != NO_LIMIT

    def attributes(self) -> dict[str, float | str]:
        """The node attributes (defaults included, so a reader never needs ours)."""
        return {
            "activation": self.activation,
            "activation_alpha": float(self.activation_alpha),
            "activation_beta": float(self.activation_beta),
            "swiglu_limit": float(self.swiglu_limit),
        }

    @classmethod
    def from_attributes(cls, attrs: dict) -> ExpertActivation:
        """From a node's attributes (name -> Python value); missing ones take their defaults."""
        return cls(**{k: _text(attrs[k]) for k in cls.__dataclass_fields__ if k in attrs})


def as_activation(activation: str | ExpertActivation) -> ExpertActivation:
    """An activation as the op's functions take it: an ExpertActivation, or a name with the
    default parameters."""
    return activation if isinstance(activation, ExpertActivation) else ExpertActivation(activation)
