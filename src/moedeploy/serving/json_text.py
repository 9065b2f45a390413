"""A request body's JSON, read as the front reads it: parsed into one-line problems and shown
back to the client in a few characters.

Why a module of its own: it imports nothing of moedeploy's, so the process that checks a large
inference body (infer_body.whole_body_problem) starts in a fraction of a second instead of
importing torch through the serving specs.
"""

from __future__ import annotations

import json
import math
from typing import Any


def parse_json(body: bytes) -> tuple[Any, str | None]:
    """(the JSON value, None), or (None, why it is not valid JSON: one line). A body nested too
    deep for Python's parser (RecursionError) is invalid JSON to the client, not a server error."""
    try:
        return json.loads(body.decode("utf-8")), None
    except UnicodeDecodeError:
        return None, "the request body is not UTF-8 text"
    except ValueError as e:
        return None, f"the request body is not valid JSON: {str(e).splitlines()[0]}"
    except RecursionError:
        return None, "the request body is not valid JSON: it is nested too deep"


def shown(value: Any) -> str:
    """A request's value as its JSON spells it (NaN and infinities as Python does), cut at 40 characters."""
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."
