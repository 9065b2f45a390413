"""A checkpoint folder's config.json read into a DecoderConfig, without torch.

Why a module of its own: the command line checks a checkpoint (a family moedeploy does not
take, an option the decoder does not implement, a field of the wrong type) before torch is
imported, and moedeploy.models.checkpoint reads the weights the same config describes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from moedeploy.models.config import DecoderConfig
from moedeploy.models.families import Family, UnsupportedOption, family_for
from moedeploy.models.families.base import checked_field_types
from moedeploy.names import checkpoint_folder_problem
from moedeploy.utils.io import read_json_object

FORMAT = "moedeploy"  #: config.json's "format" in a folder save_decoder wrote


class CheckpointError(ValueError):
    """A folder that is not a loadable checkpoint; the message says what is wrong with it."""


#: DecoderConfig's fields as a Hugging Face config.json names them (families/base.common), for
#: messages about a checkpoint's config; the expert count and width have a name per family
HF_FIELD_NAMES = {"n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                  "n_kv_heads": "num_key_value_heads", "top_k": "num_experts_per_tok",
                  "max_positions": "max_position_embeddings", "norm_eps": "rms_norm_eps",
                  "expert_hidden": "the experts' intermediate size"}  # n_experts: the family's experts_key
_FIELD_NAME = re.compile(r"\b(" + "|".join([*HF_FIELD_NAMES, "n_experts"]) + r")\b")


def config_json_name(path: Path, field: str, family: str) -> str:
    """DecoderConfig's `field` as the config.json of checkpoint `path` names it: a Hugging Face
    family's name (its expert count's key included), or the field itself in moedeploy's own
    format, whose config.json holds DecoderConfig's fields."""
    try:
        own = json.loads((path / "config.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        own = False
    if own:
        return field
    try:
        names = _hf_field_names(family_for(family))
    except UnsupportedOption:
        names = HF_FIELD_NAMES
    return names.get(field, field)


def _hf_field_names(family: Family) -> dict[str, str]:
    """DecoderConfig's field names -> the names in `family`'s config.json (its own expert count key)."""
    return {**HF_FIELD_NAMES, "n_experts": family.experts_key}


def _parse(make: Callable[[], DecoderConfig], path: Path, family: Family | None = None) -> DecoderConfig:
    """The config `make` reads from `path`/config.json; its errors as CheckpointErrors that name
    the fields as that file does (a Hugging Face family's names, not DecoderConfig's; None:
    moedeploy's own config.json, which uses DecoderConfig's)."""
    try:
        return make()
    except UnsupportedOption as e:
        raise CheckpointError(f"{path / 'config.json'}: {family.title if family else 'moedeploy'}: {e}") from None
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:
        detail = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        null = (isinstance(e, TypeError) and "NoneType" in detail) or detail.endswith("must be an integer, got None")
        if null and (nulls := _null_numeric_fields(path)):
            detail = f"{', '.join(nulls)} {'is' if len(nulls) == 1 else 'are'} null where a number is needed; give it a value"
        if family is not None:
            names = _hf_field_names(family)
            detail = _FIELD_NAME.sub(lambda m: names[m.group(1)], detail)
        raise CheckpointError(f"{path / 'config.json'}: invalid config: {detail}") from None


def _null_numeric_fields(path: Path) -> list[str]:
    """The sizes config.json sets to null that no family may leave unset (a null expert count
    reached a comparison as None); fields a config may leave null (head_dim, ...) are not named."""
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return []
    return [key for key in SIZES_NEVER_NULL if isinstance(hf, dict) and key in hf and hf[key] is None]


#: config.json sizes that, where a config has them, must hold a number
SIZES_NEVER_NULL = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "num_experts_per_tok", "num_local_experts", "num_experts", "n_routed_experts",
                    "intermediate_size", "moe_intermediate_size", "max_position_embeddings", "rms_norm_eps")


def _read_config(path: Path) -> dict:
    if problem := checkpoint_folder_problem(path):
        raise CheckpointError(problem)
    return read_json_object(path / "config.json", CheckpointError)


def read_config(path: Path) -> tuple[DecoderConfig, Family | None]:
    """The DecoderConfig a checkpoint folder's config.json describes, and its Hugging Face family
    (None: moedeploy's own format). Raises CheckpointError naming the folder's problem as its
    config.json names the fields: a missing folder or file, a family moedeploy does not take,
    an option the decoder does not implement, a field of the wrong type."""
    raw = _read_config(path)
    if raw.get("format") == FORMAT:
        return _parse(lambda: DecoderConfig.from_dict(raw["config"]), path), None
    try:
        family = family_for(raw.get("model_type"))
    except UnsupportedOption as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    return _parse(lambda: family.config(checked_field_types(raw)), path, family), family
