"""Constrained decoding: grammars (JSON schema, free JSON, regex, choice, Lark/GBNF) compiled with
llguidance, one matcher per sequence, and the token masks they allow.

``GrammarCompiler`` turns a request's constraint into an llguidance grammar and checks it (a bad
schema or regex is a ``GrammarError``, answered 400); ``Constraint`` holds one matcher per choice of
a request (``Request.grammar``). The scheduler calls ``apply_masks`` on the sampled rows before it
samples and ``advance`` after, and ``advance`` queues the next masks on one worker thread: llguidance
computes a mask without the GIL, so the next step's masks are filled while the engine loop is in
the library's forward call (which releases the GIL too), and ``apply_masks`` only waits for what
is left of that work. docs/serving.md (Structured outputs) says why llguidance; bench/grammar_mask.py
measures it against xgrammar and outlines-core.

With speculative decoding a constrained sequence drafts too: ``Constraint.check_draft`` cuts a draft
at the first token the grammar rejects, ``prefetch_draft`` queues the masks of the verification
rows (row j: the state after the first j drafted tokens, consumed and rolled back on the worker
thread while the forward call runs), and ``mask_draft_rows`` applies them (docs/speculative.md).
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from infeng_common.errors import InfengError

from .tokenizer import Tokenizer

#: What a disallowed token's logit becomes: finite, so the finiteness checks still see NaN/Inf in
#: the model's own logits, and exp() of it is 0 at any temperature.
MASKED_LOGIT = float(np.finfo(np.float32).min)
#: JSON as a strict OpenAI schema prints it: no free whitespace (a small model given free
#: whitespace can pad a document with newlines until max_tokens).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class GrammarError(InfengError):
    """A constraint that does not compile (bad JSON schema, regex or grammar)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: ``kind`` in GRAMMAR_KINDS and its value (a schema dict, a regex, choices, a
    Lark or GBNF grammar); ``param`` names the request field it came from (for errors)."""

    kind: str
    value: Any = None
    param: str = "response_format"

    def key(self) -> str:
        return json.dumps([self.kind, self.value], sort_keys=True)


def _lark_string(text: str) -> str:
    return json.dumps(text)               # Lark string literals take JSON's escapes


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
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": params(f)},
              "required": ["name", "parameters"], "additionalProperties": False} for f in fns]
    return GrammarSpec("json", {"type": "array", "minItems": 1, "items": {"anyOf": calls}}, "tool_choice")


class GrammarCompiler:
    """Grammars for one tokenizer and vocabulary (the logits' width, which may exceed the
    tokenizer's). The llguidance tokenizer is built on first use (about 0.3 s for 49k tokens);
    grammars are checked once and cached by their text."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._checked: dict[str, str] = {}

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
        """The llguidance grammar of ``spec``, checked against the tokenizer; GrammarError if bad."""
        import llguidance

        key = spec.key()
        cached = self._checked.get(key)
        if cached is not None:
            return cached
        try:
            if spec.kind == "json":
                schema = spec.value
                if not isinstance(schema, (dict, bool)):
                    raise GrammarError("a JSON schema must be a JSON object", spec.param)
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema if schema is not True else {},
                                                                        defaults=JSON_OPTIONS)
            elif spec.kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            elif spec.kind == "regex":
                if not isinstance(spec.value, str):
                    raise GrammarError("a regex must be a string", spec.param)
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.value)
            elif spec.kind == "choice":
                choices = spec.value
                if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                    raise GrammarError("choice must be a non-empty list of strings", spec.param)
                grammar = llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(_lark_string(c) for c in choices))
            elif spec.kind == "grammar":
                if not isinstance(spec.value, str) or not spec.value.strip():
                    raise GrammarError("a grammar must be a non-empty string (Lark, or GBNF/EBNF with ::=)",
                                       spec.param)
                from llguidance.gbnf_to_lark import any_to_lark

                # GBNF (llama.cpp) / EBNF (xgrammar's dialect, with ::=) becomes Lark; Lark stays
                grammar = llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.value))
            else:
                raise GrammarError(f"unknown constraint {spec.kind!r}", spec.param)
        except GrammarError:
            raise
        except Exception as e:                     # the converters raise their own error types
            raise GrammarError(f"the {spec.kind} constraint does not compile: {e}", spec.param) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise GrammarError(f"the {spec.kind} constraint does not compile: {messages[0][:500]}", spec.param)
        if len(self._checked) > 256:
            self._checked.clear()
        self._checked[key] = grammar
        return grammar

    def constraint(self, spec: GrammarSpec, n: int) -> Constraint:
        """Matchers for ``n`` choices of ``spec``, their first masks queued (call off the event loop:
        building a matcher takes a few ms for large schemas, without the GIL)."""
        import llguidance

        grammar = self.grammar(spec)
        first = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if first.is_error():
            raise GrammarError(f"the {spec.kind} constraint does not compile: {first.get_error()[:500]}", spec.param)
        matchers = [first] + [first.deep_copy() for _ in range(n - 1)]
        c = Constraint(matchers, self.vocab_size, list(self.tokenizer.eos_token_ids))
        c.prefetch(range(n))
        return c


_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def _mask_worker() -> ThreadPoolExecutor:
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(1, thread_name_prefix="infeng-grammar")
        return _worker


