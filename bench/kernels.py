"""Kernel microbenchmarks: linear (GEMV for decode, GEMM for prefill) against the memory roofline.

Prints one JSON line per result. First the machine's read bandwidth, measured here with a plain
vector-sum over 512 MiB using the same thread pool, and the pool's cost per ``ife_parallel_for``;
then each linear kernel with its GB/s (weight bytes streamed per second), GFLOP/s and
``roofline`` = GB/s / measured read bandwidth. Decode shapes rotate over enough copies of the
weights to exceed the last-level cache, so every call streams from DRAM as it does in a real
decode step. Every figure is the best of repeated samples (other processes only add time).

    python bench/kernels.py                       # native ISA, 1 and 2 threads
    python bench/kernels.py --isa avx2 --threads 2 --csv out.csv
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time

import cffi
import numpy as np

from infeng_compiler.codegen.build import build_library
from infeng_compiler.codegen.kernels import KernelSpec, cdef, library_sources
from infeng_compiler.codegen.target import get_target

#: Bytes of weights each timed pass covers (well past any last-level cache).
STREAM_BYTES = 512 << 20
DECODE_SHAPES = [(576, 1536), (1536, 576), (576, 49152), (2048, 8192)]   # (K, N): smollm135 mlp / logits, llama1b
PREFILL_SHAPES = [(576, 1536), (2048, 8192)]
WDTYPES = ["f16", "f32", "bf16"]
#: Back-to-back empty jobs timed for the thread pool's per-call overhead.
POOL_CALLS = 20000

READ_PROBE = """
#define _POSIX_C_SOURCE 200809L
#include "ife_kernels.h"
#include <time.h>

enum { CHUNKS = 256, UNROLL = 4 };
typedef float vec16 __attribute__((vector_size(64)));     /* lowered to the target's vectors */

struct read_args { const vec16 *p; size_t n; float partial[CHUNKS]; };

static void read_range(void *ctx, int begin, int end) {
    struct read_args *a = ctx;
    for (int c = begin; c < end; c++) {
        const size_t i0 = a->n * (size_t)c / CHUNKS / UNROLL * UNROLL, i1 = a->n * (size_t)(c + 1) / CHUNKS / UNROLL * UNROLL;
        vec16 s[UNROLL] = {{0}};
        for (size_t i = i0; i < i1; i += UNROLL)
            for (int u = 0; u < UNROLL; u++)
                s[u] += a->p[i + u];
        float total = 0;
        for (int u = 0; u < UNROLL; u++)
            for (int l = 0; l < 16; l++)
                total += s[u][l];
        a->partial[c] = total;
    }
}

static void no_work(void *ctx, int begin, int end) { (void)ctx; (void)begin; (void)end; }

/* Nanoseconds per ife_parallel_for of an empty job, over `calls` back-to-back calls. */
double ife_bench_pool(ife_pool *pool, int calls) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < calls; i++)
        ife_parallel_for(pool, CHUNKS, no_work, NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / calls;
}

