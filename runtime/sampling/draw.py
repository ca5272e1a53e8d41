"""Next-token draws on the few logits rows that need them: greedy, temperature, top-k, top-p, and
``draw_rows``, a step's rows at once with the greedy fast path (one argmax over the rows)."""
from __future__ import annotations

import math
import numpy as np

from .params import SamplingParams


def finite_at(logits: np.ndarray, rows: range | list[int], columns: list[int]) -> bool:
    """Whether ``logits[rows[i], columns[i]]`` are all finite (one gather, no per-row numpy call)."""
    if len(columns) == 1:
        return math.isfinite(logits.item(rows[0], columns[0]))
    vocab = logits.shape[1]
    return all(map(math.isfinite, logits.reshape(-1).take([r * vocab + c for r, c in zip(rows, columns)]).tolist()))


def draw_rows(logits: np.ndarray, seqs: list, skip: set | tuple = (), mixed: bool = True
              ) -> list[tuple[int, bool] | None]:
    """``(token, finite)`` for row ``r`` of ``logits``, drawn for ``seqs[r]`` (a scheduler
    ``Sequence``: ``greedy``, ``rng``, ``request.params``; None for a sequence in ``skip``).
    Greedy rows take one argmax over all of them; a row whose logits are not finite draws nothing
    (token -1, or the argmax, finite False). ``mixed`` False: the caller knows every
    row is greedy and none is skipped (the common case, no per-row look)."""
    # argmax lands on a NaN or +Inf if the row has one, on -Inf if the row is all -Inf
    if not mixed:                              # every row greedy: one argmax, one finiteness gather
        tokens = logits.argmax(axis=1).tolist()
        all_finite = finite_at(logits, range(len(seqs)), tokens)
        return [(token, all_finite or math.isfinite(logits.item(r, token))) for r, token in enumerate(tokens)]
    greedy_rows = [r for r, s in enumerate(seqs) if s.greedy]
    if len(greedy_rows) == len(seqs):
        greedy_tokens = logits.argmax(axis=1).tolist()
        greedy_finite = finite_at(logits, range(len(seqs)), greedy_tokens)
    elif greedy_rows:
        greedy_tokens = logits[greedy_rows].argmax(axis=1).tolist()
        greedy_finite = finite_at(logits, greedy_rows, greedy_tokens)
    draws: list[tuple[int, bool] | None] = []
    g = 0
    for r, seq in enumerate(seqs):
        if skip and seq in skip:               # not drawn this step
            g += seq.greedy
            draws.append(None)
            continue
        if seq.greedy:
            token = greedy_tokens[g]
            g += 1
            draws.append((token, greedy_finite or math.isfinite(logits.item(r, token))))
        else:
            finite = bool(np.isfinite(logits[r]).all())
            draws.append((sample(logits[r], seq.request.params, seq.rng) if finite else -1, finite))
    return draws


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from a row of logits (which the caller has checked are finite)."""
    if params.greedy:
        return int(np.argmax(logits))
    p = distribution(logits, params)
    return int(rng.choice(p.size, p=p))


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The probabilities (float64, summing to 1) that ``sample`` draws from for a non-greedy
    ``params``: temperature, then the top-k cut, then the top-p cut."""
    z = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < z.size:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z < kth, -np.inf, z)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p)
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, params.top_p)) + 1]
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return p
