"""Batch-1 decode and prefill speed of infeng against llama.cpp on the same weights, same run.

    python bench/decode.py --preset smollm135 --dtype f16 --threads 2          # vs llama.cpp F16
    python bench/decode.py --preset smollm135 --quant int4 --threads 2         # vs llama.cpp Q4_0
    python bench/decode.py --preset llama1b --quant int8                       # vs llama.cpp Q8_0
    python bench/decode.py --preset llama1b --quant int4 --quant-args embed=q4g32

Builds the synthetic checkpoint (``infeng_models.synthetic``, random init: values do not change
speed) if needed and compiles it with an f16 KV cache, as llama.cpp keeps by default: float
weights with ``--dtype``; quantized ones with ``kv-format(f16),cast-weights(f32),quantize(QUANT,
clip=0),fuse-linears`` (round-to-nearest: the clipping search changes codes, not bytes or work).
llama.cpp gets the GGUF its ``convert_hf_to_gguf.py`` makes (f32/f16/bf16), quantized with
``llama-quantize`` for ``--quant`` (int4 -> Q4_0, int8 and fp8 -> Q8_0). Then infeng and
``llama-bench`` rounds alternate and each side keeps its best. Decode is tg from an empty context,
like ``llama-bench -n``. Prints one JSON line per result: tok/s, the bandwidth roofline (bandwidth
measured at the start / weight bytes read per token: all of weights.bin but the embedding rows
not looked up) and the fraction reached, and the ratios infeng / llama.cpp. For the full
side-by-side protocol (several classes and thread counts, batched decode, charts) use
``bench/compare_llamacpp.py``. The peer comes from ../shared/tools/build-llamacpp.sh.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from infeng_runtime.membw import measure_bandwidth

PEER = Path(os.environ.get("PEER_DIR", Path.home() / ".cache" / "infeng-peers")) / "llama.cpp"
GGUF_TYPES = {"f32": "f32", "f16": "f16", "bf16": "bf16"}
QUANT_TYPES = {"int4": "Q4_0", "int8": "Q8_0", "fp8": "Q8_0"}


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def weights_label(args) -> str:
    return args.quant + (f",{args.quant_args}" if args.quant_args else "") if args.quant else args.dtype


def ensure_model(args) -> Path:
    if args.model:
        return Path(args.model)
    from infeng_models.synthetic import build_preset

    out = Path(args.workdir) / args.preset
    if not (out / "config.json").is_file():
        build_preset(args.preset, out)
    return out


def ensure_artifact(model: Path, args) -> Path:
    from infeng_compiler.compile import CompileOptions, compile_model

    label = weights_label(args).replace(",", "-").replace("=", "")
    out = Path(args.workdir) / f"{model.name}-{label}-kvf16-{args.target}.infeng"
    if args.quant:
        extra = f",{args.quant_args}" if args.quant_args else ""
        options = CompileOptions(target=args.target,
                                 passes=f"kv-format(f16),cast-weights(f32),quantize({args.quant},clip=0{extra}),fuse-linears")
    else:
        options = CompileOptions(target=args.target, dtype=args.dtype, kv="f16")
    t0 = time.perf_counter()
    summary = compile_model(model, out, options)
    emit(bench="compile", model=model.name, weights=weights_label(args), target=summary.target,
         seconds=round(time.perf_counter() - t0, 2), cache_hit=summary.cache_hit, weights_bytes=summary.weights_bytes)
    return out


def ensure_gguf(model: Path, args) -> Path:
    outtype = "f16" if args.quant else args.dtype
    converted = Path(args.workdir) / f"{model.name}-{outtype}.gguf"
    if not converted.is_file():
        subprocess.run([sys.executable, str(PEER / "convert_hf_to_gguf.py"), str(model), "--outtype",
                        GGUF_TYPES[outtype], "--outfile", str(converted)], check=True, capture_output=True)
    if not args.quant:
        return converted
    kind = QUANT_TYPES[args.quant]
    out = Path(args.workdir) / f"{model.name}-{kind}.gguf"
    if not out.is_file():
        subprocess.run([str(PEER / "build" / "bin" / "llama-quantize"), str(converted), str(out), kind],
                       check=True, capture_output=True)
    return out


def infeng_run(artifact: Path, args) -> dict[str, float]:
    from infeng_runtime.engine import Engine

    engine = Engine(artifact, threads=args.threads, max_seqs=1, max_context=args.prompt_len + args.gen_len + 16)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, engine.vocab_size, size=args.prompt_len).astype(np.int32)
    engine.step(prompt[:16], np.arange(16), np.zeros(16), np.array([15]))               # warm up
    engine.free(0)
    t0 = time.perf_counter()
    engine.step(prompt, np.arange(args.prompt_len), np.zeros(args.prompt_len), np.array([args.prompt_len - 1]))
    prefill = args.prompt_len / (time.perf_counter() - t0)
    engine.free(0)
    token = np.array([1], dtype=np.int32)          # tg like llama-bench: from an empty context
    step_times = []
    for pos in range(args.gen_len):
        t = time.perf_counter()
        logits = engine.step(token, np.array([pos]), np.zeros(1), np.array([0]))
        token = np.array([int(logits[0].argmax())], dtype=np.int32)
        step_times.append(time.perf_counter() - t)
    engine.free(0)
    m = engine.manifest
    table = next(t for t in m["tensors"] if t["name"].endswith("embed_tokens.weight"))
    rows_not_read = table["nbytes"] if not m["meta"].get("tie_word_embeddings", True) else 0
    return {"pp": prefill, "tg": args.gen_len / sum(step_times), "p50_ms": float(np.median(step_times) * 1e3),
            "bytes_per_token": m["weights_bytes"] - rows_not_read}


def llamacpp_run(gguf: Path, args) -> dict[str, float]:
    out = subprocess.run([str(PEER / "build" / "bin" / "llama-bench"), "-m", str(gguf), "-p", str(args.prompt_len),
                          "-n", str(args.gen_len), "-t", str(args.threads), "-r", "3", "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    result = {}
    for row in json.loads(out):
        result["pp" if row["n_prompt"] > 0 else "tg"] = row["avg_ts"]
    result["bytes"] = gguf.stat().st_size
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm135")
    ap.add_argument("--model", help="a Hugging Face model dir instead of a preset")
    ap.add_argument("--dtype", default="f16", choices=sorted(GGUF_TYPES), help="float weights (without --quant)")
    ap.add_argument("--quant", choices=sorted(QUANT_TYPES), help="quantized weights instead of --dtype")
    ap.add_argument("--quant-args", default="", help="more quantize() arguments, e.g. embed=q4g32 or group=64")
    ap.add_argument("--target", default="native")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="alternating infeng/llama.cpp rounds")
    ap.add_argument("--workdir", default=str(Path.home() / ".cache" / "infeng" / "bench"))
    ap.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    args = ap.parse_args()
    if args.quant_args and not args.quant:
        ap.error("--quant-args needs --quant")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)

    model = ensure_model(args)
    artifact = ensure_artifact(model, args)
    gguf = None if args.no_peer else ensure_gguf(model, args)
    bandwidth = measure_bandwidth(args.threads)
    emit(bench="bandwidth", threads=args.threads, gb_s=round(bandwidth, 2))

    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        runs = {"infeng": infeng_run(artifact, args)}
        if gguf:
            runs["llama.cpp"] = llamacpp_run(gguf, args)
        for engine, r in runs.items():
            for k, v in r.items():
                best.setdefault(engine, {})
                best[engine][k] = max(best[engine].get(k, 0.0), v) if k in ("pp", "tg") else v
    roofline = bandwidth * 1e9 / best["infeng"]["bytes_per_token"]
    common = dict(model=model.name, weights=weights_label(args), threads=args.threads)
    for engine, r in best.items():
        emit(bench="prefill", engine=engine, prompt_len=args.prompt_len, tok_s=round(r["pp"], 1), **common)
        emit(bench="decode", engine=engine, gen_len=args.gen_len, tok_s=round(r["tg"], 1),
             roofline_tok_s=round(roofline, 1), roofline_frac=round(r["tg"] / roofline, 3),
             **({"weights_bytes": int(r["bytes_per_token"])} if engine == "infeng" else {"gguf_bytes": int(r["bytes"])}),
             **common)
    if "llama.cpp" in best:
        peer = QUANT_TYPES[args.quant] if args.quant else args.dtype.upper()
        emit(bench="ratio", peer=peer, decode=round(best["infeng"]["tg"] / best["llama.cpp"]["tg"], 3),
             prefill=round(best["infeng"]["pp"] / best["llama.cpp"]["pp"], 3), **common)


if __name__ == "__main__":
    main()
