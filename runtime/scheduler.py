"""Iteration-level (continuous) batching over a paged KV cache.

Every call of ``Scheduler.schedule`` plans one forward step under a token budget:

1. running sequences, in order: a client's sequences after those it already had in flight (so
   a bystander comes before a greedy client's backlog, whatever priority either asks for), then
   by priority (lower ``priority`` first), then FIFO: one token each for those decoding, a
   prefill chunk for those still prefilling (a chunk never takes the room that decodes later in
   the order need, so decodes are never starved by a long prompt);
2. then waiting sequences, in the same order, while the budget, a sequence slot and KV blocks
   last; while another client has sequences waiting, a client past its share of the slots
   (``max(1, max_seqs // clients)`` running) is passed over. A new sequence first looks up its
   prompt's full blocks in the prefix cache and starts its prefill after the cached part.

When a running sequence needs a KV block and none is free, the scheduler *preempts by
recompute*: the running sequence last in priority order gives up its blocks and slot and goes
back to the front of its priority's queue, keeping the tokens it has generated; when it is
admitted again it recomputes their KV (most of it usually comes back from the prefix cache, as
its full blocks were published). Swapping is not offered: the library owns the pool and has no
ABI to copy blocks out, and at these model sizes recomputing is cheaper than a copy anyway.

Sequences with different adapters share a step; each token carries its sequence's adapter slot.

The scheduler is not thread safe: ``EngineLoop`` (loop.py) calls it under one lock. Detokenizing,
stop strings and everything text-shaped happen outside, on the consumer side of the outputs.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from infeng_common.errors import InfengError

from .adapters import AdapterPool
from .kv_cache import BlockAllocator, block_hashes
from .sampling import SamplingParams, distribution, sample
from .structured import advance, apply_masks, mask_verdicts, mask_wait
from .speculative import Speculator, accept_greedy, accept_sampled

NON_FINITE = "the model produced non-finite logits (NaN or Inf) for this sequence"
#: The logprob reported for a token of probability 0 (OpenAI's value; -inf is not JSON).
LOGPROB_FLOOR = -9999.0


def _finite_at(logits: np.ndarray, rows: range | list[int], columns: list[int]) -> bool:
    """Whether ``logits[rows[i], columns[i]]`` are all finite (one gather, no per-row numpy call)."""
    if len(columns) == 1:
        return math.isfinite(logits.item(rows[0], columns[0]))
    vocab = logits.shape[1]
    return all(map(math.isfinite, logits.reshape(-1).take([r * vocab + c for r, c in zip(rows, columns)]).tolist()))


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
    grammar: object = None                  # structured.Constraint: one matcher per choice, or None
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


class Scheduler:
    """Waiting queue, running set and the KV allocator of one engine.

    Adapters are asked of ``adapters`` (the engine's ``AdapterManager``, through ``AdapterPool``):
    a request holds its adapter from ``add`` until its last sequence finishes, a running sequence
    holds a slot (``acquire``, None: no slot free now, try later) until it stops running, and the
    adapter's ``namespace`` keeps its prefix-cache hashes apart.
    """

    def __init__(self, kv: BlockAllocator, eos_token_ids: list[int], *, max_batched_tokens: int = 256,
                 max_waiting: int = 256, max_context: int | None = None, adapters: AdapterPool | None = None):
        self.kv = kv
        self.eos = frozenset(eos_token_ids)
        self.max_seqs = kv.max_seqs
        # every running sequence must be able to decode in one step
        self.max_batched_tokens = max(max_batched_tokens, self.max_seqs)
        self.max_waiting = max_waiting
        self.max_context = min(max_context or kv.max_context, kv.max_context)
        self.adapters = adapters
        self.waiting: list[tuple[tuple[int, int, int], int, Sequence]] = []   # heap of (order, seq_id, seq)
        self.num_waiting = 0                  # live entries of the heap
        self.running: list[Sequence] = []     # sorted by order
        self.requests: dict[str, list[Sequence]] = {}
        self.stats = SchedulerStats()
        self.failed: list[SeqOutput] = []     # finished while scheduling (adapter failed to load)
        self._special = 0                     # requests in flight that sample or follow a grammar
        self._client_seqs: dict[str, int] = {}   # unfinished sequences per client
        self._last_forward = 0.0              # the last step's forward call, seconds
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.speculator: Speculator | None = None   # set by the loop: decodes may draft and verify

    # -- admission --------------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """Raise RequestError if ``request`` can never be served by this engine."""
        p = request.params
        if not request.prompt_ids:
            raise RequestError("the prompt is empty (and the tokenizer adds no BOS token)", "prompt")
        if request.n < 1:
            raise RequestError(f"n must be >= 1, got {request.n}", "n")
        if p.speculative and self.speculator is None:
            raise RequestError("speculative decoding is off on this engine (start it with --speculative)",
                               "speculative")
        need = len(request.prompt_ids) + max(p.max_new_tokens, 1)
        if need > self.max_context:
            raise RequestError(f"this model's context is {self.max_context} tokens; the request needs "
                               f"{len(request.prompt_ids)} prompt + {p.max_new_tokens} completion tokens",
                               "max_tokens", "context_length_exceeded")
        if -(-need // self.kv.block_size) > self.kv.n_blocks:
            raise RequestError(f"the request needs {need} tokens of KV cache; the whole pool holds "
                               f"{self.kv.n_blocks * self.kv.block_size}", "max_tokens", "context_length_exceeded")

    def add(self, request: Request) -> None:
        """Queue ``request``'s sequences; raises QueueFull past the admission bound."""
        self.check(request)
        if request.request_id in self.requests:
            raise RequestError(f"request id {request.request_id} is already in flight", "request_id")
        if self.num_waiting + request.n > self.max_waiting:
            raise QueueFull(f"the admission queue is full ({self.num_waiting} sequences waiting, bound "
                            f"{self.max_waiting}); retry later")
        namespace = ""
        if request.adapter:
            if self.adapters is None or request.adapter not in self.adapters.served:
                raise RequestError(f"the model {request.adapter!r} does not exist", "model", "model_not_found", 404)
            self.adapters.hold(request.adapter, request.n)
            namespace = self.adapters.namespace(request.adapter)
        arrival = next(self._arrivals)
        # a client's sequences rank after those it already has in flight (fair shares: a bystander is
        # served before a greedy client's backlog, whatever priority the greedy client asks for), then
        # by priority, then first come first served
        rank = self._client_seqs.get(request.client, 0) if request.client is not None else 0
        seqs = [Sequence(next(self._ids), request, i, (rank + i if request.client else 0, request.priority, arrival),
                         namespace)
                for i in range(request.n)]
        if request.client is not None:
            self._client_seqs[request.client] = rank + request.n
        # a grammar-constrained request drafts too: drafts are checked against its grammar (_draft)
        if self.speculator is not None and request.params.speculative is not False:
            for seq in seqs:
                seq.spec = self.speculator.state()
        self.requests[request.request_id] = seqs
        self._special += self._is_special(request)
        for seq in seqs:
            self._push_waiting(seq)

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = WAITING
        heapq.heappush(self.waiting, (seq.order, seq.seq_id, seq))
        self.num_waiting += 1

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> list[SeqOutput]:
        """Finish a request's sequences (all, or choice ``index``) now; returns their final outputs."""
        outs = []
        for seq in self.requests.get(request_id, ()):
            if seq.status != FINISHED and (index is None or seq.index == index):
                outs.append(self._finish(seq, reason, None))
        return outs

    @property
    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    # -- planning ---------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        kv, bs, blocks_of = self.kv, self.kv.block_size, self.kv.blocks_of
        budget = self.max_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        decodes_left = sum(1 for s in self.running if len(s.tokens) - s.num_computed == 1)
        i = 0
        preempted = False
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            rem = len(seq.tokens) - seq.num_computed
            if rem == 1:
                decodes_left -= 1
                n = 1
                if seq.num_computed < len(blocks_of[seq.seq_id]) * bs:    # fast path: its block exists
                    chosen.append((seq, 1))
                    budget -= 1
                    i += 1
                    continue
            else:
                n = min(rem, budget - decodes_left)
                if n <= 0:
                    i += 1
                    continue
            need = kv.blocks_needed(seq.seq_id, seq.num_computed + n)
            while need > kv.num_free and self.running[-1] is not seq:
                victim = self.running[-1]
                if victim.remaining == 1:
                    decodes_left -= 1
                self._preempt(victim)
                preempted = True
            if need > kv.num_free:             # nothing after it is left to preempt
                self._preempt(seq)
                preempted = True
                break
            kv.ensure(seq.seq_id, seq.num_computed + n)
            chosen.append((seq, n))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(chosen, budget)
        if not chosen:
            return None
        if self.speculator is not None and not preempted and budget > 0:
            return self._plan(chosen, self._draft(chosen, budget))
        return self._plan(chosen)

    def _draft(self, chosen: list[tuple[Sequence, int]], budget: int) -> bool:
        """Give the decoding sequences that may speculate their drafts (within the budget left and
        the KV blocks free: a draft never preempts), and make their entries 1 + k tokens. Whether
        any sequence got a draft."""
        kv, limit = self.kv, self.max_context
        where, seqs, caps = [], [], []
        for i, (seq, n) in enumerate(chosen):
            if n == 1 and seq.spec is not None and len(seq.tokens) - seq.num_computed == 1:
                cap = min(seq.request.params.max_new_tokens - seq.generated - 1, limit - len(seq.tokens))
                where.append(i)
                seqs.append(seq)
                caps.append(cap)
        if not seqs:
            return False
        base = sum(n for _, n in chosen)
        drafted = False
        drafts = self.speculator.propose(seqs, caps, base, len(seqs))
        # a constrained sequence drafts if its mask is ready by then (as long as a late mask is waited for)
        deadline = time.monotonic() + mask_wait(self._last_forward)
        for i, seq, draft in zip(where, seqs, drafts):
            grammar = seq.request.grammar
            if grammar is not None and draft:      # cut at the first token the grammar rejects
                ready = grammar.ready(seq.index, deadline)
                draft = draft[:grammar.check_draft(seq.index, draft)] if ready else NO_DRAFT
            k = min(len(draft), budget)
            while k and kv.blocks_needed(seq.seq_id, seq.num_computed + 1 + k) > kv.num_free:
                k -= 1
            if k:
                kv.ensure(seq.seq_id, seq.num_computed + 1 + k)
                seq.draft = draft[:k]
                if grammar is not None:            # the verification rows' masks, filled during the forward call
                    grammar.prefetch_draft(seq.index, seq.draft)
                chosen[i] = (seq, 1 + k)
                budget -= k
                drafted = True
        return drafted

    def _admit(self, chosen: list[tuple[Sequence, int]], budget: int) -> int:
        kv = self.kv
        share = _ClientShare(self)
        passed_over: list[tuple] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            _, _, seq = self.waiting[0]
            if seq.status != WAITING:          # aborted while waiting
                heapq.heappop(self.waiting)
                continue
            if share.over(seq.request.client):
                passed_over.append(heapq.heappop(self.waiting))
                continue
            # the last token is always run (its logits are needed), so at most len-1 come cached
            block_hashes(seq.tokens[:len(seq.tokens) - 1], kv.block_size, seq.namespace, seq.hashes)
            usable = (len(seq.tokens) - 1) // kv.block_size
            cached = kv.lookup(seq.hashes[:usable])
            start = len(cached) * kv.block_size
            n = min(len(seq.tokens) - start, budget)
            # blocks the chunk needs beyond the cached ones; cached blocks nobody references
            # count as free until claimed, so take them out of the free count
            idle_cached = sum(1 for b in cached if kv.refcount[b] == 0)
            need = -(-(start + n) // kv.block_size) - len(cached)
            if need > kv.num_free - idle_cached:
                break
            if seq.request.adapter is not None:
                try:
                    slot = self.adapters.acquire(seq.request.adapter, seq.seq_id)
                except InfengError as e:
                    self.failed.append(self._finish(seq, "error", str(e)))
                    continue
                if slot is None:
                    break
                seq.adapter_slot = slot
            heapq.heappop(self.waiting)
            self.num_waiting -= 1
            kv.claim(seq.seq_id, cached, usable)
            kv.ensure(seq.seq_id, start + n)
            seq.num_computed = start
            if seq.cached_tokens is None:       # first admission (not a return after preemption)
                seq.cached_tokens = min(start, seq.prompt_len)
                self.stats.prompt_tokens += seq.prompt_len
            seq.status = RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.order)
            share.admitted(seq.request.client)
            chosen.append((seq, n))
            budget -= n
        for entry in passed_over:
            heapq.heappush(self.waiting, entry)
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._stop_running(seq)
        seq.num_computed = 0
        self._push_waiting(seq)
        self.stats.preemptions += 1

    def _plan(self, chosen: list[tuple[Sequence, int]], drafted: bool = False) -> StepPlan:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        adapters: list[int] = []
        rows: list[int] = []
        sampled: list[Sequence] = []
        verify: list[tuple[Sequence, list[int]]] | tuple = ()
        verify_rows: list[int] | tuple = ()
        any_adapter = False
        prefill = 0
        slot_of = self.kv.slot_of
        for seq, n in chosen:
            start = seq.num_computed
            slot = slot_of[seq.seq_id]
            adapter = seq.adapter_slot
            if drafted and seq.draft:          # the last token and the drafts after it, logits for all
                first = len(tokens)
                tokens.append(seq.tokens[start])
                tokens.extend(seq.draft)
                positions.extend(range(start, start + n))
                slots.extend([slot] * n)
                adapters.extend([adapter] * n)
                verify_rows = [*verify_rows, *range(first, first + n)]
                verify = [*verify, (seq, seq.draft)]
                any_adapter = any_adapter or adapter >= 0
                continue
            if n == 1:
                tokens.append(seq.tokens[start])
                positions.append(start)
                slots.append(slot)
                adapters.append(adapter)
            else:
                tokens.extend(seq.tokens[start:start + n])
                positions.extend(range(start, start + n))
                slots.extend([slot] * n)
                adapters.extend([adapter] * n)
                prefill += n
            any_adapter = any_adapter or adapter >= 0
            if start + n == len(seq.tokens):
                rows.append(len(tokens) - 1)
                sampled.append(seq)
        return StepPlan([s for s, _ in chosen], [n for _, n in chosen], np.array(tokens, dtype=np.int32),
                        np.array(positions, dtype=np.int32), np.array(slots, dtype=np.int32),
                        np.array(adapters, dtype=np.int32) if any_adapter else None,
                        np.array(rows + verify_rows if verify else rows, dtype=np.int32), sampled, prefill,
                        len(tokens) - prefill, verify)

    # -- results ----------------------------------------------------------------------------
    def update(self, plan: StepPlan, logits: np.ndarray, forward_seconds: float = 0.0) -> list[SeqOutput]:
        """Advance the planned sequences by the step's results; sample where logits were asked for.
        ``forward_seconds`` (the step's forward call) bounds how long late grammar masks are waited for."""
        kv, bs = self.kv, self.kv.block_size
        self.stats.steps += 1
        self._last_forward = forward_seconds
        ended: list[SeqOutput] = []
        late = self._late(plan, forward_seconds, ended) if self._special else ()
        advanced = zip(plan.seqs, plan.counts)
        verify = plan.verify
        if verify:                             # their rows come after those of plan.sampled
            verify_logits, logits = logits, logits[:len(plan.sampled)]
            advanced = [(seq, n) for seq, n in advanced if not seq.draft]    # _verify advances them
        for seq, n in advanced:
            if seq.status != RUNNING:
                continue
            if late and seq in late:           # its last position runs again next step
                n -= 1
            if seq.num_computed < seq.prompt_len:
                self.stats.computed_prompt_tokens += min(n, seq.prompt_len - seq.num_computed)
            seq.num_computed += n
            if seq.num_computed % bs < n:      # a block boundary was reached: publish full blocks
                n_full = seq.num_computed // bs
                if n_full > kv.published_of.get(seq.seq_id, 0):
                    block_hashes(seq.tokens[:n_full * bs], bs, seq.namespace, seq.hashes)
                    kv.register(seq.seq_id, seq.hashes, n_full)
        outs: list[SeqOutput] = ended
        sampled = plan.sampled
        constrained = [(r, s) for r, s in enumerate(sampled) if s.request.grammar is not None
                       and s.status == RUNNING and s not in late] if self._special else ()
        if constrained:                        # structured outputs: disallowed tokens masked (structured.py)
            apply_masks(logits, constrained)
        greedy_rows = [r for r, s in enumerate(sampled) if s.greedy] if self._special else ()
        if not self._special or len(greedy_rows) == len(sampled):
            greedy_tokens = logits.argmax(axis=1).tolist()
            greedy_finite = _finite_at(logits, range(len(sampled)), greedy_tokens)
        elif greedy_rows:
            greedy_tokens = logits[greedy_rows].argmax(axis=1).tolist()
            greedy_finite = _finite_at(logits, greedy_rows, greedy_tokens)
        g = 0
        for r, seq in enumerate(sampled):
            if late and seq in late:           # not sampled this step
                g += seq.greedy
                continue
            if seq.greedy:
                token = greedy_tokens[g]
                g += 1
                # argmax lands on a NaN or +Inf if the row has one, on -Inf if the row is all -Inf
                finite = greedy_finite or math.isfinite(logits.item(r, token))
            else:
                finite = bool(np.isfinite(logits[r]).all())
                token = sample(logits[r], seq.request.params, seq.rng) if finite else -1
            if seq.status != RUNNING:
                continue
            if not finite:
                outs.append(self._finish(seq, "error", NON_FINITE))
                continue
            outs.append(self._emit(seq, token, logits, r))
        if verify:
            outs.extend(self._verify(plan, verify_logits, late))
            constrained = constrained or any(seq.request.grammar is not None for seq, _ in verify)
        if constrained:                        # matchers take the tokens; the next masks fill during forward
            advance(outs)
        return outs

    def _late(self, plan: StepPlan, forward_seconds: float, ended: list[SeqOutput]) -> set[Sequence]:
        """The constrained sequences of ``plan`` whose masks are not ready after a short wait (they
        skip this step); those whose mask is past its time limit, or whose matcher failed (a parser
        limit), are finished with an error into ``ended``."""
        seqs = [s for s in plan.sampled if s.request.grammar is not None and s.status == RUNNING]
        seqs += [s for s, _ in plan.verify if s.request.grammar is not None and s.status == RUNNING]
        if not seqs:
            return set()
        skip, errors = mask_verdicts(seqs, forward_seconds, alone=len(seqs) == len(plan.seqs))
        for i, error in errors.items():
            ended.append(self._finish(seqs[i], "error", error))
        late = {seqs[i] for i in skip}
        self.stats.late_mask_skips += len(late)
        return late

    def _verify(self, plan: StepPlan, logits: np.ndarray, late: set[Sequence] | tuple = ()) -> list[SeqOutput]:
        """The speculating sequences of ``plan``: accept drafts (greedy: while they are the
        target's argmax; sampled: the rejection rule), emit them and one token of the target's,
        count only the accepted positions as computed, publish the blocks they fill."""
        kv, bs = self.kv, self.kv.block_size
        outs: list[SeqOutput] = []
        r = len(plan.sampled)
        for seq, draft in plan.verify:
            seq.draft = NO_DRAFT
            k = len(draft)
            rows = logits[r:r + k + 1]
            r += k + 1
            if seq.status != RUNNING:
                continue
            if late and seq in late:               # its masks are late: verified again from its last token
                seq.request.grammar.drop_draft(seq.index)
                continue
            if seq.request.grammar is not None:    # row j: the grammar's state after j drafted tokens
                seq.request.grammar.mask_draft_rows(seq.index, rows)
            if seq.greedy:
                targets = rows.argmax(axis=1).tolist()
                a = accept_greedy(targets, draft)
                chosen = targets[:a + 1]
                finite = _finite_at(rows, range(a + 1), chosen)
            else:
                params, chosen = seq.request.params, []
                finite = True
                for i in range(k + 1):
                    if not np.isfinite(rows[i]).all():
                        finite = False
                        break
                    p = distribution(rows[i], params)
                    token = accept_sampled(p, draft[i], seq.rng) if i < k else int(seq.rng.choice(p.size, p=p))
                    chosen.append(token)
                    if i == k or token != draft[i]:
                        break
                a = len(chosen) - 1
            if not finite:
                outs.append(self._finish(seq, "error", NON_FINITE))
                continue
            self.speculator.verified(seq, k, a)
            seq.num_computed += 1              # the last token's position; each accepted draft adds one
            for i, token in enumerate(chosen):
                outs.append(self._emit(seq, token, rows, i))
                if seq.status != RUNNING:
                    break
                if i < a:
                    seq.num_computed += 1
            if seq.status == RUNNING:
                n_full = seq.num_computed // bs
                if n_full > kv.published_of.get(seq.seq_id, 0):
                    block_hashes(seq.tokens[:n_full * bs], bs, seq.namespace, seq.hashes)
                    kv.register(seq.seq_id, seq.hashes, n_full)
        return outs

    def _emit(self, seq: Sequence, token: int, logits: np.ndarray, row: int) -> SeqOutput:
        """The output of ``seq`` sampling ``token`` from ``logits[row]`` (read only for logprobs)."""
        p = seq.request.params
        cached = 0
        if not seq.reported_cached:
            seq.reported_cached, cached = True, seq.cached_tokens or 0
        if p.max_new_tokens == 0:              # max_tokens=0: the prompt is run, nothing is generated
            out = self._finish(seq, "length", None)
            out.cached_tokens = cached
            return out
        if token in self.eos and not p.ignore_eos:
            out = self._finish(seq, "stop", None)
            out.cached_tokens = cached
            return out
        out = SeqOutput(seq.request, seq.index, token, None, None, None, None, cached)
        k = seq.request.logprobs
        if k is not None:
            z = logits[row].astype(np.float64)
            z -= z.max()
            logp = np.maximum(z - np.log(np.exp(z).sum()), LOGPROB_FLOOR)     # -inf (masked) is not JSON
            out.logprob = float(logp[token])
            if k > 0:
                top = np.argpartition(-logp, k - 1)[:k]
                top = top[np.argsort(-logp[top], kind="stable")]
                out.top_logprobs = [(int(t), float(logp[t])) for t in top]
        seq.tokens.append(token)
        seq.generated += 1
        self.stats.generated_tokens += 1
        if seq.generated >= p.max_new_tokens or len(seq.tokens) >= self.max_context:
            self._finish(seq, "length", None)
            out.finish_reason = "length"
        return out

    def _finish(self, seq: Sequence, reason: str, error: str | None) -> SeqOutput:
        if seq.status == RUNNING:
            self.running.remove(seq)
            self._stop_running(seq)
        elif seq.status == WAITING:
            self.num_waiting -= 1              # its heap entry is dropped lazily
        seq.status = FINISHED
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        request = seq.request
        if request.client is not None:
            left = self._client_seqs[request.client] - 1
            if left:
                self._client_seqs[request.client] = left
            else:
                del self._client_seqs[request.client]
        seqs = self.requests.get(request.request_id)
        if seqs is not None and all(s.status == FINISHED for s in seqs):
            del self.requests[request.request_id]
            self._special -= self._is_special(request)
            if request.adapter:
                self.adapters.drop(request.adapter, request.n)
        return SeqOutput(request, seq.index, None, reason, error=error)

    @staticmethod
    def _is_special(request: Request) -> bool:
        """A request that samples or follows a grammar: while none is in flight, every sampled row
        of a step is greedy and unconstrained (``update`` skips looking)."""
        return not request.params.greedy or request.grammar is not None

    def _stop_running(self, seq: Sequence) -> None:
        """Give back what a running sequence holds: its KV blocks and slot, its adapter slot."""
        self.kv.free(seq.seq_id)
        seq.draft = NO_DRAFT
        if seq.spec is not None:
            self.speculator.release(seq)
        if seq.adapter_slot >= 0:
            self.adapters.release(seq.seq_id)
            seq.adapter_slot = -1

    def fail(self, plan: StepPlan, error: str) -> list[SeqOutput]:
        """The step failed: finish every sequence in it with ``error``."""
        return [self._finish(seq, "error", error) for seq in plan.seqs if seq.status != FINISHED]

    def reset_stats(self) -> None:
        self.stats = SchedulerStats()


class _ClientShare:
    """One admission round's fair share: while another client has sequences waiting, no client is
    admitted past ``max(1, max_seqs // clients)`` running sequences (clients: those with
    unfinished sequences)."""

    def __init__(self, sched: Scheduler):
        self.unfinished = sched._client_seqs
        self.running: dict[str, int] = {}
        for seq in sched.running:
            if seq.request.client is not None:
                self.running[seq.request.client] = self.running.get(seq.request.client, 0) + 1
        self.cap = max(1, sched.max_seqs // max(len(self.unfinished), 1))
        self.waiting = {c for c, n in self.unfinished.items() if n > self.running.get(c, 0)}

    def over(self, client: str | None) -> bool:
        return (client is not None and self.running.get(client, 0) >= self.cap
                and any(other != client for other in self.waiting))

    def admitted(self, client: str | None) -> None:
        if client is not None:
            self.running[client] = self.running.get(client, 0) + 1
            if self.running[client] >= self.unfinished[client]:
                self.waiting.discard(client)
