"""The commands that run a model in this process: ``eval`` (perplexity), ``generate`` (the
interpreter), ``run`` (one prompt), ``chat`` (the terminal) and ``bench`` (the compiled library's speed)."""
from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape

from infeng_common.errors import InfengError
from infeng_runtime.api.options import ServeOptions
from infeng_runtime.sampling.params import SamplingParams

from .app import app, err, fails_cleanly, progress_bar
from .compile_cmds import CHAT_COMPILE, EVAL_QUANT, SERVING_MAX_ADAPTERS, compile_options, serving_artifact, \
    serving_max_adapters
from .params import OptionGroup, parse_named_paths, takes


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

    from infeng_compiler.frontends import import_model, model_source
    from infeng_compiler.interp import Interpreter

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
        from infeng_compiler.passes.manager import PassContext, PassManager

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
    from infeng_compiler.evaluate import perplexity, read_text
    from infeng_compiler.passes.quantize import quantize_entry

    given = compile_options(EVAL_QUANT, values)
    entry = quantize_entry(given.quant, given.quant_policy, given.calib, given.calib_max_bytes, given.calib_tokens)
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
    from infeng_compiler.options import DEFAULT_BLOCK_SIZE
    from infeng_compiler.quant.kv import graph_kv_bytes_per_token

    if hasattr(runner, "manifest"):
        kv = runner.manifest.get("kv")
        if kv:
            return kv["bytes_per_token"]
        c = runner.manifest["constants"]        # artifacts from before the kv section: f32 K and V
        return 2 * 4 * c["n_layers"] * c["n_kv_heads"] * c["head_dim"]
    return graph_kv_bytes_per_token(runner.graph, DEFAULT_BLOCK_SIZE)


#: The sampling options of ``generate``, ``run`` and ``chat`` (``SamplingParams``' declarations).
SAMPLING = OptionGroup(SamplingParams, panel="Sampling")
CHAT_SAMPLING = OptionGroup(SamplingParams, panel="Sampling", defaults={"max_new_tokens": 512})


@app.command("generate")
@fails_cleanly
@takes(SAMPLING)
def generate_command(model: Path = typer.Argument(..., help="model directory or Hub id org/name[@rev]"),
                     prompt: str = typer.Argument(..., help="the text to answer or continue"),
                     as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
                     tokenizer_dir: Optional[Path] = typer.Option(None, "--tokenizer", help="tokenizer dir (ONNX)"),
                     **values):
    """Continue PROMPT with the reference interpreter (slow, exact)."""
    from infeng_runtime.llm import LLM

    from infeng_compiler.interp_engine import InterpreterEngine

    runner, tokenizer = _load_runner(model, Backend.interp, tokenizer_dir=tokenizer_dir)
    params = SamplingParams(**SAMPLING.values(values))
    llm = LLM.over(InterpreterEngine(runner, tokenizer), prefix_cache=False)    # the engine loop, as infeng run
    stream = llm.stream(prompt, params)
    print_stream(prompt, stream, lambda: stream.completion, as_json, "interpreter", source=model)


def print_stream(prompt: str, pieces, result, as_json: bool, label: str,
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


#: What ``run`` offers of ``ServeOptions``: the engine's threads and speculative decoding, as ``serve``
#: takes them.
RUN_ENGINE = OptionGroup(ServeOptions, only=("threads", "speculative"), panel="Engine")


@app.command("run")
@fails_cleanly
@takes(SAMPLING, RUN_ENGINE)
def run_command(artifact: Path = typer.Argument(..., help="compiled artifact directory"),
                prompt: str = typer.Argument(..., help="the text to answer or continue"),
                adapter: list[str] = typer.Option([], "--adapter", metavar="NAME=DIR",
                                                  help="load a LoRA adapter (repeatable)"),
                use: Optional[str] = typer.Option(None, "--use", metavar="NAME", help="generate with adapter NAME"),
                raw: bool = typer.Option(False, "--raw", help="continue PROMPT as plain text, without the model's "
                                                             "chat template"),
                system: Optional[str] = typer.Option(None, "--system", help="system prompt (chat template only)"),
                as_json: bool = typer.Option(False, "--json", help="print one JSON object"), **values):
    """Answer PROMPT with a compiled artifact, streaming text, and print tok/s.

    A model with a chat template gets PROMPT as a user message, as `infeng chat` and the chat API
    send it (`--raw` continues the text as it is). The engine loop and scheduler are those of
    `infeng serve`: the same request gives the same text."""
    from infeng_runtime.chat import chat_prompt_ids, template_source
    from infeng_runtime.llm import LLM

    params = SamplingParams(**SAMPLING.values(values))
    engine = ServeOptions(**RUN_ENGINE.values(values))
    engine.check()                              # --threads -1: one line naming the flag
    spec = engine.speculative
    llm = LLM(artifact, threads=engine.threads, max_seqs=1, adapters=parse_named_paths(adapter, "--adapter"),
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

    def draft_counters() -> dict:
        s = llm.loop.speculator.stats
        return {"method": spec.method, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
                "acceptance": round(s.accepted_tokens / s.draft_tokens, 3) if s.draft_tokens else None,
                "steps": llm.loop.stats.steps}

    print_stream("" if templated else prompt, stream, lambda: stream.completion, as_json, label,
                 draft_counters if spec is not None else None, artifact)
    llm.close()


@app.command("chat")
@fails_cleanly
@takes(CHAT_SAMPLING, CHAT_COMPILE)
def chat_command(model: str = typer.Argument(..., help="compiled artifact, or a model (dir, .gguf, .onnx, Hub id) "
                                                           "compiled into the artifact cache first"),
                 system: Optional[str] = typer.Option(None, "--system", help="system prompt"),
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
    from infeng_runtime.terminal_chat import ChatSession, chat_loop

    params = SamplingParams(**CHAT_SAMPLING.values(values))
    if params.max_new_tokens < 1:               # an answer has a token at least (run and generate allow 0)
        raise InfengError(f"--max-new-tokens {params.max_new_tokens}: must be at least 1")
    artifact = serving_artifact(model, compile_options(
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
