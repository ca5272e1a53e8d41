"""The engine loop: one thread owns the Engine and runs schedule -> forward -> sample, forever.

Other threads talk to it through ``submit``/``abort`` (under one lock, never held during the
forward call, which releases the GIL) and through commands that must run between steps (adapter
load/unload). Outputs leave the loop as token ids: each request's ``sink`` is called once per
step with that step's outputs for every request sharing the sink, on the loop thread, so a sink
must only hand them over (``call_soon_threadsafe``, a queue). Detokenizing and stop strings are
the consumer's job (``detokenize.py``); a consumer that sees a stop string calls ``abort``.

A request can fail, the loop cannot: a sequence whose logits are not finite, or whose adapter
cannot be loaded, finishes alone with ``finish_reason="error"``. If the loop itself dies anyway,
every request in flight is finished with an error, ``submit`` raises ``EngineStopped`` from then
on, and ``on_fatal`` (the server's hook) is called once.

Adapters are the engine's ``AdapterManager`` (``self.adapters``); loads and unloads run here,
between steps, because they write into the library's slots.
"""
from __future__ import annotations

import collections
import logging
import operator
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from infeng_common.errors import InfengError

from .request import grouped
from .scheduler import QueueFull, Request, RequestError, Scheduler, SeqOutput
from .sequence import WAITING
from .spec import SpeculativeConfig, Speculator

__all__ = ["EngineLimits", "EngineLoop", "EngineStopped", "LoopStats", "QueueFull", "RequestError"]

_log = logging.getLogger("infeng.engine")
_SINK = operator.attrgetter("request.sink")         # where a request's outputs go


class EngineStopped(InfengError):
    """The engine loop has failed or is stopping: no request is accepted any more."""


@dataclass(frozen=True)
class EngineLimits:
    """What a request may ask of this loop, fixed at start: the context of one sequence, the
    sequences the admission queue holds, the sequences running at once, the KV pool's blocks."""

    max_context: int
    max_waiting: int
    max_seqs: int
    kv_blocks: int
    block_size: int

    def room(self, prompt_tokens: int) -> int:
        """The most tokens a sequence with this prompt can generate (at least one)."""
        return max(1, min(self.max_context, self.kv_blocks * self.block_size) - prompt_tokens)


@dataclass
class LoopStats:
    """Counters of the loop thread; seconds are summed over steps."""

    steps: int = 0
    step_seconds: float = 0.0             # whole iterations that ran a step
    forward_seconds: float = 0.0          # inside Engine.forward (the C call)
    tokens: int = 0                       # token rows run
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=512))  # (t, generated)

    @property
    def overhead_seconds(self) -> float:
        """Python time per step outside the forward call (schedule, arrays, sampling, dispatch)."""
        return (self.step_seconds - self.forward_seconds) / self.steps if self.steps else 0.0


