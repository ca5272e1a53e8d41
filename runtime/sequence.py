"""What the scheduler keeps per sequence (``Sequence``), the step it plans (``StepPlan``) and its
counters (``SchedulerStats``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .request import Request


WAITING, RUNNING, FINISHED = 0, 1, 2
NO_DRAFT: list[int] = []                   # shared, never mutated


class Sequence:
    __slots__ = ("seq_id", "request", "index", "tokens", "prompt_len", "num_computed", "rng", "status",
                 "generated", "order", "hashes", "namespace", "reported_cached", "cached_tokens", "greedy",
                 "adapter_slot", "spec", "draft")

    def __init__(self, seq_id: int, request: Request, index: int, order: tuple[int, int, int], namespace: str):
        self.seq_id, self.request, self.index, self.order = seq_id, request, index, order
        self.tokens = list(request.prompt_ids)
        self.prompt_len = len(self.tokens)
        self.num_computed = 0                  # positions whose K/V are in the cache
        seed = request.params.seed
        self.rng = np.random.default_rng(seed if seed is None or index == 0 else [seed, index])
        self.status = WAITING
        self.generated = 0
        self.hashes: list[bytes] = []          # hash chain of the full blocks of tokens (grows)
        self.namespace = namespace
        self.reported_cached = False
        self.cached_tokens: int | None = None
        self.greedy = request.params.greedy
        self.adapter_slot = -1
        self.spec = None                       # speculative.SpecState when it may draft
        self.draft: list[int] = NO_DRAFT       # tokens drafted for the step in flight

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass
class StepPlan:
    """One forward step: flat token rows and, for the rows that end a sequence's input, logits."""

    seqs: list[Sequence]
    counts: list[int]
    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    adapter_slots: np.ndarray | None
    logits_rows: np.ndarray
    sampled: list[Sequence]                 # one per logits row, in order, before the verify rows
    prefill_tokens: int = 0
    decode_tokens: int = 0
    verify: list[tuple[Sequence, list[int]]] | tuple = ()   # (seq, draft) speculating: 1 + k rows each


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0                  # prompt tokens of admitted sequences
    computed_prompt_tokens: int = 0         # prompt tokens actually run (not from the cache)
    generated_tokens: int = 0
    late_mask_skips: int = 0                # times a sequence skipped a step for a grammar mask not ready
    finished: dict[str, int] = field(default_factory=dict)
