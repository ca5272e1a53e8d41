"""Issue 8's done-when on one artifact: (a) do a profiled build's op times add up to the measured
decode step, and where does the rest go; (b) is the unprofiled build as fast as before.

    python bench/profile_overhead.py --preset smollm135 --weights f16 --threads 2

Compiles the model twice (plain and ``--profile``; ``compare_llamacpp.compile_artifact``), then:

- ``profile_build`` (one line per artifact): timer sites in ``src/model.c`` and whether the plain
  ``ife_forward`` is the profiled one with its timer lines removed (then a normal build carries
  none of the profiling: it makes the same calls it made before profiling existed);
- ``overhead``: plain and profiled artifacts measured with ``infeng bench`` in fresh processes,
  alternating (the order flips every round); decode tok/s best and median of the rounds, and the
  ratio profiled / plain; and ``interleaved_*``: both loaded in this process, one decode step of
  each in turn, median step time (``--baseline ART`` adds an artifact built elsewhere, e.g. by an
  older checkout, to both);
- ``coverage`` (per batch size and level): the profiled artifact decoding in this process, each
  step timed four ways, with the profiled op time of the same steps:
  ``step`` = ``Engine.step`` (what ``infeng bench`` measures), ``forward`` = ``Engine.forward``
  with ready int32 arrays (no checks, no KV bookkeeping), ``c_call`` = ``ife_forward`` called with
  ready cffi buffers, ``replica`` = the statements of ``Engine.step``/``forward`` copied here with a
  clock read between them. ``profiled_frac`` = profiled ns / wall ns (sum over steps; and the
  median of the per-step fractions, which is what ``within_10pct`` tests); ``gap_us`` = median of
  wall - profiled per step (robust: noise lands mostly inside the long kernels);
- ``gap`` (per batch size): that untimed time split by differences of the levels' gaps: Python
  in ``Engine.step`` (step - forward), Python and cffi in ``Engine.forward`` (forward - c_call),
  C outside the timed nodes (c_call: the cffi call, the timers themselves, the prologue);
- ``step_part``: each piece of ``Engine.step``'s Python timed where it runs (``in_step_us``, from
  the replica, right after a forward that streamed the weights through the caches) and in a tight
  loop with warm caches (``hot_loop_us``); plus the argmax a caller does after every step.

Medians throughout, so a descheduled step on a shared machine does not decide the result.
"""
from __future__ import annotations

import argparse
import re
import shlex
import statistics
import sys
import time
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_llamacpp import (DEFAULT_WORKDIR, WEIGHT_CLASSES, BenchError, compile_artifact, emit,  # noqa: E402
                              ensure_model, fail, infeng_bench, infeng_has_quant)


# -- (b) structure and speed -----------------------------------------------------------------------
def forward_body(artifact: Path) -> list[str]:
    """The lines of ``ife_forward`` in the artifact's generated ``model.c``."""
    text = (artifact / "src" / "model.c").read_text()
    start = text.index("int ife_forward(")
    return text[start:text.index("\n}\n", start)].splitlines()


def build_check(plain: Path, profiled: Path) -> None:
    timer = re.compile(r"IFE_PROF_(BEGIN|END)\(")
    stripped = [line for line in forward_body(profiled) if not timer.search(line)]
    for artifact in (plain, profiled):
        source = (artifact / "src" / "model.c").read_text()
        emit(bench="profile_build", artifact=artifact.name, timer_sites=len(timer.findall(source)),
             clock_gettime="clock_gettime" in source,
             forward_is_profiled_minus_timers=forward_body(plain) == stripped)


