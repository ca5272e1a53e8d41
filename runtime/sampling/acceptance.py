"""Acceptance of drafted tokens (speculative decoding) against the target's rows: greedy (while the
drafts are the target's argmax) and sampled (the rejection rule, which keeps the target's
distribution exactly)."""
from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from .draw import distribution, finite_at
from .params import SamplingParams


def accept_greedy(targets: Seq[int], draft: Seq[int]) -> int:
    """How many drafts the target's argmax tokens (``len(draft) + 1`` of them) accept."""
    a = 0
    for t, d in zip(targets, draft):
        if t != d:
            break
        a += 1
    return a


def accept_sampled(p: np.ndarray, draft_token: int, rng: np.random.Generator) -> int:
    """The rejection rule for a deterministic draft: ``draft_token`` with probability ``p[d]``,
    otherwise a token drawn from ``p`` without ``d`` (renormalized). The result is distributed as
    ``p``: P(d) = p(d), and P(x != d) = (1 - p(d)) * p(x) / (1 - p(d))."""
    if rng.random() < p[draft_token]:
        return int(draft_token)
    rest = p.copy()
    rest[draft_token] = 0.0
    total = rest.sum()
    if not total > 0:           # p(d) = 1 up to rounding: nothing else can be drawn
        return int(draft_token)
    return int(rng.choice(rest.size, p=rest / total))


def accept_draft(rows: np.ndarray, draft: Seq[int], params: SamplingParams, rng: np.random.Generator
                 ) -> tuple[list[int], bool]:
    """The tokens a sequence emits after verifying ``draft``: the accepted drafts, then one of the
    target's own (``rows``: the target's logits after each drafted token, ``len(draft) + 1`` of
    them); False if a row it needed was not finite."""
    k = len(draft)
    if params.greedy:
        targets = rows.argmax(axis=1).tolist()
        chosen = targets[:accept_greedy(targets, draft) + 1]
        return chosen, finite_at(rows, range(len(chosen)), chosen)
    chosen: list[int] = []
    for i in range(k + 1):
        if not np.isfinite(rows[i]).all():
            return chosen, False
        p = distribution(rows[i], params)
        token = accept_sampled(p, draft[i], rng) if i < k else int(rng.choice(p.size, p=p))
        chosen.append(token)
        if i == k or token != draft[i]:
            break
    return chosen, True
