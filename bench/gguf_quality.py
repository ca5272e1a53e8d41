"""Quality of a real model from a GGUF file, by the BENCHMARKS perplexity protocol, beside llama.cpp's
``llama-perplexity`` on the same file.

    python bench/gguf_quality.py                          # SmolLM2-135M-Instruct (Q4_1 GGUF), ctx 512
    python bench/gguf_quality.py --gguf model.gguf --max-bytes 200000

The model is SmolLM2-135M-Instruct from the package registry (``infeng_models.registry``) unless
``--gguf`` names another file. infeng compiles it (``infeng compile``) as:

- ``import``: the GGUF's matrices as imported (Q8_0/Q4_0/Q4_1 kept code for code);
- ``f32``: every weight widened to f32 (``--dtype f32``: the GGUF's values exactly; the reference);
- ``int8``, ``int4``, ``int4 --calib``: infeng's own formats, quantized from those values
  (calibration text: bytes 200,000-400,000 of the wikitext file, disjoint from the evaluation);

and measures each with ``infeng eval ARTIFACT --ppl TEXT --ctx CTX --kld-base F32`` on the first
``--max-bytes`` bytes of ``../shared/assets/text/wikitext-2-raw-v1-test.txt``: PPL, drift against
f32, mean KL divergence KL(f32 || config) and top-1 agreement over the scored positions. The
peer line runs ``llama-perplexity -m GGUF -f TEXT -c CTX`` (the build of
``../shared/tools/build-llamacpp.sh``) when it is there. One JSON line per result.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import PEER, emit  # noqa: E402

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
TEXT = ASSETS / "text" / "wikitext-2-raw-v1-test.txt"
CALIB = (200_000, 400_000)
CONFIGS = {"import": [], "f32": ["--dtype", "f32"], "int8": ["--dtype", "f32", "--quant", "int8"],
           "int4": ["--dtype", "f32", "--quant", "int4"],
           "int4-calib": ["--dtype", "f32", "--quant", "int4", "--calib", "{calib}"]}


def infeng(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "infeng_cli", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"infeng {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def llama_perplexity(gguf: Path, text: Path, ctx: int, threads: int) -> float | None:
    binary = PEER / "build" / "bin" / "llama-perplexity"
    if not binary.is_file():
        return None
    done = subprocess.run([str(binary), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-t", str(threads),
                           "-b", str(ctx)], capture_output=True, text=True,
                          env={"LD_LIBRARY_PATH": str(binary.parent)})
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if not found:
        raise SystemExit(f"llama-perplexity gave no estimate:\n{(done.stdout + done.stderr)[-2000:]}")
    return float(found.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, help="a GGUF file (default: SmolLM2-135M-Instruct from the registry)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-bytes", type=int, default=100_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "infeng" / "bench")
    args = ap.parse_args()
    if args.gguf is None:
        from infeng_models.registry import SMOLLM2_135M_INSTRUCT, fetch

        args.gguf = fetch(SMOLLM2_135M_INSTRUCT)
    args.workdir.mkdir(parents=True, exist_ok=True)
    data = TEXT.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        text, calib = Path(tmp) / "eval.txt", Path(tmp) / "calib.txt"
        text.write_bytes(data[:args.max_bytes])
        calib.write_bytes(data[CALIB[0]:CALIB[1]])
        artifacts = {}
        for name in ["f32"] + [c for c in args.configs if c != "f32"]:
            out = args.workdir / f"{args.gguf.stem}-{name}.infeng"
            options = [a.format(calib=calib) for a in CONFIGS[name]]
            infeng("compile", str(args.gguf), "-o", str(out), *options)
            artifacts[name] = out
        common = dict(model=args.gguf.name, ctx=args.ctx, eval_bytes=args.max_bytes)
        for name, artifact in artifacts.items():
            extra = [] if name == "f32" else ["--kld-base", str(artifacts["f32"])]
            result = json.loads(infeng("eval", str(artifact), "--ppl", str(text), "--ctx", str(args.ctx),
                                       "--threads", str(args.threads), "--json", *extra).strip().splitlines()[-1])
            weights = json.loads((artifact / "manifest.json").read_text())["weights_bytes"]
            row = dict(bench="gguf-quality", config=name, ppl=round(result["ppl"], 4), weights_bytes=weights,
                       chunks=result["chunks"], **common)
            if name != "f32":
                row.update(drift_pct=round(100 * (result["ppl"] / result["base_ppl"] - 1), 3),
                           kld=round(result["kld"], 6), top1_pct=round(100 * result["top1"], 2))
            emit(**row)
        peer = llama_perplexity(args.gguf, text, args.ctx, args.threads)
        if peer is not None:
            emit(bench="gguf-quality", config="llama.cpp (the GGUF as is)", ppl=peer,
                 weights_bytes=args.gguf.stat().st_size, **common)


if __name__ == "__main__":
    main()
