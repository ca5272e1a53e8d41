"""Quality of calibrated int4 compiles by calibration token budget, compiled and measured by the
BENCHMARKS perplexity protocol (docs/performance.md, *Calibration token budget*): the table that a
change of calibration owes, and the one the default ``--calib-tokens`` is chosen by.

    python bench/calib_quality.py stories260K smollm135 smollm2 --budgets none,512,1024,2048,4096,0
    python bench/calib_quality.py /tmp/smollm135 --calib-bytes 50000 --eval-bytes 30000 --budgets 0 --label main

MODEL is a model directory or file, or a name: ``stories260K`` (the shared assets), ``smollm135``
(the benchmark shape, synthetic bf16, built into the work directory: ``infeng_models.synthetic``),
``smollm2`` (SmolLM2-135M-Instruct's Q4_1 GGUF from the package registry, ``infeng_models.registry``).
For each model: one ``--dtype f32`` compile (the reference, once per work directory), then per
budget one ``--dtype f32 --quant int4 --calib CALIB --calib-tokens B`` compile (``0``: every token
of CALIB; ``none``: ``--quant int4`` without calibration), evaluated with ``infeng eval
--kld-base`` the f32 one: perplexity, mean KL divergence KL(f32 || int4), top-1 agreement over the
scored positions. ``--dtype f32`` also widens a GGUF's Q4_1/Q8_0 matrices (without it they are kept
code for code and ``--quant``/``--calib`` have nothing to choose), so for ``smollm2`` the rows
requantize the dequantized file. Evaluation text: the first ``--eval-bytes`` of wikitext-2 test;
calibration text: ``--calib-bytes`` from byte ``--calib-start`` (200,000) of the same file (disjoint;
another start is another sample of text: the rows' spread between samples is the noise). ``--label``
names the code version (run once per ``PYTHONPATH`` checkout to compare two). One JSON line per row.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
TEXT = ASSETS / "text" / "wikitext-2-raw-v1-test.txt"


def infeng(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "infeng_cli", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"infeng {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def model_path(name: str, work: Path) -> Path:
    """A named model (built or fetched on first use) or the path given."""
    if name == "stories260K":
        return ASSETS / "models" / "stories260K"
    if name == "smollm135":
        from infeng_models.synthetic import build_preset

        built = work / "smollm135-model"
        if not (built / "config.json").is_file():
            build_preset("smollm135", built)
        return built
    if name == "smollm2":
        from infeng_models.registry import SMOLLM2_135M_INSTRUCT, fetch

        return fetch(SMOLLM2_135M_INSTRUCT)
    return Path(name)


def row(model: Path, name: str, budget: str, work: Path, calib: Path, text: Path, args) -> dict:
    base = work / "f32.infeng"
    if not (base / "manifest.json").is_file():
        infeng("compile", str(model), "-o", str(base), "--dtype", "f32", "-q")
    out = work / f"int4-{budget}-{args.calib_start}-{args.label}.infeng"
    calibration = [] if budget == "none" else ["--calib", str(calib), "--calib-tokens", budget]
    start = time.perf_counter()
    infeng("compile", str(model), "-o", str(out), "--dtype", "f32", "--quant", "int4", *calibration, "--rebuild", "-q")
    seconds = time.perf_counter() - start
    result = json.loads(infeng("eval", str(out), "--ppl", str(text), "--ctx", str(args.ctx), "--threads",
                               str(args.threads), "--kld-base", str(base), "--json").strip().splitlines()[-1])
    manifest = json.loads((out / "manifest.json").read_text())
    return dict(model=name, label=args.label, budget=budget, calib_tokens=manifest.get("quant", {}).get("calib_tokens"),
                ppl=round(result["ppl"], 4), base_ppl=round(result["base_ppl"], 4), kld=round(result["kld"], 6),
                top1_pct=round(100 * result["top1"], 2), chunks=result["chunks"], ctx=args.ctx,
                eval_bytes=args.eval_bytes, calib_bytes=args.calib_bytes, calib_start=args.calib_start,
                compile_seconds=round(seconds, 1),
                weights_sha256=hashlib.sha256((out / "weights.bin").read_bytes()).hexdigest())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="model dirs/files, or stories260K, smollm135, smollm2")
    ap.add_argument("--budgets", default="none,512,1024,2048,4096,0",
                    help="comma-separated --calib-tokens values (0: all; none: no calibration)")
    ap.add_argument("--label", default="current", help="names the code version in the output")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--eval-bytes", type=int, default=30_000)
    ap.add_argument("--calib-bytes", type=int, default=50_000)
    ap.add_argument("--calib-start", type=int, default=200_000, help="where the calibration text starts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/infeng-calib-quality"))
    args = ap.parse_args()
    data = TEXT.read_bytes()
    for name in args.models:
        work = args.workdir / Path(name).name
        work.mkdir(parents=True, exist_ok=True)
        text, calib = work / f"eval-{args.eval_bytes}.txt", work / f"calib-{args.calib_start}-{args.calib_bytes}.txt"
        text.write_bytes(data[:args.eval_bytes])
        calib.write_bytes(data[args.calib_start:args.calib_start + args.calib_bytes])
        model = model_path(name, work)
        for budget in args.budgets.split(","):
            print(json.dumps(row(model, Path(name).name, budget.strip(), work, calib, text, args)), flush=True)


if __name__ == "__main__":
    main()