class Constraint:
    """The matchers of one request's choices and their next-token masks.

    ``disallowed[i]`` is choice i's mask (True: the token may not come next), filled on the worker
    thread; ``pending[i]`` is that fill's future. The engine loop thread is the only one that
    consumes tokens (``advance``), and it waits for a choice's fill before reading or changing it."""

    def __init__(self, matchers: list, vocab_size: int, eos: list[int]):
        self.matchers = matchers
        self.vocab_size = vocab_size
        self.eos = eos
        words = (vocab_size + 31) // 32
        self.bits = np.zeros((len(matchers), words), dtype=np.int32)
        self.disallowed = np.zeros((len(matchers), vocab_size), dtype=bool)
        self.ready = [False] * len(matchers)       # disallowed[i] is the mask of choice i's current state
        self.pending: list[Future | None] = [None] * len(matchers)
        # per drafting choice: the verification rows' masks ([k + 1, vocab]) and the job that fills them
        self.draft_masks: list[tuple[np.ndarray, Callable[[], None]] | None] = [None] * len(matchers)

    def _mask_of(self, index: int, out: np.ndarray) -> None:
        """The disallowed tokens of choice ``index``'s matcher in its state now, into ``out``."""
        import llguidance.numpy as lnp

        m = self.matchers[index]
        if m.is_error():                           # a dead end: let the sequence end
            out[:] = True
            out[self.eos] = False
            return
        lnp.fill_next_token_bitmask(m, self.bits, index)           # drops the GIL
        allowed = np.unpackbits(self.bits[index].view(np.uint8), bitorder="little", count=self.vocab_size)
        np.equal(allowed, 0, out=out)
        if out.all():
            out[self.eos] = False

    def _fill(self, indices: list[int]) -> None:
        for i in indices:
            self._mask_of(i, self.disallowed[i])
            self.ready[i] = True

    def prefetch(self, indices: Iterable[int]) -> None:
        indices = list(indices)
        if indices:
            future = _mask_worker().submit(self._fill, indices)
            for i in indices:
                self.pending[i] = future

    def mask(self, index: int) -> np.ndarray:
        """Choice ``index``'s disallowed tokens (waits for its fill; fills it now if none is queued)."""
        future = self.pending[index]
        self.pending[index] = None
        if future is None:
            if not self.ready[index]:
                self._fill([index])
        elif future.cancel():                       # the worker never got to it (a busy machine): fill here
            self._fill([index])
        else:
            future.result()
        return self.disallowed[index]

    def accept(self, index: int, token: int) -> bool:
        """Advance choice ``index`` by ``token`` (the caller has waited for its mask)."""
        self.ready[index] = False
        return self.matchers[index].consume_token(token)

    def check_draft(self, index: int, draft: list[int]) -> int:
        """How many of ``draft``'s tokens, from the first, choice ``index``'s grammar allows (up to
        the first EOS, which is left to the target). Waits for the choice's mask fill: the worker
        thread and this one never use a matcher at once. The state is not changed."""
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

        self.draft_masks[index] = (masks, fill)
        self.pending[index] = _mask_worker().submit(fill)

    def mask_draft_rows(self, index: int, rows: np.ndarray) -> None:
        """Mask the verification ``rows`` of choice ``index``'s draft in place (``prefetch_draft``'s
        masks; waits for them, or computes them here if the worker has not started)."""
        (masks, fill), self.draft_masks[index] = self.draft_masks[index], None
        future, self.pending[index] = self.pending[index], None
        if future.cancel():
            fill()
        else:
            future.result()
        for row, disallowed in zip(rows, masks):
            _mask_row(row, disallowed, self.vocab_size)


def _mask_row(row: np.ndarray, disallowed: np.ndarray, vocab_size: int) -> None:
    width = row.shape[0]
    if width == vocab_size:
        np.copyto(row, MASKED_LOGIT, where=disallowed)
    else:
        n = min(width, vocab_size)
        np.copyto(row[:n], MASKED_LOGIT, where=disallowed[:n])
        row[n:] = MASKED_LOGIT


def apply_masks(logits: np.ndarray, rows: list[tuple[int, Any]]) -> None:
    """Set the disallowed logits of each ``(row, sequence)`` to MASKED_LOGIT, in place."""
    for r, seq in rows:
        c = seq.request.grammar
        _mask_row(logits[r], c.mask(seq.index), c.vocab_size)


def advance(outs: list) -> None:
    """Feed each constrained output's token to its matcher (a verification step gives a choice
    several, in order) and queue the next masks (one job for the step; it runs while the next
    forward call does)."""
    by_constraint: dict[int, tuple[Constraint, list[int]]] = {}
    for o in outs:
        c = o.request.grammar
        if c is None or o.token is None or o.finish_reason is not None:
            continue
        c.accept(o.index, o.token)
        entry = by_constraint.get(id(c))
        if entry is None:
            by_constraint[id(c)] = (c, [o.index])
        elif o.index not in entry[1]:
            entry[1].append(o.index)
    if not by_constraint:
        return
    work = list(by_constraint.values())

    def fill() -> None:
        for c, indices in work:
            c._fill(indices)

    future = _mask_worker().submit(fill)
    for c, indices in work:
        for i in indices:
            c.pending[i] = future
