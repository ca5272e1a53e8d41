"""The clipping search's inner loop in C: for every group of a symmetric integer format and every
candidate scale, the squared error of the group's codes (unweighted, weighted per column by the
calibration Gram's diagonal, or by the group's G x G block of the Gram), and the first candidate with
the least error (``quant/search.py`` computes the candidates and the codes; this only chooses).

numpy ran each candidate over the whole tensor as six separate passes through memory (divide,
round, clip, multiply, subtract, square-sum); here 16 groups at a time stay in registers for all
the candidates. The arithmetic is numpy's, operation for operation, in the same precision (float32
codes and difference, float64 squares and sums; ``-ffp-contract=off``: no fused multiply-add that
would skip a rounding), so the errors are the same up to the order of each group's float64 sum.

The library is built once per host through the build cache (``codegen/build.py``) and loaded with
cffi; ``passes/quantize.py`` hands ``clip_search`` to ``quant.search.quantize``.
"""
from __future__ import annotations

from functools import lru_cache

import cffi
import numpy as np

from .build import build_library
from .target import get_target

#: groups searched side by side (one float64 accumulator each)
GROUPS_AT_ONCE = 16

SOURCE = r"""/* ife_clip_search: the clipping search's choice, see infeng_compiler/codegen/clip_search.py */
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { B = %(groups)d };           /* groups searched side by side */

/* best[m] = the first c of the least sum_k weight[g][k] * (w[m][k] - clip(rint(w[m][k] / s), qmin, qmax) * s)^2,
   s = scale[c][m] (a zero scale divides by 1 and gives zeros), g = m %% ng; weight NULL: all ones. */
int ife_clip_search(const float *w /* [M, G] */, const float *scale /* [C, M] */,
                    const double *weight /* [ng, G] or NULL */, long M, long G, long ng, long C,
                    float qmin, float qmax, long *best /* [M] */) {
    float *wt = malloc(sizeof(float) * (size_t)G * B);             /* [G, B]: the block's groups, transposed */
    double *weight_t = weight ? malloc(sizeof(double) * (size_t)G * B) : NULL;
    if (!wt || (weight && !weight_t)) { free(wt); free(weight_t); return -1; }
    for (long m0 = 0; m0 < M; m0 += B) {
        const long nb = M - m0 < B ? M - m0 : B;
        for (long k = 0; k < G; k++)
            for (long j = 0; j < B; j++) {
                wt[k * B + j] = j < nb ? w[(m0 + j) * G + k] : 0.0f;
                if (weight_t) weight_t[k * B + j] = j < nb ? weight[((m0 + j) %% ng) * G + k] : 0.0;
            }
        double best_err[B];
        long best_c[B];
        for (long j = 0; j < B; j++) { best_err[j] = INFINITY; best_c[j] = 0; }
        for (long c = 0; c < C; c++) {
            float s[B], safe[B];
            double err[B];
            for (long j = 0; j < B; j++) {
                s[j] = j < nb ? scale[c * M + m0 + j] : 1.0f;
                safe[j] = s[j] == 0.0f ? 1.0f : s[j];
                err[j] = 0.0;
            }
            for (long k = 0; k < G; k++) {
                const float *x = wt + k * B;
                double d2[B];
                for (long j = 0; j < B; j++) {
                    float q = rintf(x[j] / safe[j]);
                    q = q < qmin ? qmin : q;           /* np.clip (not fminf/fmaxf: those do not vectorise) */
                    q = q > qmax ? qmax : q;
                    const float d = x[j] - q * s[j];
                    d2[j] = (double)d * (double)d;
                }
                if (weight_t)
                    for (long j = 0; j < B; j++) err[j] += d2[j] * weight_t[k * B + j];
                else
                    for (long j = 0; j < B; j++) err[j] += d2[j];
            }
            for (long j = 0; j < nb; j++)
                if (err[j] < best_err[j]) { best_err[j] = err[j]; best_c[j] = c; }
        }
        for (long j = 0; j < nb; j++) best[m0 + j] = best_c[j];
    }
    free(wt);
    free(weight_t);
    return 0;
}

/* The same choice weighted by each group's block of the Gram matrix: the least
   sum_l (sum_k d[k] * gram[g][k][l]) * d[l], d = w[m] - clip(rint(w[m] / s), qmin, qmax) * s, in
   numpy's order (einsum "ngk,gkl,ngl->ng" contracts the Gram with d first, then with d again).
   The groups of one column block g share its Gram block, so B rows of the same g are searched side
   by side, one group per lane (GCC/clang vector extension of the register's width: left to
   itself, the compiler vectorised the sum over k and added the lanes one by one; a B-wide type,
   or an 8-wide one without AVX-512, lived on the stack), L columns l at a time for independent
   sums, the block staying in cache. */
#ifdef __AVX512F__
enum { V = 8, L = 4 };             /* lanes per vector, columns at once */
#else
enum { V = 4, L = 2 };
#endif
typedef double f64xV __attribute__((vector_size(V * sizeof(double))));
enum { H = B / V };                /* vectors per block */

int ife_clip_search_gram(const float *w /* [N, ng, G] */, const float *scale /* [C, N, ng] */,
                         const double *gram /* [ng, G, G] */, long N, long G, long ng, long C,
                         float qmin, float qmax, long *best /* [N, ng] */) {
    const long M = N * ng;
    float *wt = malloc(sizeof(float) * (size_t)G * B);             /* [G, B]: the block's groups, transposed */
    f64xV *d = aligned_alloc(sizeof(f64xV), sizeof(f64xV) * H * (size_t)G);   /* [G, H] differences, a group per lane */
    double *gt = malloc(sizeof(double) * (size_t)G * G);           /* [G, G] the group's Gram block, transposed */
    if (!wt || !d || !gt) { free(wt); free(d); free(gt); return -1; }
    for (long g = 0; g < ng; g++) {
        for (long k = 0; k < G; k++)
            for (long l = 0; l < G; l++) gt[l * G + k] = gram[(g * G + k) * G + l];
        for (long n0 = 0; n0 < N; n0 += B) {
            const long nb = N - n0 < B ? N - n0 : B;
            for (long k = 0; k < G; k++)
                for (long j = 0; j < B; j++)
                    wt[k * B + j] = j < nb ? w[((n0 + j) * ng + g) * G + k] : 0.0f;
            double best_err[B];
            long best_c[B];
            for (long j = 0; j < B; j++) { best_err[j] = INFINITY; best_c[j] = 0; }
            for (long c = 0; c < C; c++) {
                float s[B], safe[B];
                for (long j = 0; j < B; j++) {
                    s[j] = j < nb ? scale[c * M + (n0 + j) * ng + g] : 1.0f;
                    safe[j] = s[j] == 0.0f ? 1.0f : s[j];
                }
                double *dk = (double *)d;                          /* [G, B] (GCC vectors alias their elements) */
                for (long k = 0; k < G; k++, dk += B) {
                    const float *x = wt + k * B;
                    for (long j = 0; j < B; j++) {
                        float q = rintf(x[j] / safe[j]);
                        q = q < qmin ? qmin : q;
                        q = q > qmax ? qmax : q;
                        dk[j] = (double)(x[j] - q * s[j]);
                    }
                }
                f64xV err[H] = {0};
                long l = 0;
                for (; l + L <= G; l += L) {                       /* t = sum_k d[k] * gram[k][l], k in order */
                    const double *col = gt + l * G;
                    f64xV t[L][H] = {{0}};
                    for (long k = 0; k < G; k++)
                        for (long i = 0; i < L; i++)
                            for (long h = 0; h < H; h++) t[i][h] += d[k * H + h] * col[i * G + k];
                    for (long i = 0; i < L; i++)
                        for (long h = 0; h < H; h++) err[h] += t[i][h] * d[(l + i) * H + h];
                }
                for (; l < G; l++) {
                    const double *col = gt + l * G;
                    f64xV t[H] = {0};
                    for (long k = 0; k < G; k++)
                        for (long h = 0; h < H; h++) t[h] += d[k * H + h] * col[k];
                    for (long h = 0; h < H; h++) err[h] += t[h] * d[l * H + h];
                }
                for (long j = 0; j < nb; j++)
                    if (err[j / V][j %% V] < best_err[j]) { best_err[j] = err[j / V][j %% V]; best_c[j] = c; }
            }
            for (long j = 0; j < nb; j++) best[(n0 + j) * ng + g] = best_c[j];
        }
    }
    free(wt);
    free(d);
    free(gt);
    return 0;
}
""" % {"groups": GROUPS_AT_ONCE}

