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
import time

import numpy as np

from infeng_common.errors import InfengError

from .adapters import AdapterPool
from .fair_share import AdmissionShare
from .kv_cache import BlockAllocator, block_hashes
from .request import QueueFull, Request, RequestError, SeqOutput
from .sampling import accept_draft, draw_rows, token_logprobs
from .sampling.grammar import advance, apply_masks, mask_verdicts, mask_wait
from .sequence import FINISHED, NO_DRAFT, RUNNING, WAITING, SchedulerStats, Sequence, StepPlan
from .spec import Speculator

NON_FINITE = "the model produced non-finite logits (NaN or Inf) for this sequence"


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
        share = AdmissionShare(self._client_seqs, self.running, self.max_seqs)
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
        if constrained:                        # structured outputs: disallowed tokens masked (sampling/grammar.py)
            apply_masks(logits, constrained)
        for r, (seq, drawn) in enumerate(zip(sampled, draw_rows(logits, sampled, late, bool(self._special)))):
            if drawn is None:                  # late: not sampled this step
                continue
            token, finite = drawn
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
            chosen, finite = accept_draft(rows, draft, seq.request.params, seq.rng)
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
            out.logprob, out.top_logprobs = token_logprobs(logits[row], token, k)
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
