"""Variants of the f16 decode GEMV (T = 1) on DRAM-bound shapes, and the streaming-read roof.

Compiles ``bench/gemv_variants.c`` for avx512 (when the host has it) and avx2, maps 512 MiB of f16
weights from a file (as model.c maps weights.bin) and times, with 1 and 2 threads (contiguous halves
of the rows, a spin barrier between passes), each GEMV variant over the llama1b decode shapes: every
pass streams all the copies of the matrix the 512 MiB hold, so the weights come from DRAM. A variant
is R rows read at once (interleaved along K), L cache lines of each row per step, A accumulators per
row and a software prefetch PF bytes ahead in each row's stream (0: none). Then the read probe: a
plain vector sum over the same mapping with S streams and prefetch PF, the best of which is the roof
a GEMV can reach. Prints one JSON line per result (GB/s of weights read, best of ``--reps``).

    python bench/gemv_variants.py --isa avx512 --threads 1,2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import cffi
import numpy as np

#: llama1b's decode GEMVs (K, N): o_proj, fused gate/up, down, fused qkv.
SHAPES = [(2048, 2048), (2048, 16384), (8192, 2048), (2048, 3072)]
STREAM_BYTES = 512 << 20
FLAGS = {"avx512": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mf16c", "-mfma"],
         "avx2": ["-mavx2", "-mfma", "-mf16c"]}
READS = [(1, 0), (2, 0), (1, 1024), (1, 2048)]   # (S, PF)


def build(isa: str, tmp: str):
    source = Path(__file__).with_name("gemv_variants.c")
    library = Path(tmp) / f"gemv_{isa}.so"
    subprocess.run([os.environ.get("CC", "cc"), "-O2", "-fPIC", "-shared", "-pthread", *FLAGS[isa],
                    str(source), "-o", str(library)], check=True)
    ffi = cffi.FFI()
    ffi.cdef("""int n_variants(void); const char *variant_name(int i); void set_threads(int threads);
        double time_gemv(int variant, const uint16_t *w, const float *x, float *y, int K, int N, int copies, int reps);
        double time_read(const char *p, size_t n, int S, int PF, int reps);""")
    return ffi, ffi.dlopen(str(library))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default="avx512,avx2")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", help="comma-separated variant names (default: all)")
    ap.add_argument("--no-read", action="store_true")
    ap.add_argument("--shapes", help="comma-separated KxN (default: the llama1b shapes)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="infeng-gemv-") as tmp:
        path = os.path.join(tmp, "w.bin")
        rng = np.random.default_rng(0)
        rng.standard_normal(STREAM_BYTES // 2, dtype=np.float32).astype(np.float16).tofile(path)
        w = np.memmap(path, dtype=np.uint16, mode="r")
        for isa in args.isa.split(","):
            ffi, lib = build(isa, tmp)
            names = [ffi.string(lib.variant_name(i)).decode() for i in range(lib.n_variants())]
            wp = ffi.cast("uint16_t *", ffi.from_buffer(w))
            for threads in map(int, args.threads.split(",")):
                lib.set_threads(threads)
                if not args.no_read:
                    for S, PF in READS:
                        s = lib.time_read(ffi.cast("char *", wp), w.nbytes, S, PF, args.reps)
                        print(json.dumps({"isa": isa, "threads": threads, "kernel": "read", "S": S, "PF": PF,
                                          "GB/s": round(w.nbytes / s / 1e9, 2)}), flush=True)
                for K, N in SHAPES:
                    if args.shapes and f"{K}x{N}" not in args.shapes.split(","):
                        continue
                    copies = STREAM_BYTES // (2 * K * N)
                    x = rng.standard_normal(K, dtype=np.float32)
                    y = np.empty(N, dtype=np.float32)
                    for i, name in enumerate(names):
                        if args.variants and name not in args.variants.split(","):
                            continue
                        s = lib.time_gemv(i, wp, ffi.cast("float *", ffi.from_buffer(x)), ffi.cast("float *", ffi.from_buffer(y)),
                                          K, N, copies, args.reps)
                        print(json.dumps({"isa": isa, "threads": threads, "kernel": name, "shape": f"{K}x{N}",
                                          "GB/s": round(copies * 2 * K * N / s / 1e9, 2)}), flush=True)
            lib.set_threads(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
