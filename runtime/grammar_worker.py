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
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .grammar_limits import PARSER_LIMITS, GrammarError, GrammarLimits, check_spec

_log = logging.getLogger("infeng.grammar")

#: The workers compile on a thread of this stack: a grammar that fits it fits the server's threads
#: (8 MiB, the usual RLIMIT_STACK) four times over.
WORKER_STACK_BYTES = 2 * 2 ** 20
#: How long a new worker may take to start (import llguidance, build the tokenizer) before the
#: compile sent to it counts against the request's budget.
STARTUP_SECONDS = 30.0


class GrammarBusy(GrammarError):
    """Every worker stayed busy for the whole compile budget (the server answers 503)."""


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to build the llguidance tokenizer (the server's, rebuilt there)."""

    hf_json: str
    vocab_size: int
    eos: tuple[int, ...]


def _serve(conn: Connection, tokenizer: TokenizerSpec) -> None:
    """A worker's loop: (kind, value, param, limits) in; ("ok", grammar, None) or ("error", message,
    code) out. The constraint's shape is checked against the limits first (grammar_limits.py)."""
    import llguidance

    from .structured import llguidance_grammar

    ll_tok = llguidance.LLTokenizer(tokenizer.hf_json, n_vocab=tokenizer.vocab_size,
                                    eos_token=list(tokenizer.eos) or None)
    limits = llguidance.LLParserLimits(**PARSER_LIMITS)
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


def _worker_main(conn: Connection, tokenizer: TokenizerSpec) -> None:
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
        self.process = context.Process(target=_worker_main, args=(child, tokenizer), daemon=True,
                                       name="infeng-grammar-worker")
        self.process.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False

    def wait_ready(self) -> None:
        if not self.ready:
            if not self.conn.poll(STARTUP_SECONDS):
                raise TimeoutError("the grammar worker did not start")
            self.conn.recv()
            self.ready = True

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class GrammarWorkers:
    """``count`` worker processes; ``check`` compiles one constraint on one of them within a
    budget. Thread safe: each call takes a worker for itself."""

    def __init__(self, tokenizer: TokenizerSpec, count: int = 2):
        self._context = multiprocessing.get_context("spawn")
        self._tokenizer = tokenizer
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(count):
            self._add()

    def _add(self) -> None:
        worker = _Worker(self._context, self._tokenizer)
        with self._lock:
            if self._closed:
                worker.kill()
                return
            self._all.append(worker)
        self._idle.put(worker)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
        threading.Thread(target=self._add, name="infeng-grammar-respawn", daemon=True).start()

    def check(self, kind: str, value: Any, param: str, limits: GrammarLimits) -> str:
        """The llguidance grammar of the constraint, within ``limits`` and validated; GrammarError if
        it is over a limit, does not compile, is still compiling after ``limits.compile_seconds``
        (the worker is killed) or crashes the worker."""
        budget = limits.compile_seconds
        deadline = time.monotonic() + budget
        try:
            worker = self._idle.get(timeout=budget)
        except queue.Empty:
            raise GrammarBusy(f"every grammar compiler stayed busy for {budget:g} s; retry shortly", param,
                              "grammar_compilers_busy") from None
        try:
            worker.wait_ready()
            worker.conn.send((kind, value, param, limits))
            if not worker.conn.poll(max(deadline - time.monotonic(), 0.0)):
                self._replace(worker)
                _log.warning("grammar compile abandoned at its budget", extra={"fields": {
                    "kind": kind, "param": param, "budget_s": budget}})
                raise GrammarError(f"{param}: compiling the {kind} constraint took longer than {budget:g} s "
                                   f"(the grammar compile time limit)", param, "grammar_too_expensive")
            status, payload, code = worker.conn.recv()
        except (EOFError, OSError, TimeoutError) as e:
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
