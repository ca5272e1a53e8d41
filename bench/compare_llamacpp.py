"""infeng against llama.cpp, side by side: same weights, same thread counts, same run, alternating.

    python bench/compare_llamacpp.py --preset smollm135 --weights f16 q8_0 q4_0 --threads 1 2 --rounds 3
    python bench/compare_llamacpp.py --model path/to/hf-model --weights f16 --threads 2 --csv out.csv

For each weight class it makes the GGUF (``convert_hf_to_gguf.py`` for f16/bf16/q8_0, then
``llama-quantize`` from the f16 GGUF for q4_0) and the matching infeng artifact (f16 -> ``--dtype
f16``, bf16 -> ``--dtype bf16``, q8_0 -> ``--quant int8``, q4_0 -> ``--quant int4``; a quantized
class is skipped with a ``skip`` line while ``infeng compile`` has no ``--quant``). Then, for every
round, thread count and class, it runs ``infeng bench`` and ``llama-bench`` one after the other
(the order flips every round, so drift hits both alike), and keeps the best of the rounds:

- ``pp512``: prompt processing, 512 tokens in one call (llama-bench ``-p 512``; ``infeng bench
  --prompt-len 512``; the artifact is compiled with ``--max-tokens 512`` so it is one forward call);
- ``tg128``: 128 tokens decoded one at a time from a nearly empty context (llama-bench ``-n 128``;
  ``infeng bench --prompt-len 8 --gen-len 128``), with the bandwidth roofline: bandwidth measured
  in the same round (``infeng_runtime.membw``) / weight bytes of that engine's file;
- ``batched``: aggregate decode tok/s of 1/4/16 sequences decoded together, prompt 128 and 64 new
  tokens each (BENCHMARKS.md's batched protocol): ``llama-batched-bench -npp 128 -ntg 64 -npl
  1,4,16`` against ``infeng bench --batch N`` (``Engine.step`` over N sequences per step).

Output: one JSON line per result on stdout (``gguf``, ``compile``, ``skip``, ``sample`` for every
single measurement as it is made, then ``env``, ``bandwidth``, ``pp512``, ``tg128``, ``batched``
and ``ratio`` with the best of the rounds); the side-by-side table (rich) on stderr;
``--csv FILE`` and ``--markdown FILE`` write the same results. ``bench/plot.py`` draws charts from
the JSON lines or the CSV. The peer comes from ../shared/tools/build-llamacpp.sh (``PEER_DIR``
overrides where it is looked for).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PEER = Path(os.environ.get("PEER_DIR", Path.home() / ".cache" / "infeng-peers")) / "llama.cpp"
PEER_BIN = PEER / "build" / "bin"
CONVERT = PEER / "convert_hf_to_gguf.py"
BUILD_HINT = ("build them with ../shared/tools/build-llamacpp.sh (or set PEER_DIR to the directory holding "
              "llama.cpp/)")
DEFAULT_WORKDIR = Path.home() / ".cache" / "infeng" / "bench"


@dataclass(frozen=True)
class WeightClass:
    """One weight format on both sides: how llama.cpp makes its GGUF, how infeng compiles it."""

    name: str
    gguf_outtype: str | None       # convert_hf_to_gguf.py --outtype; None: llama-quantize from f16
    quantize_type: str | None      # llama-quantize type
    infeng_args: tuple[str, ...]   # infeng compile options
    needs_quant: bool = False      # infeng side needs `infeng compile --quant`


WEIGHT_CLASSES = {
    "f16": WeightClass("f16", "f16", None, ("--dtype", "f16")),
    "bf16": WeightClass("bf16", "bf16", None, ("--dtype", "bf16")),
    "q8_0": WeightClass("q8_0", "q8_0", None, ("--quant", "int8"), needs_quant=True),
    "q4_0": WeightClass("q4_0", None, "Q4_0", ("--quant", "int4"), needs_quant=True),
}


class BenchError(Exception):
    """A step of the benchmark failed; the message says what and how to fix it."""


def emit(**fields) -> dict:
    print(json.dumps(fields), flush=True)
    return fields


def fail(message: str) -> None:
    """One line on stderr and exit code 2, like the infeng CLI (no traceback)."""
    print(f"{Path(sys.argv[0]).name}: {message}", file=sys.stderr)
    raise SystemExit(2)


def require_peer(*tools: str, convert: bool = False) -> None:
    missing = [PEER_BIN / t for t in tools if not os.access(PEER_BIN / t, os.X_OK)]
    if convert and not CONVERT.is_file():
        missing.append(CONVERT)
    if missing:
        raise BenchError(f"llama.cpp tools not found: {', '.join(map(str, missing))}; {BUILD_HINT}")


def run(cmd: list[str], what: str, env: dict | None = None) -> str:
    """stdout of ``cmd``; a BenchError with the tail of its output when it fails."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    except OSError as e:
        raise BenchError(f"{what}: cannot run {cmd[0]}: {e}") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise BenchError(f"{what} failed (exit {proc.returncode}): {shlex.join(cmd)}\n{tail}")
    return proc.stdout


