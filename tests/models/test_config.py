"""DecoderConfig: preset values, derived fields, validation, and the Hugging Face mapping."""

from __future__ import annotations

import dataclasses

import pytest

from moedeploy.models import PRESETS, DecoderConfig, preset
from moedeploy.models.families import mixtral

from .helpers import tiny_mixtral_config


def test_small_preset_values() -> None:
    c = preset("small")
    assert (c.vocab_size, c.hidden_size, c.n_layers, c.n_heads, c.n_kv_heads) == (
        32000,
        512,
        8,
        8,
        2,
    )
    assert (c.n_experts, c.top_k, c.expert_hidden, c.max_positions) == (8, 2, 1024, 2048)
    assert c.head_dim == 64  # 512 / 8
    assert c.kv_groups == 4
    assert c.normalize_topk is True


def test_tiny_preset_values() -> None:
    c = preset("tiny")
    assert (c.vocab_size, c.hidden_size, c.n_layers, c.n_heads, c.n_kv_heads) == (256, 64, 2, 4, 2)
    assert (c.n_experts, c.top_k, c.expert_hidden, c.max_positions) == (4, 2, 96, 256)
    assert c.head_dim == 16
    assert c.rope_theta == 10000.0


def test_preset_is_a_copy() -> None:
    c = preset("tiny")
    c.n_layers = 99
    assert PRESETS["tiny"].n_layers == 2
    assert preset("tiny").n_layers == 2


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="huge"):
        preset("huge")


def test_explicit_head_dim_is_kept() -> None:
    c = DecoderConfig(hidden_size=40, n_heads=4, n_kv_heads=2, head_dim=6)
    assert c.head_dim == 6
    assert DecoderConfig(hidden_size=40, n_heads=4, n_kv_heads=2).head_dim == 10


def test_dict_round_trip() -> None:
    c = DecoderConfig(
        hidden_size=48, n_heads=6, n_kv_heads=3, tie_embeddings=True, normalize_topk=False
    )
    assert DecoderConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="bogus"):
        DecoderConfig.from_dict({**c.to_dict(), "bogus": 1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden_size": 50, "n_heads": 8}, "divisible"),
        ({"n_heads": 8, "n_kv_heads": 3}, "multiple of n_kv_heads"),
        ({"n_experts": 4, "top_k": 0}, "top_k"),
        ({"n_experts": 4, "top_k": 5}, "top_k"),
        ({"n_experts": 0}, "n_experts"),
        ({"hidden_size": 24, "n_heads": 8, "n_kv_heads": 2}, "even"),  # head_dim 3
        ({"head_dim": 7}, "even"),
        ({"hidden_size": 40, "n_heads": 8, "n_kv_heads": 8}, "head_dim 5 must be even: the rotary embedding turns pairs"),
        ({"sliding_window": 5.0}, r"sliding_window must be an integer, got 5\.0"),
        ({"kv_lora_rank": True}, "kv_lora_rank must be an integer, got True"),
    ],
)
def test_invalid_configs_raise(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [{"n_heads": 0}, {"n_kv_heads": 0}])
def test_zero_heads_raise_value_error(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DecoderConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"vocab_size": 0},
        {"hidden_size": 0},
        {"n_layers": -1},
        {"expert_hidden": 0},
        {"max_positions": 0},
        {"head_dim": -2},
    ],
)
def test_non_positive_sizes_raise_value_error(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DecoderConfig(**kwargs)


def test_from_hf_mixtral() -> None:
    hf = tiny_mixtral_config(
        vocab_size=97,
        hidden_size=40,
        num_attention_heads=4,
        num_key_value_heads=1,
        num_local_experts=5,
        num_experts_per_tok=3,
        intermediate_size=33,
        num_hidden_layers=3,
        max_position_embeddings=128,
        rope_theta=500.0,
        rms_norm_eps=1e-6,
        head_dim=6,
        tie_word_embeddings=True,
    ).to_dict()
    c = mixtral.config(hf)
    expected = DecoderConfig(
        vocab_size=97,
        hidden_size=40,
        n_layers=3,
        n_heads=4,
        n_kv_heads=1,
        n_experts=5,
        top_k=3,
        expert_hidden=33,
        max_positions=128,
        rope_theta=500.0,
        norm_eps=1e-6,
        normalize_topk=True,
        tie_embeddings=True,
        head_dim=6,
    )
    assert c == expected
    assert dataclasses.asdict(c) == dataclasses.asdict(expected)


def test_from_hf_mixtral_legacy_rope_theta_and_missing_kv_heads() -> None:
    hf = {
        "model_type": "mixtral",
        "vocab_size": 10,
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": None,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "intermediate_size": 8,
        "rope_theta": 1234.0,
    }
    c = mixtral.config(hf)
    assert c.rope_theta == 1234.0
    assert c.n_kv_heads == 2  # no KV heads given: plain multi-head attention
    assert c.head_dim == 8


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
    ],
)
def test_from_hf_mixtral_rejects_unsupported(change: dict, message: str) -> None:
    hf = {**tiny_mixtral_config().to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        mixtral.config(hf)


def test_mixtral_sliding_window_applies_to_every_layer() -> None:
    c = mixtral.config({**tiny_mixtral_config(num_hidden_layers=3).to_dict(), "sliding_window": 16})
    assert [c.window(i) for i in range(3)] == [16, 16, 16]
