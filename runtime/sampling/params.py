"""``SamplingParams``: what a request asks of the next-token choice (and of its length and stops)."""
from __future__ import annotations

import math
from dataclasses import dataclass

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
