"""Grammar checks in worker processes, so that a compile can be stopped.

llguidance compiles a grammar in native code that honours no cancellation, and a deep enough
grammar overflows its stack (SIGSEGV). The first compile of every new constraint therefore runs in
one of a few spawned worker processes (``GrammarWorkers``): the worker turns the constraint into an
llguidance grammar and validates it against the tokenizer with the server's parser limits, on a
thread whose stack is a quarter of the server threads' (``WORKER_STACK_BYTES``), and answers the
grammar text. A worker past the compile budget is killed and replaced; one that dies (a crash) is
replaced and the request gets a 400 and the server one log line. Only a grammar a worker compiled
within the budget, on the smaller stack, is then compiled in the server process (``LLMatcher``:
the same work again, which that proof bounds; bench/grammar_worker.py measures both).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import json
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .grammar_limits import GrammarError, GrammarLimits, check_spec, parser_limits

_log = logging.getLogger("infeng.grammar")

#: The workers compile on a thread of this stack: a grammar that fits it fits the server's matcher
#: thread (``COMPILE_STACK_BYTES``, structured.py: 8 MiB, set explicitly) four times over.
WORKER_STACK_BYTES = 2 * 2 ** 20
PR_SET_PDEATHSIG = 1                           # linux/prctl.h
#: How long a new worker may take to start (import llguidance, build the tokenizer); one that takes
#: longer is killed and started again.
STARTUP_SECONDS = 30.0
#: JSON as a strict OpenAI schema prints it: no free whitespace (a small model given free
#: whitespace can pad a document with newlines until max_tokens).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarBusy(GrammarError):
    """Every worker stayed busy for the whole compile budget (the server answers 503)."""


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to build the llguidance tokenizer (the server's, rebuilt there)."""

    hf_json: str
    vocab_size: int
    eos: tuple[int, ...]


def _lark_string(text: str) -> str:
    return json.dumps(text)               # Lark string literals take JSON's escapes


def llguidance_grammar(kind: str, value: Any, param: str) -> str:
    """The llguidance grammar of one constraint (not yet checked against a tokenizer); GrammarError
    for a value of the wrong shape. Runs in the grammar worker processes (grammar_worker.py)."""
    import llguidance

    if kind == "json":
        if not isinstance(value, (dict, bool)):
            raise GrammarError("a JSON schema must be a JSON object", param)
        return llguidance.LLMatcher.grammar_from_json_schema(value if value is not True else {}, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        if not isinstance(value, str):
            raise GrammarError("a regex must be a string", param)
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise GrammarError("choice must be a non-empty list of strings", param)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in value))
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise GrammarError("a grammar must be a non-empty string (Lark, or GBNF/EBNF with ::=)", param)
        from llguidance.gbnf_to_lark import any_to_lark

        # GBNF (llama.cpp) / EBNF (xgrammar's dialect, with ::=) becomes Lark; Lark stays
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(value))
    raise GrammarError(f"unknown constraint {kind!r}", param)


def _serve(conn: Connection, tokenizer: TokenizerSpec) -> None:
    """A worker's loop: (kind, value, param, limits) in; ("ok", grammar, None) or ("error", message,
    code) out. The constraint's shape is checked against the limits first (grammar_limits.py)."""
    import llguidance

    ll_tok = llguidance.LLTokenizer(tokenizer.hf_json, n_vocab=tokenizer.vocab_size,
                                    eos_token=list(tokenizer.eos) or None)
    limits = parser_limits()
    conn.send(("ready", ""))
    while True:
        try:
            kind, value, param, bounds = conn.recv()
        except EOFError:
            return
        try:
            check_spec(kind, value, param, bounds)
            grammar = llguidance_grammar(kind, value, param)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tok, limits=limits)
            reply = ("error", f"the {kind} constraint does not compile: {messages[0][:500]}", None) if is_error \
                else ("ok", grammar, None)
        except GrammarError as e:
            reply = ("error", str(e), e.code)
        except Exception as e:                 # the converters raise their own error types
            reply = ("error", f"the {kind} constraint does not compile: {str(e)[:500]}", None)
        conn.send(reply)


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this process when the server's thread that started it ends (the
    server exits, even by SIGKILL); elsewhere the server's ``close`` is the only way."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:                 # the server went before the signal was set
        os._exit(0)


def _worker_main(conn: Connection, tokenizer: TokenizerSpec, parent: int) -> None:
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the server's to handle (it kills us)
    try:
        os.nice(5)                             # below the engine loop, on a shared machine
    except OSError:
        pass
    threading.stack_size(WORKER_STACK_BYTES)
    thread = threading.Thread(target=_serve, args=(conn, tokenizer), name="infeng-grammar-compile")
    thread.start()
    thread.join()


