"""The work around inference: ``finetune`` (a LoRA adapter) and ``run-batch`` (an OpenAI Batch file)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from infeng_runtime.api.options import ServeOptions

from .app import app, err, fails_cleanly
from .compile_cmds import BATCH_COMPILE, compile_options, serving_artifact, serving_max_adapters
from .params import OptionGroup, takes


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
    from infeng_compiler.finetune import FinetuneOptions, TrainProgress, finetune

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


#: What ``run-batch`` offers of ``ServeOptions``: the engine and the model's names, not the HTTP side.
BATCH_SERVE = OptionGroup(ServeOptions, only=("threads", "max_seqs", "max_context", "adapters", "served_model_name"),
                          panel="Engine")


@app.command("run-batch")
@fails_cleanly
@takes(BATCH_SERVE, BATCH_COMPILE)
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
        warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="one step of every shape before the job"),
        **values):
    """Run an OpenAI Batch file (`custom_id`, `method`, `url`, `body` per line) through the
    server's engine loop: results in input order, one error line per bad line (docs/batch.md)."""
    from infeng_runtime.batch_jobs import run_batch
    from infeng_runtime.server import build_server
    from infeng_runtime.warmup import warm_up

    options = ServeOptions(**BATCH_SERVE.values(values), log_level="warning")
    concurrency = max_concurrency or options.max_seqs
    options.max_queue = max(256, concurrency)
    options.check()
    artifact = serving_artifact(model, compile_options(
        BATCH_COMPILE, values, max_adapters=serving_max_adapters(None, len(options.adapters))))
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
