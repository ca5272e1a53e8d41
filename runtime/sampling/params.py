"""``SamplingParams``: what a request asks of the next-token choice (and of its length and stops)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from infeng_common.errors import InfengError
from infeng_common.options import option

#: Temperatures below this sample greedily (as vLLM does): dividing logits by a subnormal
#: temperature overflows, and the distribution is one-hot long before it.
GREEDY_BELOW = 1e-5
SEED_BOUND = 2 ** 64


@dataclass
class SamplingParams:
    """The options the command line offers are declared with their flags (``infeng run``, ``chat``,
    ``generate`` take them from here); the checks below hold every request to the same bounds."""

    max_new_tokens: int = option(64, flag="--max-new-tokens", short="-n", help="most tokens to generate")
    temperature: float = option(0.0, flag="--temperature", short="-t", help="0 = greedy")
    top_k: int = option(0, flag="--top-k", help="sample among the N most likely tokens (0 = all)")
    top_p: float = option(1.0, flag="--top-p", help="keep the likeliest tokens up to this probability")
    seed: int | None = option(None, flag="--seed", help="sampling seed (default: random)")
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
