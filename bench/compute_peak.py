"""The arithmetic roof of this CPU: multiply-adds per second of the instructions the kernels use.

    python bench/compute_peak.py --threads 1 2            # one JSON line per (instruction, threads)

Each probe runs a loop of independent chains of one instruction in registers (no memory traffic),
long enough that the chains hide its latency, on ``--threads`` threads at once. It gives the figure
a prefill's FLOP/s (or OP/s) is a fraction of: ``compare_llamacpp.py``'s pp512 at 2 FLOP per weight
per token is only fast or slow against it.

| probe | instruction | multiply-adds per instruction |
| --- | --- | --- |
| ``f32-fma-ymm`` | ``vfmadd231ps`` ymm (AVX2 + FMA: what f16/bf16/f32 linears issue on avx2) | 8 |
| ``f32-fma-zmm`` | ``vfmadd231ps`` zmm (AVX-512F) | 16 |
| ``bf16-dot-zmm`` | ``vdpbf16ps`` zmm (AVX-512 BF16) | 32 |
| ``u8i8-maddubs-only-ymm`` | ``vpmaddubsw`` alone (the multiply pipes' rate, u8 x i8) | 32 |
| ``i16-madd-only-ymm`` | ``vpmaddwd`` alone (the multiply pipes' rate, i16 x i16) | 16 |
| ``u4i8-maddubs-addw-ymm`` | ``vpmaddubsw`` + ``vpaddw`` (``linear_q4``'s step without VNNI: 16-bit partial sums) | 32 per pair |
| ``i8-maddubs-ymm`` | ``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd`` ymm (int8 dot steps without VNNI) | 32 per triple |
| ``i16-madd-ymm`` | ``vpmaddwd`` + ``vpaddd`` ymm (int8 weights x int16 activations) | 16 per pair |
| ``i8-vnni-zmm`` | ``vpdpbusd`` zmm (AVX-512 VNNI) | 64 |

An operation is a multiply or an add, so GOP/s = 2 x multiply-adds per second, as GFLOP/s counts
them. A probe the host cannot run prints a line with the reason and no figure.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import cffi

from infeng_compiler.codegen.target import host_features

#: probe name -> (features it needs, register prefix, one chain's step over its accumulator ``{a}``
#: and temporary ``{t}`` (inputs in registers 14 and 15, 16-bit ones in 13), multiply-adds per step)
PROBES: dict[str, tuple[set[str], str, str, int]] = {
    "f32-fma-ymm": ({"avx2", "fma"}, "ymm", "vfmadd231ps %%ymm14, %%ymm15, %%ymm{a}", 8),
    "f32-fma-zmm": ({"avx512f"}, "zmm", "vfmadd231ps %%zmm14, %%zmm15, %%zmm{a}", 16),
    "bf16-dot-zmm": ({"avx512f", "avx512_bf16"}, "zmm", "vdpbf16ps %%zmm14, %%zmm15, %%zmm{a}", 32),
    "u8i8-maddubs-only-ymm": ({"avx2"}, "ymm", "vpmaddubsw %%ymm14, %%ymm{a}, %%ymm{a}", 32),
    "i16-madd-only-ymm": ({"avx2"}, "ymm", "vpmaddwd %%ymm14, %%ymm{a}, %%ymm{a}", 16),
    "u4i8-maddubs-addw-ymm": ({"avx2"}, "ymm", "vpmaddubsw %%ymm14, %%ymm15, %%ymm{t}; "
                              "vpaddw %%ymm{t}, %%ymm{a}, %%ymm{a}", 32),
    "i8-maddubs-ymm": ({"avx2"}, "ymm", "vpmaddubsw %%ymm14, %%ymm15, %%ymm{t}; "
                       "vpmaddwd %%ymm13, %%ymm{t}, %%ymm{t}; vpaddd %%ymm{t}, %%ymm{a}, %%ymm{a}", 32),
    "i16-madd-ymm": ({"avx2"}, "ymm", "vpmaddwd %%ymm14, %%ymm15, %%ymm{t}; vpaddd %%ymm{t}, %%ymm{a}, %%ymm{a}", 16),
    "i8-vnni-zmm": ({"avx512f", "avx512_vnni"}, "zmm", "vpdpbusd %%zmm14, %%zmm15, %%zmm{a}", 64),
}

#: independent chains per thread: 12 accumulators for one-instruction steps, 6 (and 6 temporaries)
#: for the others; more than latency x throughput of every step above on current x86 cores
CHAINS_SINGLE, CHAINS_MULTI = 12, 6

SOURCE = r"""
#include <pthread.h>
typedef struct { long iters; } job_t;
static const float one = 1.0f;
static void *run(void *arg) {
    long n = ((job_t *)arg)->iters;
    __asm__ volatile(
        {init}
        "1:\n"
        {steps}
        "dec %[n]\n"
        "jnz 1b\n"
        "vzeroupper\n"
        : [n] "+r"(n)
        : [one] "m"(one)
        : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",
          "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
    return NULL;
}
void probe(long iters, int threads) {
    pthread_t t[64]; job_t jobs[64];
    for (int i = 0; i < threads; i++) { jobs[i].iters = iters; pthread_create(&t[i], NULL, run, &jobs[i]); }
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
}
"""


def chains(name: str) -> int:
    return CHAINS_MULTI if "{t}" in PROBES[name][2] else CHAINS_SINGLE


def source(name: str) -> str:
    """The probe's C: one inline-assembly loop (the compiler cannot merge or spill the chains), every
    register starting at 1.0f (no denormal, no overflow within a run)."""
    _, reg, step, _ = PROBES[name]
    init = " ".join(f'"vbroadcastss %[one], %%{reg}{r}\\n"' for r in range(16))
    steps = "\n        ".join(" ".join(f'"{part.strip()}\\n"' for part in step.format(a=a, t=a + 6).split(";"))
                               for a in range(chains(name)))
    return SOURCE.replace("{init}", init).replace("{steps}", steps)


def build(name: str, workdir: Path) -> cffi.FFI:
    """The probe's library, compiled for its instruction set."""
    c_file, library = workdir / f"{name}.c", workdir / f"{name}.so"
    c_file.write_text(source(name))
    subprocess.run([os.environ.get("CC", "cc"), "-O2", "-fPIC", "-shared", "-pthread",
                    str(c_file), "-o", str(library)], check=True)
    ffi = cffi.FFI()
    ffi.cdef("void probe(long iters, int threads);")
    return ffi.dlopen(str(library))


def measure(lib, macs_per_step: int, steps: int, threads: int, seconds: float, reps: int) -> float:
    """Best-of-``reps`` GOP/s (2 per multiply-add) of all ``threads`` together."""
    iters = 1 << 16
    while True:                                        # size one run to about ``seconds``
        start = time.perf_counter()
        lib.probe(iters, threads)
        took = time.perf_counter() - start
        if took >= seconds / 4:
            break
        iters *= 4
    iters = max(1, int(iters * seconds / took))
    best = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        lib.probe(iters, threads)
        took = time.perf_counter() - start
        best = max(best, 2 * macs_per_step * steps * iters * threads / took / 1e9)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--probes", nargs="+", default=list(PROBES), choices=list(PROBES))
    p.add_argument("--seconds", type=float, default=0.5, help="length of one timed run")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    host = host_features()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.probes:
            needs, _, _, macs = PROBES[name]
            missing = sorted(needs - host)
            if missing:
                print(json.dumps({"bench": "compute_peak", "probe": name, "skipped": f"host lacks {', '.join(missing)}"}))
                continue
            lib = build(name, Path(tmp))
            for threads in args.threads:
                gops = measure(lib, macs, chains(name), threads, args.seconds, args.reps)
                print(json.dumps({"bench": "compute_peak", "probe": name, "threads": threads,
                                  "gop_s": round(gops, 1)}), flush=True)


if __name__ == "__main__":
    main()
