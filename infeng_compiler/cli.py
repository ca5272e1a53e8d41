"""The ``infeng`` command. Every InfengError becomes one line on stderr and exit code 2."""
from __future__ import annotations

import functools
import json
import sys
from enum import Enum
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from .errors import InfengError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="infeng: compile Hugging Face / ONNX LLMs and LoRA adapters to CPU kernels.")
err = Console(stderr=True)


def fails_cleanly(fn: Callable) -> Callable:
    """Turn InfengError (and a broken pipe or ^C) into one line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InfengError as e:
            err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def progress_bar(transient: bool = True) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeRemainingColumn(), console=err, transient=transient)


class IRFormat(str, Enum):
    text = "text"
    json = "json"
    dot = "dot"


@app.command("ir")
@fails_cleanly
def ir_command(model: Path = typer.Argument(..., help="model directory or model.safetensors"),
               format: IRFormat = typer.Option(IRFormat.text, "--format", help="text, json or dot"),
               output: Optional[Path] = typer.Option(None, "-o", "--output", help="write here instead of stdout")):
    """Import MODEL and print its IR graph."""
    from .frontends.hf import import_hf
    from .ir import print_graph
    from .ir.serialize import to_dot, to_json

    graph = import_hf(model)
    text = {"text": print_graph, "json": to_json, "dot": to_dot}[format.value](graph)
    if output:
        output.write_text(text)
        err.print(f"wrote {output} ({len(graph.nodes)} nodes, {len(graph.weights)} weights)")
    else:
        sys.stdout.write(text)


class Backend(str, Enum):
    interp = "interp"


def _load_interp(model: Path):
    from infeng_runtime.tokenizer import Tokenizer

    from .frontends.hf import import_hf, resolve_model_dir
    from .interp import Interpreter

    graph = import_hf(model)
    tokenizer = Tokenizer(resolve_model_dir(model), graph.meta.get("bos_token_id"), graph.meta.get("eos_token_ids"))
    return Interpreter(graph), tokenizer


@app.command("eval")
@fails_cleanly
def eval_command(model: Path = typer.Argument(..., help="model directory"),
                 ppl: Path = typer.Option(..., "--ppl", help="text file to measure perplexity on"),
                 ctx: int = typer.Option(512, "--ctx", help="tokens per chunk"),
                 max_bytes: Optional[int] = typer.Option(None, "--max-bytes", help="use only the first N bytes"),
                 backend: Backend = typer.Option(Backend.interp, "--backend"),
                 batch: int = typer.Option(8, "--batch", help="chunks per forward step"),
                 as_json: bool = typer.Option(False, "--json", help="print one JSON object")):
    """Perplexity by the llama.cpp protocol (BOS per chunk, second half of each chunk scored)."""
    from .evaluate import perplexity, read_text

    runner, tokenizer = _load_interp(model)
    ids = tokenizer.encode(read_text(ppl, max_bytes), add_bos=True)
    with progress_bar() as bar:
        task = bar.add_task("perplexity", total=None)
        result = perplexity(runner.step, runner.free, ids, ctx, tokenizer.bos_token_id, batch=batch,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))
    out = {**result.as_dict(), "backend": backend.value, "model": str(model)}
    if as_json:
        print(json.dumps(out))
    else:
        print(f"PPL {result.ppl:.4f}  ({result.chunks} chunks of {ctx}, {result.scored} tokens scored, "
              f"{result.seconds:.1f} s)")


@app.command("generate")
@fails_cleanly
def generate_command(model: Path = typer.Argument(..., help="model directory"),
                     prompt: str = typer.Argument(...),
                     max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n"),
                     temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy"),
                     top_p: float = typer.Option(1.0, "--top-p"),
                     top_k: int = typer.Option(0, "--top-k"),
                     seed: Optional[int] = typer.Option(None, "--seed"),
                     as_json: bool = typer.Option(False, "--json")):
    """Continue PROMPT with the reference interpreter (slow, exact)."""
    from infeng_runtime.generation import Generation, stream
    from infeng_runtime.sampling import SamplingParams

    runner, tokenizer = _load_interp(model)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed)
    result = Generation()
    pieces = stream(runner, tokenizer, tokenizer.encode(prompt), params, result=result)
    if as_json:
        for _ in pieces:
            pass
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "tok_s": round(result.tok_s, 2)}))
        return
    sys.stdout.write(prompt)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    err.print(f"[dim]{len(result.token_ids)} tokens, {result.tok_s:.1f} tok/s (interpreter)[/]")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
