"""The records that cross the engine loop's boundary: a ``Request`` in, ``SeqOutput``s out, and the
errors a request can be refused with (``RequestError``: never servable as asked; ``QueueFull``:
retry later)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from infeng_common.errors import InfengError

from .sampling import SamplingParams


class RequestError(InfengError):
    """The request cannot be served as asked (bad parameter, too long, unknown adapter)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


class QueueFull(InfengError):
    """The admission queue is at its bound; retry later."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Request:
    """What a client asked for: one prompt continued ``n`` times (one sequence per choice)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    adapter: str | None = None
    priority: int = 0                       # lower is served first (after the fair-share rank); then FIFO
    logprobs: int | None = None             # None: none; k: the sampled token's and the top k
    sink: Callable[[list["SeqOutput"]], None] | None = None   # called on the engine thread
    context: object = None                  # whatever the consumer wants back with each output
    grammar: object = None                  # sampling.grammar.Constraint: a matcher per choice, or None
    client: str | None = None               # who asked (fair_share.py): ranks its sequences after its others
    arrival: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class SeqOutput:
    """What one step produced for one sequence: a token (or none when it finished without one)."""

    request: Request
    index: int                              # the choice index within the request
    token: int | None
    finish_reason: str | None = None        # "stop" (EOS), "length", "abort", "error"
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None
    cached_tokens: int = 0                  # prompt tokens served from the prefix cache (first output)


def grouped(outs: list[SeqOutput], key: Callable[[SeqOutput], Any]) -> list[tuple[Any, list[SeqOutput]]]:
    """``outs`` grouped by ``key(out)`` (the same object, not an equal one), in first-seen order;
    outputs whose key is None are left out."""
    if len(outs) == 1:                         # one sequence in the step: nothing to group
        owner = key(outs[0])
        return [] if owner is None else [(owner, outs)]
    groups: dict[int, tuple[Any, list[SeqOutput]]] = {}
    for out in outs:
        owner = key(out)
        if owner is None:
            continue
        entry = groups.get(id(owner))
        if entry is None:
            groups[id(owner)] = (owner, [out])
        else:
            entry[1].append(out)
    return list(groups.values())
