"""``infeng --help`` reads well: no type on flags, a version, defaults that agree with the text,
descriptions that flow at the terminal's width rather than the source's line breaks."""
from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from infeng_cli.main import app

COMMANDS = sorted(typer.main.get_command(app).commands)


def help_of(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("command", [[]] + [[c] for c in COMMANDS])
def test_flags_show_no_type(command: list[str]) -> None:
    assert "<bool>" not in help_of(*command)


def test_version() -> None:
    from importlib.metadata import version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"infeng {version('infeng')}\n"


@pytest.mark.parametrize("command", COMMANDS)
def test_no_default_in_the_text_contradicts_the_shown_one(command: str) -> None:
    """An option whose help names its default shows no other ``[default: ...]``."""
    for param in typer.main.get_command(app).commands[command].params:
        text = getattr(param, "help", None) or ""
        if "default" in text:
            assert param.default is None or param.default is False or not param.show_default, (command, param.name)


def test_descriptions_flow_at_words() -> None:
    """No description line ends early because its docstring was wrapped in the source: in the
    commands panel (100 columns), every line of a description but its last is nearly full."""
    panel = help_of().split("Commands")[1]
    groups: list[list[str]] = []
    for line in panel.splitlines():
        m = re.match(r"│ (\S*)\s+(.*?)\s*│$", line)
        if not m:
            continue
        if m.group(1):
            groups.append([])
        groups[-1].append(m.group(2))
    assert len(groups) == len(COMMANDS)
    for lines in groups:
        assert all(len(line) >= 70 for line in lines[:-1]), lines
    assert "A model that is not an artifact is compiled first" in " ".join(help_of("serve").split())
    assert "Hub id org/name[@rev]" in " ".join(help_of("compile").split())     # brackets are not markup


@pytest.mark.parametrize("columns", ["80", "120"])
@pytest.mark.parametrize("command", [[]] + [[c] for c in COMMANDS])
def test_help_reads_at_80_and_120_columns(command: list[str], columns: str) -> None:
    """No type noise (``list[``, ``<int range>``, ``[x>=1]``), no metavar broken across lines (a
    ``<`` left open), capitals for arguments in the usage line, and help text on every option and
    argument."""
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": columns})
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "list[" not in text and "range>" not in text and "[x>" not in text and "{" not in text
    assert "<str>" not in text and "<path>" not in text
    for line in text.splitlines():
        assert line.count("<") <= line.count(">"), line
    group = typer.main.get_command(app)
    for param in (group.commands[command[0]] if command else group).params:
        assert (param.help or "").strip(), f"{' '.join(command)} {param.opts[0]} has no help text"


@pytest.mark.parametrize("args, message", [
    (["compile", "m", "-o", "out", "--kv", "f8"], "Invalid value for '--kv'"),
    (["compile", "m", "-o", "out", "--max-tokens", "many"], "Invalid value for '--max-tokens'"),
    (["run"], "Missing argument 'ARTIFACT'"),
    (["serve", "m", "--no-such-flag"], "No such option: --no-such-flag"),
    (["no-such-command"], "No such command 'no-such-command'"),
])
def test_a_value_the_command_line_refuses_is_one_line(args: list[str], message: str) -> None:
    """What typer refuses (a choice, a number, a missing argument, an unknown flag or command) is one
    line naming it and the help to read, exit code 2, as an InfengError is."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
