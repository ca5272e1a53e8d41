"""Untrusted JSON as strict, bounded values: the one parser for every JSON text a client or the
model hands the server (request bodies, schemas sent as JSON text, tool-call arguments in requests,
tool calls parsed from generated text).

Python's ``json`` is lenient where a server must not be: it accepts ``NaN``/``Infinity`` (and
turns ``1e999`` into ``inf``), decodes a lone UTF-16 surrogate (``"\\ud800"``) into a string
nothing downstream can encode, reads bytes as UTF-16 or UTF-32 when they look like it, and recurses
once per nesting level until it raises RecursionError. ``loads`` refuses each of those with
``JSONRejected`` (a ValueError) saying why; bytes must be strict UTF-8 (a UTF-8 byte-order mark is
ignored, as RFC 8259 allows); the nesting depth is bounded by ``MAX_DEPTH`` before parsing,
without recursion (strings are cut out by one regular expression and the brackets counted with
numpy). ``parse_json`` is ``loads`` for a request body: a 400 with OpenAI's body.
"""
from __future__ import annotations

import codecs
import json
import math
import re
from typing import Any

import numpy as np

from .api_errors import APIError

#: Deepest nesting of arrays and objects a JSON text may have (OpenAI bodies, tool schemas and
#: tool calls included, stay far below it).
MAX_DEPTH = 64

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
#: An escaped surrogate: present in every text with a lone one, and in texts with escaped pairs
#: (checked in full then).
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
#: The UTF-8 form of U+D800..U+DFFF (which strict UTF-8 refuses), to name it in the refusal.
_ENCODED_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")
_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
              (codecs.BOM_UTF16_BE, "UTF-16"))


class JSONRejected(ValueError):
    """A JSON text refused; the message completes "the <text> ...", e.g. "is not valid UTF-8: ..."."""


def _lone_surrogate() -> JSONRejected:
    return JSONRejected("has a lone UTF-16 surrogate (\\ud800-\\udfff) in a string; strings must be valid Unicode")


def _constant(name: str) -> float:
    raise JSONRejected(f"is not valid JSON: {name} is not a JSON number; numbers must be finite")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONRejected(f"is not valid JSON: {text} is out of range for a floating-point number")
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


def _utf8(raw: bytes) -> str:
    """``raw`` as strict UTF-8 text (a leading UTF-8 byte-order mark dropped)."""
    for bom, encoding in _WIDE_BOMS:
        if raw.startswith(bom):
            raise JSONRejected(f"is {encoding} (it starts with a {encoding} byte-order mark); JSON must be UTF-8")
    if b"\0" in raw:
        raise JSONRejected("has NUL bytes (UTF-16 or UTF-32 text?); JSON must be UTF-8")
    try:
        return raw.removeprefix(codecs.BOM_UTF8).decode("utf-8")
    except UnicodeDecodeError as e:
        start = e.start + (len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0)
        if _ENCODED_SURROGATE.match(raw, start):
            raise JSONRejected(f"is not valid UTF-8: bytes {raw[start:start + 3]!r} at offset {start} encode a lone "
                               "UTF-16 surrogate (U+D800-U+DFFF); strings must be valid Unicode") from None
        raise JSONRejected(f"is not valid UTF-8: {e.reason} at byte offset {start}; JSON must be UTF-8") from None


def loads(text: str | bytes) -> Any:
    """The value of a strict, finite JSON text of bounded depth with no lone surrogate; bytes
    must be UTF-8. ``JSONRejected`` (a ValueError) otherwise, never RecursionError."""
    if isinstance(text, bytes):
        raw, text = text, _utf8(text)
    else:
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:
            raise _lone_surrogate() from None
    if too_deep(raw):
        raise JSONRejected(f"nests arrays and objects more than {MAX_DEPTH} levels deep (the JSON nesting limit)")
    try:
        value = json.loads(text or "null", parse_constant=_constant, parse_float=_float)
    except JSONRejected:
        raise
    except RecursionError:
        raise JSONRejected("nests arrays and objects too deeply") from None
    except ValueError as e:                          # JSONDecodeError
        raise JSONRejected(f"is not valid JSON: {e}") from None
    if _ESCAPED_SURROGATE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _lone_surrogate() from None
    return value


def parse_json(raw: bytes) -> Any:
    """The parsed request body; APIError 400 for anything that is not strict, finite, bounded
    UTF-8 JSON."""
    try:
        return loads(raw)
    except JSONRejected as e:
        raise APIError(400, f"the request body {e}") from None