def speed(artifacts: dict[str, Path], args) -> None:
    samples: dict[str, list[dict]] = {name: [] for name in artifacts}
    for rnd in range(args.rounds):
        names = list(artifacts) if rnd % 2 == 0 else list(reversed(artifacts))
        for name in names:
            samples[name].append(infeng_bench(artifacts[name], args.threads, args.prompt_len, args.gen_len)["decode"])
        print(f"speed round {rnd + 1}/{args.rounds}", file=sys.stderr, flush=True)
    summary = {}
    for name, rows in samples.items():
        tok_s = [r["tok_s"] for r in rows]
        p50 = [r["p50_ms"] for r in rows]
        summary[name] = emit(bench="decode", artifact=artifacts[name].name, build=name, threads=args.threads,
                             prompt_len=args.prompt_len, gen_len=args.gen_len, tok_s_best=max(tok_s),
                             tok_s_median=round(statistics.median(tok_s), 1),
                             p50_ms_median=round(statistics.median(p50), 3),
                             samples=tok_s)
    step_ms = interleaved(artifacts, args)
    for name in summary:
        if name == "plain":
            continue
        a, b = summary[name], summary["plain"]
        emit(bench="overhead", build=name, vs="plain", threads=args.threads,
             tok_s_ratio_best=round(a["tok_s_best"] / b["tok_s_best"], 3),
             tok_s_ratio_median=round(a["tok_s_median"] / b["tok_s_median"], 3),
             p50_ratio_median=round(a["p50_ms_median"] / b["p50_ms_median"], 3),
             interleaved_step_ms=round(step_ms[name], 4), interleaved_plain_step_ms=round(step_ms["plain"], 4),
             interleaved_step_ratio=round(step_ms[name] / step_ms["plain"], 4))


def interleaved(artifacts: dict[str, Path], args) -> dict[str, float]:
    """Median ``Engine.step`` time per artifact, all loaded in this process and stepped in turn (the
    order rotating every step), so drift on a shared machine hits each alike."""
    from infeng_runtime.engine import Engine

    engines = {name: Engine(path, threads=args.threads, max_seqs=1, max_context=args.prompt_len + args.gen_len + 16)
               for name, path in artifacts.items()}
    names = list(engines)
    times: dict[str, list[float]] = {name: [] for name in names}
    prompt = np.random.default_rng(0).integers(0, 1000, size=args.prompt_len).astype(np.int32)
    for rnd in range(args.rounds):
        tokens = {}
        for name, engine in engines.items():
            logits = engine.step(prompt, np.arange(args.prompt_len), np.zeros(args.prompt_len), [args.prompt_len - 1])
            tokens[name] = logits.argmax(axis=1).astype(np.int32)
        for i in range(args.gen_len):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                t0 = time.perf_counter_ns()
                logits = engines[name].step(tokens[name], [args.prompt_len + i], [0])
                times[name].append(time.perf_counter_ns() - t0)
                tokens[name] = logits.argmax(axis=1).astype(np.int32)
        for engine in engines.values():
            engine.free(0)
    for engine in engines.values():
        engine.close()
    return {name: float(np.median(t)) / 1e6 for name, t in times.items()}


# -- (a) coverage ---------------------------------------------------------------------------------
class ProfileReader:
    """Sum of the profiled ns so far, read straight from the library into reused arrays."""

    def __init__(self, engine):
        n = int(engine.lib.ife_profile_entries())
        self.arrays = [np.zeros(n, dtype=np.int64) for _ in range(4)]
        self.ptrs = [engine.ffi.from_buffer("int64_t[]", a) for a in self.arrays]
        self.engine = engine

    def total_ns(self) -> int:
        self.engine.lib.ife_profile_read(self.engine._handle, *self.ptrs)
        return int(self.arrays[0].sum())


STEP_PARTS = ("step: input arrays", "step: checks (shapes, token range)", "step: per-sequence KV loop",
              "forward: logits array + cffi buffers", "ife_forward: C outside the timed nodes",
              "caller: argmax + astype (outside the measured step)")
KV_PARTS = ("kv loop: np.unique(seq_ids)", "kv loop: mask + positions[mask].max()", "kv loop: kv.ensure",
            "kv loop: slots[mask] = slot_of[seq]")


