"""Main-memory read bandwidth of this machine, measured with a small C probe (pthreads, 64-byte
vectors lowered to the host's registers). ``infeng bench`` and ``bench/`` use it for roofline fractions.

The probe reads each of ``buffers`` freshly allocated buffers ``reps`` times and keeps the best
pass: the threads are started once and wait on a spin flag, so no pass times a thread's creation,
and each thread sums its contiguous part with four independent 64-byte accumulators, so the adds
never bound it. Several buffers, because on a VM the bandwidth depends on where a buffer's pages
lie: on the 2-core Zen 4 dev VM three back-to-back runs of the one-buffer probe this replaces read
33.9, 50.0 and 31.9 GB/s with two threads, while plain reads of a mapped 512 MiB weights file reached 51-60
(bench/gemv_variants.py), and llama.cpp's f16 decode 38.8 against a probe figure of 33.7.

    python -m infeng_runtime.membw --threads 2      # one JSON line: {"bench": "bandwidth", "gb_s": ...}
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import cffi
import numpy as np

PROBE = r"""
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
typedef float v16 __attribute__((vector_size(64)));
enum { MAX_THREADS = 256 };
struct probe {
    const v16 *p;
    size_t n;                           /* 64-byte vectors at p */
    int threads;
    atomic_int pass, done, quit;
    float sums[MAX_THREADS];
};
struct worker { struct probe *s; int t; };

/* thread t's contiguous part of the buffer, four accumulators of two vectors each per step */
static void read_part(struct probe *s, int t) {
    const size_t per = s->n / s->threads / 8 * 8, i0 = per * t;
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (size_t i = i0; i < i0 + per; i += 8) {
        a0 += s->p[i] + s->p[i + 4];
        a1 += s->p[i + 1] + s->p[i + 5];
        a2 += s->p[i + 2] + s->p[i + 6];
        a3 += s->p[i + 3] + s->p[i + 7];
    }
    const v16 a = a0 + a1 + a2 + a3;
    float sum = 0;
    for (int l = 0; l < 16; l++)
        sum += a[l];
    s->sums[t] = sum;
}

static void *run_worker(void *arg) {
    struct worker *w = arg;
    int seen = 0;
    for (;;) {
        int pass;
        while ((pass = atomic_load(&w->s->pass)) == seen)
            if (atomic_load(&w->s->quit))
                return NULL;
        seen = pass;
        read_part(w->s, w->t);
        atomic_fetch_add(&w->s->done, 1);
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Fewest seconds of `reps` passes reading the n floats at p with `threads` threads. */
double best_read_seconds(const float *p, size_t n, int threads, int reps) {
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    const size_t skip = (64 - (uintptr_t)p % 64) % 64 / sizeof(float);   /* to whole aligned vectors */
    struct probe s = {.p = (const v16 *)(p + skip), .n = (n - skip) / 16, .threads = threads};
    pthread_t ids[MAX_THREADS];
    struct worker workers[MAX_THREADS];
    for (int t = 1; t < threads; t++) {
        workers[t] = (struct worker){&s, t};
        pthread_create(&ids[t], NULL, run_worker, &workers[t]);
    }
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        atomic_store(&s.done, 0);
        const double t0 = now();
        atomic_fetch_add(&s.pass, 1);
        read_part(&s, 0);
        while (atomic_load(&s.done) < threads - 1)
            ;
        const double seconds = now() - t0;
        best = seconds < best ? seconds : best;
    }
    atomic_store(&s.quit, 1);
    for (int t = 1; t < threads; t++)
        pthread_join(ids[t], NULL);
    return best;
}
"""


def measure_bandwidth(threads: int, megabytes: int = 1024, reps: int = 5, buffers: int = 3) -> float:
    """Best read bandwidth in GB/s over ``buffers`` fresh buffers much larger than the caches,
    ``reps`` passes each."""
    with tempfile.TemporaryDirectory() as tmp:
        source, library = Path(tmp) / "probe.c", Path(tmp) / "probe.so"
        source.write_text(PROBE)
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-march=native", "-fPIC", "-shared", "-pthread",
                        str(source), "-o", str(library)], check=True)
        return _measure(str(library), threads, megabytes, reps, buffers)


def _measure(library: str, threads: int, megabytes: int, reps: int, buffers: int) -> float:
    ffi = cffi.FFI()
    ffi.cdef("double best_read_seconds(const float *p, size_t n, int threads, int reps);")
    lib = ffi.dlopen(library)
    best = 0.0
    for _ in range(buffers):
        data = np.ones(megabytes * 2**20 // 4, dtype=np.float32)     # a fresh buffer, every page touched
        seconds = lib.best_read_seconds(ffi.from_buffer("float[]", data), data.size, threads, reps)
        best = max(best, data.nbytes / seconds / 1e9)
        del data
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    print(json.dumps({"bench": "bandwidth", "threads": args.threads, "gb_s": round(measure_bandwidth(args.threads), 2)}))


if __name__ == "__main__":
    main()
