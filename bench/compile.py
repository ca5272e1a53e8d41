"""Compile time: where an ``infeng compile`` spends its time, one JSON line per stage (docs/performance.md).

    python bench/compile.py ../shared/assets/models/stories260K --quant int4 \\
        --calib ../shared/assets/text/wikitext-2-raw-v1-test.txt --calib-max-bytes 200000
    python bench/compile.py /tmp/smollm135 --dtype f16
    python bench/compile.py /tmp/llama1b --quant int4 --passes-detail

Each run compiles MODEL into a temporary artifact with an empty build cache (``INFENG_CACHE_DIR``
and the search cache pointed at a fresh temporary directory: a cold compile), then, with
``--recompile``, once more with the caches it just filled (a cached recompile). Lines:

    {"run": "cold", "stage": "import", "seconds": ...}     one per stage (import, passes, build, ...)
    {"run": "cold", "pass": "quantize", "seconds": ...}     one per pass with --passes-detail
    {"run": "cold", "stage": "total", "seconds": ..., "weights_sha256": ...}

Build the benchmark shapes with ``python -m infeng_models.synthetic smollm135|llama1b DIR``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def run(label: str, model: str, out: Path, options, passes_detail: bool) -> None:
    from infeng_compiler.compile import compile_model

    start = time.perf_counter()
    summary = compile_model(model, out, options)
    total = time.perf_counter() - start
    for name, seconds in summary.stages.items():
        emit(run=label, stage=name, seconds=round(seconds, 3))
        if name == "passes" and passes_detail:
            for record in summary.passes:
                emit(run=label, **{"pass": record.name}, seconds=round(record.seconds, 3))
    emit(run=label, stage="total", seconds=round(total, 3), build_cache_hit=summary.cache_hit,
         pipeline=summary.pipeline, weights_sha256=file_sha256(out / "weights.bin"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--quant", choices=("int8", "int4", "fp8"))
    ap.add_argument("--dtype", choices=("f32", "f16", "bf16"))
    ap.add_argument("--kv", default="f32")
    ap.add_argument("--calib", type=Path)
    ap.add_argument("--calib-max-bytes", type=int)
    ap.add_argument("--calib-tokens", type=int, help="calibration token budget (default: the compiler's; 0: all)")
    ap.add_argument("--target", default="native")
    ap.add_argument("--recompile", action="store_true", help="then compile again with the caches filled")
    ap.add_argument("--passes-detail", action="store_true", help="also one line per pass")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="infeng-bench-compile-") as tmp:
        os.environ["INFENG_CACHE_DIR"] = str(Path(tmp) / "cache" / "build")    # cold: nothing built before
        from infeng_compiler.compile import CompileOptions

        options = CompileOptions(target=args.target, dtype=args.dtype, quant=args.quant, kv=args.kv,
                                 calib=args.calib, calib_max_bytes=args.calib_max_bytes,
                                 **({} if args.calib_tokens is None else {"calib_tokens": args.calib_tokens}))
        run("cold", args.model, Path(tmp) / "cold.infeng", options, args.passes_detail)
        if args.recompile:
            run("cached", args.model, Path(tmp) / "cached.infeng", options, args.passes_detail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
