"""The commands that compile and show the compiler's work: ``compile``, ``ir``, ``explore``,
``export``, ``verify``; the compile options each command offers (``CompileOptions``' declarations)
and ``serving_artifact`` (a model compiled into the artifact cache, for the commands that serve it)."""
from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from infeng_common.errors import InfengError
from infeng_compiler.options import CompileOptions

from .app import StageDisplay, app, err, fails_cleanly, progress_bar
from .params import OptionGroup, takes


class IRFormat(str, Enum):
    text = "text"
    json = "json"
    dot = "dot"
    onnx = "onnx"
    model_explorer = "model-explorer"


#: The compile options of each command that compiles (``CompileOptions``' declarations). The
#: serving commands choose ``--max-adapters`` themselves (its default follows their adapters).
COMPILE = OptionGroup(CompileOptions, panel="Compile")
PIPELINE = OptionGroup(CompileOptions, skip=("dump_ir", "profile"), panel="Compile pipeline")
SERVE_COMPILE = OptionGroup(CompileOptions, panel="Compile (a MODEL that is not an artifact)",
                            skip=("passes", "dump_ir", "profile", "lora", "merge", "max_adapters", "lora_targets"))
CHAT_COMPILE = OptionGroup(CompileOptions, only=("target", "dtype", "max_rank", "tokenizer", "quant", "kv"),
                           panel="Compile (a MODEL that is not an artifact)")
BATCH_COMPILE = OptionGroup(CompileOptions, only=("target", "dtype", "quant", "kv"),
                            panel="Compile (a MODEL that is not an artifact)")
EVAL_QUANT = OptionGroup(CompileOptions, only=("tokenizer", "quant", "quant_policy", "calib", "calib_max_bytes",
                                               "calib_tokens"),
                         panel="A model directory (interpreter)")


def compile_options(group: OptionGroup, values: dict, **fixed) -> CompileOptions:
    """``CompileOptions`` from a command's ``group`` parameters (and ``fixed`` fields), checked."""
    options = CompileOptions(**group.values(values), **fixed)
    options.check()
    return options


def serving_max_adapters(given: int | None, adapters: int, loads_adapters: bool = False) -> int:
    """LoRA slots a serving command compiles MODEL with: ``--max-adapters``, or 4 (at least one per
    ``--adapter``) when it serves adapters, else none."""
    if given is not None:
        return given
    return max(4, adapters) if adapters or loads_adapters else 0


#: ``--max-adapters`` of the commands that serve what they compile.
SERVING_MAX_ADAPTERS = typer.Option(None, "--max-adapters", min=0, rich_help_panel=SERVE_COMPILE.panel,
                                    help="LoRA slots when compiling MODEL (default: 4 with --adapter, else none)")


@app.command("compile")
@fails_cleanly
@takes(COMPILE)
def compile_command(model: Optional[str] = typer.Argument(None, help="model dir, .safetensors, .onnx, .gguf or Hub "
                                                                      "id org/name[@rev]"),
                    output: Path = typer.Option(..., "-o", "--output", help="artifact directory to write"),
                    replay: Optional[Path] = typer.Option(None, "--replay",
                                                          help="rebuild ARTIFACT from the model, inputs and options "
                                                               "its manifest records (inputs checked by sha256)"),
                    timings: bool = typer.Option(False, "--timings", help="also show time per pass"),
                    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress display"),
                    rebuild: bool = typer.Option(False, "--rebuild",
                                                 help="compile afresh, not copying an unchanged artifact built "
                                                      "from the same inputs (--replay always does)"),
                    **values):
    """Compile MODEL into an artifact directory (weights.bin, libmodel.so, src/, manifest.json)."""
    from rich.table import Table

    from infeng_common.manifest import read_manifest, weight_storage

    from infeng_compiler.compile import compile_model, replay_options

    if replay is not None:
        if model is not None:
            raise InfengError("--replay ARTIFACT rebuilds the model it records: give no MODEL")
        model, options = replay_options(replay)
    elif model is None:
        raise InfengError("give the MODEL to compile (or --replay ARTIFACT)")
    else:
        options = compile_options(COMPILE, values)
    with progress_bar(quiet=quiet) as bar:
        display = StageDisplay(bar)
        summary = compile_model(model, output, options, stage=display.stage, progress=display.progress,
                                reuse=replay is None and not rebuild)
    table = Table(show_header=False)
    table.add_row("target", summary.target)
    table.add_row("pipeline", summary.pipeline)
    table.add_row("kv cache", f"{options.kv}" + (f", last {options.kv_window} tokens f16" if options.kv_window else "")
                  + (", K centred" if summary.kv_centred else "") + f", {summary.kv_bytes_per_token:g} bytes/token")
    table.add_row("weights", f"{summary.weights_bytes / 2**20:.1f} MiB, matrices stored as "
                  f"{weight_storage(read_manifest(output))}")
    table.add_row("kernels rendered", str(summary.kernels))
    table.add_row("build cache", "hit" if summary.cache_hit else "miss")
    for name, seconds in summary.stages.items():
        table.add_row(f"  {name}", f"{seconds:.2f} s")
        if name == "passes" and timings:
            for record in summary.passes:
                table.add_row(f"    {record.name}", f"{record.seconds * 1e3:.1f} ms"
                              + ("" if record.changed else " (no change)"))
    table.add_row("total", f"{summary.seconds:.2f} s")
    err.print(table, soft_wrap=False)
    if summary.quant:
        table, notes = quant_table(summary.quant)
        err.print(table, soft_wrap=False)
        for note in notes:                      # lines of their own: a table caption would break them
            err.print(f"  {note}", highlight=False)
    err.print(f"compiled {output}", highlight=False)


