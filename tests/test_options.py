"""Options declared once (``infeng_common.options``): every ``ServeOptions`` field carries its flag,
help and range; ``check`` holds values to the ranges with one line naming the flag; and the typer
parameters of ``infeng serve`` and ``serve-ray`` and the arguments of Ray's app builder are
generated from those declarations (same flags, help and environment variables)."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from infeng_common.errors import InfengError
from infeng_common.options import flags
from infeng_compiler.options import CompileOptions
from infeng_cli.main import app
from infeng_runtime.ray_options import RayServeConfig
from infeng_runtime.sampling import SamplingParams
from infeng_runtime.server import ServeOptions


def test_every_serve_option_is_declared_with_its_flag():
    declared = dict(flags(ServeOptions))
    assert set(declared) == {f.name for f in fields(ServeOptions)}
    assert all(spec.flag.startswith("--") and spec.help for spec in declared.values())


@pytest.mark.parametrize("values, message", [
    ({"port": 0}, "--port 0: must be between 1 and 65535"),
    ({"max_queue": 0}, "--max-queue 0: must be at least 1"),
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
    params = {opt: p for p in typer.main.get_command(app).commands["serve-ray"].params for opt in p.opts}
    replica = [(name, spec) for name, spec in flags(ServeOptions) if name in RAY_REPLICA_OPTIONS]
    for name, spec in flags(RayServeConfig) + replica:
        assert params[spec.flag].help == spec.help, spec.flag
    assert "--threads" not in params                    # a replica's threads are --threads-per-replica


RAY_REPLICA_OPTIONS = {"host", "port", "max_seqs", "max_context", "max_queue", "served_model_name", "api_key",
                       "max_request_bytes", "kv_memory", "max_batched_tokens", "prefix_cache",
                       "trust_request_chat_template", "shutdown_timeout", "always_include_usage", "log_format",
                       "log_level", "speculative", "adapters"}


def test_serve_parses_sizes_switches_and_adapters(monkeypatch):
    """What the generated parameters hand the command: sizes in bytes, ``--no-x`` as x false,
    ``--adapter NAME=DIR`` as a dict, the API key from its environment variable."""
    import infeng_cli.serve_cmds as serve_cmds

    seen = {}
    monkeypatch.setattr(serve_cmds, "serving_artifact", lambda model, options: model)
    monkeypatch.setattr("infeng_runtime.server.serve", lambda artifact, options: seen.update(options=options))
    monkeypatch.setenv("INFENG_API_KEY", "sekrit")
    result = CliRunner().invoke(app, ["serve", "model-dir", "--kv-memory", "64MiB", "--no-prefix-cache",
                                      "--adapter", "a=./lora", "--speculative", "ngram:4", "--max-queue", "9"])
    assert result.exit_code == 0, result.output
    options = seen["options"]
    assert (options.kv_memory, options.prefix_cache, options.adapters, options.api_key, options.max_queue) == \
        (64 * 2 ** 20, False, {"a": Path("./lora")}, "sekrit", 9)
    assert options.max_request_bytes == 4 * 2 ** 20 and options.speculative.max_draft == 4
    bad = CliRunner().invoke(app, ["serve", "model-dir", "--port", "0"])
    assert bad.exit_code == 2 and "--port 0: must be between 1 and 65535" in bad.output


def test_app_builder_arguments_are_the_declared_options():
    pytest.importorskip("ray")
    from infeng_runtime.ray_serve import RayAppArgs

    declared = {name for name, _ in flags(RayServeConfig) + flags(ServeOptions)} - {"threads"}
    assert set(RayAppArgs.model_fields) == declared | {"artifact", "autoscaling_config"}
    args = RayAppArgs.model_validate({"artifact": "a", "max_request_bytes": "1MiB", "max_queue": 3})
    assert (args.max_request_bytes, args.max_queue, args.host, args.prefix_cache) == ("1MiB", 3, "0.0.0.0", True)


@pytest.mark.parametrize("command, options_class", [("compile", CompileOptions), ("run", SamplingParams),
                                                    ("generate", SamplingParams), ("chat", SamplingParams)])
def test_commands_offer_every_declared_option(command, options_class):
    """``compile`` offers every compile option, the generating commands every sampling option, as
    declared (flag, short form, help, choices)."""
    params = {opt: p for p in typer.main.get_command(app).commands[command].params for opt in p.opts}
    for name, spec in flags(options_class):
        param = params[spec.flag]
        assert param.help.startswith(spec.help) and (spec.short is None or spec.short in param.opts), spec.flag
        if spec.choices:
            assert [c.value for c in param.type_descriptor.choices] == list(spec.choices)


def test_compile_options_are_checked_with_one_line():
    with pytest.raises(InfengError, match="^--max-tokens 0: must be at least 1$"):
        CompileOptions(max_tokens=0).check()
    with pytest.raises(InfengError, match="^--merge a: no adapter of that name"):
        CompileOptions(merge=["a"]).check()
    bad = CliRunner().invoke(app, ["compile", "model-dir", "-o", "out", "--kv-window", "-1"])
    assert bad.exit_code == 2 and "--kv-window -1: must be at least 0" in bad.output


def test_chat_refuses_an_answer_of_no_tokens():
    """``chat -n 0`` is one line and exit 2 (``run`` and ``generate`` allow 0), before MODEL is looked at."""
    bad = CliRunner().invoke(app, ["chat", "no-such-model", "-n", "0"])
    assert bad.exit_code == 2 and "--max-new-tokens 0: must be at least 1" in bad.output


@pytest.mark.parametrize("args, message", [(["--replicas", "0"], "--replicas 0: must be at least 1"),
                                           (["--min-replicas", "1"], "give --min-replicas and --max-replicas"),
                                           (["--adapter", "a=no-such-dir"], "--adapter a=no-such-dir: not a directory")])
def test_serve_ray_checks_its_options_before_compiling(args, message):
    """A bad replica option is refused before MODEL is compiled (here MODEL does not even exist)."""
    pytest.importorskip("ray")
    bad = CliRunner().invoke(app, ["serve-ray", "no-such-model", *args])
    assert bad.exit_code == 2 and message in bad.output, bad.output


def test_run_takes_threads_and_speculative_as_serve_declares_them():
    params = {opt: p for p in typer.main.get_command(app).commands["run"].params for opt in p.opts}
    declared = dict(flags(ServeOptions))
    for name in ("threads", "speculative"):
        assert params[declared[name].flag].help == declared[name].help
    bad = CliRunner().invoke(app, ["run", "no-such-artifact", "hi", "--speculative", "bogus"])
    assert bad.exit_code == 2 and "--speculative 'bogus'" in bad.output
