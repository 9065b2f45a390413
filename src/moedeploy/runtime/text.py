"""Text in and text out with the artifact's own tokenizer (export/tokenizer_files.py).

`TextCodec` encodes prompts with the `tokenizers` library from the artifact's tokenizer.json
and renders chat messages with its chat template the way transformers' `apply_chat_template`
does (jinja2's immutable sandbox, trim_blocks and lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII, and the special tokens as
variables), so a server's prompt ids are transformers' for the same messages.
`IncrementalDetokenizer` turns generated ids into text pieces as they come, holding back a
piece while it ends in an incomplete UTF-8 sequence (byte-level BPE splits a multi-byte
character over several tokens), so a stream never shows a broken character.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from moedeploy.export.artifact import Artifact
from moedeploy.export.tokenizer_files import (
    CHAT_TEMPLATE,
    TOKENIZER_CONFIG,
    TOKENIZER_DIR,
    TOKENIZER_JSON,
)

#: what a decode of an incomplete UTF-8 sequence ends in
REPLACEMENT = "\ufffd"
#: the special tokens transformers passes to a chat template by name
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

Message = dict[str, Any]


#: a prompt longer than this many characters per allowed token is first encoded in part (TextCodec.encode)
PREFIX_CHARS_PER_TOKEN = 8
#: how many more tokens than allowed the part must hold to refuse the prompt: a word cut at the
#: part's end can take a few more tokens than the whole word does
PREFIX_SLACK_TOKENS = 16


class TextError(ValueError):
    """Text cannot be handled: the artifact has no tokenizer or chat template, or a message is malformed."""


def check_unicode(text: str, what: str) -> None:
    """Refuse a string that UTF-8 cannot hold (a lone surrogate such as "\\ud800", which JSON can
    carry): the tokenizer and Triton's transport would fail on it later, as a server error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TextError(f"{what} holds {text[e.start]!r} at character {e.start}, a lone surrogate that is not "
                        "valid Unicode text; send well-formed text") from None


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


class TextCodec:
    """The artifact's tokenizer: ids from text, text from ids, and its chat template."""

    def __init__(self, folder: Path, eos_token_ids: Sequence[int] = (), stop_strings: Sequence[str] = ()) -> None:
        from tokenizers import Tokenizer

        self.folder = folder
        self.tokenizer = Tokenizer.from_file(str(folder / TOKENIZER_JSON))
        config_path = folder / TOKENIZER_CONFIG
        self.config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        self.eos_token_ids = list(eos_token_ids)
        self.stop_strings = list(stop_strings)

    @classmethod
    def from_artifact(cls, artifact: Artifact) -> TextCodec:
        section = artifact.manifest.get("tokenizer")
        if not section:
            raise TextError(f"{artifact.path} has no tokenizer: export it from a checkpoint folder that holds "
                            "tokenizer.json (and tokenizer_config.json for its special tokens and chat template)")
        return cls(artifact.path / TOKENIZER_DIR, section["eos_token_ids"], section.get("stop_strings", []))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Ids of `text`; with add_special_tokens, the tokenizer's post-processor adds its BOS
        and the like, as transformers' tokenizer(text) does.

        `max_tokens`: a text certainly longer is refused (TextError) after encoding only a part of
        it: its first PREFIX_CHARS_PER_TOKEN * max_tokens characters, then 4 times as many, and
        so on, so a megabyte prompt costs about what a prompt of the model's length does (a
        part's ids are the text's first ids, give or take its last word). Encoding goes through
        `encode_batch`, which lets other Python threads run (`encode` holds the GIL), so a server
        can encode on a worker thread without stalling."""
        if not isinstance(text, str):
            raise TextError(f"a prompt must be a string, not {type(text).__name__}")
        check_unicode(text, "the prompt")
        cut = PREFIX_CHARS_PER_TOKEN * max_tokens if max_tokens is not None else len(text)
        while cut < len(text):  # parts 4 times longer each time: at most a third more work than the whole
            head = len(self._encode(text[:cut], add_special_tokens))
            if head > max_tokens + PREFIX_SLACK_TOKENS:
                raise TextError(f"the prompt is longer than the model's {max_tokens} positions: its first {cut:,} "
                                f"characters alone are {head:,} tokens")
            cut *= 4
        return self._encode(text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def special_tokens(self) -> dict[str, str]:
        return {name: text for name in SPECIAL_TOKENS if (text := _token_text(self.config.get(name))) is not None}

    @cached_property
    def chat_template(self) -> str | None:
        """chat_template.jinja (transformers 5), else tokenizer_config.json's chat_template
        (a string, or a list of named templates of which "default" is the one used)."""
        if (self.folder / CHAT_TEMPLATE).is_file():
            return (self.folder / CHAT_TEMPLATE).read_text(encoding="utf-8")
        template = self.config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    @cached_property
    def _compiled_template(self):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if self.chat_template is None:
            raise TextError(f"the tokenizer in {self.folder} has no chat template: send a plain prompt "
                            "(completions) instead of chat messages")

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        def strftime_now(format: str) -> str:
            return datetime.datetime.now().strftime(format)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            return env.from_string(self.chat_template)
        except jinja2.exceptions.TemplateError as e:
            raise TextError(f"the chat template in {self.folder} does not compile: {e}") from None

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` (each {"role": str, "content": str}) as the template makes it."""
        import jinja2

        check_messages(messages)
        try:
            return self._compiled_template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                                  **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise TextError(f"the chat template refused these messages: {e}") from None

    def chat_ids(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                 max_tokens: int | None = None) -> list[int]:
        """Prompt ids of chat messages: the rendered template already holds its special tokens,
        so none are added (transformers' apply_chat_template(tokenize=True) does the same)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False,
                           max_tokens=max_tokens)


def check_messages(messages: Any) -> None:
    """Chat messages as the OpenAI API sends them: a non-empty list of {"role", "content"} with string values."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TextError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TextError(f"messages[{i}] is not an object with a string \"role\"")
        for calls in ("tool_calls", "function_call"):
            if message.get(calls):  # an empty list, as some clients send with every message, asks for none
                raise TextError(f"messages[{i}] holds {calls}: this server does not take tool calls")
        if not isinstance(message.get("content"), str):
            raise TextError(f"messages[{i}].content is not a string (only text content is supported)")
        check_unicode(message["role"], f"messages[{i}].role")
        check_unicode(message["content"], f"messages[{i}].content")