def peer_env() -> dict:
    return {**os.environ, "LD_LIBRARY_PATH": f"{PEER_BIN}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


def infeng_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "infeng_cli", *args]


# -- inputs --------------------------------------------------------------------------------------
def ensure_model(model: str | None, preset: str, workdir: Path) -> Path:
    """The HF model dir: ``model`` as given, or the synthetic ``preset`` built under ``workdir``."""
    if model:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise BenchError(f"{path}: not a Hugging Face model dir (no config.json)")
        return path
    from infeng_models.synthetic import PRESETS, build_preset

    if preset not in PRESETS:
        raise BenchError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    out = workdir / preset
    if not (out / "model.safetensors").is_file():
        t0 = time.perf_counter()
        build_preset(preset, out)
        emit(bench="model", model=preset, path=str(out), seconds=round(time.perf_counter() - t0, 2))
    return out


def _fresh(path: Path, source: Path) -> bool:
    """``path`` exists and is newer than every file of ``source`` (a model dir or a file)."""
    if not path.is_file():
        return False
    inputs = [p for p in source.iterdir() if p.is_file()] if source.is_dir() else [source]
    return all(path.stat().st_mtime >= p.stat().st_mtime for p in inputs)


def ensure_gguf(model: Path, cls: WeightClass, workdir: Path) -> Path:
    out = workdir / f"{model.name}-{cls.name}.gguf"
    if cls.gguf_outtype is None:                     # llama-quantize from the f16 GGUF
        source = ensure_gguf(model, WEIGHT_CLASSES["f16"], workdir)
        if _fresh(out, source):
            return out
        require_peer("llama-quantize")
        t0 = time.perf_counter()
        run([str(PEER_BIN / "llama-quantize"), str(source), str(out), cls.quantize_type], "llama-quantize", peer_env())
    else:
        if _fresh(out, model):
            return out
        require_peer(convert=True)
        t0 = time.perf_counter()
        run([sys.executable, str(CONVERT), str(model), "--outtype", cls.gguf_outtype, "--outfile", str(out)],
            "convert_hf_to_gguf.py")
    emit(bench="gguf", weights=cls.name, file=str(out), mib=round(out.stat().st_size / 2**20, 1),
         seconds=round(time.perf_counter() - t0, 1))
    return out


