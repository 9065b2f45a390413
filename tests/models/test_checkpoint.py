"""Checkpoints: Hugging Face Mixtral folders (per-expert, fused, sharded) against transformers' logits;
our own save/load round trip; every kind of bad folder gives a CheckpointError that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moedeploy.models import CheckpointError, MoEDecoder, load_decoder, preset

from .helpers import randomize_, tiny_mixtral

# Several tiny shapes: odd vocab and intermediate sizes, GQA, MQA and MHA, top-1 and top-k = E,
# explicit head_dim (also where heads * head_dim != hidden), tied embeddings, rope theta, and
# hidden == intermediate / hidden == 2 * intermediate (where a layout guessed from shapes errs).
_FIELDS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "num_local_experts", "num_experts_per_tok", "intermediate_size", "num_hidden_layers",
    "rope_theta",
)  # fmt: skip
CONFIGS = {
    name: {**dict(zip(_FIELDS, values, strict=True)), **extra}
    for name, values, extra in [
        ("gqa", (64, 32, 4, 2, 4, 2, 48, 2, 1e4), {}),
        ("mqa-top1-tied", (50, 24, 3, 1, 3, 1, 40, 1, 1e6), {"tie_word_embeddings": True}),
        (
            "mha-topE-headdim",
            (97, 40, 4, 4, 5, 5, 16, 3, 500.0),
            {"head_dim": 6, "rms_norm_eps": 1e-6},
        ),
        (
            "wide-head-tied",
            (33, 16, 2, 1, 2, 2, 33, 2, 1e5),
            {"head_dim": 12, "tie_word_embeddings": True},
        ),
        ("six-experts", (61, 48, 6, 3, 6, 3, 20, 1, 2e4), {}),
        ("square", (40, 24, 2, 2, 3, 2, 24, 1, 1e4), {}),
        ("hidden-2x-inter", (40, 32, 4, 1, 4, 2, 16, 1, 1e4), {}),
    ]
}


def _ids(vocab: int, shape: tuple[int, int] = (2, 11)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))


def _assert_matches_hf(ours: MoEDecoder, hf, vocab: int) -> None:
    ids = _ids(vocab)
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert expected.std() > 0.3  # O(1) logits, so 1e-4 is a real bound
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def _assert_eval(model: torch.nn.Module) -> None:
    assert not model.training
    assert not any(m.training for m in model.modules())


def _keys(folder: Path) -> set[str]:
    keys: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys |= set(f.keys())
    return keys


def _write_fused(hf, folder: Path) -> None:
    """transformers 5's in-memory layout: experts fused as gate_up_proj / down_proj."""
    state = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # aliased; transformers' own save drops it too
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    hf.config.save_pretrained(folder)


# ---------------------------------------------------------------- Hugging Face layouts


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_per_expert_checkpoint_matches_transformers(name: str, tmp_path: Path) -> None:
    hf = tiny_mixtral(seed=len(name), **CONFIGS[name])
    hf.save_pretrained(tmp_path)
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in _keys(
        tmp_path
    )  # per-expert on disk
    ours = MoEDecoder.from_pretrained(tmp_path)
    _assert_eval(ours)
    c, h = ours.config, hf.config
    assert (c.n_heads, c.n_kv_heads, c.n_experts, c.top_k, c.n_layers) == (
        h.num_attention_heads,
        h.num_key_value_heads,
        h.num_local_experts,
        h.num_experts_per_tok,
        h.num_hidden_layers,
    )
    assert c.tie_embeddings == h.tie_word_embeddings
    if c.tie_embeddings:
        assert ours.lm_head.weight is ours.embed.weight
    _assert_matches_hf(ours, hf, h.vocab_size)


@pytest.mark.parametrize(
    "name", ["gqa", "mqa-top1-tied", "mha-topE-headdim", "square", "hidden-2x-inter"]
)
def test_hf_fused_checkpoint_matches_transformers(name: str, tmp_path: Path) -> None:
    hf = tiny_mixtral(seed=3, **CONFIGS[name])
    _write_fused(hf, tmp_path / "ckpt")
    assert "model.layers.0.mlp.experts.gate_up_proj" in _keys(tmp_path / "ckpt")
    ours = MoEDecoder.from_pretrained(tmp_path / "ckpt")
    _assert_eval(ours)
    _assert_matches_hf(ours, hf, hf.config.vocab_size)


