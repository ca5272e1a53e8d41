"""The ``infeng`` application: its typer app with help that reads at 80 columns, the error
console, ``fails_cleanly`` (every InfengError one line on stderr and exit code 2) and the progress
displays the commands share. The commands register themselves on ``app`` (``main.py`` imports them)."""
from __future__ import annotations

import functools
import typing
from typing import Callable

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from typer._click.exceptions import NoArgsIsHelpError, UsageError   # typer 0.29's own click (pinned)
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from infeng_common.errors import InfengError


class _ReadableParams:
    """Help that reads at 80 columns. typer 0.29's rich options panel prints each option's type
    (``<bool>`` on every flag, ``<list[str]>``, ``<int range> [x>=1]``, a choice list that breaks
    mid-word), ``<str>`` after each argument and the usage line a ``{model}``. So: a flag and an
    argument show no type, an option with no metavar of its own shows one from its type (N, X,
    TEXT, PATH; a choice shows the option's name, KV, and its choices go into the help text), a
    number's range is not printed (the value is still checked), and the usage line names arguments
    in capitals: ``infeng chat [OPTIONS] MODEL``. A value the command line refuses (a choice, a
    number, a missing argument) is one line and exit code 2, as an InfengError is."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except NoArgsIsHelpError:
            raise
        except UsageError as e:
            _refuse(ctx, e)

    def get_params(self, ctx: typer.Context) -> list:
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "_readable", False):
                continue
            param._readable = True
            if isinstance(param, TyperArgument):
                param.metavar = param.metavar or param.name.upper()
                param.display_type_rich = lambda ctx: None           # MODEL, not MODEL <str>
            elif isinstance(param, TyperOption) and param.metavar is None:
                param.metavar = "" if param.is_flag else _metavar(param)
            if getattr(param, "min", None) is not None or getattr(param, "max", None) is not None:
                param._get_number_range_help_str = lambda: None
        return params

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = param.metavar + ("..." if param.nargs != 1 else "")
                pieces.append(name if param.required else f"[{name}]")
        return pieces


def _refuse(ctx: typer.Context, error: UsageError) -> None:
    """One line and exit code 2 (typer would print a box of usage, hint and message)."""
    err.print(f"[bold red]error:[/] {escape(error.format_message())} (see {escape(ctx.command_path)} --help)",
              highlight=False, soft_wrap=True)
    raise typer.Exit(2) from None


def _metavar(option: TyperOption) -> str:
    """An option's metavar from its type; a choice's values are appended to its help."""
    described = option.type_descriptor
    if described.is_choice:
        choices = [str(getattr(c, "value", c)) for c in described.choices]
        if not all(c in (option.help or "") for c in choices):
            option.help = f"{option.help or ''} (one of {', '.join(choices)})".strip()
        return option.name.upper()
    if described.is_path:
        return "PATH"
    annotation = described.annotation
    element = typing.get_args(annotation)[0] if described.is_list else annotation
    return {int: "N", float: "X"}.get(element, "TEXT")


class _Command(_ReadableParams, TyperCommand):
    pass


class _Group(_ReadableParams, TyperGroup):
    def resolve_command(self, ctx: typer.Context, args: list[str]):
        try:
            return super().resolve_command(ctx, args)
        except UsageError as e:                 # no such command
            _refuse(ctx, e)


class _Typer(typer.Typer):
    """Every command is a ``_Command``."""

    def command(self, *args, **kwargs):
        return super().command(*args, cls=kwargs.pop("cls", _Command), **kwargs)


# Markdown help: docstrings and option help flow as paragraphs (single newlines are spaces), where
# the "rich" mode keeps the source's line breaks in command descriptions, and reads [...] as markup.
app = _Typer(cls=_Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
             rich_markup_mode="markdown",
             help="infeng: compile Hugging Face / ONNX LLMs and LoRA adapters to CPU kernels, and run them.")
err = Console(stderr=True, soft_wrap=True)    # lines are never broken: a path stays one piece to paste


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"infeng {version('infeng')}")
        raise typer.Exit()


@app.callback()
def _main(show_version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                            help="print the version and exit")) -> None:
    pass


def fails_cleanly(fn: Callable) -> Callable:
    """Turn InfengError, and an OSError about a file (a name too long, a permission), into one line
    and exit code 2; ^C into exit code 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InfengError as e:
            err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except OSError as e:
            if e.filename is None:              # not about a file the user named
                raise
            # only strerror's first letter is lowered ("permission denied"); the path keeps its case
            reason = e.strerror[:1].lower() + e.strerror[1:] if e.strerror else \
                " ".join(map(str, e.args)) or type(e).__name__
            err.print(f"[bold red]error:[/] {escape(str(e.filename))}: {escape(reason)}", highlight=False,
                      soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def progress_bar(transient: bool = True, quiet: bool = False) -> Progress:
    """A progress bar on stderr: what runs, done/total, elapsed and remaining time. A transient one
    is not shown off a terminal (where it could not be erased and left a blank line, before an
    error's line too); none under ``quiet``."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=err, transient=transient,
                    disable=quiet or (transient and not err.is_terminal))


class StageDisplay:
    """One line of ``bar`` per compile: a fresh task (count, elapsed, ETA) for every stage or step."""

    def __init__(self, bar: Progress):
        self.bar = bar
        self.task: TaskID | None = None

    def stage(self, description: str) -> None:
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(description, total=None)

    def progress(self, done: int, total: int) -> None:
        if self.task is not None:
            self.bar.update(self.task, completed=done, total=total)
