"""Logprob entries of a drawn token: its log probability under the row's logits (masked tokens
included, at the floor) and the ``k`` most likely tokens."""
from __future__ import annotations

import numpy as np

#: The logprob reported for a token of probability 0 (OpenAI's value; -inf is not JSON).
LOGPROB_FLOOR = -9999.0


def token_logprobs(row: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]] | None]:
    """``token``'s logprob in ``row`` and, for ``k > 0``, the top ``k`` (token, logprob), best first."""
    z = row.astype(np.float64)
    z -= z.max()
    logp = np.maximum(z - np.log(np.exp(z).sum()), LOGPROB_FLOOR)     # -inf (masked) is not JSON
    top = None
    if k > 0:
        best = np.argpartition(-logp, k - 1)[:k]
        best = best[np.argsort(-logp[best], kind="stable")]
        top = [(int(t), float(logp[t])) for t in best]
    return float(logp[token]), top
