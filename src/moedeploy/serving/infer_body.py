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
Its parser answered 500 too for JSON of the wrong type: a name, datatype or output name that is
not a string, a value that is not of the input's datatype ("a" or 6.5 for INT64, "hot" for
FP32, an INT64 past its range), a binary_data_output that is not true or false. Those are
checked here as well, in bodies whose JSON part is parsed (up to PARSED_JSON_BYTES). A larger
JSON part goes to Triton once its declared shapes fit its size; when Triton answers it 500, the
front has the whole body checked in a child process (whole_body_problem) and answers 400 with
the reason it finds.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moedeploy.serving.json_text import parse_json, shown

#: the header of KServe's binary data extension: the JSON part's length, binary tensors after it
JSON_LENGTH_HEADER = "Inference-Header-Content-Length"


#: a JSON part up to this size is parsed whole and every input's values counted; past it parsing
#: would hold the GIL, and so the front's event loop and every stream it carries, for seconds
#: (a 57 MiB body: 4 s), so only the declared shapes are read and held to the body's size
PARSED_JSON_BYTES = 2 * 2**20
_SHAPE = re.compile(rb'"shape"\s*:\s*\[([^\]]*)\]')


def infer_body_problem(body: bytes | bytearray, json_length: str | None, *, whole: bool = False) -> str | None:
    """Why Triton must not read this inference request (one line), or None. `json_length`: the
    request's Inference-Header-Content-Length, the length of its JSON part (None: all JSON).
    A JSON part over PARSED_JSON_BYTES has only its declared shapes checked, unless `whole`."""
    if (part := _json_part(body, json_length)) is None:
        return f"{JSON_LENGTH_HEADER} must be the length of the body's JSON part, at most {len(body)}"
    body = part
    if len(body) > PARSED_JSON_BYTES and ((problem := _declared_size_problem(body)) is not None or not whole):
        return problem
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
    outputs = payload.get("outputs", [])
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs):
        return '"outputs" must be a list of objects, each with a "name" string'
    for where, part, level in (("the request's", payload, "request"),
                               *((f"outputs[{i}]'s", o, "output") for i, o in enumerate(outputs)),
                               *((f"inputs[{i}]'s", t, "input") for i, t in enumerate(inputs))):
        if (problem := _parameters_problem(part.get("parameters", {}), level)) is not None:
            return f"{where} {problem}"
    return None


