"""Options declared once: a dataclass field's metadata (``option(...)``) says its command-line
flag, help text, the range its value must lie in and the environment variable that may set it.
``check_ranges`` holds a filled-in options object to the ranges (one line naming the flag). The
``infeng`` command's parameters and Ray Serve's application arguments are generated from these
declarations (``infeng_cli.params``, ``infeng_runtime.ray_serve.app``); a value given as text (a
size such as 512MiB, a speculative method) names its ``parse``."""
from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable

from .errors import InfengError

__all__ = ["SIZE", "Flag", "check_ranges", "flags", "option", "parse_size", "size_text"]


@dataclass(frozen=True)
class Flag:
    """How one option is given: ``--flag`` (a bool field whose flag starts with ``--no-`` is set
    false by it) or its ``short`` form (``-n``), its help, ``low <= value <= high`` (either bound may
    be None: no bound), an environment variable read when the flag is not given, the placeholder of
    its value in the help (``metavar``), the values it may take (``choices``), and for a value given
    as text, ``parse``
    (text, flag) -> value and ``text`` value -> text (the default as the help shows it)."""

    flag: str
    help: str
    short: str | None = None
    low: float | None = None
    high: float | None = None
    env: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    parse: Callable[[str, str], Any] | None = None
    text: Callable[[Any], str] = str

    def bound(self) -> str:
        if self.high is None:
            return f"at least {self.low}"
        return f"at most {self.high}" if self.low is None else f"between {self.low} and {self.high}"


def option(default: Any = MISSING, *, default_factory: Any = MISSING, **flag: Any) -> Any:
    """A dataclass field carrying its ``Flag(**flag)`` (``default`` or ``default_factory`` as ``field`` takes them)."""
    return field(default=default, default_factory=default_factory, metadata={"flag": Flag(**flag)})


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


def parse_size(text: str, flag: str) -> int:
    """``"512MiB"``, ``"2G"``, ``"1000000"`` -> bytes (k/M/G are powers of 1000, Ki/Mi/Gi of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmg])(i?))?b?\s*", text.lower())
    if not m:
        raise InfengError(f"{flag} {text!r}: expected a size such as 512MiB, 2GiB or a number of bytes")
    power = "kmg".index(m.group(2)) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


def size_text(size: int) -> str:
    """Bytes as ``parse_size`` reads them back, in the largest binary unit that divides them: 4MiB, 64KiB."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


#: The ``option`` arguments of a size given as text (512MiB, 2GiB, a number of bytes).
SIZE: dict[str, Any] = {"parse": parse_size, "text": size_text}