def replica_step(engine, tokens, positions, seq_ids, reader: ProfileReader, marks: list[int],
                 kv_ns: list[int]) -> np.ndarray:
    """``Engine.step`` + ``Engine.forward`` for one decode step (single call, no adapters), statement for
    statement as runtime/engine.py has them, with a clock read between the pieces (``marks``)."""
    ffi, lib, kv = engine.ffi, engine.lib, engine.kv
    marks.append(time.perf_counter_ns())
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    positions = np.ascontiguousarray(positions, dtype=np.int32)
    seq_ids = np.asarray(seq_ids)
    n = len(tokens)
    rows = np.arange(n, dtype=np.int32)
    marks.append(time.perf_counter_ns())
    if n == 0 or positions.shape != (n,) or seq_ids.shape != (n,):
        raise ValueError("bad shapes")
    if tokens.min() < 0 or tokens.max() >= engine.vocab_size:
        raise ValueError("token out of range")
    marks.append(time.perf_counter_ns())
    slots = np.empty(n, dtype=np.int32)
    t = [time.perf_counter_ns()]
    unique = np.unique(seq_ids)
    t.append(time.perf_counter_ns())
    kv_ns[0] += t[1] - t[0]
    for seq in unique:                  # the loop body of Engine.step, split in three
        t0 = time.perf_counter_ns()
        mask = seq_ids == seq
        length = int(positions[mask].max()) + 1
        t1 = time.perf_counter_ns()
        kv.ensure(int(seq), length)
        t2 = time.perf_counter_ns()
        slots[mask] = kv.slot_of[int(seq)]
        t3 = time.perf_counter_ns()
        kv_ns[1] += t1 - t0
        kv_ns[2] += t2 - t1
        kv_ns[3] += t3 - t2
    marks.append(time.perf_counter_ns())
    logits = np.empty((len(rows), engine.vocab_size), dtype=np.float32)
    table = kv.block_table
    chunk_rows = np.ascontiguousarray(rows, dtype=np.int32)
    args = (engine._handle, n, ffi.from_buffer("int32_t[]", tokens), ffi.from_buffer("int32_t[]", positions),
            ffi.from_buffer("int32_t[]", slots), ffi.from_buffer("int32_t[]", table), table.shape[1],
            len(chunk_rows), ffi.from_buffer("int32_t[]", chunk_rows), ffi.from_buffer("float[]", logits), ffi.NULL)
    before = reader.total_ns()
    marks.append(time.perf_counter_ns())
    lib.ife_forward(*args)
    marks.append(time.perf_counter_ns())
    marks.append(reader.total_ns() - before)
    return logits


