"""Quality of a calibrated int4 compile, compiled and measured by the BENCHMARKS perplexity protocol
(docs/performance.md, *Calibrated compiles*): the table that a change of calibration owes.

    python bench/calib_quality.py ../shared/assets/models/stories260K --label branch
    python bench/calib_quality.py /tmp/smollm135 --calib-bytes 50000 --eval-bytes 30000 --label branch
    python bench/calib_quality.py SmolLM2-135M-Instruct.Q4_1.gguf --calib-bytes 50000 --label branch

Compiles MODEL with ``--dtype f32`` (the reference, once per work directory) and with ``--dtype f32
--quant int4 --calib CALIB``, then evaluates the int4 artifact with ``infeng eval --kld-base`` the
f32 one: perplexity, mean KL divergence KL(f32 || int4) and top-1 agreement over the scored
positions. Evaluation text: the first ``--eval-bytes`` of wikitext-2 test; calibration text:
``--calib-bytes`` from byte 200,000 of the same file (disjoint). Run it once per code version
(``PYTHONPATH`` naming another checkout's package root, ``--label`` naming it) to compare two
calibrations on the same model and text. One JSON line per run.
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
CALIB_START = 200_000


def infeng(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "infeng_compiler.cli", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"infeng {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--label", default="current", help="names the code version in the output")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--eval-bytes", type=int, default=100_000)
    ap.add_argument("--calib-bytes", type=int, default=200_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/infeng-calib-quality"))
    args = ap.parse_args()
    work = args.workdir / args.model.name
    work.mkdir(parents=True, exist_ok=True)
    data = TEXT.read_bytes()
    text, calib = work / "eval.txt", work / "calib.txt"
    text.write_bytes(data[:args.eval_bytes])
    calib.write_bytes(data[CALIB_START:CALIB_START + args.calib_bytes])
    base = work / "f32.infeng"
    if not (base / "manifest.json").is_file():
        infeng("compile", str(args.model), "-o", str(base), "--dtype", "f32", "-q")
    out = work / f"int4-calib-{args.label}.infeng"
    start = time.perf_counter()
    infeng("compile", str(args.model), "-o", str(out), "--dtype", "f32", "--quant", "int4", "--calib", str(calib),
           "--rebuild", "-q")
    seconds = time.perf_counter() - start
    result = json.loads(infeng("eval", str(out), "--ppl", str(text), "--ctx", str(args.ctx), "--threads",
                               str(args.threads), "--kld-base", str(base), "--json").strip().splitlines()[-1])
    print(json.dumps(dict(model=args.model.name, label=args.label, ppl=round(result["ppl"], 4),
                          base_ppl=round(result["base_ppl"], 4), kld=round(result["kld"], 6),
                          top1_pct=round(100 * result["top1"], 2), chunks=result["chunks"], ctx=args.ctx,
                          eval_bytes=args.eval_bytes, calib_bytes=args.calib_bytes,
                          compile_seconds=round(seconds, 1),
                          weights_sha256=hashlib.sha256((out / "weights.bin").read_bytes()).hexdigest())), flush=True)


if __name__ == "__main__":
    main()