_CDEF = ("int ife_clip_search(const float *w, const float *scale, const double *weight, long M, long G, long ng, "
         "long C, float qmin, float qmax, long *best);\n"
         "int ife_clip_search_gram(const float *w, const float *scale, const double *gram, long N, long G, long ng, "
         "long C, float qmin, float qmax, long *best);")


@lru_cache(maxsize=1)
def _library():
    ffi = cffi.FFI()
    ffi.cdef(_CDEF)
    built = build_library({"ife_clip_search.c": SOURCE}, get_target("native"), extra_flags=("-ffp-contract=off",))
    return ffi, ffi.dlopen(str(built.path))


def clip_search(wg: np.ndarray, scales: np.ndarray, weight: np.ndarray | None, qmin: int, qmax: int) -> np.ndarray:
    """Index [N, ng] of the first least-error candidate of every group.

    ``wg`` [N, ng, G] float32 weights; ``scales`` [C, N, ng] float32 candidate scales (their stored
    values); ``weight``: None (squared error), [ng, G] float64 per-column error weights (the
    calibration Gram's diagonal) or [ng, G, G] float64 (each group's block of the Gram)."""
    ffi, lib = _library()
    N, ng, G = wg.shape
    M, C = N * ng, scales.shape[0]
    w = np.ascontiguousarray(wg, dtype=np.float32)
    s = np.ascontiguousarray(scales, dtype=np.float32)
    wt = None if weight is None else np.ascontiguousarray(weight, dtype=np.float64)
    best = np.empty(M, dtype=np.int64)
    args = (ffi.from_buffer("float[]", w), ffi.from_buffer("float[]", s),
            ffi.NULL if wt is None else ffi.from_buffer("double[]", wt))
    if wt is not None and wt.ndim == 3:
        status = lib.ife_clip_search_gram(*args, N, G, ng, C, float(qmin), float(qmax), ffi.from_buffer("long[]", best))
    else:
        status = lib.ife_clip_search(*args, M, G, ng, C, float(qmin), float(qmax), ffi.from_buffer("long[]", best))
    if status != 0:
        raise MemoryError("clip search: out of memory")
    return best.reshape(N, ng)
