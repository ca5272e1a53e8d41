"""Request bodies as strict, bounded JSON.

Python's ``json`` is lenient where a server must not be: it accepts ``NaN``/``Infinity`` (and
turns ``1e999`` into ``inf``), decodes a lone UTF-16 surrogate (``"\\ud800"``, or its raw bytes)
into a string nothing downstream can encode, and recurses once per nesting level until it raises
RecursionError. Here each of those is a 400 with OpenAI's body, found before any of it reaches a
handler; the nesting depth is bounded by ``MAX_DEPTH`` without parsing (strings are cut out by
one regular expression and the brackets counted with numpy).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from .api_errors import APIError

#: Deepest nesting of arrays and objects a body may have (OpenAI bodies, tool schemas included,
#: stay far below it).
MAX_DEPTH = 64

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
#: An escaped or raw (UTF-8 of U+D800..U+DFFF, which json decodes with surrogatepass) surrogate:
#: present in every body with a lone one, and in bodies with escaped pairs (checked in full then).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


class _NotFinite(ValueError):
    pass


def _constant(name: str) -> float:
    raise _NotFinite(f"{name} is not a JSON number; numbers must be finite")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(f"{text} is out of range for a floating-point number")
    return value


def too_deep(raw: bytes) -> bool:
    """Whether arrays and objects nest more than ``MAX_DEPTH`` levels in ``raw``, strings ignored
    (well-formed or not)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    codes = np.frombuffer(_STRING.sub(b'""', raw), np.uint8)
    step = ((codes == ord("[")) | (codes == ord("{"))).astype(np.int32) - \
        ((codes == ord("]")) | (codes == ord("}"))).astype(np.int32)
    return bool(step.size) and int(np.cumsum(step).max()) > MAX_DEPTH


def parse_json(raw: bytes) -> Any:
    """The parsed body; APIError 400 for anything that is not strict, finite, bounded JSON."""
    if too_deep(raw):
        raise APIError(400, f"the request body nests arrays and objects more than {MAX_DEPTH} levels deep")
    try:
        data = json.loads(raw or b"null", parse_constant=_constant, parse_float=_float)
    except _NotFinite as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body nests arrays and objects too deeply") from None
    except ValueError as e:                      # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if _SURROGATE.search(raw):
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the request body has a lone UTF-16 surrogate (\\ud800-\\udfff) in a string; "
                                "strings must be valid Unicode") from None
    return data