def test_hf_sharded_checkpoint_matches_transformers(tmp_path: Path) -> None:
    hf = tiny_mixtral(seed=4, **CONFIGS["gqa"])
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert not (tmp_path / "model.safetensors").exists()
    ours = MoEDecoder.from_pretrained(tmp_path)
    _assert_matches_hf(ours, hf, 64)


def test_a_tensor_in_two_indexed_shards_is_refused_naming_the_copy_the_index_does_not(tmp_path: Path) -> None:
    """The fix offered was to add the index the checkpoint already had."""
    hf = tiny_mixtral(seed=4, **CONFIGS["gqa"])
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.embed_tokens.weight"
    named, other = weight_map[key], next(f for f in sorted(set(weight_map.values())) if f != weight_map[key])
    tensors = load_file(str(tmp_path / other))
    save_file({**tensors, key: load_file(str(tmp_path / named))[key]}, str(tmp_path / other))
    first, second = sorted([named, other])
    assert _load_error(tmp_path) == (
        f"{tmp_path}: '{key}' is in both {first} and {second}, which model.safetensors.index.json both lists; it names {named} "
        f"for it: remove the copy in {other}")


def test_hf_bf16_checkpoint_stays_bf16(tmp_path: Path) -> None:
    hf = tiny_mixtral(seed=5, **CONFIGS["gqa"]).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    ours = load_decoder(tmp_path)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    inter = hf.config.intermediate_size
    experts = hf.model.layers[1].mlp.experts
    assert torch.equal(ours.layers[1].ffn.w_gate, experts.gate_up_proj[:, :inter])
    assert torch.equal(ours.layers[1].ffn.w_up, experts.gate_up_proj[:, inter:])
    assert torch.equal(ours.layers[1].ffn.w_down, experts.down_proj)
    assert torch.equal(ours.embed.weight, hf.model.embed_tokens.weight)
    as_fp32 = load_decoder(tmp_path, dtype=torch.float32)
    assert {p.dtype for p in as_fp32.parameters()} == {torch.float32}
    assert torch.equal(
        as_fp32.layers[0].attn.wq.weight, hf.model.layers[0].self_attn.q_proj.weight.float()
    )


# ---------------------------------------------------------------- our own format


@pytest.mark.parametrize("tied", [False, True])
def test_save_load_round_trip_is_exact(tied: bool, tmp_path: Path) -> None:
    config = preset("tiny")
    config.tie_embeddings = tied
    config.n_layers = 1
    torch.manual_seed(0)
    model = randomize_(MoEDecoder(config), seed=8).eval()
    model.save_pretrained(tmp_path / "ckpt")
    model.save_pretrained(tmp_path / "ckpt")  # overwriting an existing checkpoint works
    loaded = MoEDecoder.from_pretrained(tmp_path / "ckpt")
    _assert_eval(loaded)
    assert loaded.config == model.config
    assert (loaded.lm_head.weight is loaded.embed.weight) == tied
    ids = _ids(config.vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    assert list(tmp_path.iterdir()) == [tmp_path / "ckpt"]  # no temp folders left behind


def test_hf_to_ours_round_trip(tmp_path: Path) -> None:
    hf = tiny_mixtral(seed=6, **CONFIGS["mqa-top1-tied"])
    _write_fused(hf, tmp_path / "hf")
    MoEDecoder.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "ours")
    _assert_matches_hf(MoEDecoder.from_pretrained(tmp_path / "ours"), hf, 50)


# ---------------------------------------------------------------- bad folders


@pytest.fixture
def hf_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    tiny_mixtral(seed=0, **{**CONFIGS["gqa"], "num_hidden_layers": 1}).save_pretrained(folder)
    return folder


