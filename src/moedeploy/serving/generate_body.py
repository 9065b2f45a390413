"""Checks of a Triton generate-extension request (`POST /v2/models/<name>/generate[_stream]`)
that the HTTP front makes before Triton reads it, and the status its error answers get.

Why: Triton's generate extension parses the JSON body itself and answers what its parser
refuses (a body that is not a JSON object, a string where a number goes, a float in
`input_ids`, an integer past int64, a lone surrogate) with HTTP 500, a server error, for what
is the client's mistake. And a decoupled model's refusal comes back as HTTP 400 whatever its
code, so "busy, retry later" would read as "your request is wrong". The front answers the
first kind 400 itself, with one line naming the input, and gives the second its 503.
"""

from __future__ import annotations

import json
import math
from typing import Any

from moedeploy.serving.json_text import parse_json, shown
from moedeploy.serving.specs import GENERATE_OPTIONS, STREAM_OPTIONS, STREAM_SUFFIX

#: how every message of moedeploy's Unavailable errors starts (serving.batching, serving.inflight)
UNAVAILABLE_PREFIXES = ("the server is busy", "the server is shutting down")
#: request parameters only the server sets (a client's would steer cancellation or refusals)
RESERVED_PARAMETER_PREFIX = "moedeploy"
INT64 = (-(2**63), 2**63 - 1)
FLOAT32_MAX = 3.4e38  # float32's largest finite value, near enough: the options' dtype
#: body bytes a generate request may take per position of its prompt (generate_body_limit)
BYTES_PER_POSITION = 64
#: inputs holding one value, which Triton also takes as a one-element array
SCALARS = {"text_input", *GENERATE_OPTIONS, *STREAM_OPTIONS}
_INTEGERS = {name for name, dtype in (GENERATE_OPTIONS | STREAM_OPTIONS).items() if dtype == "int64"}
_FLOATS = {name for name, dtype in (GENERATE_OPTIONS | STREAM_OPTIONS).items() if dtype == "float32"}


def checked_generate_body(body: bytes, model: str, endpoint: str, parameter: tuple[str, str]) -> tuple[bytes, str | None]:
    """(the body with `parameter` (name, value) set in its "parameters", None), or (body, why it
    is refused: one line) when Triton's parser would answer it 500 or it asks for the wrong
    endpoint. The body is parsed once: a large one holds the GIL while it is."""
    if endpoint == "generate" and model.endswith(STREAM_SUFFIX):
        return body, (f"{model} sends a response per token: POST to /v2/models/{model}/generate_stream, or to "
                      f"/v2/models/{model.removesuffix(STREAM_SUFFIX)}_generate/generate for one answer")
    payload, problem = parse_json(body)
    if problem is not None:
        return body, problem
    if not isinstance(payload, dict):
        return body, "the request body must be a JSON object of input names to values"
    parameters = payload.get("parameters", {})
    if not isinstance(parameters, dict):
        return body, '"parameters" must be a JSON object'
    if reserved := [k for k in parameters if str(k).lower().startswith(RESERVED_PARAMETER_PREFIX)]:
        return body, f"the parameter {reserved[0]!r} is the server's own; leave it out"
    for name, value in payload.items():
        if (problem := _value_problem(name, value)) is not None:
            return body, problem
    payload["parameters"] = {**parameters, parameter[0]: parameter[1]}
    return json.dumps(payload).encode(), None


def generate_body_limit(max_positions: int, batch: int) -> int:
    """The most bytes a generate request's body needs: `batch` prompts of `max_positions` tokens,
    as ids (at most 21 characters each) or as text (64 bytes a token: far more than a token's
    characters, JSON-escaped), and 1 MiB for stop strings and options. A larger body cannot hold
    a prompt the model takes, so the front refuses it unread instead of parsing it for seconds."""
    return batch * max_positions * BYTES_PER_POSITION + 2**20


def _value_problem(name: str, value: Any) -> str | None:
    if name in SCALARS and isinstance(value, list) and len(value) == 1:
        value = value[0]  # Triton takes a one-element array for a one-value input
    if name in ("text_input", "stop"):
        strings = value if name == "stop" and isinstance(value, list) else [value]
        if not all(isinstance(s, str) for s in strings):
            return f"{name} must be {'a string or a list of strings' if name == 'stop' else 'a string'}"
        return next((f"{name} holds a lone surrogate, which is not valid Unicode text" for s in strings
                     if not _is_utf8(s)), None)
    if name == "input_ids":
        return _ids_problem(value)
    if name in _INTEGERS and not _is_int64(value):
        return f"{name} must be an integer in int64's range, got {shown(value)}"
    if name in _FLOATS and (not isinstance(value, (int, float)) or isinstance(value, bool)
                            or not math.isfinite(value) or abs(value) > FLOAT32_MAX):
        return f"{name} must be a number within float32's range, got {shown(value)}"
    return None


def _ids_problem(value: Any) -> str | None:
    if not isinstance(value, list):
        return "input_ids must be a list of token ids"
    if any(isinstance(v, list) for v in value):
        return "input_ids must be a flat list of token ids: the generate endpoint takes one sequence"
    bad = [v for v in value if not _is_int64(v)]
    return f"input_ids must hold integer token ids, got {shown(bad[0])}" if bad else None


def _is_int64(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and INT64[0] <= value <= INT64[1]


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def error_message(body: bytes) -> str:
    """The one-line reason in an error answer of Triton's: {"error": ...}, as JSON or as a
    server-sent event (`data: {...}`), else the text itself."""
    text = body.decode("utf-8", "replace").strip()
    for candidate in (text, *(line[len("data:"):] for line in text.splitlines() if line.startswith("data:"))):
        try:
            payload = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(payload, dict) and "error" in payload:
            return (str(payload["error"]).strip().splitlines() or [""])[0]
    return (text.splitlines() or [""])[0]


def error_status(status: int, message: str) -> int:
    """503 for moedeploy's Unavailable refusals (busy, shutting down), else Triton's status."""
    return 503 if message.startswith(UNAVAILABLE_PREFIXES) else status
