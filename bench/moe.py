"""Mixture of experts on GPT-OSS-20B's shape: infeng against llama.cpp on the same MXFP4 weights.

    python bench/moe.py --threads 2 --rounds 3                 # builds ~/.cache/infeng/bench/gpt-oss-20b-shape
    python bench/moe.py --tiny --rounds 1 --tg 16              # the scaled-down shape: checks the pipeline
    python bench/moe.py --rounds 0                             # only build the files (checkpoint, GGUF, artifact)

The checkpoint is ``infeng_models.gpt_oss_shape`` (random MXFP4 experts, bf16 elsewhere, written
once under ``--workdir``: about 13 GB, and as much again for the GGUF it transcodes for llama.cpp).
``infeng compile`` builds the artifact (``--max-tokens`` = ``--pp``, so the prompt is one forward
call; ``--compile-args``, by default ``--passes cast-weights(bf16),experts-act(q8),fuse-linears``:
the bf16 matrices stay bf16 and the MXFP4 experts MXFP4, the bytes the GGUF holds, and the experts
read int8 activation rows as llama.cpp's do; ``--compile-args "--passes
cast-weights(bf16),fuse-linears"`` measures the f32-activation experts, exact against transformers). Then, for every round (the order flips each round, so
drift hits both alike), in fresh processes on ``--threads`` threads:

- ``pp``: prompt processing of ``--pp`` tokens (``infeng bench --prompt-len``; llama-bench ``-p``);
- ``tg``: ``--tg`` tokens decoded one at a time after a short prompt, batch 1 (``infeng bench
  --gen-len``; llama-bench ``-n``);
- the peak RSS of each process (``wait4``), and the main-memory bandwidth measured in the same run
  (``infeng_runtime.membw``).

A decode step reads only the chosen experts, so the roofline counts the *active* bytes per token
of each engine's own file: every matrix outside the experts (lm_head included), one row of the
token embedding, and top_k / E of every expert stack (its blocks, scales and biases). ``tg`` is
reported with ``roofline_frac`` = tok/s x active bytes / bandwidth. Output: one JSON line per
result (``model``, ``gguf``, ``compile``, ``sample``, ``env``, ``bandwidth``, then ``pp``, ``tg``
and ``ratio`` with the best of the rounds); a failing step is one line on stderr and exit 2.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_llamacpp import (
    DEFAULT_WORKDIR,
    PEER_BIN,
    BenchError,
    best,
    emit,
    fail,
    infeng_cmd,
    peer_env,
    ratio,
    require_peer,
)

#: The checkpoint's bf16 matrices stay bf16 (the default pipeline stores f32) and its MXFP4 experts
#: stay MXFP4 (``--dtype bf16`` would widen them too), so both engines read the same bytes; the
#: experts read int8 activation rows (``experts-act(q8)``), as llama.cpp's MXFP4 x Q8_0 dot products do.
DEFAULT_COMPILE_ARGS = "--passes cast-weights(bf16),experts-act(q8),fuse-linears"


def run_measured(cmd: list[str], what: str, env: dict | None = None) -> tuple[str, float]:
    """(stdout, peak RSS in MiB) of ``cmd``; a BenchError with the tail of its output when it fails.

    The peak is the child's own VmHWM, read from /proc every 20 ms while it runs: ``wait4``'s
    ru_maxrss would count this process's memory too (Linux carries the high-water mark of the
    forking image across exec)."""
    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
        try:
            proc = subprocess.Popen(cmd, stdout=out_file, stderr=err_file, text=True, env=env)
        except OSError as e:
            raise BenchError(f"{what}: cannot run {cmd[0]}: {e}") from None
        peak_kib = 0
        while proc.poll() is None:
            peak_kib = max(peak_kib, _vm_hwm_kib(proc.pid))
            time.sleep(0.02)
        out_file.seek(0)
        err_file.seek(0)
        out, err = out_file.read(), err_file.read()
    if proc.returncode != 0:
        tail = "\n".join((err or out).strip().splitlines()[-15:])
        raise BenchError(f"{what} failed (exit {proc.returncode}): {shlex.join(cmd)}\n{tail}")
    return out, round(peak_kib / 1024, 1)


def _vm_hwm_kib(pid: int) -> int:
    """The peak resident set of a running process (0 once it has exited)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)