#: the range of each integer datatype's values
_INTEGER_RANGES = {f"{kind}INT{bits}": ((-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if kind == "" else (0, 2**bits - 1))
                   for kind in ("", "U") for bits in (8, 16, 32, 64)}
_FLOATS = {"FP16", "FP32", "FP64", "BF16"}
#: the parameters Triton's HTTP extensions (binary data, classification) read at each level, and
#: the JSON type each must have; any other parameter, or these at another level (a request's
#: own "classification", say), Triton hands the model as it is
_TYPED_PARAMETERS = {"request": {"binary_data_output": bool}, "input": {"binary_data_size": int},
                     "output": {"binary_data": bool, "classification": int}}


def _parameters_problem(parameters: Any, level: str) -> str | None:
    if not isinstance(parameters, dict):
        return '"parameters" must be a JSON object'
    for name, kind in _TYPED_PARAMETERS[level].items():
        if name not in parameters:
            continue
        value = parameters[name]
        if kind is bool and not isinstance(value, bool):
            return f'parameter "{name}" must be true or false, got {shown(value)}'
        if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            return f'parameter "{name}" must be a non-negative integer, got {shown(value)}'
    return None


def _json_part(body: bytes | bytearray, json_length: str | None) -> memoryview | None:
    """The body's JSON part: all of it, or the first `json_length` bytes; None when that header
    is not a length within the body."""
    if json_length is None:
        return memoryview(body)
    text = json_length.strip()
    if not (text.isascii() and text.isdecimal()) or int(text) > len(body):
        return None
    return memoryview(body)[:int(text)]


def checked_partly(body: bytes | bytearray, json_length: str | None) -> bool:
    """Whether infer_body_problem read only the declared shapes of this body's JSON part."""
    part = _json_part(body, json_length)
    return part is not None and len(part) > PARSED_JSON_BYTES


#: the child's program: the body on stdin, its problem (a JSON string, or null) on stdout
_CHILD = ("import json, sys; sys.path.append(sys.argv[1]); "
          "from moedeploy.serving.infer_body import infer_body_problem; "
          "print(json.dumps(infer_body_problem(sys.stdin.buffer.read(), sys.argv[2] or None, whole=True)))")
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


async def whole_body_problem(body: bytes | bytearray, json_length: str | None) -> str | None:
    """infer_body_problem(..., whole=True) of a large body, run in a child Python. Parsing 64 MiB
    of JSON takes seconds with the GIL held; in the front's process that would stall its event
    loop, and so every other request it carries. Raises RuntimeError if the child fails (out of
    memory, say): the caller then passes on Triton's own answer."""
    if not sys.executable:  # an embedding application's Python, with no interpreter to start
        raise RuntimeError("no Python interpreter to check the body in (sys.executable is empty)")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-c", _CHILD, _PACKAGE_ROOT, json_length or "",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await process.communicate(bytes(body))
    except BaseException:  # cancelled (the client went away): the child goes too
        if process.returncode is None:
            process.kill()
            await process.wait()
        raise
    if process.returncode != 0:
        lines = err.decode("utf-8", "replace").strip().splitlines()
        raise RuntimeError(f"the body check exited {process.returncode}: {lines[-1] if lines else 'no message'}")
    return json.loads(out)


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
    if not isinstance(tensor.get("name"), str):
        return '"name" must be a string'
    datatype = tensor.get("datatype")
    if not isinstance(datatype, str):
        return '"datatype" must be a string, such as "INT64" or "FP32"'
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return "shape must be a list of non-negative integers"
    if "data" not in tensor:
        return None  # binary data or a shared-memory region: Triton checks its size before allocating
    sent, wrong = count_values(tensor["data"], _all_valid(datatype))
    if wrong:
        return f"data holds {shown(wrong[0])}, which is not of datatype {datatype}; send {_what(datatype)}"
    declared = math.prod(shape)
    if declared != sent:
        return (f"shape {shape} holds {declared:,} values but data has {sent:,}; send as many values as the shape "
                "holds")
    return None


def _what(datatype: str) -> str:
    if datatype in _INTEGER_RANGES:
        low, high = _INTEGER_RANGES[datatype]
        return f"integers from {low} to {high}"
    return {"BOOL": "true or false", "BYTES": "strings"}.get(datatype, "numbers")


def count_values(data: Any, all_valid: Callable[[list], bool] | None = None) -> tuple[int, tuple]:
    """(the values in a (nested) JSON array, (the first value `all_valid` refuses,) or ()), walked
    without recursion (the body's nesting is the client's to choose); a lone value is one.
    `all_valid(values)` judges a whole list at once, at C speed (a 2 MiB body holds a million
    values; a child process checks 64 MiB ones). A refused list of lists (rows) is walked
    item by item, each row judged whole; a refused list of values is halved until the wrong one
    is alone: found in about twice the work of judging them once (10.5 million values: 1.2 s,
    against 9 s for a call per value)."""
    count, pending = 0, [data if isinstance(data, list) else [data]]
    while pending:
        items = pending.pop()
        if all_valid is None:
            nested = [item for item in items if isinstance(item, list)]
            count += len(items) - len(nested)
            pending.extend(reversed(nested))
        elif not items:
            continue
        elif all_valid(items):
            count += len(items)
        elif any(type(item) is list for item in items):  # rows: each judged whole in turn, values alone
            pending.extend(item if type(item) is list else [item] for item in reversed(items))
        elif len(items) > 1:
            half = len(items) // 2
            pending += [items[half:], items[:half]]  # the first half is judged first
        else:
            return count, (items[0],)
    return count, ()


def _all_valid(datatype: str) -> Callable[[list], bool] | None:
    """Whether every value of a list is one of `datatype`'s, by the set of their JSON types
    (type(), so a bool is no integer) and, for an integer datatype, their least and greatest;
    None for a datatype Triton itself judges."""
    if datatype in _INTEGER_RANGES:
        low, high = _INTEGER_RANGES[datatype]
        return lambda values: set(map(type, values)) == {int} and low <= min(values) and max(values) <= high
    types = {int, float} if datatype in _FLOATS else {bool} if datatype == "BOOL" else {str} if datatype == "BYTES" else None
    if types is None:
        return None
    return lambda values: set(map(type, values)) <= types
