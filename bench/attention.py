"""Attention kernel microbenchmark: one decode token over a long paged KV cache, from DRAM.

Times the ``attention_kvq`` kernel of a model's attention shape alone, the way a decode step calls
it: one token at position ``ctx`` attends to ``ctx`` cached positions, once per layer. Each layer's
cache lives in its own place, and steps rotate over enough copies of all layers that the cache
comes from DRAM (as in a model, where the weights stream through the last-level cache between two
attention calls). The cache is filled by the kernel itself (a prefill of random rows), so scores
and probabilities are realistic. Prints one JSON line per (scheme, context, threads): ms per step
(all layers; best and median of ``--steps``), the cache bytes read per step, and GB/s.

    python bench/attention.py --preset smollm135 --kv f16,fht-int8,fht-int4 --contexts 256,2048 --threads 1,2

Each step is ``layers`` cffi calls (about 1 us each) next to the kernel time.
"""
from __future__ import annotations

import argparse
import json
import math
import mmap
import statistics
import time

import cffi
import numpy as np

from infeng_compiler.codegen.build import build_library
from infeng_compiler.codegen.kernels import KernelSpec, cdef, library_sources
from infeng_compiler.codegen.target import get_target
from infeng_compiler.quant.kv import DEFAULT_GROUP, block_bytes

#: (query heads, KV heads, head_dim, layers) of the presets' attention.
PRESETS = {"smollm135": (9, 3, 64, 30), "llama1b": (32, 8, 64, 16)}
#: Bytes all copies of the cache span: well past the last-level cache.
SPAN_BYTES = 256 << 20
BLOCK = 16


def scheme(kv: str) -> tuple[str, bool]:
    """``--kv`` name -> (format of K and V, rotated)."""
    fmt = kv.removeprefix("fht-")
    if fmt not in ("f32", "f16", "int8", "int4"):
        raise SystemExit(f"bench/attention.py: unknown KV scheme {kv!r} (f16, int8, int4, fht-int8, fht-int4)")
    return fmt, kv.startswith("fht-")


def spec_for(isa: str, heads: int, kv_heads: int, head_dim: int, fmt: str, rotate: bool) -> KernelSpec:
    return KernelSpec.make("attention_kvq", isa, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
                           block_size=BLOCK, scale=1 / math.sqrt(head_dim), window=0, k_format=fmt, v_format=fmt,
                           group=DEFAULT_GROUP if fmt == "int4" else 0, rotate=rotate, kv_window=0, ring_rows=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="smollm135", choices=sorted(PRESETS))
    ap.add_argument("--kv", default="f16,fht-int8,fht-int4")
    ap.add_argument("--contexts", default="256,2048")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--isa", default="native")
    args = ap.parse_args(argv)

    heads, kv_heads, head_dim, layers = PRESETS[args.preset]
    target = get_target(args.isa)
    schemes = args.kv.split(",")
    specs = {kv: spec_for(target.name, heads, kv_heads, head_dim, *scheme(kv)) for kv in schemes}
    sources, baseline = library_sources(list(specs.values()), target)
    ffi = cffi.FFI()
    ffi.cdef(cdef(list(specs.values())))
    lib = ffi.dlopen(str(build_library(sources, target, baseline_sources=baseline).path))
    rng = np.random.default_rng(0)

    def ptr(a, ctype="float *"):
        return ffi.cast(ctype, ffi.from_buffer(a))

    for ctx in (int(c) for c in args.contexts.split(",")):
        n_blocks = ctx // BLOCK + 1
        table = np.arange(n_blocks, dtype=np.int32)
        for kv in schemes:
            fmt, _ = scheme(kv)
            kb = block_bytes(fmt, BLOCK, kv_heads, head_dim, DEFAULT_GROUP)
            vb = block_bytes(fmt, BLOCK, kv_heads, head_dim, DEFAULT_GROUP, value=True)
            layer_bytes = n_blocks * (kb + vb)
            copies = max(1, -(-SPAN_BYTES // (layers * layer_bytes)))
            span = mmap.mmap(-1, copies * layers * layer_bytes)
            span.madvise(mmap.MADV_HUGEPAGE)
            cache = np.frombuffer(span, np.uint8).reshape(copies * layers, layer_bytes)
            fn = getattr(lib, specs[kv].symbol)
            # fill one layer with a prefill of random rows, then copy it everywhere
            q = rng.standard_normal((ctx, heads * head_dim), dtype=np.float32)
            k = rng.standard_normal((ctx, kv_heads * head_dim), dtype=np.float32)
            v = rng.standard_normal((ctx, kv_heads * head_dim), dtype=np.float32)
            out = np.empty_like(q)
            pos, seq = np.arange(ctx, dtype=np.int32), np.zeros(ctx, np.int32)
            fill_pool = lib.ife_pool_create(2)
            fn(fill_pool, ptr(q), ptr(k), ptr(v), ffi.NULL, ctx, ptr(pos, "int32_t *"), ptr(seq, "int32_t *"),
               ptr(table, "int32_t *"), n_blocks, ptr(cache[0, :n_blocks * kb], "uint8_t *"),
               ptr(cache[0, n_blocks * kb:], "uint8_t *"), ffi.NULL, ffi.NULL, ffi.NULL, ptr(out))
            lib.ife_pool_destroy(fill_pool)
            cache[1:] = cache[0]
            read_mb = layers * ctx * (kb + vb) / BLOCK / 1e6
            q1, k1, v1, out1 = q[:1].copy(), k[:1].copy(), v[:1].copy(), out[:1].copy()
            pos1 = np.array([ctx], np.int32)
            out1_ptr = ptr(out1)
            layer_ptrs = [(ptr(row[:n_blocks * kb], "uint8_t *"), ptr(row[n_blocks * kb:], "uint8_t *"))
                          for row in cache]
            step_args = (ptr(q1), ptr(k1), ptr(v1), ffi.NULL, 1, ptr(pos1, "int32_t *"), ptr(seq[:1], "int32_t *"),
                         ptr(table, "int32_t *"), n_blocks)
            for threads in (int(t) for t in args.threads.split(",")):
                pool = lib.ife_pool_create(threads)
                times = []
                for step in range(args.steps):
                    copy = layer_ptrs[(step % copies) * layers:(step % copies + 1) * layers]
                    t0 = time.perf_counter()
                    for k_cache, v_cache in copy:
                        fn(pool, *step_args, k_cache, v_cache, ffi.NULL, ffi.NULL, ffi.NULL, out1_ptr)
                    times.append(time.perf_counter() - t0)
                lib.ife_pool_destroy(pool)
                best = min(times)
                print(json.dumps({"bench": "attention_kvq", "preset": args.preset, "kv": kv, "ctx": ctx,
                                  "threads": threads, "isa": target.name, "layers": layers,
                                  "ms_per_step": round(best * 1e3, 3),
                                  "ms_median": round(statistics.median(times) * 1e3, 3),
                                  "mb_read_per_step": round(read_mb, 2), "gb_s": round(read_mb / 1e3 / best, 2)}),
                      flush=True)
            del layer_ptrs, step_args, out1_ptr, cache
            span.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
