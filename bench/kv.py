"""KV cache formats: decode speed at long context, and quality (docs/kv-cache.md).

    python bench/kv.py speed --preset smollm135 --dtype f16 --kv f16,fht-int8,fht-int4 \\
        --contexts 128,1024,2048 --batch 1,8 --threads 2
    python bench/kv.py quality                  # stories260K + a head_dim-64 model with K outliers
    python bench/kv.py quality --centre 0,1     # also with K centred on calibration text

``speed`` compiles the preset once per KV scheme, fills every sequence's cache with a ``ctx``-token
prompt, then alternates rounds of ``--gen`` decode steps between the schemes (same machine state for
all), and prints one JSON line per (scheme, context, batch): decode tok/s (median and best round),
ms per step, KV bytes per token, KV bytes read per step, and the ratio to the first scheme. With
``--gguf`` (the same weights converted for llama.cpp), llama-bench then decodes at the same depth
with its closest cache type (f16, q8_0, q4_0; flash attention on) and a ``peer`` line gives
infeng / llama.cpp per scheme.

``quality`` runs the BENCHMARKS perplexity protocol (stories260K, first 100,000 bytes of wikitext-2
test, ctx 256) for each scheme with and without an f16 window, against the f32-cache artifact:
PPL, drift, mean KL divergence, top-1 agreement. ``--centre 1`` compiles the int8/int4 schemes with
``--calib`` (K mean-centring) on bytes 200,000-400,000 of the same file, disjoint from the evaluated
text (``--centre 0,1``: both). Then the same KL/top-1 figures on a random-init
Llama with head_dim 64 whose k_proj rows of a few channels are scaled up (the outlier channels of
trained models), where per-token int4 without the rotation collapses.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO.parent / "shared" / "assets"
WIKITEXT = ASSETS / "text" / "wikitext-2-raw-v1-test.txt"


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


CALIB = (200_000, 400_000)            # calibration bytes of WIKITEXT (as bench/quant_quality.py)


def calib_text(workdir: Path) -> Path:
    out = workdir / "calib-200k-400k.txt"
    if not out.is_file():
        out.write_bytes(WIKITEXT.read_bytes()[CALIB[0]:CALIB[1]])
    return out


def artifact(model: Path, workdir: Path, kv: str, window: int = 0, dtype: str = "f32", target: str = "native",
             calib: Path | None = None, quant: str | None = None) -> Path:
    from infeng_compiler.compile import CompileOptions, compile_model

    weights = quant or dtype
    out = workdir / f"{model.name}-{weights}-kv{kv}-w{window}-{target}{'-centred' if calib else ''}.infeng"
    t0 = time.perf_counter()
    summary = compile_model(model, out, CompileOptions(target=target, dtype=dtype, kv=kv, kv_window=window,
                                                       calib=calib, quant=quant))
    emit(bench="compile", model=model.name, kv=kv, window=window, weights=weights, target=summary.target,
         centred=summary.kv_centred, seconds=round(time.perf_counter() - t0, 2), cache_hit=summary.cache_hit,
         kv_bytes_per_token=summary.kv_bytes_per_token)
    return out


# ---------------------------------------------------------------------------------------------
# speed
def speed(args) -> None:
    from infeng_models.synthetic import build_preset
    from infeng_runtime.engine import Engine
    from infeng_runtime.membw import measure_bandwidth

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else workdir / args.preset
    if not (model / "config.json").is_file():
        build_preset(args.preset, model)
    schemes = args.kv.split(",")
    calib = calib_text(workdir) if args.centre else None
    arts = {kv: artifact(model, workdir, kv, args.window if kv not in ("f32", "f16") else 0, args.dtype, args.target,
                         calib if kv.endswith(("int8", "int4")) else None, args.quant)
            for kv in schemes}
    emit(bench="bandwidth", threads=args.threads, gb_s=round(measure_bandwidth(args.threads), 2))
    rng = np.random.default_rng(0)
    for batch in (int(b) for b in args.batch.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            engines, positions = {}, {}
            for kv, path in arts.items():
                engine = Engine(path, threads=args.threads, max_seqs=batch,
                                max_context=ctx + args.rounds * args.gen + 16)
                for s in range(batch):          # fill each sequence's cache with its own prompt
                    prompt = rng.integers(3, engine.vocab_size, ctx).astype(np.int32)
                    engine.step(prompt, np.arange(ctx), np.full(ctx, s), np.array([ctx - 1]))
                engines[kv], positions[kv] = engine, ctx
            rounds: dict[str, list[float]] = {kv: [] for kv in arts}
            for _ in range(args.rounds):
                for kv, engine in engines.items():
                    tokens = np.ones(batch, np.int32)
                    seqs = np.arange(batch)
                    t0 = time.perf_counter()
                    for _ in range(args.gen):
                        engine.step(tokens, np.full(batch, positions[kv]), seqs)
                        positions[kv] += 1
                    rounds[kv].append(time.perf_counter() - t0)
            first = None
            for kv, times in rounds.items():
                tok_s = [batch * args.gen / t for t in times]
                median = statistics.median(tok_s)
                first = first or median
                per_token = engines[kv].manifest["kv"]["bytes_per_token"]
                emit(bench="decode", weights=args.quant or args.dtype, kv=kv, ctx=ctx, batch=batch,
                     threads=engines[kv].threads,
                     tok_s=round(median, 2), tok_s_best=round(max(tok_s), 2),
                     ms_per_step=round(1e3 * statistics.median(times) / args.gen, 3),
                     kv_bytes_per_token=per_token, kv_mb_read_per_step=round(batch * ctx * per_token / 1e6, 2),
                     vs_first=round(median / first, 3), first=schemes[0], rounds=args.rounds)
            for engine in engines.values():
                engine.close()
            if args.gguf and batch == 1:
                peer(Path(args.gguf), schemes, ctx, args, rounds)


#: llama.cpp's KV cache type closest to each scheme (its quantized V cache needs flash attention).
PEER_CACHE = {"f16": "f16", "int8": "q8_0", "fht-int8": "q8_0", "int4": "q4_0", "fht-int4": "q4_0"}


def peer(gguf: Path, schemes: list[str], ctx: int, args, rounds: dict[str, list[float]]) -> None:
    """llama-bench on the same weights at depth ``ctx`` with the matching cache types, right after
    infeng's rounds: decode tok/s and infeng / llama.cpp for each scheme."""
    from compare_llamacpp import PEER_BIN, peer_env, require_peer, run

    require_peer("llama-bench")
    for kv in schemes:
        cache = PEER_CACHE[kv]
        out = run([str(PEER_BIN / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(args.gen), "-d", str(ctx),
                   "-ctk", cache, "-ctv", cache, "-fa", "on", "-t", str(args.threads), "-r", str(args.rounds),
                   "-o", "json"], f"llama-bench {gguf.name} -d {ctx}", peer_env())
        peer_tok_s = json.loads(out)[0]["avg_ts"]
        infeng_tok_s = statistics.median(args.gen / t for t in rounds[kv])
        emit(bench="peer", engine="llama.cpp", gguf=gguf.name, kv=kv, cache_type=cache, ctx=ctx, batch=1,
             threads=args.threads, tok_s=round(peer_tok_s, 2), infeng_tok_s=round(infeng_tok_s, 2),
             infeng_vs_peer=round(infeng_tok_s / peer_tok_s, 3))


# ---------------------------------------------------------------------------------------------
# quality
def evaluate(path: Path, base: Path, text: str, ctx: int, tokenizer_from: Path | None = None) -> dict:
    from infeng_compiler.evaluate import perplexity
    from infeng_runtime.engine import Engine

    engine, base_engine = Engine(path), Engine(base)
    tokenizer = engine.tokenizer
    ids = tokenizer.encode(text, add_bos=True)
    result = perplexity(engine.step, engine.free, ids, ctx, tokenizer.bos_token_id, batch=8,
                        base_step=base_engine.step, base_free=base_engine.free).as_dict()
    return {k: result[k] for k in ("ppl", "base_ppl", "drift", "kld", "kld_max", "top1", "chunks")} | {
        "kv_bytes_per_token": engine.manifest["kv"]["bytes_per_token"]}


def outlier_model(out: Path, outliers: float) -> Path:
    """A random-init Llama, head_dim 64, whose k_proj rows of two RoPE channel pairs per KV head are
    ``outliers`` x larger (and q_proj's same rows as much smaller, so that those channels do not
    simply take over the scores): per-token K quantization spends its range on them."""
    from safetensors.numpy import load_file, save_file

    from infeng_models.synthetic import build_checkpoint, build_tokenizer

    if (out / "config.json").is_file():
        return out
    build_checkpoint(out, "llama", hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                     vocab=1024, init_std=0.1, max_position=1024)
    build_tokenizer(out, vocab_size=1024)
    tensors = load_file(out / "model.safetensors")
    for name in tensors:
        if name.endswith("k_proj.weight") or name.endswith("q_proj.weight"):
            heads = tensors[name].shape[0] // 64
            w = tensors[name].reshape(heads, 64, -1).copy()
            for channel in (3, 35, 17, 49):        # two RoPE pairs (d, d + 32) of every head
                w[:, channel] *= outliers if "k_proj" in name else 1.0 / np.sqrt(outliers)
            tensors[name] = w.reshape(tensors[name].shape)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def quality(args) -> None:
    from infeng_compiler.evaluate import read_text

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    schemes = args.kv.split(",")
    windows = [int(w) for w in args.windows.split(",")]
    centres = [bool(int(c)) for c in args.centre.split(",")]
    calib = calib_text(workdir)
    text = read_text(WIKITEXT, args.max_bytes)

    def variants():              # (kv, window, centred) per scheme: windows and centring for int8/int4 only
        for kv in schemes:
            quantized = kv.endswith(("int8", "int4"))
            for window in windows if quantized else [0]:
                for centred in centres if quantized else [False]:
                    yield kv, window, centred

    stories = ASSETS / "models" / "stories260K"
    if "stories" in args.models:
        base = artifact(stories, workdir, "f32")
        for kv, window, centred in variants():
            emit(bench="quality", model="stories260K", kv=kv, window=window, centred=centred, ctx=256,
                 **evaluate(artifact(stories, workdir, kv, window, calib=calib if centred else None), base, text, 256))
    if "outliers" not in args.models:
        return
    model = outlier_model(workdir / f"outliers-hd64-x{args.outliers:g}", args.outliers)
    base = artifact(model, workdir, "f32")
    for kv, window, centred in variants():
        result = evaluate(artifact(model, workdir, kv, window, calib=calib if centred else None), base,
                          text[:args.outlier_bytes], 256)
        emit(bench="quality", model=model.name, kv=kv, window=window, centred=centred, ctx=256,
             **{k: result[k] for k in ("kld", "kld_max", "top1", "chunks", "kv_bytes_per_token")})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    sp = sub.add_parser("speed", help="decode tok/s per KV scheme and context")
    sp.add_argument("--preset", default="smollm135")
    sp.add_argument("--model", help="a Hugging Face model dir instead of a preset")
    sp.add_argument("--dtype", default="f16", help="weight storage (f32, f16, bf16)")
    sp.add_argument("--quant", help="quantized weights instead (int8, int4; infeng compile --quant)")
    sp.add_argument("--gguf", help="the same weights for llama.cpp: llama-bench at each context (batch 1) with "
                                   "its f16 / q8_0 / q4_0 cache for f16 / int8 / int4 schemes")
    sp.add_argument("--target", default="native")
    sp.add_argument("--kv", default="f16,fht-int8,fht-int4", help="schemes; ratios are against the first")
    sp.add_argument("--window", type=int, default=0, help="--kv-window for the int8/int4 schemes")
    sp.add_argument("--centre", type=int, default=0, help="1: int8/int4 schemes with K centred (--calib)")
    sp.add_argument("--contexts", default="128,1024,2048")
    sp.add_argument("--batch", default="1", help="sequences decoded together, e.g. 1,8")
    sp.add_argument("--gen", type=int, default=32, help="decode steps per round")
    sp.add_argument("--rounds", type=int, default=3, help="rounds alternating between the schemes")
    sp.add_argument("--threads", type=int, default=2)
    sp.add_argument("--workdir", default=str(Path.home() / ".cache" / "infeng" / "bench"))
    qp = sub.add_parser("quality", help="PPL drift, KL divergence and top-1 agreement per KV scheme")
    qp.add_argument("--kv", default="f16,int8,fht-int8,int4,fht-int4")
    qp.add_argument("--models", default="stories,outliers", help="stories (stories260K), outliers (head_dim 64)")
    qp.add_argument("--windows", default="0,32", help="f16 windows to try for the int8/int4 schemes")
    qp.add_argument("--centre", default="0,1", help="K centring to try for the int8/int4 schemes (0, 1 or 0,1)")
    qp.add_argument("--max-bytes", type=int, default=100_000)
    qp.add_argument("--outliers", type=float, default=8.0, help="k_proj outlier rows scale (head_dim 64 model)")
    qp.add_argument("--outlier-bytes", type=int, default=50_000, help="text for the outlier model's KLD")
    qp.add_argument("--workdir", default=str(Path.home() / ".cache" / "infeng" / "bench" / "kv"))
    args = ap.parse_args()
    {"speed": speed, "quality": quality}[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