def _rewrite(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _load_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        MoEDecoder.from_pretrained(path)
    return str(info.value)


def test_error_nonexistent_path(tmp_path: Path) -> None:
    assert "does not exist" in _load_error(tmp_path / "nope")


def test_error_file_instead_of_folder(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert "not a folder" in _load_error(tmp_path / "model.safetensors")


def test_error_no_config(tmp_path: Path) -> None:
    assert "no config.json" in _load_error(tmp_path)


@pytest.mark.parametrize(
    ("text", "message"), [("{not json", "not readable JSON"), ("[1, 2]", "JSON object")]
)
def test_error_bad_json(text: str, message: str, hf_folder: Path) -> None:
    (hf_folder / "config.json").write_text(text)
    assert message in _load_error(hf_folder)


def test_error_wrong_model_type(hf_folder: Path) -> None:
    config = json.loads((hf_folder / "config.json").read_text())
    config["model_type"] = "llama"
    (hf_folder / "config.json").write_text(json.dumps(config))
    msg = _load_error(hf_folder)
    assert "'llama'" in msg and "not supported" in msg


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": None}, "invalid config"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
        ({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types='chunked_attention'"),
        ({"num_attention_heads": 4.0}, "num_attention_heads is 4.0, not an integer"),
        # was written into the artifact and refused only by its own manifest check, in its place
        ({"sliding_window": 5.0}, "sliding_window is 5.0, not an integer; fix it in config.json"),
        ({"num_attention_heads": True}, "num_attention_heads is True, not an integer"),
        ({"hidden_size": "32"}, "hidden_size is '32', not an integer"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps is -1.0, not a finite number >= 0"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps is 'x'"),
        ({"routed_scaling_factor": 0}, "routed_scaling_factor is 0, which weighs every expert by 0; fix it in config.json"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -5.0}}, "rope_theta is -5.0, not a finite number > 0"),
        # named as config.json names them, not as moedeploy's DecoderConfig does (n_heads, top_k ...)
        ({"num_attention_heads": 0}, "num_attention_heads is 0, not an integer >= 1"),  # was a ZeroDivisionError
        ({"num_attention_heads": 6, "num_key_value_heads": 4, "head_dim": 8},
         "num_attention_heads 6 must be a multiple of num_key_value_heads 4"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 must lie in [1, num_local_experts=4]"),
        ({"num_hidden_layers": 0}, "num_hidden_layers is 0, not an integer >= 1"),
        ({"num_local_experts": 0}, "num_local_experts must be >= 1, got 0"),
    ],
)
def test_error_unsupported_hf_config(change: dict, message: str, hf_folder: Path) -> None:
    config = json.loads((hf_folder / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    (hf_folder / "config.json").write_text(json.dumps(config))
    assert message in _load_error(hf_folder)


def test_a_null_expert_count_is_named_not_a_python_type_error(hf_folder: Path) -> None:
    """"num_local_experts": null read as "'<' not supported between instances of 'NoneType' and 'int'"."""
    config = json.loads((hf_folder / "config.json").read_text())
    config["num_local_experts"] = None
    config["head_dim"] = None  # a field a config may leave null is not blamed
    (hf_folder / "config.json").write_text(json.dumps(config))
    message = _load_error(hf_folder)
    assert "num_local_experts is null where a number is needed; give it a value" in message
    assert "NoneType" not in message and "head_dim" not in message


def test_error_zero_heads_is_a_checkpoint_error(hf_folder: Path) -> None:
    config = json.loads((hf_folder / "config.json").read_text())
    config["num_attention_heads"] = 0
    (hf_folder / "config.json").write_text(json.dumps(config))
    assert "num_attention_heads is 0, not an integer >= 1; fix it in config.json" in _load_error(hf_folder)


def test_error_only_pickle_weights(hf_folder: Path) -> None:
    (hf_folder / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, hf_folder / "pytorch_model.bin")
    msg = _load_error(hf_folder)
    assert "pytorch_model.bin" in msg and "safetensors" in msg


def test_error_no_weights(hf_folder: Path) -> None:
    (hf_folder / "model.safetensors").unlink()
    assert "no *.safetensors" in _load_error(hf_folder)


@pytest.mark.parametrize(("dtype", "stored"), [(torch.int32, "I32"), (torch.bool, "BOOL"), (torch.complex64, "C64"),
                                               (torch.float8_e4m3fn, "F8_E4M3")])
def test_a_weight_stored_in_a_dtype_that_is_not_a_float_one_is_refused_by_its_name(dtype, stored, hf_folder: Path) -> None:
    """An int32 or bool weight was cast to float in silence (as transformers casts it), a complex
    one lost its imaginary part with only torch's warning, and an fp8 one ended in "internal
    error" inside torch.stack."""
    key = "model.layers.0.block_sparse_moe.experts.1.w3.weight"
    _rewrite(hf_folder, lambda t: t.update({key: t[key].to(dtype)}))
    assert _load_error(hf_folder) == (
        f"{hf_folder}: {key} in model.safetensors is stored as {stored}; weights are read as F32, F16, BF16 or F64: "
        "re-download that file if it is damaged, or convert the checkpoint to one of those dtypes")


def test_a_weight_a_family_derives_is_held_to_its_sources_dtypes(tmp_path: Path) -> None:
    """gpt-oss's fused experts reach our weights through its family's derivation, which the
    dtype check passed over: int32 ended in load_state_dict's RuntimeError, fp8 loaded silently."""

    from tests.families.cases import cases, make_model, save_checkpoint

    folder = save_checkpoint(make_model(cases(n_layers=2)["gpt_oss"]), tmp_path / "gpt_oss")
    key = "model.layers.0.mlp.experts.gate_up_proj"
    shard = next(f for f in sorted(folder.glob("*.safetensors")) if key in load_file(str(f)))
    tensors = load_file(str(shard))
    save_file({**tensors, key: tensors[key].to(torch.float8_e4m3fn)}, str(shard))
    assert _load_error(folder) == (
        f"{folder}: {key} in {shard.name} is stored as F8_E4M3; weights are read as F32, F16, BF16 or F64: "
        "re-download that file if it is damaged, or convert the checkpoint to one of those dtypes")


def test_a_field_is_named_as_the_checkpoints_own_config_json_names_it(hf_folder: Path, tmp_path: Path) -> None:
    """What compare says of an edited config.json: Hugging Face's names in a family's file,
    DecoderConfig's in moedeploy's own format, whose file holds those."""
    from moedeploy.models.checkpoint import config_json_name

    hf = json.loads((hf_folder / "config.json").read_text())
    assert "rms_norm_eps" in hf and "num_local_experts" in hf
    assert config_json_name(hf_folder, "norm_eps", "mixtral") == "rms_norm_eps"
    assert config_json_name(hf_folder, "n_experts", "mixtral") == "num_local_experts"
    assert config_json_name(hf_folder, "n_experts", "qwen3_moe") == "num_experts"
    assert config_json_name(hf_folder, "rope_theta", "mixtral") == "rope_theta"
    MoEDecoder(preset("tiny")).save_pretrained(tmp_path / "own")
    own = json.loads((tmp_path / "own" / "config.json").read_text())
    assert "norm_eps" in own["config"] and "n_layers" in own["config"]
    assert config_json_name(tmp_path / "own", "norm_eps", "mixtral") == "norm_eps"
    assert config_json_name(tmp_path / "own", "n_layers", "mixtral") == "n_layers"


def test_weights_in_any_float_dtype_are_read_as_the_checkpoints_values(hf_folder: Path) -> None:
    key = "model.layers.0.block_sparse_moe.experts.1.w3.weight"
    original = load_file(str(hf_folder / "model.safetensors"))[key]
    _rewrite(hf_folder, lambda t: t.update({key: t[key].double()}))
    model = MoEDecoder.from_pretrained(hf_folder)
    torch.testing.assert_close(model.state_dict()["layers.0.ffn.w_up"][1].double(), original.double(), rtol=0, atol=0)


@pytest.mark.parametrize("expert", [0, 1])
def test_one_expert_of_another_shape_is_named_with_its_file(expert: int, hf_folder: Path) -> None:
    """Was "layer 0 w_up: the experts' weights differ in shape", in moedeploy's names only. The
    odd one is the one whose shape config.json does not imply, whichever expert it is."""
    key = f"model.layers.0.block_sparse_moe.experts.{expert}.w3.weight"
    shape = tuple(load_file(str(hf_folder / "model.safetensors"))[key].shape)
    _rewrite(hf_folder, lambda t: t.update({key: t[key].T.contiguous()}))
    assert _load_error(hf_folder) == (
        f"{hf_folder}: {key} in model.safetensors has shape {shape[::-1]}, the layer's other experts {shape}; "
        "re-download that file if it is damaged, or fix the weights")


def test_error_missing_tensor(hf_folder: Path) -> None:
    _rewrite(hf_folder, lambda t: t.pop("model.layers.0.self_attn.q_proj.weight"))
    msg = _load_error(hf_folder)
    assert "missing tensors" in msg and "layers.0.attn.wq.weight" in msg


def test_error_wrong_shape(hf_folder: Path) -> None:
    def edit(t: dict) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)

    _rewrite(hf_folder, edit)
    msg = _load_error(hf_folder)
    assert (
        "shape mismatch" in msg and "layers.0.attn.wk.weight (8, 32)" in msg and "(16, 32)" in msg
    )
    # and by the checkpoint's own name, which the user knows
    assert "(expected (16, 32); stored as model.layers.0.self_attn.k_proj.weight, in model.safetensors)" in msg


def test_error_missing_expert(hf_folder: Path) -> None:
    _rewrite(hf_folder, lambda t: t.pop("model.layers.0.block_sparse_moe.experts.2.w3.weight"))
    msg = _load_error(hf_folder)
    assert "layer 0" in msg and "w_up" in msg and "(missing 2)" in msg
    assert str(hf_folder) in msg and "num_local_experts=" in msg  # names the folder and the config key


def test_error_expert_count_names_the_folder(hf_folder: Path) -> None:
    """config.json says more experts than the weights hold: the message names the folder."""
    config = json.loads((hf_folder / "config.json").read_text())
    config["num_local_experts"] += 1
    (hf_folder / "config.json").write_text(json.dumps(config))
    msg = _load_error(hf_folder)
    assert msg.startswith(f"{hf_folder}: ") and f"num_local_experts={config['num_local_experts']}" in msg


def test_error_extra_expert(hf_folder: Path) -> None:
    def edit(t: dict) -> None:
        t["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = torch.zeros(48, 32)

    _rewrite(hf_folder, edit)
    assert "num_local_experts=4, but the weights hold 5: 0, 1, 2, 3, 4" in _load_error(hf_folder)


def test_error_unknown_tensor(hf_folder: Path) -> None:
    def edit(t: dict) -> None:
        t["model.layers.0.mystery.weight"] = torch.zeros(2)

    _rewrite(hf_folder, edit)
    assert "unexpected tensors" in _load_error(hf_folder)


def test_unknown_tensors_in_a_stray_file_name_the_file(hf_folder: Path) -> None:
    """A second weight file with other names (an adapter, a consolidated copy): the error says which file."""
    save_file({"layers.0.attention.wq.weight": torch.zeros(2)}, str(hf_folder / "consolidated.safetensors"))
    msg = _load_error(hf_folder)
    assert "unexpected tensors" in msg and "(in consolidated.safetensors)" in msg and "wq.weight" in msg


def test_error_corrupt_safetensors(hf_folder: Path) -> None:
    (hf_folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    assert "not a readable safetensors file" in _load_error(hf_folder)


def test_error_missing_shard(tmp_path: Path) -> None:
    tiny_mixtral(seed=0, **CONFIGS["gqa"]).save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    msg = _load_error(tmp_path)
    assert "missing" in msg and shard.name in msg


def test_error_unknown_field_in_our_format(tmp_path: Path) -> None:
    MoEDecoder(preset("tiny")).save_pretrained(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["config"]["n_expert"] = 3
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    assert "n_expert" in _load_error(tmp_path / "ckpt")


def test_tied_checkpoint_with_stored_lm_head_loads(tmp_path: Path) -> None:
    hf = tiny_mixtral(seed=2, **CONFIGS["mqa-top1-tied"])
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    assert "lm_head.weight" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    hf.config.save_pretrained(tmp_path)
    _assert_matches_hf(MoEDecoder.from_pretrained(tmp_path), hf, 50)


def test_tied_checkpoint_with_a_different_stored_lm_head_is_refused(tmp_path: Path) -> None:
    """transformers keeps such a file's lm_head, against config.json: which one is meant is the user's call."""
    hf = tiny_mixtral(seed=2, **CONFIGS["mqa-top1-tied"])
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    state["lm_head.weight"][7, 3] += 1.0
    save_file(state, str(tmp_path / "model.safetensors"))
    hf.config.save_pretrained(tmp_path)
    msg = _load_error(tmp_path)
    assert "tie_word_embeddings" in msg and "lm_head.weight" in msg and "differs" in msg


def test_a_tensor_in_two_files_without_an_index_is_refused(hf_folder: Path) -> None:
    """A stray second file (an old shard) holding a tensor again: which copy is meant is unknown."""
    tensors = load_file(str(hf_folder / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    save_file({name: -tensors[name]}, str(hf_folder / "zz-old.safetensors"))
    msg = _load_error(hf_folder)
    assert name in msg and "model.safetensors" in msg and "zz-old.safetensors" in msg


def test_rope_scaling_beside_different_rope_parameters_is_refused(hf_folder: Path) -> None:
    config = json.loads((hf_folder / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "default"  # what transformers 5 writes
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (hf_folder / "config.json").write_text(json.dumps(config))
    assert "rope_parameters and the older rope_scaling" in _load_error(hf_folder)
    config["rope_scaling"] = config["rope_parameters"]  # the same: nothing to choose between
    (hf_folder / "config.json").write_text(json.dumps(config))
    MoEDecoder.from_pretrained(hf_folder)


@pytest.mark.parametrize("where", ["rope_parameters", "top level"])
def test_partial_rotary_factor_is_ignored_where_transformers_ignores_it(where: str, tmp_path: Path) -> None:
    """Mixtral's rotary embedding rotates the whole head whatever partial_rotary_factor says: so does ours."""
    hf = tiny_mixtral(seed=4, **CONFIGS["gqa"])
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    if where == "top level":
        config["partial_rotary_factor"] = 0.5
    else:
        config["rope_parameters"]["partial_rotary_factor"] = 0.5
    (tmp_path / "config.json").write_text(json.dumps(config))
    import transformers

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    _assert_matches_hf(MoEDecoder.from_pretrained(tmp_path), reloaded, CONFIGS["gqa"]["vocab_size"])


def test_rope_theta_defaults_to_each_familys_transformers_default() -> None:
    """A config.json with no rope_theta anywhere: each family's default as transformers 5 has it."""
    import transformers

    from moedeploy.models.families import FAMILIES
    from moedeploy.models.families.base import rope

    for model_type in FAMILIES:
        expected = transformers.AutoConfig.for_model(model_type).__class__.default_theta
        assert rope({"model_type": model_type})[0] == expected, model_type


@pytest.mark.parametrize("name", ["gqa", "square"])
def test_hf_fused_transposed_layout_is_rejected(name: str, tmp_path: Path) -> None:
    # Expert matrices stored (E, in, out) instead of transformers' (E, out, in): shapes cannot
    # always tell the two apart (H == 2I), so the loader must refuse, never load them silently wrong.
    hf = tiny_mixtral(seed=7, **CONFIGS[name])
    state = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        state[key] = state[key].transpose(1, 2).contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    hf.config.save_pretrained(tmp_path)
    msg = _load_error(tmp_path)
    assert "gate_up_proj" in msg or "shape mismatch" in msg


def test_a_nan_in_a_fused_expert_stack_is_named_as_the_checkpoint_stores_it(tmp_path: Path) -> None:
    """Our w_up is rows I..2I-1 of every expert of transformers 5's fused gate_up_proj: a NaN in
    expert 1's up half is named by the checkpoint's tensor, the expert and those rows."""
    from moedeploy.models.checkpoint import CheckpointWeights
    from moedeploy.models.weights import fingerprint, finite_check

    hf = tiny_mixtral(seed=3, **CONFIGS["gqa"])
    inter = hf.config.intermediate_size
    with torch.no_grad():
        hf.model.layers[1].mlp.experts.gate_up_proj[1, inter + 3, 2] = float("nan")
    _write_fused(hf, tmp_path / "ckpt")
    weights = CheckpointWeights(tmp_path / "ckpt")
    with pytest.raises(ValueError) as refused:
        fingerprint(weights, inspect=finite_check(weights))
    assert str(refused.value).startswith(
        f"weight layers.1.ffn.w_up (stored as model.layers.1.mlp.experts.gate_up_proj, expert 1, rows {inter} to "
        f"{2 * inter - 1} of each expert, in model.safetensors) holds 1 NaN and 0 infinite values")
