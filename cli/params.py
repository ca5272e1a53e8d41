"""Typer parameters generated from option declarations (``infeng_common.options``): an
``OptionGroup`` names a dataclass of options (or some of its fields), ``@takes(group, ...)`` adds
their parameters to a command's signature (its own ``**values`` receives them), and
``group.values(values)`` turns what typer parsed back into the dataclass's field values. So each
flag's name, help, range, choices and environment variable are written once, in the dataclass."""
from __future__ import annotations

import inspect
import typing
from dataclasses import MISSING, dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from infeng_common.errors import InfengError
from infeng_common.options import Flag

__all__ = ["OptionGroup", "parse_named_paths", "takes"]


def parse_named_paths(items: list[str], option: str) -> dict[str, Path]:
    """``["med=./lora"]`` -> ``{"med": Path("./lora")}``, refusing malformed or repeated names."""
    named: dict[str, Path] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise InfengError(f"{option} {item!r}: expected NAME=DIR")
        if name in named:
            raise InfengError(f"{option}: adapter name {name!r} given twice")
        named[name] = Path(path)
    return named


@dataclass(frozen=True)
class _Param:
    """One declared option as a typer parameter: its annotation and default on the command line,
    and how the parsed value becomes the field's value."""

    name: str
    spec: Flag
    annotation: Any
    default: Any
    convert: Callable[[Any], Any]

    def parameter(self, panel: str | None) -> inspect.Parameter:
        spec = self.spec          # the range is checked on the options (check_ranges: one line naming the flag)
        names = (spec.flag, spec.short) if spec.short else (spec.flag,)
        info = typer.Option(self.default, *names, help=spec.help, envvar=spec.env, metavar=spec.metavar,
                            show_default="default" not in spec.help,    # a help that says its default says it
                            rich_help_panel=panel)
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=self.annotation)


def _param(name: str, spec: Flag, hint: Any, default: Any) -> _Param:
    """How field ``name`` (type ``hint``, ``default``) is given on the command line."""
    origin = typing.get_origin(hint)
    if spec.parse is not None:                              # a size, a method: text parsed after typer
        text = None if default is None else spec.text(default)
        return _Param(name, spec, Optional[str], text,
                      lambda given: None if given is None else spec.parse(given, spec.flag))
    if spec.choices:
        choices = Enum(name.title().replace("_", ""), {c: c for c in spec.choices}, type=str)
        return _Param(name, spec, Optional[choices], None if default is None else choices(default),
                      lambda given: None if given is None else given.value)
    if hint is bool and spec.flag.startswith("--no-"):     # --no-x sets a true-by-default field false
        return _Param(name, spec, bool, False, lambda given: not given)
    if origin is dict:                                      # NAME=DIR, repeatable
        return _Param(name, spec, list[str], [], lambda given: parse_named_paths(given, spec.flag))
    if origin is list:
        return _Param(name, spec, hint, [], list)
    return _Param(name, spec, hint, default, lambda given: given)


class OptionGroup:
    """The declared options of ``options_class`` a command offers: all of them, those in ``only``,
    or all but ``skip``; shown under the help panel ``panel``; ``defaults`` where the command's
    default is not the declaration's."""

    def __init__(self, options_class: type, *, only: tuple[str, ...] = (), skip: tuple[str, ...] = (),
                 panel: str | None = None, defaults: dict[str, Any] | None = None):
        hints = typing.get_type_hints(options_class)
        declared = {f.name: f for f in fields(options_class) if "flag" in f.metadata}
        defaults = defaults or {}
        unknown = [name for name in (*only, *skip, *defaults) if name not in declared]
        if unknown:
            raise ValueError(f"{options_class.__name__} declares no option {unknown[0]}")
        self.options_class = options_class
        self.panel = panel
        self.params = [_param(name, f.metadata["flag"], hints[name],
                              defaults.get(name, None if f.default is MISSING else f.default))
                       for name, f in declared.items() if (not only or name in only) and name not in skip]

    def parameters(self) -> list[inspect.Parameter]:
        return [p.parameter(self.panel) for p in self.params]

    def values(self, given: dict[str, Any]) -> dict[str, Any]:
        """The field values of this group's options among the command's ``given`` parameters."""
        return {p.name: p.convert(given[p.name]) for p in self.params}


def takes(*groups: OptionGroup) -> Callable[[Callable], Callable]:
    """Give a command the parameters of ``groups`` after its own; it receives them in ``**values``."""

    def decorate(command: Callable) -> Callable:
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values()
               if p.kind is not inspect.Parameter.VAR_KEYWORD]
        panels = {group.panel for group in groups}
        in_panel = [p for p in own if getattr(p.default, "rich_help_panel", None) in panels]
        added = []          # each group's parameters, then the command's own in that group's panel
        for group in groups:
            added += group.parameters() + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in in_panel
                                           if p.default.rich_help_panel == group.panel]
        params = [p for p in own if p not in in_panel] + added
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise ValueError(f"{command.__name__}: a parameter is declared twice in {names}")
        command.__signature__ = inspect.Signature(params)
        return command

    return decorate
