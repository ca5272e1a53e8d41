"""Grammar masks: ``Constraint`` holds one llguidance matcher per choice of a request
(``Request.grammar``, built by ``structured.GrammarCompiler``). After each step ``advance`` queues,
per choice, feeding its matcher the sampled token and filling its next mask on the mask worker
threads: llguidance does both without the GIL, so they run while the engine loop is in the
library's forward call. Before the next draw the scheduler waits a little for masks not yet ready
(``mask_verdicts``: a share of the forward call's time); a choice whose mask is later skips that
step, one whose mask is later than ``--grammar-mask-timeout`` ends with an error, and the engine
loop never waits longer for a grammar. ``apply_masks`` sets the disallowed logits of the rows to
draw from. With speculative decoding ``check_draft`` cuts a draft at the first rejected token and
``mask_draft_rows`` masks the verification rows (docs/speculative.md)."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import numpy as np

from ..grammar_limits import GrammarLimits

#: What a disallowed token's logit becomes: finite, so the finiteness checks still see NaN/Inf in
#: the model's own logits, and exp() of it is 0 at any temperature.
MASKED_LOGIT = float(np.finfo(np.float32).min)


#: How a sequence's error starts when its grammar ended it (the server answers such a failure 400).
CONSTRAINT_FAILED = "the output constraint"
MASK_OVERDUE = (CONSTRAINT_FAILED + "'s next-token mask was not ready within {:g} s (the grammar mask time "
                "limit, --grammar-mask-timeout); the sequence was ended")


#: Threads computing masks (llguidance drops the GIL): one request's matchers do not queue behind
#: each other's, nor a slow grammar's masks in front of everyone's. They run at a lower priority
#: than the engine loop (``MASK_NICE``), so mask work yields to the forward calls of others; a
#: mild one: at nice 19 they lost the CPU to the engine's spinning pool on a 2-core machine and
#: nearly every mask came late.
MASK_WORKERS = 4
MASK_NICE = 5
#: How long a step waits for masks not ready when its forward call ends: this share of the forward
#: call's time; a sequence whose mask is later is skipped for the step (its last position runs
#: again next step). When every sampled row waits for a mask (nobody else to serve), up to
#: MASK_IDLE_WAIT seconds.
MASK_WAIT_SHARE = 0.1
MASK_IDLE_WAIT = 0.05

_workers: ThreadPoolExecutor | None = None
_workers_lock = threading.Lock()


def _lower_priority() -> None:
    try:                                       # Linux: a thread's nice value is its own
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), MASK_NICE)
    except (OSError, AttributeError):
        pass


def _mask_workers() -> ThreadPoolExecutor:
    global _workers
    with _workers_lock:
        if _workers is None:
            _workers = ThreadPoolExecutor(MASK_WORKERS, thread_name_prefix="infeng-grammar",
                                          initializer=_lower_priority)
        return _workers


class Constraint:
    """The matchers of one request's choices and their next-token masks.

    ``disallowed[i]`` is choice i's mask (True: the token may not come next), filled on a worker
    thread; ``pending[i]`` is the future of choice i's job (consume, then fill) and ``queued[i]``
    when it was queued. At most one job per choice is queued at a time, and the engine loop thread
    reads a matcher only once its job is done: no two threads use a matcher at once."""

    def __init__(self, matchers: list, vocab_size: int, eos: list[int],
                 mask_seconds: float = GrammarLimits.mask_seconds):
        self.matchers = matchers
        self.vocab_size = vocab_size
        self.eos = eos
        self.mask_seconds = mask_seconds
        words = (vocab_size + 31) // 32
        self.bits = np.zeros((len(matchers), words), dtype=np.int32)
        self.disallowed = np.zeros((len(matchers), vocab_size), dtype=bool)
        self.pending: list[Future | None] = [None] * len(matchers)
        self.queued = [0.0] * len(matchers)
        # per drafting choice: the verification rows' masks ([k + 1, vocab])
        self.draft_masks: list[np.ndarray | None] = [None] * len(matchers)

    def _mask_of(self, index: int, out: np.ndarray) -> None:
        """The disallowed tokens of choice ``index``'s matcher in its state now, into ``out``."""
        import llguidance.numpy as lnp

        m = self.matchers[index]
        if m.is_error():                           # a dead end (or a parser limit): let the sequence end
            out[:] = True
            out[self.eos] = False
            return
        lnp.fill_next_token_bitmask(m, self.bits, index)           # drops the GIL
        allowed = np.unpackbits(self.bits[index].view(np.uint8), bitorder="little", count=self.vocab_size)
        np.equal(allowed, 0, out=out)
        if out.all():
            out[self.eos] = False

    def _queue(self, index: int, job: Callable[[], None]) -> None:
        self.queued[index] = time.monotonic()
        self.pending[index] = _mask_workers().submit(job)

    def prefetch(self, indices: Iterable[int]) -> None:
        """Queue the masks of choices ``indices`` (one job each: they fill in parallel)."""
        for i in indices:
            self._queue(i, lambda i=i: self._mask_of(i, self.disallowed[i]))

    def ready(self, index: int, deadline: float | None = None) -> bool:
        """Whether choice ``index``'s mask is ready (waiting for it until ``deadline`` at most)."""
        future = self.pending[index]
        if future is None or future.done():
            return True
        if deadline is not None:
            futures_wait([future], timeout=max(deadline - time.monotonic(), 0.0))
        return future.done()

    def overdue(self, index: int, now: float) -> bool:
        """Whether choice ``index``'s mask is still not ready ``mask_seconds`` after it was queued."""
        return not self.ready(index) and now - self.queued[index] > self.mask_seconds

    def failure(self, index: int) -> str | None:
        """Why choice ``index``'s matcher stopped (a parser limit hit, its job failed), or None; its
        mask is ready."""
        future = self.pending[index]
        if future is not None and future.exception() is not None:
            return f"the mask worker failed: {future.exception()}"[:300]
        m = self.matchers[index]
        return m.get_error()[:300] if m.is_error() else None

    def mask(self, index: int) -> np.ndarray:
        """Choice ``index``'s disallowed tokens (the caller has seen ``ready``; after a failed job,
        only EOS: ``failure`` says why)."""
        future, self.pending[index] = self.pending[index], None
        if future is not None and future.exception() is not None:
            self.disallowed[index] = True
            self.disallowed[index, self.eos] = False
        return self.disallowed[index]

    def advance(self, index: int, tokens: list[int]) -> None:
        """Queue feeding choice ``index``'s matcher ``tokens`` (in order; the caller has taken its
        mask) and filling its next mask: both on a worker thread, as consuming a token costs what a
        mask does for an ambiguous grammar (a refused token leaves the matcher in error: ``failure``)."""
        def job() -> None:
            m = self.matchers[index]
            for token in tokens:
                if not m.consume_token(token):
                    break
            self._mask_of(index, self.disallowed[index])
        self._queue(index, job)

    def check_draft(self, index: int, draft: list[int]) -> int:
        """How many of ``draft``'s tokens, from the first, choice ``index``'s grammar allows (up to
        the first EOS, which is left to the target); the caller has seen ``ready``. The state is not
        changed."""
        self.mask(index)
        eos = next((j for j, t in enumerate(draft) if t in self.eos), len(draft))
        return self.matchers[index].validate_tokens(draft[:eos]) if eos else 0

    def prefetch_draft(self, index: int, draft: list[int]) -> None:
        """Queue the masks of the ``len(draft) + 1`` verification rows of a checked ``draft``: row j
        masks the target's logits after the first j drafted tokens (the matcher consumes them on the
        worker thread and rolls them back, so its state is unchanged when the job is done)."""
        masks = np.empty((len(draft) + 1, self.vocab_size), dtype=bool)
        masks[0] = self.mask(index)

        def fill() -> None:
            m = self.matchers[index]
            consumed = 0
            for j, token in enumerate(draft):
                if not m.consume_token(token):      # a checked draft never gets here: its rows allow only EOS
                    masks[j + 1:] = True
                    masks[j + 1:, self.eos] = False
                    break
                consumed += 1
                self._mask_of(index, masks[j + 1])
            if consumed:
                m.rollback(consumed)

        self.draft_masks[index] = masks
        self._queue(index, fill)

    def mask_draft_rows(self, index: int, rows: np.ndarray) -> None:
        """Mask the verification ``rows`` of choice ``index``'s draft in place (``prefetch_draft``'s
        masks; the caller has seen ``ready``)."""
        masks, self.draft_masks[index] = self.draft_masks[index], None
        self.mask(index)
        for row, disallowed in zip(rows, masks):
            _mask_row(row, disallowed, self.vocab_size)

    def drop_draft(self, index: int) -> None:
        """The verification of choice ``index``'s draft was skipped (its masks were late): once the
        job is done, the matcher is back in its state before the draft and ``disallowed`` is its mask."""
        self.draft_masks[index] = None