class _Worker:
    def __init__(self, context, tokenizer: TokenizerSpec):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, tokenizer, os.getpid()), daemon=True,
                                       name="infeng-grammar-worker")
        self.process.start()
        child.close()

    def wait_ready(self) -> None:
        if not self.conn.poll(STARTUP_SECONDS):
            raise TimeoutError(f"the grammar worker did not start within {STARTUP_SECONDS:g} s")
        self.conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class GrammarWorkers:
    """``count`` worker processes, started on the first ``check`` (each costs about a second and
    40 MB, which a server that never sees a grammar does not pay); ``check`` compiles one
    constraint on one of them within a budget. Thread safe: each call takes a worker for itself.
    Only a started worker waits in ``_idle``: its start never counts against a compile's budget."""

    def __init__(self, tokenizer: TokenizerSpec, count: int = 2):
        self._context = multiprocessing.get_context("spawn")
        self._tokenizer = tokenizer
        self._count = count
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._started = False
        self._starting = 0                          # workers on their way to ``_idle``
        self._closed = False

    def start(self) -> None:
        """Start the workers (at most once; ``check`` calls it)."""
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
        for _ in range(self._count):
            self._respawn()

    def _respawn(self) -> None:
        with self._lock:
            self._starting += 1
        threading.Thread(target=self._add, name="infeng-grammar-respawn", daemon=True).start()

    def _add(self) -> None:
        """Start one worker and queue it once it is ready; a failed start is logged and tried again.
        This thread then stays until the worker is gone: the worker's parent-death signal is tied
        to the thread that started it (prctl), so it must not end before the worker does."""
        delay = 1.0
        worker: _Worker | None = None
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                worker = None
                try:
                    worker = _Worker(self._context, self._tokenizer)
                    with self._lock:
                        if self._closed:
                            worker.kill()
                            return
                        self._all.append(worker)
                    worker.wait_ready()
                    break
                except (OSError, EOFError, TimeoutError) as e:
                    with self._lock:
                        if self._closed:
                            return
                        if worker is not None and worker in self._all:
                            self._all.remove(worker)
                    if worker is not None:
                        worker.kill()
                    _log.error("grammar worker failed to start; retrying", extra={"fields": {
                        "error": str(e), "retry_in_s": delay}})
                    time.sleep(delay)
                    delay = min(delay * 2, 30.0)
        finally:
            with self._lock:
                self._starting -= 1
        self._idle.put(worker)
        worker.process.join()                  # until it is killed (replaced, closed) or dies

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
        self._respawn()

    def check(self, kind: str, value: Any, param: str, limits: GrammarLimits) -> str:
        """The llguidance grammar of the constraint, within ``limits`` and validated; GrammarError if
        it is over a limit, does not compile, is still compiling after ``limits.compile_seconds``
        (the worker is killed) or crashes the worker. The budget starts when a ready worker takes
        the constraint; waiting for one is bounded by the budget too (by ``STARTUP_SECONDS`` more
        while workers are starting)."""
        self.start()
        budget = limits.compile_seconds
        try:
            worker = self._idle.get(timeout=budget + (STARTUP_SECONDS if self._starting else 0.0))
        except queue.Empty:
            raise GrammarBusy(f"every grammar compiler stayed busy for {budget:g} s; retry shortly", param,
                              "grammar_compilers_busy") from None
        try:
            worker.conn.send((kind, value, param, limits))
            if not worker.conn.poll(budget):
                self._replace(worker)
                _log.warning("grammar compile abandoned at its budget", extra={"fields": {
                    "kind": kind, "param": param, "budget_s": budget}})
                raise GrammarError(f"{param}: compiling the {kind} constraint took longer than {budget:g} s "
                                   f"(the grammar compile time limit)", param, "grammar_too_expensive")
            status, payload, code = worker.conn.recv()
        except (EOFError, OSError) as e:
            self._replace(worker)
            exitcode = worker.process.exitcode
            _log.error("grammar compiler crashed", extra={"fields": {"kind": kind, "param": param,
                                                                     "exitcode": exitcode, "error": str(e)}})
            raise GrammarError(f"{param}: the {kind} constraint crashed the grammar compiler (exit code "
                               f"{exitcode}); simplify it", param, "grammar_crashed") from None
        self._idle.put(worker)
        if status != "ok":
            raise GrammarError(payload, param, code)
        return payload

    def close(self) -> None:
        """Kill every worker (at shutdown: nothing waits for a compile in progress)."""
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for worker in workers:
            worker.kill()
