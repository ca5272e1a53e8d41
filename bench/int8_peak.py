"""The integer dot-product peak of this core on the AVX2 vocabulary: what the int4/int8 prefill
kernels' GOP/s are a fraction of.

    python bench/int8_peak.py --threads 1,2

A tiny loop in assembly (AVX2 only, so it runs on every host the avx2 target runs on) keeps 10
independent ymm sums busy with one instruction pattern per case, for ``--seconds`` per round, on each of ``threads`` threads at once (one per core), and reports the best round:

- ``maddubs``: ``vpmaddubsw`` alone (u8 x i8 -> 16-bit pair sums: 32 multiply-adds per ymm), and
  ``madd``: ``vpmaddwd`` alone (int16 x int16 -> int32: 16 per ymm): the multiply pipes' rate;
- ``maddubs+addw``: the int4 path's step since the 16-bit partial sums (``docs/performance.md``):
  ``vpmaddubsw`` + ``vpaddw``, 32 multiply-adds;
- ``maddubs+madd+addd``: the int8 dot step without VNNI and without the 16-bit sums (``vpmaddubsw``,
  ``vpmaddwd`` by ones, ``vpaddd``): 32 multiply-adds for two multiplies;
- ``madd+addd``: the int8-weight x int16-activation step (``linear_q8``'s ``ife_vi_dot_i16``
  without VNNI): ``vpmaddwd`` + ``vpaddd``, 16 multiply-adds.

Each JSON line: ``case``, ``threads``, ``GOP/s`` (2 ops per multiply-add, over all threads),
``per_cycle_per_core`` (steps of the pattern per TSC cycle per core, at the TSC rate measured
here: a VM's TSC runs at the nominal clock, so boost shows as more than the pipes allow; take it
as a ratio between cases), ``tsc_GHz``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <x86intrin.h>


static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

struct job { long iters; };

/* Each iteration: STEP on each of 10 chains (ymm0-9); ymm14 holds codes, ymm15 16-bit ones,
 * ymm10-13 are temporaries (the multiplies of the dot steps do not depend on the chain, as in the
 * kernels, whose products feed the sums). In assembly: the compiler spilled the C version. */
#define KERNEL(name, STEP)                                                                        \
static void *name(void *arg) {                                                                    \
    struct job *j = arg;                                                                          \
    long n = j->iters;                                                                            \
    __asm__ volatile("vpcmpeqw %%ymm15, %%ymm15, %%ymm15\n\tvpsrlw $15, %%ymm15, %%ymm15\n\t"      \
                     "vpcmpeqb %%ymm14, %%ymm14, %%ymm14\n\tvpabsb %%ymm14, %%ymm13\n"              \
                     "1:\n\t"                                                                     \
                     STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7) STEP(8) STEP(9) \
                     "dec %0\n\tjnz 1b\n"                                                         \
                     : "+r"(n) : : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6",      \
                       "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"); \
    return NULL;                                                                                  \
}
#define MADDUBS(i) "vpmaddubsw %%ymm14, %%ymm" #i ", %%ymm" #i "\n\t"
#define MADD(i) "vpmaddwd %%ymm14, %%ymm" #i ", %%ymm" #i "\n\t"
#define MADDUBS_ADDW(i) "vpmaddubsw %%ymm14, %%ymm13, %%ymm10\n\tvpaddw %%ymm10, %%ymm" #i ", %%ymm" #i "\n\t"
#define MADDUBS_MADD_ADDD(i) "vpmaddubsw %%ymm14, %%ymm13, %%ymm10\n\tvpmaddwd %%ymm15, %%ymm10, %%ymm11\n\t" \
                             "vpaddd %%ymm11, %%ymm" #i ", %%ymm" #i "\n\t"
#define MADD_ADDD(i) "vpmaddwd %%ymm14, %%ymm13, %%ymm10\n\tvpaddd %%ymm10, %%ymm" #i ", %%ymm" #i "\n\t"
KERNEL(run_maddubs, MADDUBS)
KERNEL(run_madd, MADD)
KERNEL(run_maddubs_addw, MADDUBS_ADDW)
KERNEL(run_maddubs_madd_addd, MADDUBS_MADD_ADDD)
KERNEL(run_madd_addd, MADD_ADDD)
static void *(*const kernels[])(void *) = {run_maddubs, run_madd, run_maddubs_addw, run_maddubs_madd_addd,
                                           run_madd_addd};

int main(int argc, char **argv) {
    const int kind = atoi(argv[1]), threads = atoi(argv[2]);
    const long iters = atol(argv[3]);
    struct job jobs[64];
    pthread_t tid[64];
    const uint64_t c0 = __rdtsc();
    const double t0 = now();
    for (int t = 0; t < threads; t++) {
        jobs[t].iters = iters;
        pthread_create(&tid[t], NULL, kernels[kind], &jobs[t]);
    }
    for (int t = 0; t < threads; t++)
        pthread_join(tid[t], NULL);
    const double seconds = now() - t0;
    const uint64_t cycles = __rdtsc() - c0;
    printf("%.9f %llu\n", seconds, (unsigned long long)cycles);
    return 0;
}
"""

#: case -> (its index in the C source's ``kernels``, multiply-adds per step of one sum)
CASES = {"maddubs": (0, 32), "madd": (1, 16), "maddubs+addw": (2, 32), "maddubs+madd+addd": (3, 32),
         "madd+addd": (4, 16)}
CHAINS = 10


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--seconds", type=float, default=0.3, help="about this long per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per case; the best is kept")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="infeng-int8-peak-") as tmp:
        src, exe = os.path.join(tmp, "peak.c"), os.path.join(tmp, "peak")
        with open(src, "w") as f:
            f.write(SOURCE)
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-mavx2", "-mfma", "-pthread", src, "-o", exe], check=True)
        for threads in map(int, args.threads.split(",")):
            for case, (kind, macs) in CASES.items():
                iters = 1 << 20
                seconds, cycles = _run(exe, kind, threads, iters)
                iters = max(iters, int(iters * args.seconds / max(seconds, 1e-6)))
                best = min((_run(exe, kind, threads, iters) for _ in range(args.rounds)), key=lambda r: r[0])
                steps = iters * CHAINS
                print(json.dumps({"bench": "int8_peak", "case": case, "threads": threads,
                                  "GOP/s": round(2 * macs * steps * threads / best[0] / 1e9, 1),
                                  "per_cycle_per_core": round(steps / best[1], 3),
                                  "tsc_GHz": round(best[1] / best[0] / 1e9, 3)}), flush=True)
    return 0


def _run(exe: str, kind: int, threads: int, iters: int) -> tuple[float, int]:
    out = subprocess.run([exe, str(kind), str(threads), str(iters)], check=True, capture_output=True, text=True).stdout
    seconds, cycles = out.split()
    return float(seconds), int(cycles)


if __name__ == "__main__":
    raise SystemExit(main())