def _mask_row(row: np.ndarray, disallowed: np.ndarray, vocab_size: int) -> None:
    width = row.shape[0]
    if width == vocab_size:
        np.copyto(row, MASKED_LOGIT, where=disallowed)
    else:
        n = min(width, vocab_size)
        np.copyto(row[:n], MASKED_LOGIT, where=disallowed[:n])
        row[n:] = MASKED_LOGIT


def mask_wait(forward_seconds: float) -> float:
    """How long a step waits for masks that are not ready, after a forward call of this long."""
    return MASK_WAIT_SHARE * forward_seconds


def late_masks(seqs: list[Any], forward_seconds: float, alone: bool) -> set[int]:
    """Wait a little for the masks of the constrained sequences ``seqs`` of a step (MASK_WAIT_SHARE
    of its forward call; MASK_IDLE_WAIT if they are ``alone`` in it and none is ready); the positions
    in ``seqs`` of those still not ready."""
    waiting: list[tuple[int, Future]] = []
    for i, seq in enumerate(seqs):
        future = seq.request.grammar.pending[seq.index]
        if future is not None and not future.done():
            waiting.append((i, future))
    if not waiting:
        return set()
    idle = alone and len(waiting) == len(seqs)
    budget = MASK_IDLE_WAIT if idle else mask_wait(forward_seconds)
    futures_wait([f for _, f in waiting], timeout=budget)
    return {i for i, f in waiting if not f.done()}


