"""Decode speed of the ONNX-imported artifact against the Hugging Face-imported one, same model,
same run.

    python bench/onnx_vs_hf.py --model ../shared/assets/models/stories260K --tokens 256 --repeats 5

Exports the checkpoint with ``torch.onnx.export(dynamo=True)`` (``infeng_models.onnx_export``),
compiles both for the same target, then alternates batch-1 greedy decode runs of the two
artifacts. Prints one JSON line per run and per artifact (median tok/s) and the ratio onnx / hf.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def decode_tok_s(engine, prompt: list[int], tokens: int) -> float:
    logits = engine.step(np.array(prompt), np.arange(len(prompt)), np.zeros(len(prompt)),
                         np.array([len(prompt) - 1]))
    pos = len(prompt)
    t0 = time.perf_counter()
    for _ in range(tokens):
        token = int(logits[-1].argmax())
        logits = engine.step(np.array([token]), np.array([pos]), np.zeros(1))
        pos += 1
    seconds = time.perf_counter() - t0
    engine.free(0)
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO.parent / "shared/assets/models/stories260K"))
    ap.add_argument("--target", default="native")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    from infeng_compiler.compile import CompileOptions, compile_model
    from infeng_models.onnx_export import export_onnx
    from infeng_runtime.engine import Engine

    model = Path(args.model)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="onnx_vs_hf."))
    t0 = time.perf_counter()
    onnx_path = export_onnx(model, work / "onnx" / f"{model.name}.onnx")
    emit(bench="export", model=model.name, seconds=round(time.perf_counter() - t0, 2))
    artifacts = {}
    for kind, source in (("hf", model), ("onnx", onnx_path)):
        t0 = time.perf_counter()
        out = work / f"{model.name}-{kind}.infeng"
        summary = compile_model(source, out, CompileOptions(target=args.target, tokenizer=model))
        emit(bench="compile", frontend=kind, target=summary.target, seconds=round(time.perf_counter() - t0, 2))
        artifacts[kind] = out
    engines = {kind: Engine(path, threads=args.threads) for kind, path in artifacts.items()}
    prompt = [1] + list(range(10, 42))
    for kind, engine in engines.items():          # warm-up
        decode_tok_s(engine, prompt, 16)
    runs: dict[str, list[float]] = {kind: [] for kind in engines}
    for r in range(args.repeats):
        for kind, engine in engines.items():
            tok_s = decode_tok_s(engine, prompt, args.tokens)
            runs[kind].append(tok_s)
            emit(bench="decode", frontend=kind, run=r, tokens=args.tokens, tok_s=round(tok_s, 1))
    median = {kind: statistics.median(v) for kind, v in runs.items()}
    for kind, value in median.items():
        emit(bench="decode_median", frontend=kind, model=model.name, target=engines[kind].manifest["target"],
             threads=engines[kind].threads, tokens=args.tokens, repeats=args.repeats, tok_s=round(value, 1))
    emit(bench="ratio", model=model.name, onnx_over_hf=round(median["onnx"] / median["hf"], 4))


if __name__ == "__main__":
    main()
