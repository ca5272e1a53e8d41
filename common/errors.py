"""Errors a user can act on. The CLI prints their message on one line and exits with code 2."""
from __future__ import annotations

from pathlib import Path


class InfengError(Exception):
    """Base class: the message names the file (and tensor) at fault and what to do."""


class ModelFormatError(InfengError):
    """A checkpoint, config or tokenizer file is missing, corrupt or inconsistent."""


class UnsupportedError(InfengError):
    """The input is valid but uses something infeng does not implement."""


class IRError(InfengError):
    """IR text that does not parse, or a graph that does not verify."""


def not_a_file(path: str | Path) -> str:
    """The one wording for a named file that cannot be read as one: "PATH: no such file or
    directory", or "PATH: is a directory, not a file"."""
    return f"{path}: is a directory, not a file" if Path(path).is_dir() else f"{path}: no such file or directory"
