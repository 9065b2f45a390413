"""The Hugging Face MoE families moedeploy loads, one small module each, keyed by model_type.

To add a family: write a module with a `config(hf) -> DecoderConfig` mapping (refusing what
the decoder does not implement) and a `Family`, list it here, and add its parity test.
"""

from __future__ import annotations

from moedeploy.models.families import (
    deepseek,
    glm4_moe,
    gpt_oss,
    granitemoe,
    minimax_m2,
    mixtral,
    olmoe,
    phimoe,
    qwen_moe,
)
from moedeploy.models.families.base import LLAMA_NAMES, Family, TensorNames, UnsupportedOption

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (mixtral.FAMILY, qwen_moe.QWEN2, qwen_moe.QWEN3, olmoe.FAMILY, granitemoe.FAMILY, phimoe.FAMILY,
              glm4_moe.FAMILY, minimax_m2.FAMILY, gpt_oss.FAMILY, deepseek.V2, deepseek.V3)
}


def family_for(model_type: str | None) -> Family:
    """The family of a config.json's model_type; an unknown one fails naming what is supported."""
    try:
        return FAMILIES[model_type or ""]
    except KeyError:
        raise UnsupportedOption(
            f"model_type {model_type or '<none>'!r} is not supported; supported: {', '.join(FAMILIES)} "
            "(see `moedeploy families`)"
        ) from None


__all__ = ["FAMILIES", "LLAMA_NAMES", "Family", "TensorNames", "UnsupportedOption", "family_for"]