class EngineLoop:
    """Continuous batching over one Engine. ``start()`` runs it on a thread; ``run_once()`` runs
    one iteration on the caller's thread (the offline API does that)."""

    def __init__(self, engine, *, max_batched_tokens: int | None = None, max_waiting: int = 256,
                 prefix_cache: bool = True, speculative: SpeculativeConfig | None = None):
        self.engine = engine
        engine.kv.prefix_cache = prefix_cache
        tokenizer = engine.tokenizer
        eos = tokenizer.eos_token_ids if tokenizer is not None else engine.manifest["meta"].get("eos_token_ids") or []
        self.adapters = engine.adapters
        self.scheduler = Scheduler(engine.kv, list(eos), max_batched_tokens=max_batched_tokens or engine.max_tokens,
                                   max_waiting=max_waiting, max_context=engine.max_context, adapters=engine.adapters)
        # speculative decoding (spec/): decodes draft and the step verifies; measured at load
        self.speculator = Speculator(speculative, engine) if speculative is not None else None
        self.scheduler.speculator = self.speculator
        self.stats = LoopStats()
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)
        self._commands: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._thread: threading.Thread | None = None
        self._held: list[SeqOutput] = []          # outputs of the last step, handed over before the next
        self._stop = False
        self.error: BaseException | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None   # called once, on the loop thread

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="infeng-engine-loop", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still in flight are finished with reason "abort"."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self.lock:
            outs = [o for rid in list(self.scheduler.requests) for o in self.scheduler.abort(rid)]
        self._deliver(outs)
        self._fail_commands(EngineStopped("the engine loop stopped before the command ran"))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- requests ---------------------------------------------------------------------------
    @property
    def limits(self) -> EngineLimits:
        sched, kv = self.scheduler, self.scheduler.kv
        return EngineLimits(sched.max_context, sched.max_waiting, kv.max_seqs, kv.n_blocks, kv.block_size)

    def check(self, request: Request) -> None:
        """Raise RequestError if ``request`` could never run here (context, adapter, sizes)."""
        self.scheduler.check(request)

    def request_ids(self) -> list[str]:
        """The requests in flight (queued or running)."""
        with self.lock:
            return list(self.scheduler.requests)

    def adapters_in_flight(self) -> tuple[list[str], list[str]]:
        """The adapters of the running sequences and of the waiting ones."""
        with self.lock:
            sched = self.scheduler
            running = {s.request.adapter for s in sched.running if s.request.adapter}
            waiting = {s.request.adapter for _, _, s in sched.waiting if s.status == WAITING and s.request.adapter}
        return sorted(running), sorted(waiting)

    def submit(self, request: Request) -> None:
        """Queue a request; raises RequestError (bad request, unknown adapter), QueueFull or
        EngineStopped."""
        with self._wake:
            if self.error is not None or self._stop:
                raise EngineStopped(f"the engine loop has {'failed' if self.error else 'stopped'}; "
                                    f"no request is accepted")
            self.scheduler.add(request)
            self._wake.notify()

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort",
              error: str | None = None) -> None:
        """End a request (or one of its choices); its sink gets the final outputs, carrying ``error``."""
        with self.lock:
            outs = self.scheduler.abort(request_id, index, reason)
        for out in outs:
            out.error = error
        self._deliver(outs)

    def has_work(self) -> bool:
        with self.lock:
            return self.scheduler.has_work or bool(self._commands)

    # -- adapters (run between steps, on the loop thread) -------------------------------------
    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the loop thread between two steps; the future has its result."""
        fut: Future = Future()
        with self._wake:
            self._commands.append((fn, fut))
            self._wake.notify()
        if self._thread is None:                 # not threaded: run it now
            self._run_commands()
        return fut

    def load_adapter(self, name: str, path: str | Path, scale: float = 1.0) -> Future:
        """Serve the PEFT adapter at ``path`` as model ``name``: read and checked on a worker thread
        (files, regexes, finiteness: nothing holds the loop's lock meanwhile), then put into a slot
        between two steps. The future has the slot."""
        result: Future = Future()

        def read() -> None:
            try:
                adapter = self.adapters.read(name, path, scale)
            except BaseException as e:          # handed to the caller
                result.set_exception(e)
                return
            installed = self.call(lambda: self.adapters.install(adapter))
            installed.add_done_callback(lambda f: result.set_exception(f.exception()) if f.exception()
                                        else result.set_result(f.result()))

        threading.Thread(target=read, name="infeng-adapter-read", daemon=True).start()
        return result

    def unload_adapter(self, name: str) -> Future:
        """Stop serving ``name``; requests already accepted for it still finish with it."""
        return self.call(lambda: self.adapters.unload(name))

    def _run_commands(self) -> None:
        while True:
            with self.lock:
                if not self._commands:
                    return
                fn, fut = self._commands.popleft()
                if not fut.set_running_or_notify_cancel():      # its caller gave up: skip it
                    continue
                try:
                    result = fn()
                except BaseException as e:   # handed to the caller
                    fut.set_exception(e)
                else:
                    fut.set_result(result)

    def _fail_commands(self, error: BaseException) -> None:
        """Answer every command still queued with ``error`` (the loop will not run them)."""
        with self.lock:
            commands, self._commands = list(self._commands), collections.deque()
        for _, fut in commands:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)

    # -- the loop ---------------------------------------------------------------------------
    def run_once(self) -> bool:
        """One iteration: commands, then one step if there is work. False when idle."""
        if self._commands:
            self._run_commands()
        t0 = time.perf_counter()
        with self.lock:
            plan = self.scheduler.schedule()
            failed, self.scheduler.failed = self.scheduler.failed, []
        held, self._held = self._held, []
        self._deliver(held + failed)
        if plan is None:
            return bool(failed or held)
        t1 = time.perf_counter()
        try:
            logits = self.engine.forward(plan.tokens, plan.positions, plan.slots, plan.logits_rows,
                                         plan.adapter_slots)
        except InfengError as e:
            t2 = time.perf_counter()
            with self.lock:
                outs = self.scheduler.fail(plan, str(e))
        else:
            t2 = time.perf_counter()
            with self.lock:
                outs = self.scheduler.update(plan, logits, t2 - t1)
            if self.speculator is not None and len(plan.logits_rows) == len(plan.tokens):
                self.speculator.observe(len(plan.tokens), float(plan.positions.mean()), t2 - t1)
        generated = self.scheduler.stats.generated_tokens
        if self._thread is not None and self.scheduler.has_work:
            # hand the outputs over just before the next forward call: the consumers then do their
            # Python work (detokenizing, writing streams) while this thread is in C without the
            # GIL, instead of competing with it for the GIL while it plans the next step
            self._held = outs
        else:
            self._deliver(outs)
        t3 = time.perf_counter()
        s = self.stats
        s.steps += 1
        s.step_seconds += t3 - t0
        s.forward_seconds += t2 - t1
        s.tokens += len(plan.tokens)
        s.recent.append((t3, generated))
        return True

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stop and not self.scheduler.has_work and not self._commands \
                            and not self._held:
                        self._wake.wait(0.5)
                    if self._stop:
                        break
                if not self.run_once():             # work, but none of it can run yet: don't spin
                    with self._wake:
                        self._wake.wait(0.002)
            held, self._held = self._held, []
            self._deliver(held)
        except BaseException as e:          # keep the reason for /health; fail what is in flight
            with self.lock:
                self.error = e                  # submit refuses from now on (it checks under the lock)
                finished, self._held = self._held + self.scheduler.failed, []
                self.scheduler.failed = []
                outs = [o for rid in list(self.scheduler.requests)
                        for o in self.scheduler.abort(rid, reason="error")]
            for o in outs:
                o.error = f"engine loop failed: {e}"
            self._deliver(finished + outs)
            self._fail_commands(EngineStopped(f"the engine loop failed: {e}"))
            _log.error("the engine loop failed; every request in flight was ended with an error", exc_info=e)
            if self.on_fatal is not None:
                self.on_fatal(e)

    @staticmethod
    def _deliver(outs: list[SeqOutput]) -> None:
        """Hand each sink its outputs, one call per sink."""
        if not outs:
            return
        for sink, batch in grouped(outs, _SINK):
            sink(batch)

    # -- numbers ----------------------------------------------------------------------------
    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last ``window`` seconds of steps."""
        recent = list(self.stats.recent)
        if len(recent) < 2:
            return 0.0
        now = time.perf_counter()
        inside = [r for r in recent if now - r[0] <= window]
        if len(inside) < 2:
            return 0.0
        (t_a, n_a), (t_b, n_b) = inside[0], inside[-1]
        return (n_b - n_a) / (t_b - t_a) if t_b > t_a else 0.0

    def snapshot(self) -> dict[str, Any]:
        """Gauges for /metrics and tests: queue, running, KV and prefix-cache counters."""
        with self.lock:
            sched, kv = self.scheduler, self.scheduler.kv
            return {"waiting": sched.num_waiting, "running": len(sched.running), "kv_blocks_used": kv.used_blocks,
                    "kv_blocks_total": kv.n_blocks, "kv_blocks_cached": kv.cached_blocks,
                    "kv_bytes_touched": self.engine.kv_bytes_touched,
                    "prefix_queries": kv.queries, "prefix_hits": kv.hits, "preemptions": sched.stats.preemptions,
                    "prompt_tokens": sched.stats.prompt_tokens,
                    "computed_prompt_tokens": sched.stats.computed_prompt_tokens,
                    "generated_tokens": sched.stats.generated_tokens, "steps": self.stats.steps,
                    "late_mask_skips": sched.stats.late_mask_skips,
                    "step_seconds": self.stats.step_seconds, "forward_seconds": self.stats.forward_seconds,
                    "overhead_seconds_per_step": self.stats.overhead_seconds, **self._spec_snapshot()}

    def _spec_snapshot(self) -> dict[str, Any]:
        spec = self.speculator
        if spec is None:
            return {"spec_drafts": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_emitted_tokens": 0}
        s = spec.stats
        return {"spec_drafts": s.drafts, "spec_draft_tokens": s.draft_tokens, "spec_accepted_tokens": s.accepted_tokens,
                "spec_emitted_tokens": s.emitted_tokens}
