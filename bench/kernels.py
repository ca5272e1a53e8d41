"""Kernel microbenchmarks: linear (GEMV for decode, GEMM for prefill) against the memory roofline.

``--wdtypes`` takes float weight dtypes (f16, f32, bf16) and quantized formats (q4g32, q8r, ...:
the ``linear_q4``/``linear_q8``/``linear_f8`` kernels over packed weights of random bytes, which
time like real ones, and activation rows quantized as the kernel reads them; ``q4g32/f32``: the
integer format's f32-activation kernel, ``linear_qf32``).

Prints one JSON line per result. First the machine's read bandwidth, measured here with a plain
vector-sum over 512 MiB using the same thread pool, and the pool's cost per ``ife_parallel_for``;
then each linear kernel with its GB/s (weight bytes streamed per second), GFLOP/s and
``roofline`` = GB/s / measured read bandwidth. The weights live in a file mapped the way model.c
maps weights.bin; decode shapes (T < 512) rotate over all the copies 512 MiB holds, so every call
streams from DRAM as in a real decode step. Every figure is the best over ``--rounds`` passes of
repeated samples: on a shared machine other processes only ever add time.

    python bench/kernels.py                       # native ISA, 1 and 2 threads
    python bench/kernels.py --isa avx2 --threads 2 --csv out.csv
    python bench/kernels.py --tokens 1,4,8,16,32 --wdtypes f16    # batched decode
"""
from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import cffi
import numpy as np

from infeng_compiler.codegen.build import build_library
from infeng_compiler.codegen import quant_kernels
from infeng_compiler.codegen.kernels import KernelSpec, cdef, library_sources, template_isa
from infeng_compiler.codegen.quant_kernels import linear_op
from infeng_compiler.codegen.target import get_target
from infeng_compiler.quant.act import pack_act_rows
from infeng_compiler.quant.formats import get_format, is_quantized

#: Bytes of weights each decode pass streams (well past any last-level cache).
STREAM_BYTES = 512 << 20
DECODE_SHAPES = [(576, 1536), (1536, 576), (576, 49152), (2048, 8192), (2048, 16384), (2048, 2048), (2048, 3072), (8192, 2048),
                 (2048, 49152)]
# (K, N): smollm135 mlp / logits; llama1b gate or up, fused gate/up, o_proj, fused qkv, down, logits
PREFILL_SHAPES = [(576, 1536), (2048, 8192), (8192, 2048)]   # and llama1b's down projection
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