def quant_table(report):
    """Formats and bytes of a ``quantize`` pass: one row per format, then the total; and notes
    (fallback formats, padding, calibration), at most 8 lines and a count."""
    from rich.table import Table

    table = Table(title=f"weights by format ({report.scheme})")
    for column in ("format", "tensors", "params", "bytes", "bits/weight"):
        table.add_column(column, justify="left" if column == "format" else "right")
    params = total = 0
    for row in report.by_format():
        table.add_row(row["format"], str(row["tensors"]), f"{row['params']:,}", f"{row['bytes']:,}",
                      f"{row['bpw']:.3f}")
        params, total = params + row["params"], total + row["bytes"]
    table.add_row("all matrices", str(len(report.tensors)), f"{params:,}", f"{total:,}",
                  f"{8 * total / max(params, 1):.3f}")
    notes = [f"{t.name}: {t.fallback_from} does not fit K={t.shape[1]}, stored as {t.format}"
             for t in report.tensors if t.fallback_from]
    notes += [f"{t.name}: K padded to {t.padded[1]} (zero columns to whole groups)" for t in report.tensors
              if t.padded and t.padded[1] != t.shape[1] and not t.fallback_from]
    if report.calib_tokens:
        notes.append(f"calibrated on {report.calib_tokens:,} tokens; AWQ scales folded at {len(report.awq)} sites")
    return table, notes[:8] + ([f"... and {len(notes) - 8} more"] if len(notes) > 8 else [])


