"""Constrained decoding: grammars (JSON schema, free JSON, regex, choice, Lark/GBNF) compiled with
llguidance, one matcher per sequence, and the token masks they allow.

``GrammarCompiler`` turns a request's constraint into an llguidance grammar and checks it (within
the limits of grammar_limits.py, compiled first in a worker process, grammar_worker.py; a bad or
too large one is a ``GrammarError``, answered 400); ``Constraint`` holds one matcher per choice of
a request (``Request.grammar``). After each step ``advance`` queues, per choice, feeding its matcher
the sampled token and filling its next mask on the mask worker threads: llguidance does both
without the GIL, so they run while the engine loop is in the library's forward call. Before the
next sampling the scheduler waits a little for masks not yet ready (``late_masks``: a share of the
forward call's time); a choice whose mask is later skips that step, one whose mask is later than
``--grammar-mask-timeout`` ends with an error, and the engine loop never waits longer for a
grammar. docs/serving.md (Structured outputs, Limits) says why llguidance and lists the bounds;
bench/grammar_mask.py measures it against xgrammar and outlines-core.

With speculative decoding a constrained sequence drafts too: ``Constraint.check_draft`` cuts a draft
at the first token the grammar rejects, ``prefetch_draft`` queues the masks of the verification
rows (row j: the state after the first j drafted tokens, consumed and rolled back on the worker
thread while the forward call runs), and ``mask_draft_rows`` applies them (docs/speculative.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from infeng_common.tokenizer import Tokenizer

from .grammar_limits import GrammarError, GrammarLimits, check_spec, parser_limits
from .grammar_worker import WORKER_STACK_BYTES, GrammarWorkers, llguidance_grammar

#: What a disallowed token's logit becomes: finite, so the finiteness checks still see NaN/Inf in
#: the model's own logits, and exp() of it is 0 at any temperature.
MASKED_LOGIT = float(np.finfo(np.float32).min)
GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: The stack of the thread that builds a matcher in the server process: explicit, not whatever the
#: platform gives a thread by default, and four times the stack the worker process proved the
#: grammar compiles on (grammar_worker.py).
COMPILE_STACK_BYTES = 4 * WORKER_STACK_BYTES
_stack_size_lock = threading.Lock()


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: ``kind`` in GRAMMAR_KINDS and its value (a schema dict, a regex, choices, a
    Lark or GBNF grammar); ``param`` names the request field it came from (for errors);
    ``wrapper_depth`` is the nesting the server wrapped around what the client sent (tool calls:
    the client's parameter schemas are held to the depth limit, not the wrapper around them)."""

    kind: str
    value: Any = None
    param: str = "response_format"
    wrapper_depth: int = 0

    def key(self) -> str:
        return json.dumps([self.kind, self.value], sort_keys=True)


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None) -> GrammarSpec:
    """``tool_choice`` as a grammar: a named function's arguments (its parameters schema), or, for
    ``required``, a JSON array of one or more ``{"name", "parameters"}`` calls of the given tools
    (vLLM's shapes for both)."""
    def params(fn: dict[str, Any]) -> dict[str, Any]:
        return fn.get("parameters") or {"type": "object"}

    fns = [t["function"] for t in tools]
    if name is not None:
        fn = next(f for f in fns if f["name"] == name)
        return GrammarSpec("json", params(fn), "tool_choice")
    def calls(schema_of: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
        return {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": schema_of(f)},
             "required": ["name", "parameters"], "additionalProperties": False} for f in fns]}}

    # a call's parameters sit 5 levels down: {items: {anyOf: [{properties: {parameters: ...}}]}}
    return GrammarSpec("json", calls(params), "tool_choice", wrapper_depth=5)


#: Refusals that another try may not repeat (the compile ran out of time on a busy machine, or found
#: every compiler busy): never remembered. The others (over a limit, does not compile, crashed the
#: compiler) are the grammar's own and are refused at once when it comes again.
TRANSIENT_REFUSALS = frozenset({"grammar_too_expensive", "grammar_compilers_busy"})


