"""GPTQ (Frantar et al. 2022): quantize a matrix one input column at a time and push each column's
rounding error onto the columns not yet quantized, weighted by the inverse of the calibration
Hessian ``H = XᵀX / tokens``, so that the layer's *output* error stays small.

Scales are chosen per group when the search reaches the group's first column, from the weights as
updated so far, by the same clipping search as ``search.quantize`` (weight error); the codes are
then plain round-to-nearest on that scale. The result is an ordinary ``QuantizedTensor``: the
format, layout and dequantization are unchanged, only the codes are better chosen.
"""
from __future__ import annotations

import numpy as np

from infeng_common.errors import UnsupportedError

from .formats import QuantFormat, QuantizedTensor, e4m3_decode, e4m3_encode
from .search import quantize

BLOCK = 128          # columns per lazy-update block (a multiple of every group size)
DAMP = 0.01          # fraction of the mean diagonal added to H


def gptq_quantize(w: np.ndarray, fmt: QuantFormat, hessian: np.ndarray) -> QuantizedTensor:
    """Quantize ``w`` [N, K] to ``fmt`` minimising ``tr(D H Dᵀ)`` greedily, ``H`` [K, K]."""
    if fmt.mins:
        raise UnsupportedError(f"GPTQ does not produce {fmt.name} (a GGUF Q4_1 import format); use q4g{fmt.group}a")
    N, K = w.shape
    kp = fmt.padded_k(K)
    W = np.zeros((N, kp), np.float64)
    W[:, :K] = w
    H = np.zeros((kp, kp))
    H[:K, :K] = hessian
    dead = np.diag(H) <= 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += DAMP * np.mean(np.diag(H)) * np.eye(kp)
    Hinv = _upper_cholesky_of_inverse(H)

    G = kp if fmt.group == 0 else fmt.group
    ng = kp // G
    codes = np.zeros((N, kp), np.uint8)
    scales = np.zeros((N, ng), fmt.scale_dtype)
    zeros = np.zeros((N, ng), np.uint8) if fmt.asym else None
    if fmt.group == 0:                                   # one scale per row, from the whole row
        row = quantize(W[:, :K].astype(np.float32), fmt)
        scales[:, 0] = row.scales[:, 0]
    for b0 in range(0, kp, BLOCK):
        b1 = min(b0 + BLOCK, kp)
        W1 = W[:, b0:b1].copy()
        E1 = np.zeros_like(W1)
        Hb = Hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            g = col // G
            if fmt.group and col % G == 0:               # the group's scale from the updated weights
                grp = quantize(W1[:, i:i + G].astype(np.float32), QuantFormat(fmt.name, fmt.kind, fmt.bits, G, fmt.asym))
                scales[:, g] = grp.scales[:, 0]
                if fmt.asym:
                    zeros[:, g] = grp.zeros[:, 0]
            c, deq = _round_column(W1[:, i].astype(np.float32), fmt, scales[:, g],
                                   zeros[:, g] if fmt.asym else None)
            codes[:, col] = c
            err = (W1[:, i] - deq) / Hb[i, i]
            W1[:, i:] -= np.outer(err, Hb[i, i:])
            E1[:, i] = err
        W[:, b1:] -= E1 @ Hinv[b0:b1, b1:]
    if fmt.kind == "int":                                # padding columns hold the zero point
        codes[:, K:] = fmt.zero if not fmt.asym else np.repeat(zeros, G, axis=1)[:, K:]
    else:
        codes[:, K:] = 0
    return QuantizedTensor(fmt.name, (N, K), codes, scales, zeros)


def _round_column(x: np.ndarray, fmt: QuantFormat, scale: np.ndarray, zero: np.ndarray | None):
    """(codes uint8 [N], dequantized float64 [N]) of one column on the given scales."""
    s = scale.astype(np.float32)
    safe = np.where(s == 0, np.float32(1), s)
    if fmt.kind == "fp8":
        c = np.where(s == 0, np.uint8(0), e4m3_encode(x / safe))
        return c, (e4m3_decode(c) * s).astype(np.float64)
    if fmt.asym:
        z = zero.astype(np.float32)
        u = np.clip(np.rint(x / safe) + z, 0, fmt.umax)
        return u.astype(np.uint8), ((u - z) * s).astype(np.float64)
    q = np.where(s == 0, 0, np.clip(np.rint(x / safe), fmt.qmin, fmt.qmax))
    return (q + fmt.zero).astype(np.uint8), (q * s).astype(np.float32).astype(np.float64)


def _upper_cholesky_of_inverse(H: np.ndarray) -> np.ndarray:
    """U with H⁻¹ = Uᵀ U (upper triangular), as GPTQ uses it."""
    L = np.linalg.cholesky(H)
    Linv = np.linalg.solve(L, np.eye(len(H)))
    Hinv = Linv.T @ Linv
    return np.linalg.cholesky(Hinv).T
