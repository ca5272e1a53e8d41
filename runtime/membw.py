"""Main-memory read bandwidth of this machine, measured with a small C probe (pthreads, vectorised
by the compiler for the host). ``infeng bench`` and ``bench/`` use it for roofline fractions.

    python -m infeng_runtime.membw --threads 2      # one JSON line: {"bench": "bandwidth", "gb_s": ...}
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
import numpy as np

PROBE = r"""
#include <pthread.h>
#include <stddef.h>
typedef struct { const float *p; size_t n; float sum; } job_t;
static void *run(void *arg) {
    job_t *j = arg;
    float a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    for (size_t i = 0; i + 8 <= j->n; i += 8) {
        a0 += j->p[i]; a1 += j->p[i + 1]; a2 += j->p[i + 2]; a3 += j->p[i + 3];
        a4 += j->p[i + 4]; a5 += j->p[i + 5]; a6 += j->p[i + 6]; a7 += j->p[i + 7];
    }
    j->sum = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
    return NULL;
}
float read_all(const float *p, size_t n, int threads) {
    pthread_t t[64]; job_t jobs[64]; float s = 0;
    size_t per = n / threads;
    for (int i = 0; i < threads; i++) {
        jobs[i].p = p + per * i; jobs[i].n = per;
        pthread_create(&t[i], NULL, run, &jobs[i]);
    }
    for (int i = 0; i < threads; i++) { pthread_join(t[i], NULL); s += jobs[i].sum; }
    return s;
}
"""


def measure_bandwidth(threads: int, megabytes: int = 1024, reps: int = 5) -> float:
    """Best-of-``reps`` read bandwidth in GB/s over a buffer much larger than the caches."""
    with tempfile.TemporaryDirectory() as tmp:
        source, library = Path(tmp) / "probe.c", Path(tmp) / "probe.so"
        source.write_text(PROBE)
        subprocess.run([os.environ.get("CC", "cc"), "-O3", "-march=native", "-ffast-math", "-fPIC", "-shared",
                        "-pthread", str(source), "-o", str(library)], check=True)
        return _measure(str(library), threads, megabytes, reps)


def _measure(library: str, threads: int, megabytes: int, reps: int) -> float:
    ffi = cffi.FFI()
    ffi.cdef("float read_all(const float *p, size_t n, int threads);")
    lib = ffi.dlopen(library)
    data = np.ones(megabytes * 2**20 // 4, dtype=np.float32)
    ptr = ffi.from_buffer("float[]", data)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        lib.read_all(ptr, data.size, threads)
        best = max(best, data.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    print(json.dumps({"bench": "bandwidth", "threads": args.threads, "gb_s": round(measure_bandwidth(args.threads), 2)}))


if __name__ == "__main__":
    main()