@app.command("ir")
@fails_cleanly
@takes(PIPELINE)
def ir_command(model: str = typer.Argument(..., help="model dir, .safetensors, .onnx, .gguf, Hub id org/name[@rev] "
                                                       "or an artifact"),
               format: IRFormat = typer.Option(IRFormat.text, "--format",
                                               help="text, json, dot, onnx (needs -o) or model-explorer (Google "
                                                    "Model Explorer's JSON graph of the lowered graph)"),
               output: Optional[Path] = typer.Option(None, "-o", "--output", help="write here instead of stdout"),
               html: Optional[Path] = typer.Option(None, "--html", metavar="FILE",
                                                   help="write the IR explorer (every stage, diffs, kernels and "
                                                        "their C) as one self-contained HTML file"),
               node_profile: Optional[Path] = typer.Option(None, "--node-profile", metavar="FILE",
                                                           help="with --html or model-explorer: time per node "
                                                                "from infeng bench --profile --node-profile FILE"),
               after: Optional[str] = typer.Option(None, "--after",
                                                   help="print the graph after this pass (import, an ONNX raising "
                                                        "pass, a compile pass), after a compile phase (model, "
                                                        "storage, fusion, memory), after lowering (lower), or after "
                                                        "each pass (all)"),
               **values):
    """Print MODEL's IR: as imported, after any pass of its compile pipeline, or lowered to kernel calls.

    The compile options choose the pipeline, as with `infeng compile`; no C is built. With `--after all`
    the graph's `meta` line is printed once, in the first section that has it. `--html FILE` writes the
    IR explorer (docs/web.md) instead: every stage, the diffs, each node's kernels and their C source."""
    from infeng_common.manifest import is_artifact

    options = compile_options(PIPELINE, values)
    if html is not None or format == IRFormat.model_explorer:
        if after is not None:
            raise InfengError("--html and --format model-explorer show every stage and the lowered graph; "
                              "leave out --after")
        _write_explorer(model, options, html, format, output, node_profile)
        return
    from infeng_compiler.compile import run_pipeline
    from infeng_compiler.ir import print_graph
    from infeng_compiler.ir.serialize import to_dot, to_json

    render = {"text": print_graph, "json": to_json, "dot": to_dot}.get(format.value)
    if format == IRFormat.onnx:
        if output is None or after in ("all", "lower"):
            raise InfengError("--format onnx writes a file: give -o g.onnx (and at most one --after pass)")
        from infeng_compiler.ir.onnx_export import save_onnx
    if is_artifact(model):                      # the final IR the artifact was built from
        if after or format != IRFormat.text:
            raise InfengError(f"{model}: is a compiled artifact; it keeps its final IR only (ir.txt, text)")
        _write_text((Path(model) / "ir.txt").read_text(), output)
        return
    snapshots: list[tuple[str, str]] = []
    printed_meta: dict[str, str] = {}           # meta text -> the section that printed it

    def keep(name: str, g) -> None:
        if after not in ("all", name):
            return
        if format == IRFormat.onnx:
            save_onnx(g, output)
        if format == IRFormat.text and after == "all":
            meta = json.dumps(g.meta)
            seen = printed_meta.setdefault(meta, name)
            snapshots.append((name, print_graph(g, meta_note=f"as after {seen}" if seen != name else None)))
            return
        snapshots.append((name, "" if format == IRFormat.onnx else render(g)))

    def keep_phase(name: str, g) -> None:
        if after == name:
            keep(name, g)

    compile_stages = after is not None and after != "import"
    if compile_stages:
        graph = run_pipeline(model, options, after=keep, after_phase=keep_phase).graph
    else:
        from infeng_compiler.frontends import import_model

        graph = import_model(model, options.tokenizer, after=keep if after else None)
    if after in ("all", "lower"):
        from infeng_compiler.codegen.lower import describe, lower
        from infeng_compiler.codegen.target import get_target

        lowered = lower(graph, get_target(options.target), max_tokens=options.max_tokens,
                        block_size=options.block_size)
        snapshots.append(("lower", describe(lowered)))
    if after and not snapshots:
        from infeng_compiler.frontends import ONNX_PIPELINE, is_onnx
        from infeng_compiler.passes.pipeline import COMPILE_PHASES

        ran = ["import", *(ONNX_PIPELINE.split(",") if is_onnx(model) else []),
               *(name for name, _ in options.pipeline()), "lower"]
        raise InfengError(f"--after {after}: no such pass ran for {model} (passes: {', '.join(ran)}; phases: "
                          f"{', '.join(COMPILE_PHASES)}; or all)")
    if format == IRFormat.onnx:
        if not after:
            save_onnx(graph, output)
        err.print(f"wrote {output} (ONNX, {len(graph.nodes)} nodes, {len(graph.weights)} weights; "
                  f"checked by onnx.checker)")
        return
    if after:
        text = "".join(f"# after {name}\n{t}" if after == "all" else t for name, t in snapshots)
    else:
        text = render(graph)
    _write_text(text, output, f" ({len(graph.nodes)} nodes, {len(graph.weights)} weights)")


def _explorer_input(model: str, options) -> tuple[str, object]:
    """(model, options) the explorer runs: an artifact's own source and compile options (replayed)."""
    from infeng_common.manifest import is_artifact

    if not is_artifact(model):
        return model, options
    from infeng_compiler.compile import replay_options

    source, replayed = replay_options(model)
    return str(source), replayed