def decode_steps(engine, level: str, batch: int, prompt_len: int, gen_len: int, reader: ProfileReader,
                 rng: np.random.Generator) -> dict[str, list[float]]:
    """Per decode step of ``batch`` sequences: wall ns, profiled ns (and for ``replica`` the ns of each
    of ``STEP_PARTS``)."""
    ids = rng.integers(0, engine.vocab_size, size=(batch, prompt_len)).astype(np.int32)
    seqs = np.arange(batch)
    logits = engine.step(ids.reshape(-1), np.tile(np.arange(prompt_len), batch), np.repeat(seqs, prompt_len),
                         seqs * prompt_len + prompt_len - 1)
    tokens = logits.argmax(axis=1).astype(np.int32)
    ffi, lib = engine.ffi, engine.lib
    slots = np.array([engine.kv.slot_of[int(s)] for s in seqs], dtype=np.int32)
    rows = np.arange(batch, dtype=np.int32)
    out = np.empty((batch, engine.vocab_size), dtype=np.float32)
    got: dict[str, list[float]] = {"wall": [], "profiled": [], **{p: [] for p in STEP_PARTS + KV_PARTS}}
    for i in range(gen_len):
        positions = np.full(batch, prompt_len + i, dtype=np.int32)
        if level in ("forward", "c_call"):
            for s in seqs:
                engine.kv.ensure(int(s), prompt_len + i + 1)
        if level == "c_call":
            args = (engine._handle, batch, ffi.from_buffer("int32_t[]", tokens),
                    ffi.from_buffer("int32_t[]", positions),
                    ffi.from_buffer("int32_t[]", slots), ffi.from_buffer("int32_t[]", engine.kv.block_table),
                    engine.kv.block_table.shape[1], batch, ffi.from_buffer("int32_t[]", rows),
                    ffi.from_buffer("float[]", out), ffi.NULL)
        if level == "replica":
            marks: list[int] = []
            kv_ns = [0] * len(KV_PARTS)
            logits = replica_step(engine, tokens, positions, seqs, reader, marks, kv_ns)
            t_argmax = time.perf_counter_ns()
            tokens = logits.argmax(axis=1).astype(np.int32)
            t_end = time.perf_counter_ns()
            *clock, profiled = marks
            got["wall"].append(clock[-1] - clock[0])
            got["profiled"].append(profiled)
            for part, (a, b) in zip(STEP_PARTS[:4], zip(clock[:4], clock[1:5])):
                got[part].append(b - a)
            got[STEP_PARTS[4]].append(clock[5] - clock[4] - profiled)
            got[STEP_PARTS[5]].append(t_end - t_argmax)
            for part, ns in zip(KV_PARTS, kv_ns):
                got[part].append(ns)
            continue
        before = reader.total_ns()
        t0 = time.perf_counter_ns()
        if level == "step":
            logits = engine.step(tokens, positions, seqs)
        elif level == "forward":
            logits = engine.forward(tokens, positions, slots, rows)
        else:
            lib.ife_forward(*args)
            logits = out
        t1 = time.perf_counter_ns()
        got["wall"].append(t1 - t0)
        got["profiled"].append(reader.total_ns() - before)
        tokens = logits.argmax(axis=1).astype(np.int32)
    for s in seqs:
        engine.free(int(s))
    return got


def coverage(profiled_artifact: Path, args) -> None:
    from infeng_runtime.engine import Engine

    engine = Engine(profiled_artifact, threads=args.threads, max_seqs=max(args.batch),
                    max_context=args.prompt_len + args.gen_len + 16)
    reader = ProfileReader(engine)
    rng = np.random.default_rng(0)
    levels = ("step", "forward", "c_call", "replica")
    for batch in args.batch:
        got: dict[str, dict[str, list[float]]] = {}
        decode_steps(engine, "step", batch, args.prompt_len, min(args.gen_len, 8), reader, rng)     # warm up
        for rnd in range(args.coverage_rounds):
            for level in (levels if rnd % 2 == 0 else tuple(reversed(levels))):
                for k, v in decode_steps(engine, level, batch, args.prompt_len, args.gen_len, reader, rng).items():
                    got.setdefault(level, {}).setdefault(k, []).extend(v)
        gaps = {}
        for level in levels:
            wall, prof = np.array(got[level]["wall"]), np.array(got[level]["profiled"])
            gaps[level] = float(np.median(wall - prof)) / 1e3
            emit(bench="coverage", level=level, batch=batch, threads=engine.threads, steps=len(wall),
                 wall_us=round(float(np.median(wall)) / 1e3, 1), profiled_us=round(float(np.median(prof)) / 1e3, 1),
                 gap_us=round(gaps[level], 1), profiled_frac=round(float(prof.sum() / wall.sum()), 4),
                 profiled_frac_median=round(float(np.median(prof / wall)), 4),
                 within_10pct=bool(np.median(prof / wall) >= 0.9))
        emit(bench="gap", batch=batch, threads=engine.threads, step_gap_us=round(gaps["step"], 1),
             python_in_step_us=round(gaps["step"] - gaps["forward"], 1),
             python_in_forward_us=round(gaps["forward"] - gaps["c_call"], 1),
             c_outside_timed_nodes_us=round(gaps["c_call"], 1))
        hot = hot_parts(engine, batch, args.prompt_len)
        for part in STEP_PARTS + KV_PARTS:
            emit(bench="step_part", batch=batch, threads=engine.threads, part=part,
                 in_step_us=round(float(np.median(got["replica"][part])) / 1e3, 2), hot_loop_us=hot.get(part))
    engine.close()


