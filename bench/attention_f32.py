"""f32-cache attention kernel microbenchmark: a prefill step and one-row decode steps, one target.

Times the ``attention`` kernel (the default f32 KV cache) of a preset's attention shape alone: a
step of ``--prefill`` rows of one sequence from position 0 (a prompt's chunk), and a one-row decode
step after each of ``--contexts`` positions, over a paged cache of 16-position blocks filled by the
kernel itself (random rows). The cache of one layer stays in the last-level cache (this measures the
kernel's arithmetic, not DRAM; bench/attention.py streams the other KV formats from DRAM). Prints one
JSON line per (case, threads): ms per call, best and median of ``--reps``.

    python bench/attention_f32.py --preset smollm135 --isa avx2 --threads 1,2

To compare two checkouts, run this file with each one's package on PYTHONPATH, alternating.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import cffi
import numpy as np

from infeng_compiler.codegen.build import build_library
from infeng_compiler.codegen.kernels import KernelSpec, cdef, library_sources
from infeng_compiler.codegen.target import get_target

#: (query heads, KV heads, head_dim) of the presets' attention.
PRESETS = {"smollm135": (9, 3, 64), "llama1b": (32, 8, 64)}
BLOCK = 16


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="smollm135", choices=sorted(PRESETS))
    ap.add_argument("--isa", default="native")
    ap.add_argument("--prefill", type=int, default=512, help="rows of the prefill step")
    ap.add_argument("--contexts", default="512,2048", help="positions before each decode step")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=25)
    args = ap.parse_args(argv)

    heads, kv_heads, head_dim = PRESETS[args.preset]
    target = get_target(args.isa)
    spec = KernelSpec.make("attention", target.name, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
                           block_size=BLOCK, scale=1 / math.sqrt(head_dim), window=0)
    sources, baseline = library_sources([spec], target)
    ffi = cffi.FFI()
    ffi.cdef(cdef([spec]))
    lib = ffi.dlopen(str(build_library(sources, target, baseline_sources=baseline).path))
    fn = getattr(lib, spec.symbol)
    rng = np.random.default_rng(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    positions = max([args.prefill, *contexts]) + 1
    n_blocks = -(-positions // BLOCK)
    table = rng.permutation(n_blocks).astype(np.int32)              # blocks scattered, as after reuse
    k_cache = np.zeros((n_blocks, BLOCK, kv_heads, head_dim), np.float32)
    v_cache = np.zeros_like(k_cache)

    def ptr(a: np.ndarray, ctype: str = "float *"):
        return ffi.cast(ctype, ffi.from_buffer(a))

    def step(pool, first: int, rows: int) -> float:
        q = rng.standard_normal((rows, heads * head_dim), dtype=np.float32)
        k, v = (rng.standard_normal((rows, kv_heads * head_dim), dtype=np.float32) for _ in range(2))
        out = np.empty_like(q)
        pos, seq = np.arange(first, first + rows, dtype=np.int32), np.zeros(rows, np.int32)
        t0 = time.perf_counter()
        fn(pool, ptr(q), ptr(k), ptr(v), rows, ptr(pos, "int32_t *"), ptr(seq, "int32_t *"), ptr(table, "int32_t *"),
           n_blocks, ptr(k_cache), ptr(v_cache), ptr(out))
        return time.perf_counter() - t0

    fill = lib.ife_pool_create(2)
    step(fill, 0, positions)                                         # every position's K/V in the cache
    lib.ife_pool_destroy(fill)
    cases = [(f"prefill{args.prefill}", 0, args.prefill)] + [(f"decode@{c}", c, 1) for c in contexts]
    for threads in (int(t) for t in args.threads.split(",")):
        pool = lib.ife_pool_create(threads)
        for name, first, rows in cases:
            times = [step(pool, first, rows) for _ in range(args.reps)]
            print(json.dumps({"bench": "attention_f32", "preset": args.preset, "isa": target.name, "case": name,
                              "threads": threads, "ms_best": round(min(times) * 1e3, 3),
                              "ms_median": round(statistics.median(times) * 1e3, 3)}), flush=True)
        lib.ife_pool_destroy(pool)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
