"""Next-token sampling on the few logits rows that need it: greedy, temperature, top-k, top-p."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from infeng_common.errors import InfengError

#: Temperatures below this sample greedily (as vLLM does): dividing logits by a subnormal
#: temperature overflows, and the distribution is one-hot long before it.
GREEDY_BELOW = 1e-5
SEED_BOUND = 2 ** 64


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0          # 0 means greedy
    top_k: int = 0                    # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    speculative: bool | None = None   # None/True: draft if the engine speculates; False: never

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise InfengError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InfengError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InfengError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InfengError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < SEED_BOUND:
            raise InfengError(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


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