/* Reads n 64-byte vectors at p once with every pool thread; the sum keeps the reads alive. */
float ife_bench_read(ife_pool *pool, const float *p, size_t n) {
    struct read_args a = {(const vec16 *)p, n, {0}};
    ife_parallel_for(pool, CHUNKS, read_range, &a);
    float s = 0;
    for (int c = 0; c < CHUNKS; c++) s += a.partial[c];
    return s;
}
"""


def build(isa: str, specs: list[KernelSpec]):
    target = get_target(isa, for_running=True)
    sources, baseline = library_sources(specs, target)
    sources["bench_read.c"] = READ_PROBE
    result = build_library(sources, target, baseline_sources=baseline)
    ffi = cffi.FFI()
    ffi.cdef(cdef(specs) + "float ife_bench_read(ife_pool *pool, const float *p, size_t n);\n"
                           "double ife_bench_pool(ife_pool *pool, int calls);")
    return ffi, ffi.dlopen(str(result.path))


def timed(fn, min_seconds: float) -> float:
    """Fastest seconds per call of ``fn`` over at least ``min_seconds`` (after one warm-up call).

    The minimum, not the median: on a shared machine other processes only ever add time.
    """
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_seconds or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def weights_for(wdtype: str, K: int, N: int, copies: int, rng: np.random.Generator) -> list[np.ndarray]:
    dtype = np.float32 if wdtype == "f32" else np.uint16
    one = rng.standard_normal((N, K), dtype=np.float32)
    if wdtype == "f16":
        one = one.astype(np.float16).view(np.uint16)
    elif wdtype == "bf16":
        one = (one.view(np.uint32) >> 16).astype(np.uint16)
    return [one.astype(dtype, copy=True) for _ in range(copies)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default="native")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--wdtypes", default=",".join(WDTYPES))
    ap.add_argument("--seconds", type=float, default=1.0, help="minimum timing per result")
    ap.add_argument("--csv", help="also write the results to this CSV file")
    args = ap.parse_args(argv)
    isa = get_target(args.isa, for_running=True).name
    wdtypes = args.wdtypes.split(",")
    shapes = sorted(set(DECODE_SHAPES) | set(PREFILL_SHAPES))
    specs = {(K, N, wd): KernelSpec.make("linear", isa, K=K, N=N, wdtype=wd) for K, N in shapes for wd in wdtypes}
    ffi, lib = build(isa, list(specs.values()))
    rng = np.random.default_rng(0)
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    def fptr(a: np.ndarray, ctype: str = "float *"):
        return ffi.cast(ctype, ffi.from_buffer(a))

    probe = np.ones(STREAM_BYTES // 4, dtype=np.float32)
    bandwidth: dict[int, float] = {}
    for threads in map(int, args.threads.split(",")):
        pool = lib.ife_pool_create(threads)
        try:
            seconds = timed(lambda: lib.ife_bench_read(pool, fptr(probe), probe.size // 16), args.seconds)
            bandwidth[threads] = probe.nbytes / seconds / 1e9
            emit({"kernel": "read_probe", "shape": f"{probe.nbytes >> 20}MiB", "T": 0, "threads": threads,
                  "isa": isa, "GB/s": round(bandwidth[threads], 2)})
            pool_ns = min(lib.ife_bench_pool(pool, POOL_CALLS) for _ in range(5))
            emit({"kernel": "parallel_for", "shape": "empty job", "T": 0, "threads": threads, "isa": isa,
                  "us": round(pool_ns / 1e3, 3)})
            for (K, N, wd), spec in specs.items():
                fn = getattr(lib, spec.symbol)
                ctype = "float *" if wd == "f32" else "uint16_t *"
                per_copy = N * K * (4 if wd == "f32" else 2)
                for T, shape_list in ((1, DECODE_SHAPES), (512, PREFILL_SHAPES)):
                    if (K, N) not in shape_list:
                        continue
                    copies = max(2, -(-STREAM_BYTES // per_copy)) if T == 1 else 1
                    arrays = weights_for(wd, K, N, copies, rng)         # kept alive while timed
                    ws = [fptr(w, ctype) for w in arrays]
                    x = rng.standard_normal((T, K), dtype=np.float32)
                    y = np.empty((T, N), dtype=np.float32)
                    xp, yp = fptr(x), fptr(y)

                    def run_pass() -> None:
                        for w in ws:
                            fn(pool, xp, T, w, ffi.NULL, yp)

                    seconds = timed(run_pass, args.seconds) / copies
                    gbs = per_copy / seconds / 1e9
                    emit({"kernel": spec.symbol, "shape": f"K={K},N={N}", "wdtype": wd, "T": T, "threads": threads,
                          "isa": isa, "us": round(seconds * 1e6, 2), "GB/s": round(gbs, 2),
                          "GFLOP/s": round(2.0 * T * K * N / seconds / 1e9, 2),
                          "roofline": round(gbs / bandwidth[threads], 3) if T == 1 else None})
        finally:
            lib.ife_pool_destroy(pool)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