def infeng_has_quant() -> bool:
    """Whether this checkout's ``infeng compile`` offers ``--quant``."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    return "--quant" in run(infeng_cmd("compile", "--help"), "infeng compile --help", env)


def compile_artifact(model: Path, cls: WeightClass, workdir: Path, target: str, max_tokens: int,
                     extra: list[str], profile: bool = False) -> Path:
    """``infeng compile`` (the build cache makes a repeat cheap); emits a ``compile`` line."""
    suffix = "-prof" if profile else ""
    out = workdir / f"{model.name}-{cls.name}-{target}-t{max_tokens}{suffix}.infeng"
    cmd = infeng_cmd("compile", str(model), "-o", str(out), "--target", target, "--max-tokens", str(max_tokens),
                     *cls.infeng_args, *extra, *(["--profile"] if profile else []))
    t0 = time.perf_counter()
    run(cmd, f"infeng compile ({cls.name})")
    manifest = json.loads((out / "manifest.json").read_text())
    emit(bench="compile", weights=cls.name, artifact=str(out), target=manifest["target"], profile=profile,
         weights_mib=round(manifest["weights_bytes"] / 2**20, 1), seconds=round(time.perf_counter() - t0, 2))
    return out


def weights_bytes(artifact: Path) -> int:
    return int(json.loads((artifact / "manifest.json").read_text())["weights_bytes"])


# -- one measurement each ------------------------------------------------------------------------
def infeng_bench(artifact: Path, threads: int, prompt_len: int, gen_len: int, batch: int = 1) -> dict[str, dict]:
    """``infeng bench --json`` in a fresh process: {"prefill": row, "decode": row}."""
    out = run(infeng_cmd("bench", str(artifact), "--json", "--no-bandwidth", "--threads", str(threads),
                         "--prompt-len", str(prompt_len), "--gen-len", str(gen_len), "--batch", str(batch)),
              f"infeng bench {artifact.name}")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["bench"]: r for r in rows}


def infeng_pp_tg(artifact: Path, threads: int, pp: int, tg: int) -> dict[str, float]:
    """pp: prefill of ``pp`` tokens; tg: ``tg`` decode steps after an 8-token prompt (``infeng bench``
    needs at least 8 prompt tokens for its warm-up)."""
    prefill = infeng_bench(artifact, threads, pp, 1)["prefill"]
    decode = infeng_bench(artifact, threads, 8, tg)["decode"]
    return {"pp": prefill["tok_s"], "tg": decode["tok_s"], "tg_p50_ms": decode["p50_ms"]}


def llama_bench(gguf: Path, threads: int, pp: int, tg: int) -> dict[str, float]:
    require_peer("llama-bench")
    out = run([str(PEER_BIN / "llama-bench"), "-m", str(gguf), "-p", str(pp), "-n", str(tg), "-t", str(threads),
               "-r", "1", "-o", "json"], f"llama-bench {gguf.name}", peer_env())
    result: dict = {}
    for row in json.loads(out):
        result["pp" if row["n_prompt"] > 0 else "tg"] = row["avg_ts"]
        result["model_size"] = row["model_size"]
        result["build_commit"] = row.get("build_commit")
        result["cpu_info"] = row.get("cpu_info")
    return result


def llama_batched(gguf: Path, threads: int, batches: list[int], prompt: int, gen: int) -> dict[int, float]:
    """Aggregate decode tok/s (``speed_tg``) per number of parallel sequences."""
    require_peer("llama-batched-bench")
    ctx = max(batches) * (prompt + gen) + 256
    out = run([str(PEER_BIN / "llama-batched-bench"), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
               "-npp", str(prompt), "-ntg", str(gen), "-npl", ",".join(map(str, batches)), "-t", str(threads),
               "-tb", str(threads), "--output-format", "jsonl"], f"llama-batched-bench {gguf.name}", peer_env())
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {int(r["pl"]): float(r["speed_tg"]) for r in rows}


def best(samples: list[float]) -> float:
    return max(samples) if samples else float("nan")


# -- output --------------------------------------------------------------------------------------
def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if a and b else None


def side_by_side(results: list[dict]) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """(header, rows) of the pp/tg table and of the batched table, as text cells."""
    single = [x for x in results if x["bench"] == "ratio" and "pp_ratio" in x]
    pp, tg = (f"pp{single[0]['pp_tokens']}", f"tg{single[0]['tg_tokens']}") if single else ("pp", "tg")
    head = ["weights", "threads", f"{pp} infeng", f"{pp} llama.cpp", "ratio", f"{tg} infeng", f"{tg} llama.cpp",
            "ratio", "bandwidth GB/s", "roofline infeng", "roofline llama.cpp", "frac infeng", "frac llama.cpp"]
    rows = [[r["weights"], str(r["threads"]), fmt(r["pp_infeng"]), fmt(r["pp_llamacpp"]), fmt(r["pp_ratio"], 2) + "x",
             fmt(r["tg_infeng"]), fmt(r["tg_llamacpp"]), fmt(r["tg_ratio"], 2) + "x", fmt(r["bandwidth_gb_s"]),
             fmt(r["roofline_infeng"]), fmt(r["roofline_llamacpp"]), fmt(r["roofline_frac_infeng"], 2),
             fmt(r["roofline_frac_llamacpp"], 2)] for r in single]
    bhead = ["weights", "threads", "sequences", "infeng tok/s", "llama-batched-bench tok/s", "ratio"]
    brows = [[r["weights"], str(r["threads"]), str(r["batch"]), fmt(r["infeng"]), fmt(r["llamacpp"]),
              fmt(r["decode"], 2) + "x"] for r in results if r["bench"] == "ratio" and "batch" in r]
    return head, rows, bhead, brows


def print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=220)
    head, rows, bhead, brows = side_by_side(results)
    for title, h, body in (("infeng vs llama.cpp, best of rounds (ratio = infeng / llama.cpp)", head, rows),
                           ("batched decode, aggregate tok/s", bhead, brows)):
        if body:
            table = Table(*h, title=title)
            for row in body:
                table.add_row(*row)
            console.print(table)
    for s in (x for x in results if x["bench"] == "skip"):
        console.print(f"skipped {s['weights']}: {s['reason']}")


def fmt(v, digits: int = 1) -> str:
    return "-" if v is None or v != v else f"{v:.{digits}f}"


def write_csv(path: Path, results: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in results for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows([{k: (json.dumps(v) if isinstance(v, list) else v) for k, v in r.items()} for r in results])


def write_markdown(path: Path, results: list[dict], command: str) -> None:
    """The side-by-side tables as markdown (for docs/performance.md), with the command that made them."""
    lines = [f"`{command}`"]
    head, rows, bhead, brows = side_by_side(results)
    for h, body in ((head, rows), (bhead, brows)):
        if body:
            lines += ["", "| " + " | ".join(h) + " |", "| --- | " + " | ".join(["---:"] * (len(h) - 1)) + " |"]
            lines += ["| " + " | ".join(row) + " |" for row in body]
    skips = [x for x in results if x["bench"] == "skip"]
    if skips:
        lines += [""] + [f"- {s['weights']} skipped: {s['reason']}" for s in skips]
    path.write_text("\n".join(lines) + "\n")


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="a Hugging Face model dir (default: build --preset)")
    src.add_argument("--preset", default="smollm135", help="synthetic checkpoint (infeng_models.synthetic)")
    ap.add_argument("--weights", nargs="+", default=["f16", "q8_0", "q4_0"], choices=sorted(WEIGHT_CLASSES))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3, help="alternating infeng/llama.cpp rounds; best is kept")
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens of the pp test")
    ap.add_argument("--tg", type=int, default=128, help="decoded tokens of the tg test")
    ap.add_argument("--batch", nargs="*", type=int, default=[1, 4, 16],
                    help="sequences decoded together in the batched test (none: skip it)")
    ap.add_argument("--batch-prompt", type=int, default=128)
    ap.add_argument("--batch-gen", type=int, default=64)
    ap.add_argument("--batch-threads", nargs="*", type=int, default=None,
                    help="thread counts of the batched test (default: the largest of --threads)")
    ap.add_argument("--target", default="native")
    ap.add_argument("--max-tokens", type=int, default=None, help="infeng compile --max-tokens (default: max(pp, 256))")
    ap.add_argument("--compile-args", default="--kv f16", help="extra infeng compile options (default: an f16 KV cache, as "
                    "llama.cpp keeps by default), e.g. '--kv f16 --quant-policy p.json'")
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    ap.add_argument("--csv", type=Path, help="also write the results as CSV")
    ap.add_argument("--markdown", type=Path, help="also write the side-by-side tables as markdown")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        compare(args)
    except BenchError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted")


def compare(args: argparse.Namespace) -> list[dict]:
    quantize = ["llama-quantize"] if any(WEIGHT_CLASSES[w].quantize_type for w in args.weights) else []
    require_peer("llama-bench", *quantize, *(["llama-batched-bench"] if args.batch else []), convert=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    model = ensure_model(args.model, args.preset, args.workdir)
    extra = shlex.split(args.compile_args)
    max_tokens = args.max_tokens or max(args.pp, 256)

    has_quant = None
    classes: dict[str, tuple[Path, Path]] = {}     # class -> (artifact, gguf)
    for name in args.weights:
        cls = WEIGHT_CLASSES[name]
        if cls.needs_quant:
            has_quant = infeng_has_quant() if has_quant is None else has_quant
            if not has_quant:
                results.append(emit(bench="skip", weights=name, reason=(
                    f"infeng compile has no --quant in this checkout (needed for {' '.join(cls.infeng_args)}); "
                    "rerun when quantization has landed")))
                continue
        try:
            artifact = compile_artifact(model, cls, args.workdir, args.target, max_tokens, extra)
        except BenchError as e:
            if not cls.needs_quant:
                raise
            results.append(emit(bench="skip", weights=name, reason=f"infeng compile failed: {e}".splitlines()[0]))
            continue
        classes[name] = (artifact, ensure_gguf(model, cls, args.workdir))
    if not classes:
        raise BenchError("no weight class left to compare (see the skip lines)")

    batch_threads = args.batch_threads if args.batch_threads is not None else [max(args.threads)]
    samples: dict[tuple, list[float]] = {}
    meta: dict[str, dict] = {}
    bandwidth: dict[int, list[float]] = {}
    from infeng_runtime.membw import measure_bandwidth

    def add(key: tuple, value: float) -> None:
        """Keep one measurement and print it as a ``sample`` line (the summary lines come at the end)."""
        samples.setdefault(key, []).append(float(value))
        engine, name, threads, test = key
        test = {"pp": f"pp{args.pp}", "tg": f"tg{args.tg}"}.get(test, f"batch{test[1:]}")
        emit(bench="sample", engine=engine, weights=name, threads=threads, test=test, round=rnd + 1,
             tok_s=round(float(value), 1))

    for rnd in range(args.rounds):
        for threads in args.threads:
            bandwidth.setdefault(threads, []).append(measure_bandwidth(threads))
            for name, (artifact, gguf) in classes.items():
                order = ("infeng", "llama.cpp") if rnd % 2 == 0 else ("llama.cpp", "infeng")
                for engine in order:
                    if engine == "infeng":
                        r = infeng_pp_tg(artifact, threads, args.pp, args.tg)
                    else:
                        r = llama_bench(gguf, threads, args.pp, args.tg)
                        meta[name] = r
                    add((engine, name, threads, "pp"), r["pp"])
                    add((engine, name, threads, "tg"), r["tg"])
                if args.batch and threads in batch_threads:
                    for engine in order:
                        if engine == "infeng":
                            for b in args.batch:
                                d = infeng_bench(artifact, threads, args.batch_prompt, args.batch_gen, b)["decode"]
                                add((engine, name, threads, f"b{b}"), d["tok_s"])
                        else:
                            for b, tok_s in llama_batched(gguf, threads, args.batch, args.batch_prompt,
                                                          args.batch_gen).items():
                                add((engine, name, threads, f"b{b}"), tok_s)
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    peer = next(iter(meta.values()), {})
    results.append(emit(bench="env", llama_cpp_commit=peer.get("build_commit"), cpu=peer.get("cpu_info"),
                        model=model.name, rounds=args.rounds, target=args.target,
                        infeng_commit=_git_head()))
    for threads in args.threads:
        bw = max(bandwidth[threads])
        results.append(emit(bench="bandwidth", threads=threads, gb_s=round(bw, 2),
                            samples=[round(x, 2) for x in bandwidth[threads]]))
        for name, (artifact, gguf) in classes.items():
            sizes = {"infeng": weights_bytes(artifact), "llama.cpp": int(meta[name]["model_size"])}
            row: dict = {"bench": "ratio", "weights": name, "threads": threads, "model": model.name,
                         "bandwidth_gb_s": round(bw, 2)}
            for engine in ("infeng", "llama.cpp"):
                key = engine.replace(".", "")
                pp = samples[(engine, name, threads, "pp")]
                tg = samples[(engine, name, threads, "tg")]
                roofline = bw * 1e9 / sizes[engine]
                common = dict(engine=engine, weights=name, threads=threads, model=model.name)
                results.append(emit(bench=f"pp{args.pp}", **common, tok_s=round(best(pp), 1),
                                    samples=[round(x, 1) for x in pp]))
                results.append(emit(bench=f"tg{args.tg}", **common, tok_s=round(best(tg), 1),
                                    samples=[round(x, 1) for x in tg], weights_mib=round(sizes[engine] / 2**20, 1),
                                    bandwidth_gb_s=round(bw, 2), roofline_tok_s=round(roofline, 1),
                                    roofline_frac=round(best(tg) / roofline, 3)))
                row.update({f"pp_{key}": round(best(pp), 1), f"tg_{key}": round(best(tg), 1),
                            f"roofline_{key}": round(roofline, 1),
                            f"roofline_frac_{key}": round(best(tg) / roofline, 3)})
            row.update(pp_ratio=ratio(row["pp_infeng"], row["pp_llamacpp"]),
                       tg_ratio=ratio(row["tg_infeng"], row["tg_llamacpp"]), pp_tokens=args.pp, tg_tokens=args.tg)
            results.append(emit(**row))
    for threads in (batch_threads if args.batch else []):
        if threads not in args.threads:
            continue
        for name in classes:
            for b in args.batch:
                got = {e: samples.get((e, name, threads, f"b{b}"), []) for e in ("infeng", "llama.cpp")}
                for engine, s in got.items():
                    results.append(emit(bench="batched", engine=engine, weights=name, threads=threads, batch=b,
                                        prompt_len=args.batch_prompt, gen_len=args.batch_gen,
                                        tok_s=round(best(s), 1), samples=[round(x, 1) for x in s]))
                results.append(emit(bench="ratio", weights=name, threads=threads, batch=b,
                                    infeng=round(best(got["infeng"]), 1), llamacpp=round(best(got["llama.cpp"]), 1),
                                    decode=ratio(best(got["infeng"]), best(got["llama.cpp"]))))
    print_table(results)
    if args.csv:
        write_csv(args.csv, results)
    if args.markdown:
        write_markdown(args.markdown, results, "python " + shlex.join(sys.argv))
    return results


def _git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    main()
