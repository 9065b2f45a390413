"""The checkpoint's tokenizer travels in the artifact (hashed like every file) and gives the
same ids, chat prompts and text as transformers' own tokenizer of the same folder."""

from __future__ import annotations

import json
import shutil

import pytest

from moedeploy.export.artifact import Artifact, ArtifactError, first_manifest_problem
from moedeploy.export.tokenizer_files import TokenizerFilesError, tokenizer_summary
from moedeploy.runtime.text import (
    REPLACEMENT,
    IncrementalDetokenizer,
    StopStrings,
    TextCodec,
    TextError,
)
from tests.text_helpers import CORPUS, SPECIALS, export_with_tokenizer, write_tokenizer

TEXTS = ["hello world", "café 🙂 naïve", "日本語のテキスト", "unseen wörds ∑ 😀!"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve 🙂?"},
            {"role": "assistant", "content": "Oui."}, {"role": "user", "content": "日本語?"}]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(checkpoint folder, artifact, special ids): a 2-layer Mixtral whose vocabulary covers the tokenizer."""
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("tokenizer")
    _, artifact = export_with_tokenizer(root, seed=1)
    tokenizer = Tokenizer.from_file(str(root / "checkpoint" / "tokenizer.json"))
    return root / "checkpoint", artifact, {token: tokenizer.token_to_id(token) for token in SPECIALS}


@pytest.fixture(scope="module")
def reference(exported):
    """transformers' tokenizer of the checkpoint folder: the independent reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(exported[0])


def test_export_copies_and_hashes_the_tokenizer_and_records_the_eos_ids(exported) -> None:
    checkpoint, artifact, ids = exported
    section = artifact.manifest["tokenizer"]
    assert section == {"files": ["tokenizer.json", "tokenizer_config.json", "generation_config.json"],
                       "eos_token_ids": [ids["</s>"], ids["<|end|>"]], "chat_template": True, "stop_strings": []}
    for name in section["files"]:
        assert (artifact.path / "tokenizer" / name).read_bytes() == (checkpoint / name).read_bytes()
        assert f"tokenizer/{name}" in artifact.manifest["files"]
    Artifact.load(artifact.path, verify=True)


def test_a_modified_tokenizer_file_fails_verification(exported, tmp_path) -> None:
    copy = tmp_path / "artifact"
    shutil.copytree(exported[1].path, copy)
    with (copy / "tokenizer" / "tokenizer.json").open("a") as f:
        f.write(" ")
    with pytest.raises(ArtifactError, match=r"tokenizer/tokenizer\.json does not match its sha256"):
        Artifact.load(copy, verify=True)


def test_a_manifest_whose_tokenizer_section_is_wrong_is_refused(exported) -> None:
    manifest = json.loads((exported[1].path / "manifest.json").read_text())
    assert first_manifest_problem(manifest) is None
    bad = {**manifest, "tokenizer": {**manifest["tokenizer"], "eos_token_ids": ["</s>"]}}
    assert first_manifest_problem(bad) == "tokenizer.eos_token_ids is ['</s>'], not a list of token ids"
    unlisted = {**manifest, "files": {k: v for k, v in manifest["files"].items() if k != "tokenizer/tokenizer.json"}}
    assert first_manifest_problem(unlisted) == "files does not list tokenizer/tokenizer.json, so nothing checks it"


def test_ids_and_chat_prompts_are_transformers(exported, reference) -> None:
    codec = TextCodec.from_artifact(exported[1])
    for text in TEXTS + CORPUS[:4]:
        assert codec.encode(text) == reference(text)["input_ids"], text
        assert codec.decode(codec.encode(text)) == reference.decode(reference(text)["input_ids"], skip_special_tokens=True)
    for messages in (MESSAGES, MESSAGES[:2]):
        for add in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert codec.render_chat(messages, add_generation_prompt=add) == expected
            expected_ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=add)["input_ids"]
            assert codec.chat_ids(messages, add_generation_prompt=add) == expected_ids
    assert codec.render_chat(MESSAGES[:2]).endswith("<|assistant|>")


def test_chat_template_file_of_transformers_5_is_read(tmp_path) -> None:
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, template_file=True)
    codec = TextCodec(tmp_path)
    assert codec.render_chat(MESSAGES) == AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


def test_streamed_pieces_never_split_a_character(exported) -> None:
    codec = TextCodec.from_artifact(exported[1])
    text = "café 🙂 日本語 naïve 😀"
    ids = codec.encode(text, add_special_tokens=False)
    # the test means something only if some characters really span several tokens
    assert any(REPLACEMENT in codec.decode([i]) for i in ids)
    stream = IncrementalDetokenizer(codec)
    pieces = [stream.push(i) for i in ids]
    assert "" in pieces  # held back while a character was incomplete
    assert not any(REPLACEMENT in p for p in pieces)
    assert "".join(pieces) + stream.flush() == text == codec.decode(ids)


def test_what_text_cannot_do_is_said_in_one_line(exported, store, tmp_path) -> None:
    preset = store.decoder("fp32")  # random weights, no checkpoint: no tokenizer
    assert "tokenizer" not in preset.manifest
    with pytest.raises(TextError, match=r"has no tokenizer: export it from a checkpoint folder that holds tokenizer\.json"):
        TextCodec.from_artifact(preset)
    codec = TextCodec.from_artifact(exported[1])
    with pytest.raises(TextError, match=r"messages\[1\].content is not a string"):
        codec.render_chat([{"role": "user", "content": "hi"}, {"role": "user", "content": ["a", "b"]}])
    with pytest.raises(TextError, match="messages must be a non-empty list"):
        codec.render_chat([])
    (tmp_path / "tok").mkdir()
    shutil.copy(exported[1].path / "tokenizer" / "tokenizer.json", tmp_path / "tok")
    with pytest.raises(TextError, match="has no chat template: send a plain prompt"):
        TextCodec(tmp_path / "tok").render_chat(MESSAGES)


def test_stop_strings_come_from_generation_config(tmp_path) -> None:
    write_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "stop_strings": "###"}))
    assert tokenizer_summary(tmp_path)["stop_strings"] == ["###"]
    (tmp_path / "generation_config.json").write_text(json.dumps({"stop_strings": ["a", 3]}))
    with pytest.raises(TokenizerFilesError, match=r"stop_strings \['a', 3\] is not a string or a list of them"):
        tokenizer_summary(tmp_path)


@pytest.mark.parametrize("stops", [["\n\n"], ["User:", "<|"], ["ab", "b"], ["xyz"]])
def test_stop_strings_end_the_text_before_the_first_one_and_never_send_part_of_one(stops) -> None:
    """Every way of cutting the text into pieces: what is sent joins to the text up to the earliest
    stop string (str.find on the whole text), and what has been sent is always a prefix of that."""
    text = "Hi there.\n\nUser: ab<|x"
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[:min(hits)] if hits else text
    for cut in range(1, 6):
        pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
        matcher, sent = StopStrings(stops), ""
        for piece in pieces:
            sent += matcher.push(piece)
            assert expected.startswith(sent), (cut, sent)
        sent += matcher.flush()
        assert sent == expected and matcher.stopped == bool(hits), (cut, sent)