def _write_explorer(model: str, options, html: Path | None, format: IRFormat, output: Path | None,
                    node_profile: Path | None) -> None:
    from infeng_compiler.explore import (explorer_data, explorer_html, model_explorer_graph, model_explorer_node_data,
                          read_node_profile)

    if format not in (IRFormat.text, IRFormat.model_explorer) or (html is not None and format != IRFormat.text):
        raise InfengError("--html writes the explorer page; give it without --format, or use --format "
                          "model-explorer alone")
    profile = read_node_profile(node_profile) if node_profile else None
    source, options = _explorer_input(model, options)
    data = explorer_data(source, options, profile)
    if html is not None:
        html.write_text(explorer_html(data))
        err.print(f"wrote {html} ({len(data['stages'])} stages, {len(data['stages'][-1]['nodes'])} nodes; "
                  f"open it in a browser)")
        return
    _write_text(json.dumps(model_explorer_graph(data), indent=1) + "\n", output, " (Model Explorer JSON graph)")
    if profile is not None and output is not None:
        node_data = output.with_suffix(".nodedata.json")
        node_data.write_text(json.dumps(model_explorer_node_data(data), indent=1) + "\n")
        err.print(f"wrote {node_data} (the profile's share of the step per node: Model Explorer node data)")


def _write_text(text: str, output: Path | None, what: str = "") -> None:
    if output:
        output.write_text(text)
        err.print(f"wrote {output}{what}")
    else:
        sys.stdout.write(text)


@app.command("explore")
@fails_cleanly
@takes(PIPELINE)
def explore_command(model: str = typer.Argument(..., help="model dir, .safetensors, .onnx, .gguf, Hub id, or an "
                                                           "artifact (its source is compiled again, as it was)"),
                    host: str = typer.Option("127.0.0.1", "--host", help="bind address"),
                    port: int = typer.Option(8001, "--port", help="TCP port to listen on"),
                    node_profile: Optional[Path] = typer.Option(None, "--node-profile", metavar="FILE",
                                                                help="heat overlay: time per node from infeng "
                                                                     "bench --profile --node-profile FILE"),
                    **values):
    """Serve the IR explorer for MODEL: the graph after every pass, the diff of each pass, every node's
    kernel and its C source, and a profile heat overlay (docs/web.md). No C is built."""
    from infeng_compiler.explore import explorer_data, read_node_profile, serve_explorer

    options = compile_options(PIPELINE, values)
    profile = read_node_profile(node_profile) if node_profile else None
    source, options = _explorer_input(model, options)
    data = explorer_data(source, options, profile)
    serve_explorer(data, host, port, announce=err.print)


@app.command("export")
@fails_cleanly
def export_command(model: Path = typer.Argument(..., help="model dir, .gguf, Hub id, or an artifact (its source model "
                                                           "at its weight precision)"),
                   output: Path = typer.Option(..., "-o", "--output", help="the .gguf file to write"),
                   gguf_type: Optional[str] = typer.Option(None, "--type",
                                                           help="f32, f16, q8_0 or q4_0 for the matrices (default: "
                                                                "f32, or the artifact's precision)")):
    """Write MODEL as a GGUF file that llama.cpp and transformers load (tokenizer and chat template included)."""
    from infeng_compiler.export_gguf import export_gguf

    summary = export_gguf(model, output, gguf_type)
    err.print(f"wrote {summary['out']} ({summary['architecture']}, {summary['type']}, "
              f"{summary['bytes'] / 2**20:.1f} MiB, tensors {summary['tensors']}, vocabulary {summary['vocab']})")


@app.command("verify")
@fails_cleanly
def verify_command(artifact: Path = typer.Argument(..., help="compiled artifact directory")):
    """Check an artifact's library and weights against the sizes and sha256 its manifest records."""
    from infeng_common.manifest import verify_artifact

    for name, digest in verify_artifact(artifact).items():
        print(f"{name}  sha256 {digest}  ok")


def serving_artifact(model: str | Path, options: CompileOptions) -> Path:
    """MODEL itself if it is an artifact; else MODEL compiled with ``options`` into the artifact
    cache (reused when the same model and options were compiled before), as ``serve`` and
    ``serve-ray`` do."""
    from infeng_common.manifest import is_artifact

    if is_artifact(model):
        return Path(model)
    from infeng_compiler.compile import cached_artifact

    with progress_bar() as bar:
        task = bar.add_task("compile", total=None)
        artifact, hit = cached_artifact(
            model, options, stage=lambda name: bar.update(task, description=name, completed=0, total=None),
            progress=lambda done, total: bar.update(task, completed=done, total=total))
    err.print(f"{'reusing' if hit else 'compiled'} {artifact}")
    return artifact