def hot_parts(engine, batch: int, pos: int) -> dict[str, float]:
    """The same Python pieces timed in a tight loop (caches warm), for comparison with ``in_step_us``."""
    tokens = np.zeros(batch, dtype=np.int32)
    positions = np.full(batch, pos, dtype=np.int32)
    seq_ids = np.arange(batch)
    for s in seq_ids:
        engine.kv.ensure(int(s), pos + 1)
    ffi, kv = engine.ffi, engine.kv
    slots = np.empty(batch, dtype=np.int32)
    logits = np.empty((batch, engine.vocab_size), dtype=np.float32)

    def per_seq():
        for seq in np.unique(seq_ids):
            mask = seq_ids == seq
            kv.ensure(int(seq), int(positions[mask].max()) + 1)
            slots[mask] = kv.slot_of[int(seq)]

    def buffers():
        out = np.empty((batch, engine.vocab_size), dtype=np.float32)
        rows = np.ascontiguousarray(seq_ids, dtype=np.int32)
        return (ffi.from_buffer("int32_t[]", tokens), ffi.from_buffer("int32_t[]", positions),
                ffi.from_buffer("int32_t[]", slots), ffi.from_buffer("int32_t[]", kv.block_table),
                ffi.from_buffer("int32_t[]", rows), ffi.from_buffer("float[]", out))

    parts = {
        STEP_PARTS[0]: lambda: (np.ascontiguousarray(tokens, dtype=np.int32),
                                np.ascontiguousarray(positions, dtype=np.int32), np.asarray(seq_ids),
                                np.arange(batch, dtype=np.int32)),
        STEP_PARTS[1]: lambda: (positions.shape != (batch,), tokens.min() < 0 or tokens.max() >= engine.vocab_size),
        STEP_PARTS[2]: per_seq,
        STEP_PARTS[3]: buffers,
        STEP_PARTS[5]: lambda: logits.argmax(axis=1).astype(np.int32),
    }
    hot = {name: round(min(timeit.repeat(fn, number=1000, repeat=5)) / 1000 * 1e6, 2) for name, fn in parts.items()}
    for s in seq_ids:
        engine.free(int(s))
    return hot


# -- main -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="a Hugging Face model dir (default: build --preset)")
    src.add_argument("--preset", default="smollm135")
    ap.add_argument("--weights", default="f16", choices=sorted(WEIGHT_CLASSES), help="infeng side of this class")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 16], help="batch sizes of the coverage check")
    ap.add_argument("--rounds", type=int, default=6, help="alternating plain/profiled infeng bench runs each")
    ap.add_argument("--coverage-rounds", type=int, default=2, help="decode passes per level and batch size")
    ap.add_argument("--target", default="native")
    ap.add_argument("--compile-args", default="", help="extra infeng compile options")
    ap.add_argument("--baseline", type=Path,
                    help="another artifact to alternate with (e.g. built by an older checkout)")
    ap.add_argument("--skip-speed", action="store_true", help="only the build check and the coverage")
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    args = ap.parse_args(argv)
    try:
        cls = WEIGHT_CLASSES[args.weights]
        if cls.needs_quant and not infeng_has_quant():
            raise BenchError(f"--weights {args.weights} needs infeng compile --quant, which this checkout lacks")
        args.workdir.mkdir(parents=True, exist_ok=True)
        model = ensure_model(args.model, args.preset, args.workdir)
        extra = shlex.split(args.compile_args)
        max_tokens = 256        # the compile default; Engine.forward splits a longer batched prefill
        plain = compile_artifact(model, cls, args.workdir, args.target, max_tokens, extra)
        profiled = compile_artifact(model, cls, args.workdir, args.target, max_tokens, extra, profile=True)
        build_check(plain, profiled)
        if not args.skip_speed:
            artifacts = {"plain": plain, "profiled": profiled}
            if args.baseline:
                artifacts["baseline"] = args.baseline
            speed(artifacts, args)
        coverage(profiled, args)
    except BenchError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted")


if __name__ == "__main__":
    main()