def mapped_weights(path: str, dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    """STREAM_BYTES of weights written to ``path`` and mapped back, as model.c maps weights.bin
    (shared file mapping, page-cache pages): f32 values, or f16 bit patterns (valid as bf16 too)."""
    n = STREAM_BYTES // dtype.itemsize
    values = rng.standard_normal(n, dtype=np.float32)
    data = values if dtype == np.float32 else values.astype(np.float16).view(np.uint16)
    data.tofile(path)
    return np.memmap(path, dtype=dtype, mode="r")


@dataclass
class Case:
    """One timed configuration; ``run`` does one pass over ``copies`` weight matrices."""

    row: dict
    run: Callable[[], None]
    copies: int
    bytes_per_copy: int
    flops_per_copy: float
    best: float = math.inf
    call_times: list[float] | None = None     # --per-call: seconds of each call


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default="native")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--wdtypes", default=",".join(WDTYPES))
    ap.add_argument("--shapes", help="comma-separated KxN filter, e.g. 576x1536,576x49152")
    ap.add_argument("--tokens", default="1,512",
                    help="token rows per call: 512 times the prefill shapes, any other count the decode "
                         "shapes with weights streamed from DRAM (batched decode), e.g. 1,4,8,16,32")
    ap.add_argument("--seconds", type=float, default=0.5, help="minimum timing per result and round")
    ap.add_argument("--rounds", type=int, default=3, help="passes over all results; each keeps its best")
    ap.add_argument("--per-call", type=float, metavar="Q",
                    help="time linear calls one by one and report this quantile of them (e.g. 0.2) instead of "
                         "the best pass over all weight copies: on a loaded machine a whole pass is rarely "
                         "left alone, single calls often are")
    ap.add_argument("--csv", help="also write the results to this CSV file")
    ap.add_argument("--tile-rows", type=int, metavar="TT",
                    help="token rows per micro-tile of the integer linears (linear_q4, linear_q8) instead of "
                         "quant_kernels._TILES: to choose that table's value by measurement")
    ap.add_argument("--item-blocks", type=int, metavar="RB",
                    help="blocks of 16 weight rows per work item of the integer linears (the most: "
                         "quant_kernels._item_blocks may take fewer) instead of quant_kernels._TILES")
    ap.add_argument("--gemv-prefetch", type=int, metavar="BYTES",
                    help="software prefetch distance of the int4 and int8 streamed paths (T <= STREAM_T) "
                         "instead of quant_kernels.GEMV_PREFETCH_BYTES(_INT8, _INT8_ONE_ROW): to choose them "
                         "by measurement")
    args = ap.parse_args(argv)
    isa = get_target(args.isa, for_running=True).name
    if args.tile_rows or args.item_blocks:
        vocabulary = template_isa(KernelSpec.make("linear_q4", isa, K=64, N=16, wformat="q4g32"))
        tt, rb, rb_multi = quant_kernels._TILES[vocabulary]
        quant_kernels._TILES[vocabulary] = (args.tile_rows or tt, args.item_blocks or rb, rb_multi)
    if args.gemv_prefetch is not None:
        quant_kernels.GEMV_PREFETCH_BYTES = quant_kernels.GEMV_PREFETCH_BYTES_INT8 = args.gemv_prefetch
        quant_kernels.GEMV_PREFETCH_BYTES_INT8_ONE_ROW = dict.fromkeys(quant_kernels.GEMV_PREFETCH_BYTES_INT8_ONE_ROW,
                                                                       args.gemv_prefetch)
    wdtypes = args.wdtypes.split(",")
    wanted = {tuple(map(int, s.split("x"))) for s in args.shapes.split(",")} if args.shapes else None
    shapes = [s for s in sorted(set(DECODE_SHAPES) | set(PREFILL_SHAPES)) if wanted is None or s in wanted]
    token_counts = [int(t) for t in args.tokens.split(",")]
    specs = {(K, N, wd): linear_spec(isa, K, N, wd) for K, N in shapes for wd in wdtypes}
    ffi, lib = build(isa, list(specs.values()))
    rng = np.random.default_rng(0)

    def ptr(a: np.ndarray, ctype: str = "float *"):
        return ffi.cast(ctype, ffi.from_buffer(a))

    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="infeng-bench-") as tmp:
        data = {"f32": mapped_weights(os.path.join(tmp, "f32.bin"), np.dtype(np.float32), rng),
                "u16": mapped_weights(os.path.join(tmp, "u16.bin"), np.dtype(np.uint16), rng)}
        pools = {threads: lib.ife_pool_create(threads) for threads in map(int, args.threads.split(","))}
        try:
            for threads, pool in pools.items():
                common = {"threads": threads, "isa": isa, **({"tile_rows": args.tile_rows} if args.tile_rows else {}),
                          **({"item_blocks": args.item_blocks} if args.item_blocks else {}),
                          **({"gemv_prefetch": args.gemv_prefetch} if args.gemv_prefetch is not None else {})}
                probe = data["f32"]
                cases.append(Case({"kernel": "read_probe", "shape": f"{probe.nbytes >> 20}MiB", "T": 0, **common},
                                  functools.partial(lib.ife_bench_read, pool, ptr(probe), probe.size // 16),
                                  1, probe.nbytes, 0.0))
                cases.append(Case({"kernel": "parallel_for", "shape": "empty job", "T": 0, **common},
                                  functools.partial(lib.ife_bench_pool, pool, POOL_CALLS), POOL_CALLS, 0, 0.0))
                for (K, N, wd), spec in specs.items():
                    flat = data["f32" if wd == "f32" else "u16"]
                    ctype = "float *" if wd == "f32" else "uint16_t *"
                    per_copy = N * K * flat.itemsize
                    if is_quantized(wd.partition("/")[0]):
                        flat, ctype = data["u16"].view(np.uint8), "uint8_t *"
                        per_copy = get_format(wd.partition("/")[0]).nbytes((N, K))
                    for T in token_counts:
                        if (K, N) not in (PREFILL_SHAPES if T == 512 else DECODE_SHAPES):
                            continue
                        # decode streams every copy the file holds; prefill reuses one (compute-bound)
                        copies = max(1, STREAM_BYTES // per_copy) if T != 512 else 1
                        elems = per_copy // flat.itemsize
                        ws = [ptr(flat[i * elems:(i + 1) * elems], ctype) for i in range(copies)]
                        x = rng.standard_normal((T, K), dtype=np.float32)
                        if spec.op in ("linear_q4", "linear_q8"):
                            x = activation_rows(spec, x)
                        y = np.empty((T, N), dtype=np.float32)
                        call_times = [] if args.per_call is not None else None
                        cases.append(Case({"kernel": spec.symbol, "shape": f"K={K},N={N}", "wdtype": wd, "T": T, **common},
                                          functools.partial(run_linear, getattr(lib, spec.symbol), pool,
                                                            ptr(x, "float *" if x.dtype == np.float32 else "void *"), T, ws,
                                                            ptr(y), ffi.NULL, (x, y), call_times),
                                          copies, per_copy, 2.0 * T * K * N, call_times=call_times))
            for _ in range(args.rounds):
                for case in cases:
                    if case.call_times is not None:
                        case.call_times.clear()
                        timed(case.run, args.seconds)
                        quantile = float(np.quantile(case.call_times, args.per_call)) * case.copies
                        case.best = min(case.best, quantile)
                    else:
                        case.best = min(case.best, timed(case.run, args.seconds))
        finally:
            for pool in pools.values():
                lib.ife_pool_destroy(pool)

    bandwidth = {c.row["threads"]: c.bytes_per_copy / c.best / 1e9 for c in cases if c.row["kernel"] == "read_probe"}
    rows = []
    for case in cases:
        per_call = case.best / case.copies
        row = dict(case.row, us=round(per_call * 1e6, 3))
        if case.bytes_per_copy:
            row["GB/s"] = round(case.bytes_per_copy / per_call / 1e9, 2)
        if case.flops_per_copy:
            row["GFLOP/s"] = round(case.flops_per_copy / per_call / 1e9, 2)
        if 0 < row["T"] < 512:
            row["roofline"] = round(row["GB/s"] / bandwidth[row["threads"]], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            writer.writeheader()
            writer.writerows(rows)
    return 0


def linear_spec(isa: str, K: int, N: int, wdtype: str) -> KernelSpec:
    """The linear kernel of a float weight dtype or a quantized weight format (``<format>/f32``: the
    f32-activation kernel of an integer format)."""
    if wdtype.endswith("/f32"):
        return KernelSpec.make("linear_qf32", isa, K=K, N=N, wformat=wdtype.removesuffix("/f32"))
    if is_quantized(wdtype):
        return KernelSpec.make(linear_op(wdtype), isa, K=K, N=N, wformat=wdtype)
    return KernelSpec.make("linear", isa, K=K, N=N, wdtype=wdtype)


def activation_rows(spec: KernelSpec, x: np.ndarray) -> np.ndarray:
    """``x`` quantized into the activation rows an integer linear kernel reads (quant/act.py)."""
    return pack_act_rows(x, 8 if spec.op == "linear_q4" else 16)


def run_linear(fn, pool, x, T: int, weights: list, y, bias, keep_alive: tuple, call_times: list | None = None) -> None:
    """One linear call per weight copy (``keep_alive`` holds the arrays behind the pointers); with
    ``call_times``, each call is timed on its own and appended."""
    if call_times is None:
        for w in weights:
            fn(pool, x, T, w, bias, y)
        return
    clock = time.perf_counter
    for w in weights:
        t0 = clock()
        fn(pool, x, T, w, bias, y)
        call_times.append(clock() - t0)


if __name__ == "__main__":
    sys.exit(main())