class IncrementalDetokenizer:
    """Generated ids in, text pieces out, never splitting a character.

    Each new piece is the decode of the ids since the last emitted piece's start, minus what
    was already emitted from them, released only when it does not end in an incomplete UTF-8
    sequence (decoded as U+FFFD). Decoding from a recent offset rather than from the first id
    keeps each step's work small and lets tokenizers that join words with spaces (SentencePiece,
    WordPiece) decide a piece's leading space from the token before it.
    """

    def __init__(self, codec: TextCodec, skip_special_tokens: bool = True) -> None:
        self.codec = codec
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # where the decoded window starts
        self._read = 0  # the ids before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """The text this token completes ('' while a character is still incomplete)."""
        self.ids.append(int(token_id))
        emitted = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) > len(emitted) and not text.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(emitted):]
        return ""

    def flush(self) -> str:
        """What is still held back at the end of a generation (an incomplete character stays U+FFFD)."""
        emitted = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(emitted):]


class StopStrings:
    """Text pieces in, the text to send out, ending at the first stop string (which is not sent).

    A piece that could be the start of a stop string is held back until the next pieces show
    whether it is one, so no client ever sees part of a stop string; `flush` releases what is
    held when generation ends for another reason. OpenAI's `stop` behaves the same way.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._matchers = [_PrefixMatcher(s) for s in self.stops]
        self.held = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        """What of `held + piece` can be sent now; after a stop string, nothing more.

        Each push costs the piece's length times the stop strings (plus finding them in the held
        text), whatever their length: the tail to hold is tracked as each stop string's longest
        prefix that the text ends with, a Knuth-Morris-Pratt automaton fed one character at a time."""
        if self.stopped:
            return ""
        text = self.held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[:min(hits)]
        # hold back the longest tail that is a proper prefix of some stop string
        keep = max((m.feed(piece) for m in self._matchers), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        held, self.held = ("" if self.stopped else self.held), ""
        return held


class _PrefixMatcher:
    """The length of the longest prefix of `stop` that the text fed so far ends with (Knuth-Morris-
    Pratt: `fail[k]` is the longest proper prefix of stop[:k + 1] that is also its suffix)."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k
        self.state = 0

    def feed(self, text: str) -> int:
        stop, fail, k = self.stop, self.fail, self.state
        for c in text:
            if k == len(stop):  # a whole match (StopStrings ends there); go on as from its longest border
                k = fail[k - 1]
            while k and stop[k] != c:
                k = fail[k - 1]
            if stop[k] == c:
                k += 1
        self.state = k
        return k
