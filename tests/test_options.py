"""Options declared once (``infeng_common.options``): every ``ServeOptions`` field carries its flag,
help and range; ``check`` holds values to the ranges with one line naming the flag; and ``infeng
serve`` (``serve-ray`` for ``RayServeConfig``'s own fields) offers each of those flags with the same
help (until the CLI is generated from them)."""
from __future__ import annotations

from dataclasses import fields

import pytest
import typer

from infeng_common.errors import InfengError
from infeng_common.options import flags
from infeng_compiler.cli import app
from infeng_runtime.server import ServeOptions


def test_every_serve_option_is_declared_with_its_flag():
    declared = dict(flags(ServeOptions))
    assert set(declared) == {f.name for f in fields(ServeOptions)}
    assert all(spec.flag.startswith("--") and spec.help for spec in declared.values())


@pytest.mark.parametrize("values, message", [
    ({"port": 0}, "--port 0: must be between 1 and 65535"),
    ({"max_waiting": 0}, "--max-queue 0: must be at least 1"),
    ({"shutdown_timeout": float("nan")}, "--shutdown-timeout nan: must be at least 0"),
    ({"max_grammar_bytes": 2 ** 27}, "--max-grammar-bytes 134217728: must be between 16 and 67108864"),
])
def test_ranges_come_from_the_declarations(values, message):
    with pytest.raises(InfengError, match=f"^{message}$"):
        ServeOptions(**values).check()


def test_serve_command_offers_the_declared_flags_and_help():
    params = {opt: p for p in typer.main.get_command(app).commands["serve"].params for opt in p.opts}
    for name, spec in flags(ServeOptions):
        assert spec.flag in params, spec.flag
        assert params[spec.flag].help == spec.help, spec.flag
        if spec.env:
            assert params[spec.flag].envvar == spec.env


def test_serve_ray_command_offers_the_declared_flags_and_help():
    pytest.importorskip("ray")
    from infeng_runtime.ray_serve import RayServeConfig

    params = {opt: p for p in typer.main.get_command(app).commands["serve-ray"].params for opt in p.opts}
    for name, spec in flags(RayServeConfig):
        assert params[spec.flag].help == spec.help, spec.flag