def _remember(cache: dict, key: str, value: Any) -> None:
    if len(cache) > 256:
        cache.clear()
    cache[key] = value


class GrammarCompiler:
    """Grammars for one tokenizer and vocabulary (the logits' width, which may exceed the
    tokenizer's). The llguidance tokenizer is built on first use (about 0.3 s for 49k tokens);
    grammars are checked once and cached by their text."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, limits: GrammarLimits | None = None,
                 workers: GrammarWorkers | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self.workers = workers
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._checked: dict[str, str] = {}
        self._refused: dict[str, tuple[str, str | None]] = {}    # key -> (message with {param}, code)

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                eos = list(self.tokenizer.eos_token_ids) or None
                self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.hf.to_str(), n_vocab=self.vocab_size,
                                                            eos_token=eos)
            return self._ll_tokenizer

    def grammar(self, spec: GrammarSpec) -> str:
        """The llguidance grammar of ``spec``, within the limits and checked against the tokenizer
        (in a worker process when the compiler has workers); GrammarError if bad."""
        limits = self.limits if not spec.wrapper_depth else \
            dataclasses.replace(self.limits, max_depth=self.limits.max_depth + spec.wrapper_depth)
        check_spec(spec.kind, spec.value, spec.param, limits, deep=self.workers is None)
        key = spec.key()
        cached = self._checked.get(key)
        if cached is not None:
            return cached
        refused = self._refused.get(key)
        if refused is not None:                    # the same bad grammar again: no second compile
            reason, code = refused
            raise GrammarError(reason.format(param=spec.param), spec.param, code)
        try:
            if self.workers is not None:
                grammar = self.workers.check(spec.kind, spec.value, spec.param, limits)
            else:
                grammar = self._check_here(spec)
        except GrammarError as e:
            if e.code not in TRANSIENT_REFUSALS:
                reason = str(e).replace("{", "{{").replace("}", "}}")
                if e.param and reason.startswith(f"{e.param}: "):     # the next request names its own field
                    reason = "{param}" + reason[len(e.param):]
                _remember(self._refused, key, (reason, e.code))
            raise
        _remember(self._checked, key, grammar)
        return grammar

    def _check_here(self, spec: GrammarSpec) -> str:
        import llguidance

        try:
            grammar = llguidance_grammar(spec.kind, spec.value, spec.param)
        except GrammarError:
            raise
        except Exception as e:                     # the converters raise their own error types
            raise GrammarError(f"the {spec.kind} constraint does not compile: {str(e)[:500]}", spec.param) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer,
                                                                                 limits=parser_limits())
        if is_error:
            raise GrammarError(f"the {spec.kind} constraint does not compile: {messages[0][:500]}", spec.param)
        return grammar

    def constraint(self, spec: GrammarSpec, n: int) -> Constraint:
        """Matchers for ``n`` choices of ``spec``, their first masks queued (call off the event loop:
        building a matcher takes a few ms for large schemas, without the GIL)."""
        import llguidance

        grammar = self.grammar(spec)
        ll_tokenizer = self.ll_tokenizer
        first = on_compile_stack(lambda: llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0,
                                                              limits=parser_limits()))
        if first.is_error():
            raise GrammarError(f"the {spec.kind} constraint does not compile: {first.get_error()[:500]}", spec.param)
        matchers = [first] + [first.deep_copy() for _ in range(n - 1)]
        c = Constraint(matchers, self.vocab_size, list(self.tokenizer.eos_token_ids), self.limits.mask_seconds)
        c.prefetch(range(n))
        return c


def on_compile_stack(build: Callable[[], Any]) -> Any:
    """``build()`` on a new thread of ``COMPILE_STACK_BYTES`` of stack (the calling thread waits)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = build()
        except BaseException as e:             # re-raised on the calling thread
            outcome["error"] = e

    with _stack_size_lock:                     # the size is the process's, for threads started now
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="infeng-grammar-matcher", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


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
