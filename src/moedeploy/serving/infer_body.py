"""Checks of a KServe inference request (`POST /v2/models/<name>/infer`) that the HTTP front
makes before Triton reads it.

Why: Triton 2.51's JSON parser allocates each input by the shape the request declares before it
counts the values sent, so a 300-byte body declaring shape [1, 100000000, 64] made it allocate
25 GB and die (std::bad_alloc, the whole server gone), and smaller lies left it gigabytes larger.
What else its parser refuses (a body that is not JSON, no "inputs", a negative dimension, fewer
values than the shape holds) it answers HTTP 500, a server error, for the client's mistake. The
front answers those 400 itself, in one line naming the input. Values sent as binary data (the
`Inference-Header-Content-Length` extension) Triton checks against the shape itself, before it
allocates (400 "input byte size mismatch"); only the JSON header of such a body is read here.
"""

from __future__ import annotations

import math
import re
from typing import Any

from moedeploy.serving.generate_body import parse_json

#: the header of KServe's binary data extension: the JSON part's length, binary tensors after it
JSON_LENGTH_HEADER = "Inference-Header-Content-Length"


#: a JSON part up to this size is parsed whole and every input's values counted; past it parsing
#: would hold the GIL, and so the front's event loop and every stream it carries, for seconds
#: (a 57 MiB body: 4 s), so only the declared shapes are read and held to the body's size
PARSED_JSON_BYTES = 2 * 2**20
_SHAPE = re.compile(rb'"shape"\s*:\s*\[([^\]]*)\]')


def infer_body_problem(body: bytes | bytearray, json_length: str | None) -> str | None:
    """Why Triton must not read this inference request (one line), or None. `json_length`: the
    request's Inference-Header-Content-Length, the length of its JSON part (None: all JSON)."""
    if json_length is not None:
        text = json_length.strip()
        if not (text.isascii() and text.isdecimal()) or int(text) > len(body):
            return f"{JSON_LENGTH_HEADER} must be the length of the body's JSON part, at most {len(body)}"
        body = memoryview(body)[:int(text)]
    if len(body) > PARSED_JSON_BYTES:
        return _declared_size_problem(body)
    payload, problem = parse_json(bytes(body))
    if problem is not None:
        return problem
    if not isinstance(payload, dict):
        return 'the request body must be a JSON object with "inputs"'
    inputs = payload.get("inputs")
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, dict) for i in inputs):
        return '"inputs" must be a non-empty list of input objects ({"name", "shape", "datatype", "data"})'
    for index, tensor in enumerate(inputs):
        if (problem := _input_problem(tensor)) is not None:
            name = tensor.get("name")
            return f"inputs[{index}]{f' ({name})' if isinstance(name, str) else ''}: {problem}"
    return None


def _declared_size_problem(body: bytes | bytearray | memoryview) -> str | None:
    """A large body's declared shapes, found without parsing its values: each value takes at
    least one byte of JSON, so a shape holding more values than the body has bytes is a lie,
    and Triton would allocate what it declares. (Its other mistakes Triton itself answers.)"""
    for match in _SHAPE.finditer(body):
        dims = [d.strip() for d in bytes(match[1]).split(b",") if d.strip()]
        if not all(d.isdigit() for d in dims):
            return "a shape must be a list of non-negative integers"
        if (declared := math.prod(int(d) for d in dims)) > len(body):
            return (f"a shape declares {declared:,} values, more than the {len(body):,}-byte request can hold; send "
                    "as many values as the shape holds")
    return None


def _input_problem(tensor: dict) -> str | None:
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return "shape must be a list of non-negative integers"
    if "data" not in tensor:
        return None  # binary data or a shared-memory region: Triton checks its size before allocating
    declared, sent = math.prod(shape), count_values(tensor["data"])
    if declared != sent:
        return (f"shape {shape} holds {declared:,} values but data has {sent:,}; send as many values as the shape "
                "holds")
    return None


def count_values(data: Any) -> int:
    """The values in a (nested) JSON array, counted without recursion (the body's nesting is the
    client's to choose); a lone value is one."""
    count, pending = 0, [data]
    while pending:
        item = pending.pop()
        if isinstance(item, list):
            pending.extend(item)
        else:
            count += 1
    return count
