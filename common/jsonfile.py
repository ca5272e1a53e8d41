"""Reading a JSON object from a file the user gave: any malformed content is one line naming it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import InfengError, ModelFormatError


def read_json_object(path: Path, error: type[InfengError] = ModelFormatError) -> dict[str, Any]:
    """The JSON object in ``path``; ``error`` (naming the file) when it does not hold one."""
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise error(f"{path}: malformed JSON: {str(e)[:200]}") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value
