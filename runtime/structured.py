"""Constrained decoding, the grammars: a request's constraint (JSON schema, free JSON, regex,
choice, Lark/GBNF: ``GrammarSpec``; tool calls: ``tool_call_grammar``) compiled with llguidance.

``GrammarCompiler`` turns a constraint into an llguidance grammar and checks it (within the limits
of grammar_limits.py, compiled first in a worker process, grammar_worker.py; a bad or too large one
is a ``GrammarError``, answered 400), then builds the request's ``Constraint`` (one matcher per
choice), whose token masks the sampler applies (``sampling/grammar.py``). docs/serving.md
(Structured outputs, Limits) says why llguidance and lists the bounds; bench/grammar_mask.py
measures it against xgrammar and outlines-core.
"""
from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from infeng_common.tokenizer import Tokenizer

from .grammar_limits import GrammarError, GrammarLimits, check_spec, parser_limits
from .grammar_worker import WORKER_STACK_BYTES, GrammarWorkers, llguidance_grammar
from .sampling.grammar import Constraint

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