# -- inputs --------------------------------------------------------------------------------------
def ensure_checkpoint(workdir: Path, tiny: bool, seed: int) -> Path:
    from infeng_models.gpt_oss_shape import GPT_OSS_20B, TINY, write_checkpoint

    out = workdir / ("gpt-oss-tiny-shape" if tiny else "gpt-oss-20b-shape")
    if not (out / "model.safetensors.index.json").is_file():
        t0 = time.perf_counter()
        write_checkpoint(out, TINY if tiny else GPT_OSS_20B, seed)
        emit(bench="model", path=str(out), gib=round(_dir_bytes(out) / 2**30, 2), seconds=round(time.perf_counter() - t0, 1))
    return out


def ensure_gguf(model: Path) -> Path:
    from infeng_models.gpt_oss_shape import write_gguf

    out = model.with_name(model.name + "-mxfp4.gguf")
    if not out.is_file() or out.stat().st_mtime < (model / "model.safetensors.index.json").stat().st_mtime:
        t0 = time.perf_counter()
        partial = out.with_suffix(".partial")
        write_gguf(model, partial)
        partial.replace(out)
        emit(bench="gguf", file=str(out), gib=round(out.stat().st_size / 2**30, 2), seconds=round(time.perf_counter() - t0, 1))
    return out


def compile_artifact(model: Path, target: str, max_tokens: int, extra: list[str]) -> Path:
    """``infeng compile``, kept from an earlier run with the same options and model (``ARTIFACT.bench.json``
    records them): a 20B artifact is 13 GB."""
    variant = hashlib.sha256(shlex.join(extra).encode()).hexdigest()[:8]          # one artifact per option set
    out = model.with_name(f"{model.name}-{target}-t{max_tokens}-{variant}.infeng")
    options = out.with_suffix(".bench.json")
    wanted = {"compile_args": extra, "model_mtime": (model / "model.safetensors.index.json").stat().st_mtime}
    if options.is_file() and json.loads(options.read_text()) == wanted:
        emit(bench="compile", artifact=str(out), reused=True)
        return out
    t0 = time.perf_counter()
    _, rss = run_measured(infeng_cmd("compile", str(model), "-o", str(out), "--target", target, "--max-tokens",
                                     str(max_tokens), *extra), "infeng compile")
    manifest = json.loads((out / "manifest.json").read_text())
    emit(bench="compile", artifact=str(out), target=manifest["target"], weights_gib=round(manifest["weights_bytes"] / 2**30, 2),
         peak_rss_mib=rss, seconds=round(time.perf_counter() - t0, 1))
    options.write_text(json.dumps(wanted))
    return out


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


# -- active bytes per decoded token ----------------------------------------------------------------
def active_bytes(tensors: list[tuple[str, tuple[int, ...], int]], experts: int, top_k: int, vocab: int) -> int:
    """Bytes one batch-1 decode step reads from (name, shape, bytes) tensors: top_k / E of each expert
    stack (first dimension E, named ...exps... or ...experts...), one row of the token embedding,
    everything else whole."""
    total = 0
    for name, shape, nbytes in tensors:
        if ("exps" in name or "experts" in name) and shape and shape[0] == experts:
            total += nbytes * top_k // experts
        elif name in ("model.embed_tokens.weight", "token_embd.weight"):
            total += nbytes // vocab
        else:
            total += nbytes
    return total


def infeng_active_bytes(artifact: Path, config: dict) -> int:
    manifest = json.loads((artifact / "manifest.json").read_text())
    tensors = [(t["name"], tuple(t["shape"]), t["nbytes"]) for t in manifest["tensors"]]
    return active_bytes(tensors, config["num_local_experts"], config["num_experts_per_tok"], config["vocab_size"])


def gguf_active_bytes(path: Path, config: dict) -> int:
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = [(t.name, tuple(int(d) for d in reversed(t.shape)), int(t.n_bytes)) for t in reader.tensors]
    return active_bytes(tensors, config["num_local_experts"], config["num_experts_per_tok"], config["vocab_size"])


