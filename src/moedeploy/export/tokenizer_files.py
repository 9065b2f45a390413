"""The checkpoint's tokenizer, carried into the artifact so text in and text out need nothing else.

A Hugging Face folder keeps its tokenizer beside the weights: `tokenizer.json` (the
`tokenizers` model, normaliser, pre-tokeniser, post-processor and decoder),
`tokenizer_config.json` (special tokens, and the chat template in older saves),
`chat_template.jinja` (the chat template as transformers 5 saves it), `special_tokens_map.json`
and `generation_config.json` (EOS ids, sampling defaults). Export copies whichever of these
exist into `<artifact>/tokenizer/`, each hashed in the manifest's `files` like every other
file, and records in `manifest["tokenizer"]` what a server needs without opening them: the
EOS ids (generation_config's, else config's, else the tokenizer's eos_token), the stop strings
(generation_config's `stop_strings`) and whether there is a chat template.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from moedeploy.utils.io import read_json_object

TOKENIZER_DIR = "tokenizer"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"
#: what is copied when present; tokenizer.json is what makes a folder have a tokenizer at all
FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, CHAT_TEMPLATE, "special_tokens_map.json", GENERATION_CONFIG)


class TokenizerFilesError(ValueError):
    """The checkpoint's tokenizer files cannot be read as a tokenizer."""


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, TokenizerFilesError)


def _ids(value: Any) -> list[int]:
    """An eos_token_id as configs write it: one id, a list of ids, or null."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TokenizerFilesError(f"eos_token_id {value!r} is not a token id or a list of them")
    return list(dict.fromkeys(values))


def _token_text(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def tokenizer_summary(folder: Path) -> dict[str, Any] | None:
    """What the manifest records of the tokenizer in `folder` (a checkpoint, or an artifact's
    tokenizer/), or None when it has no tokenizer.json. Reads the small JSON files only."""
    folder = Path(folder)
    if not (folder / TOKENIZER_JSON).is_file():
        return None
    vocab = _read_json(folder / TOKENIZER_JSON).get("added_tokens", [])
    added = {t["content"]: t["id"] for t in vocab if isinstance(t, dict) and isinstance(t.get("id"), int)}
    config = _read_json(folder / TOKENIZER_CONFIG) if (folder / TOKENIZER_CONFIG).is_file() else {}
    generation = _read_json(folder / GENERATION_CONFIG) if (folder / GENERATION_CONFIG).is_file() else {}
    model_config = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    eos = _ids(generation.get("eos_token_id")) or _ids(model_config.get("eos_token_id"))
    eos_text = _token_text(config.get("eos_token"))
    if not eos and eos_text in added:
        eos = [added[eos_text]]
    template = (folder / CHAT_TEMPLATE).is_file() or isinstance(config.get("chat_template"), (str, list))
    stops = generation.get("stop_strings") or []
    stops = [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise TokenizerFilesError(f"{folder / GENERATION_CONFIG}: stop_strings {stops!r} is not a string or a list of them")
    return {"files": [f for f in FILES if (folder / f).is_file()], "eos_token_ids": eos, "chat_template": template,
            "stop_strings": stops}


def copy_tokenizer(checkpoint: Path, artifact_folder: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """Copy the checkpoint's tokenizer files into `artifact_folder`/tokenizer/.

    Returns the manifest's tokenizer section (None without a tokenizer) and the files written,
    relative to the artifact folder, for the manifest's hashes. The config's EOS ids are read
    from the checkpoint, so the summary is made there, before the copy.
    """
    summary = tokenizer_summary(checkpoint)
    if summary is None:
        return None, []
    target = artifact_folder / TOKENIZER_DIR
    target.mkdir()
    for name in summary["files"]:
        shutil.copyfile(checkpoint / name, target / name)
    return summary, [f"{TOKENIZER_DIR}/{name}" for name in summary["files"]]


def tokenizer_problems(section: Any, files: Any) -> list[str]:
    """How a manifest's tokenizer section breaks the schema, [] when it is valid or absent."""
    if section is None:
        return []
    if not isinstance(section, dict):
        return ["tokenizer is not an object"]
    problems = []
    listed = section.get("files")
    if not isinstance(listed, list) or TOKENIZER_JSON not in listed or not all(n in FILES for n in listed):
        problems.append(f"tokenizer.files is {listed!r}, not a list of {', '.join(FILES)} with {TOKENIZER_JSON}")
    elif isinstance(files, dict):
        problems += [f"files does not list {TOKENIZER_DIR}/{n}, so nothing checks it"
                     for n in listed if f"{TOKENIZER_DIR}/{n}" not in files]
    eos = section.get("eos_token_ids")
    if not isinstance(eos, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos):
        problems.append(f"tokenizer.eos_token_ids is {eos!r}, not a list of token ids")
    if not isinstance(section.get("chat_template"), bool):
        problems.append("tokenizer.chat_template is not true or false")
    stops = section.get("stop_strings", [])
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        problems.append(f"tokenizer.stop_strings is {stops!r}, not a list of strings")
    return problems