def mask_verdicts(seqs: list[Any], forward_seconds: float, alone: bool) -> tuple[set[int], dict[int, str]]:
    """After a step's forward call, for its constrained sequences ``seqs``: the positions of those
    whose masks are late (``late_masks``: they sit the step out) and, by position, the error of
    those to end (a mask past its time limit, a matcher stopped at a parser limit)."""
    late = late_masks(seqs, forward_seconds, alone)
    now = time.monotonic()
    skip: set[int] = set()
    ended: dict[int, str] = {}
    for i, seq in enumerate(seqs):
        grammar = seq.request.grammar
        if i in late:
            if grammar.overdue(seq.index, now):
                ended[i] = MASK_OVERDUE.format(grammar.mask_seconds)
            else:
                skip.add(i)
            continue
        failure = grammar.failure(seq.index)
        if failure is not None:
            ended[i] = f"{CONSTRAINT_FAILED} stopped at a parser limit: {failure}"
    return skip, ended


def apply_masks(logits: np.ndarray, rows: list[tuple[int, Any]]) -> None:
    """Set the disallowed logits of each ``(row, sequence)`` to MASKED_LOGIT, in place (their masks
    are ready)."""
    for r, seq in rows:
        c = seq.request.grammar
        _mask_row(logits[r], c.mask(seq.index), c.vocab_size)


def advance(outs: list) -> None:
    """Queue feeding each constrained output's token to its matcher (a verification step gives a
    choice several, in order) and its next mask (one job per choice; they run while the next
    forward call does)."""
    advanced: dict[tuple[int, int], tuple[Constraint, int, list[int]]] = {}
    for o in outs:
        c = o.request.grammar
        if c is None or o.token is None or o.finish_reason is not None:
            continue
        entry = advanced.get((id(c), o.index))
        if entry is None:
            advanced[id(c), o.index] = (c, o.index, [o.token])
        else:
            entry[2].append(o.token)
    for c, index, tokens in advanced.values():
        c.advance(index, tokens)