# -- one measurement each --------------------------------------------------------------------------
def infeng_run(artifact: Path, threads: int, pp: int, tg: int) -> dict[str, float]:
    """Prefill of ``pp`` tokens, then ``tg`` decode steps after an 8-token prompt (two processes)."""
    result = {}
    for kind, prompt, gen in (("pp", pp, 1), ("tg", 8, tg)):
        out, rss = run_measured(infeng_cmd("bench", str(artifact), "--json", "--no-bandwidth", "--threads", str(threads),
                                           "--prompt-len", str(prompt), "--gen-len", str(gen)), f"infeng bench ({kind})")
        rows = {r["bench"]: r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
        result[kind] = rows["prefill" if kind == "pp" else "decode"]["tok_s"]
        result[f"{kind}_rss_mib"] = rss
    return result


def llama_run(gguf_path: Path, threads: int, pp: int, tg: int) -> dict[str, float]:
    require_peer("llama-bench")
    result = {}
    for kind, args in (("pp", ["-p", str(pp), "-n", "0"]), ("tg", ["-p", "0", "-n", str(tg)])):
        out, rss = run_measured([str(PEER_BIN / "llama-bench"), "-m", str(gguf_path), *args, "-t", str(threads),
                                 "-r", "1", "-o", "json"], f"llama-bench ({kind})", peer_env())
        result[kind] = json.loads(out)[0]["avg_ts"]
        result[f"{kind}_rss_mib"] = rss
    return result


# -- the run ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="0: build the checkpoint, GGUF and artifact only")
    p.add_argument("--pp", type=int, default=512, help="prompt tokens of the prefill measurement")
    p.add_argument("--tg", type=int, default=64, help="decode steps of the decode measurement")
    p.add_argument("--target", default="native")
    p.add_argument("--compile-args", default=DEFAULT_COMPILE_ARGS,
                   help="`infeng compile` options, one string (default: bf16 storage of the non-expert matrices, "
                        "as the checkpoint and the GGUF hold them; the MXFP4 experts kept as they are, on int8 rows)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument("--model", type=Path, default=None, help="a GPT-OSS MXFP4 checkpoint instead of the built one")
    p.add_argument("--tiny", action="store_true", help="the scaled-down shape (checks the pipeline)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        measure(args)
    except BenchError as e:
        fail(str(e))


def measure(args: argparse.Namespace) -> None:
    from infeng_runtime.membw import measure_bandwidth

    args.workdir.mkdir(parents=True, exist_ok=True)
    model = args.model or ensure_checkpoint(args.workdir, args.tiny, args.seed)
    config = json.loads((model / "config.json").read_text())
    gguf_path = ensure_gguf(model)
    artifact = compile_artifact(model, args.target, args.pp, shlex.split(args.compile_args))
    active = {"infeng": infeng_active_bytes(artifact, config), "llama.cpp": gguf_active_bytes(gguf_path, config)}
    emit(bench="env", host=platform.node(), cpu=platform.processor() or platform.machine(), threads=args.threads,
         active_mib={k: round(v / 2**20, 1) for k, v in active.items()}, model=str(model))
    if args.rounds == 0:            # the files are ready; measure later
        return
    bandwidth = measure_bandwidth(args.threads)
    emit(bench="bandwidth", threads=args.threads, gb_s=round(bandwidth, 2))
    samples: dict[str, list[dict]] = {"infeng": [], "llama.cpp": []}
    for r in range(args.rounds):
        order = ("infeng", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "infeng")
        for engine in order:
            result = (infeng_run(artifact, args.threads, args.pp, args.tg) if engine == "infeng"
                      else llama_run(gguf_path, args.threads, args.pp, args.tg))
            samples[engine].append(result)
            emit(bench="sample", engine=engine, round=r, **result)
    summary = {}
    for engine, rows in samples.items():
        pp, tg = best([s["pp"] for s in rows]), best([s["tg"] for s in rows])
        rss = max(max(s["pp_rss_mib"], s["tg_rss_mib"]) for s in rows)
        summary[engine] = (pp, tg)
        emit(bench="pp", engine=engine, threads=args.threads, prompt=args.pp, tok_s=round(pp, 1), peak_rss_mib=rss)
        emit(bench="tg", engine=engine, threads=args.threads, gen=args.tg, tok_s=round(tg, 2), peak_rss_mib=rss,
             active_mib=round(active[engine] / 2**20, 1), bandwidth_gb_s=round(bandwidth, 2),
             roofline_tok_s=round(bandwidth * 1e9 / active[engine], 2),
             roofline_frac=round(tg * active[engine] / (bandwidth * 1e9), 3))
    (ipp, itg), (lpp, ltg) = summary["infeng"], summary["llama.cpp"]
    emit(bench="ratio", threads=args.threads, pp=ratio(ipp, lpp), tg=ratio(itg, ltg))


if __name__ == "__main__":
    main()
