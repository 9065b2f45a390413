"""Mixtral (and Mixtral-shaped models): softmax top-k routing with renormalisation, optional
sliding-window attention on every layer."""

from __future__ import annotations

from typing import Any

from moedeploy.models.config import DecoderConfig
from moedeploy.models.families.base import Family, common


def config(hf: dict[str, Any]) -> DecoderConfig:
    base = common(hf, eps=1e-5)
    base["rope_theta"] = float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 1e6)))
    return DecoderConfig(
        **base,
        n_experts=hf["num_local_experts"],
        expert_hidden=hf["intermediate_size"],
        normalize_topk=True,
        sliding_window=hf.get("sliding_window") or 0,
    )


FAMILY = Family("mixtral", "Mixtral", config, "sliding_window (all layers), head_dim, tie_word_embeddings")
