"""Choosing codes and scales: round-to-nearest with a per-group clipping search.

For every group (every row for the per-row formats) a grid of candidate scales is tried, each
rounded to the scale's storage dtype first (so the error measured is the error stored), and the
candidate with the smallest error wins:

- without calibration, the squared weight error ``|w - ŵ|²``;
- with calibration, the output error ``(w - ŵ)ᵀ C (w - ŵ)`` where ``C = XᵀX`` over the
  calibration activations that reach the group (``C`` per group of K; its diagonal for the
  per-row formats, whose full K x K form would cost K times more).

Candidates: symmetric int4 tries the scale that maps the group's extreme value to code -8 (the
llama.cpp Q4_0 choice, which uses all 16 levels) and the one that maps |max| to +7, each shrunk
by every clip ratio; int8 shrinks |max|/127; asymmetric int4 shrinks [min, max] towards zero by
the same ratio on both sides; fp8 shrinks |max|/448.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .formats import QuantFormat, QuantizedTensor, e4m3_decode, e4m3_encode, get_format

#: Clip ratios tried by the search (1.0 = plain round-to-nearest of the full range).
CLIP_RATIOS = tuple(float(r) for r in np.round(np.linspace(1.0, 0.5, 21), 3))

#: The symmetric integer search's choice done elsewhere (``codegen/clip_search.py``, in C):
#: (weights [N, ng, G] f32, candidate scales [C, N, ng] f32, error weights: None, the Gram's diagonal
#: [ng, G] f64 or its group blocks [ng, G, G] f64, qmin, qmax) -> index [N, ng] of each group's first
#: least-error candidate.
SymmetricChoice = Callable[[np.ndarray, np.ndarray, "np.ndarray | None", int, int], np.ndarray]


def quantize(w: np.ndarray, fmt: QuantFormat | str, *, search: bool = True,
             gram: np.ndarray | None = None, ratios: tuple[float, ...] = CLIP_RATIOS,
             symmetric_choice: SymmetricChoice | None = None) -> QuantizedTensor:
    """Quantize ``w`` [N, K] (float32) to ``fmt``.

    ``search`` False: one candidate, the full range (round-to-nearest). ``gram``: ``XᵀX`` [K, K]
    of the calibration activations (or its diagonal [K], or its group blocks [ng, G, G] zero-padded
    past K); the search then minimises output error.
    ``symmetric_choice``: picks among the candidates of a symmetric integer format (weighted by
    nothing, the Gram's diagonal or its group blocks) instead of numpy; the same arithmetic, faster.
    """
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a matrix, got shape {w.shape}")
    N, K = w.shape
    kp = fmt.padded_k(K)
    wp = np.zeros((N, kp), np.float32)
    wp[:, :K] = w
    G = kp if fmt.group == 0 else fmt.group
    ng = kp // G
    wg = wp.reshape(N, ng, G)
    weight = _error_weights(gram, K, kp, G, ng, fmt)
    ratios = ratios if search else (1.0,)

    if (symmetric_choice is not None and fmt.kind == "int" and not fmt.asym and not fmt.mins
            and len(ratios) * (2 if fmt.bits == 4 else 1) > 1):                 # int4: two bases
        scales = np.stack(_symmetric_scales(wg, fmt, ratios))                  # [C, N, ng] storage dtype
        best = symmetric_choice(wg, scales.astype(np.float32), weight, fmt.qmin, fmt.qmax)
        best_scales = np.take_along_axis(scales, best[None], axis=0)[0]
        return _packed(fmt, N, K, G, _round(wg, fmt, best_scales, None), best_scales, None, None)

    errors, choices = [], []
    d = np.empty_like(wg)                                        # one buffer for every candidate
    for scales, zeros, deq in _candidates(wg, fmt, ratios):
        np.subtract(wg, deq, out=d)                               # float32, exact difference
        if weight is None:
            err = np.einsum("ngk,ngk->ng", d, d, dtype=np.float64)
        elif weight.ndim == 2:                                   # diagonal [ng, G]
            err = np.einsum("ngk,ngk,gk->ng", d, d, weight, dtype=np.float64)
        else:                                                    # full per group [ng, G, G]
            d64 = d.astype(np.float64)
            err = np.einsum("ngk,gkl,ngl->ng", d64, weight, d64, optimize=True)
        errors.append(err)
        choices.append((scales, zeros))
    best = np.argmin(np.stack(errors), axis=0)                   # the first of equal errors wins
    pick = lambda values: np.take_along_axis(np.stack(values), best[None], axis=0)[0]  # noqa: E731
    best_scales = pick([c[0] for c in choices]).astype(fmt.scale_dtype)
    best_zeros = pick([c[1] for c in choices]).astype(np.uint8) if fmt.asym else None
    best_mins = pick([c[1] for c in choices]).astype(np.float16) if fmt.mins else None
    best_codes = _round(wg, fmt, best_scales, best_zeros if fmt.asym else best_mins)
    return _packed(fmt, N, K, G, best_codes, best_scales, best_zeros, best_mins)


def _packed(fmt: QuantFormat, N: int, K: int, G: int, best_codes: np.ndarray, best_scales: np.ndarray,
            best_zeros: np.ndarray | None, best_mins: np.ndarray | None) -> QuantizedTensor:
    """The chosen codes [N, ng, G] as a tensor [N, K], its padding columns filled."""
    codes = best_codes.reshape(N, -1)
    if fmt.kind == "int" and not fmt.mins:                      # padding columns hold the zero point
        pad_zero = fmt.zero if not fmt.asym else np.repeat(best_zeros, G, axis=1)[:, K:]
        codes[:, K:] = pad_zero
    else:                                                       # (activations are zero there)
        codes[:, K:] = 0
    return QuantizedTensor(fmt.name, (N, K), codes, best_scales, best_zeros, best_mins)


def _error_weights(gram: np.ndarray | None, K: int, kp: int, G: int, ng: int, fmt: QuantFormat):
    if gram is None:
        return None
    gram = np.asarray(gram, dtype=np.float64)
    if gram.ndim == 3:                                           # already the group blocks [ng, G, G]
        return gram
    if gram.ndim == 1 or fmt.group == 0:
        diag = np.diag(gram) if gram.ndim == 2 else gram
        full = np.zeros(kp)
        full[:K] = diag
        return full.reshape(ng, G)
    full = np.zeros((kp, kp))
    full[:K, :K] = gram
    idx = np.arange(ng)
    blocks = full.reshape(ng, G, ng, G)[idx, :, idx, :]              # [ng, G, G]
    return blocks


def _to_scale(s: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    """Round candidate scales to the storage dtype."""
    return s.astype(fmt.scale_dtype)


def _round(wg: np.ndarray, fmt: QuantFormat, scales: np.ndarray, zeros: np.ndarray | None) -> np.ndarray:
    """Codes (uint8 [N, ng, G]) of ``wg`` on the given per-group scales (and zero points, or
    minimums for the ``m`` formats)."""
    sf = scales.astype(np.float32)
    safe = np.where(sf == 0, np.float32(1), sf)[..., None]
    if fmt.kind == "fp8":
        return np.where(sf[..., None] == 0, np.uint8(0), e4m3_encode(wg / safe))
    if fmt.mins:
        return np.clip(np.rint((wg - zeros[..., None].astype(np.float32)) / safe), 0, fmt.umax).astype(np.uint8)
    if fmt.asym:
        return np.clip(np.rint(wg / safe) + zeros[..., None].astype(np.float32), 0, fmt.umax).astype(np.uint8)
    q = np.where(sf[..., None] == 0, 0, np.clip(np.rint(wg / safe), fmt.qmin, fmt.qmax))
    return (q + fmt.zero).astype(np.uint8)


def _candidates(wg: np.ndarray, fmt: QuantFormat, ratios: tuple[float, ...]):
    """Yield (scales [N,ng] storage dtype, zeros or None, dequantized f32 [N,ng,G]) per candidate; the
    symmetric candidates share one dequantized array (each is consumed before the next is made)."""
    amax = np.abs(wg).max(axis=2)
    if fmt.kind == "fp8":
        for r in ratios:
            s = _to_scale(amax * np.float32(r) / np.float32(448.0), fmt)
            sf = s.astype(np.float32)
            codes = _round(wg, fmt, s, None)
            yield s, None, e4m3_decode(codes) * sf[..., None]
        return
    if fmt.mins:                                             # [min, max] shrunk towards zero by r
        wmin, wmax = wg.min(axis=2), wg.max(axis=2)
        for r in ratios:
            lo = (wmin * np.float32(r)).astype(np.float16)
            s = _to_scale((wmax * np.float32(r) - lo.astype(np.float32)) / np.float32(fmt.umax), fmt)
            yield s, lo, _round(wg, fmt, s, lo) * s.astype(np.float32)[..., None] + lo.astype(np.float32)[..., None]
        return
    if fmt.asym:
        wmin, wmax = wg.min(axis=2), wg.max(axis=2)
        for r in ratios:
            lo, hi = np.minimum(wmin * np.float32(r), 0), np.maximum(wmax * np.float32(r), 0)
            s = _to_scale((hi - lo) / np.float32(fmt.umax), fmt)
            sf = s.astype(np.float32)
            safe = np.where(sf == 0, np.float32(1), sf)
            z = np.clip(np.rint(-lo / safe), 0, fmt.umax)
            u = np.clip(np.rint(wg / safe[..., None]) + z[..., None], 0, fmt.umax)
            yield s, z.astype(np.uint8), ((u - z[..., None]) * sf[..., None]).astype(np.float32)
        return
    q = np.empty_like(wg)                                    # reused: the caller is done with it on resuming
    for s in _symmetric_scales(wg, fmt, ratios):
        sf = s.astype(np.float32)
        safe = np.where(sf == 0, np.float32(1), sf)
        np.divide(wg, safe[..., None], out=q)
        np.rint(q, out=q)
        np.clip(q, fmt.qmin, fmt.qmax, out=q)
        q *= sf[..., None]                               # a zero scale gives zeros
        yield s, None, q


def _symmetric_scales(wg: np.ndarray, fmt: QuantFormat, ratios: tuple[float, ...]) -> list[np.ndarray]:
    """The candidate scales [N, ng] (storage dtype) of a symmetric integer format, in search order:
    per base (int4: the extreme at code -8 first, then |max| at +7), every ratio."""
    amax = np.abs(wg).max(axis=2)
    bases = [amax / np.float32(fmt.qmax)]
    if fmt.bits == 4:
        idx = np.abs(wg).argmax(axis=2)[..., None]
        extreme = np.take_along_axis(wg, idx, axis=2)[..., 0]
        bases.insert(0, -extreme / np.float32(-fmt.qmin))           # the extreme maps to code -8
    return [_to_scale(base * np.float32(r), fmt) for base in bases for r in ratios]
