"""Options declared once: a dataclass field's metadata (``option(...)``) says its command-line
flag, help text, the range its value must lie in and the environment variable that may set it.
``check_ranges`` holds a filled-in options object to the ranges (one line naming the flag). The
command line still declares each flag as a typer parameter as well: ``tests/test_options.py`` holds
the two to the same flags, help and ranges (generating the parameters from ``flags`` is the next
step, issue 28)."""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .errors import InfengError

__all__ = ["Flag", "check_ranges", "flags", "option"]


@dataclass(frozen=True)
class Flag:
    """How one option is given: ``--flag`` (a bool field whose flag starts with ``--no-`` is set
    false by it), its help, ``low <= value <= high`` (either bound may be None: no bound), and an
    environment variable read when the flag is not given."""

    flag: str
    help: str
    low: float | None = None
    high: float | None = None
    env: str | None = None

    def bound(self) -> str:
        if self.high is None:
            return f"at least {self.low}"
        return f"at most {self.high}" if self.low is None else f"between {self.low} and {self.high}"


def option(default: Any = MISSING, *, flag: str, help: str, low: float | None = None, high: float | None = None,
           env: str | None = None, default_factory: Any = MISSING) -> Any:
    """A dataclass field carrying its ``Flag`` (``default`` or ``default_factory`` as ``field`` takes them)."""
    return field(default=default, default_factory=default_factory,
                 metadata={"flag": Flag(flag, help, low, high, env)})


def flags(options_class: type) -> list[tuple[str, Flag]]:
    """(field name, Flag) of every declared option of a dataclass, in field order."""
    return [(f.name, f.metadata["flag"]) for f in fields(options_class) if "flag" in f.metadata]


def check_ranges(options: Any) -> None:
    """InfengError ``--flag VALUE: must be ...`` for the first option outside its range (None passes)."""
    for name, spec in flags(type(options)):
        value = getattr(options, name)
        if value is None or (spec.low is None and spec.high is None):
            continue
        low = spec.low if spec.low is not None else -math.inf
        high = spec.high if spec.high is not None else math.inf
        if not math.isfinite(value) or not low <= value <= high:
            raise InfengError(f"{spec.flag} {value}: must be {spec.bound()}")
