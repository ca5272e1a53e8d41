"""The request core every endpoint sits on: a request made into what the engine takes (prompt
bounds, text work off the event loop, grammar constraints, the adapter, admission all or nothing),
and the engine's outputs made into what a client gets (per-choice text deltas from the output
processor, usage, finish reasons, the error a failed choice answers with).

Routers (completions.py, chat.py, responses.py, tokenize.py, admin.py) call only this module's
public methods; app.py assembles them with the life cycle into the ``Server``.

Chat templates and tokenizers run on a small thread pool under a time budget, never on the event
loop thread, which only routes, detokenizes and writes streams; each client runs at most one text
job and one grammar compile at a time (fair_share.py)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from infeng_common.errors import InfengError

from ..api_errors import APIError
from ..detokenize import ChoiceText, Delta, TokenTexts
from ..fair_share import CLIENT, ClientShares, ClientsInFlight
from ..grammar_worker import GrammarBusy
from ..http_guard import AdapterRoots
from ..loop import EngineLoop, EngineStopped
from ..metrics import ServerMetrics
from ..request_log import LOGGER, InFlight, RequestRecord, record_of
from ..sampling import SamplingParams
from ..sampling.grammar import CONSTRAINT_FAILED
from ..scheduler import QueueFull, Request, RequestError
from ..structured import GrammarCompiler, GrammarError, GrammarSpec
from .bodies import parse_body
from .options import ServeOptions
from .sink import AsyncSink

DISCONNECT_POLL_SECONDS = 0.5
#: Longest the text work of one request (chat template, tokenizer) may take once it runs; past it
#: the request is dropped with 400. It runs on ``TEXT_WORKERS`` threads, never on the event loop
#: thread; past ``TEXT_QUEUE_BOUND`` requests waiting for a thread, a new one gets 503.
TEXT_WORK_SECONDS = 5.0
TEXT_WORKERS = 2
TEXT_QUEUE_BOUND = 256
#: Grammar compiler processes (grammar_worker.py); each client runs at most one text job and one
#: grammar compile at a time (fair_share.py), so one client never holds every thread or compiler.
GRAMMAR_WORKERS = 2
#: A prompt longer than ``max_context`` times this many characters (or the vocabulary's longest
#: token, if longer) cannot fit in the context whatever it tokenizes to: refused without tokenizing.
CHARS_PER_TOKEN = 16
SHUTTING_DOWN = "the server is shutting down"


# -- errors -----------------------------------------------------------------------------------
def from_request_error(e: RequestError) -> APIError:
    type_ = "not_found_error" if e.status == 404 else "invalid_request_error"
    return APIError(e.status, str(e), type_, e.param, e.code)


def queue_full(e: QueueFull) -> APIError:
    return APIError(429, str(e), "rate_limit_error", None, "queue_full",
                    {"Retry-After": str(max(1, round(e.retry_after)))})


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "server_error", None, code)


def record_for(http: HTTPRequest) -> RequestRecord:
    """The request's log record (RequestLog's, or a new one for an app used without it)."""
    record = record_of(http.scope)
    if record is None:
        record = http.scope["infeng.record"] = RequestRecord(uuid.uuid4().hex[:16], http.method, http.url.path)
    return record


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def post_routes(core: "RequestCore", handlers: dict[str, Callable[["RequestCore", HTTPRequest], Any]]) -> APIRouter:
    """A router of POST endpoints: each path's ``handler(core, request)``."""
    routes = APIRouter()

    def endpoint(handler: Callable[["RequestCore", HTTPRequest], Any]) -> Callable[[HTTPRequest], Any]:
        async def answer(http: HTTPRequest):
            return await handler(core, http)
        return answer

    for path, handler in handlers.items():
        routes.add_api_route(path, endpoint(handler), methods=["POST"])
    return routes


def include_usage(options: ServeOptions, stream_options: dict[str, Any] | None) -> bool:
    """Whether a stream ends with a usage chunk (asked for, or ``--always-include-usage``)."""
    return options.always_include_usage or bool((stream_options or {}).get("include_usage"))


# -- per-request consumer state ---------------------------------------------------------------
@dataclass
class Pending:
    """One HTTP request: its engine requests and the queue their outputs arrive on."""

    queue: asyncio.Queue
    arrival: float
    choices: dict[tuple[str, int], int] = field(default_factory=dict)   # (request_id, index) -> choice no.
    prompt_tokens: int = 0


class RequestCore:
    """The state every endpoint shares over one EngineLoop, and the steps of a request."""

    def __init__(self, loop: EngineLoop, model_name: str, options: ServeOptions | None = None):
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = loop.engine.tokenizer
        if self.tokenizer is None:
            raise InfengError(f"{loop.engine.path}: the artifact has no tokenizer.json; it cannot be served")
        self.options = options or ServeOptions()
        self.model_name = model_name
        self.created = int(time.time())
        self.limits = loop.limits
        self.metrics = ServerMetrics(loop, model_name)
        self.token_texts = TokenTexts(self.tokenizer)
        self.grammar_limits = self.options.grammar_limits()
        self.grammars = GrammarCompiler(self.tokenizer, loop.engine.vocab_size, self.grammar_limits)
        self.clients = ClientsInFlight()
        self.text_shares = ClientShares(capacity=TEXT_WORKERS, in_flight=self.clients)
        self.grammar_shares = ClientShares(capacity=GRAMMAR_WORKERS, in_flight=self.clients)
        self.ending: asyncio.Event | None = None        # set when the shutdown ends what is left
        self.adapter_roots = AdapterRoots(self.options.adapter_roots)
        longest_token = max((len(t) for t in self.tokenizer.hf.get_vocab()), default=1)
        self.max_prompt_chars = max(CHARS_PER_TOKEN, longest_token) * self.limits.max_context
        self.sink: AsyncSink | None = None
        self.text_pool: ThreadPoolExecutor | None = None
        self.grammar_pool: ThreadPoolExecutor | None = None
        self.text_waiting = 0                           # requests whose text work waits for a thread
        self.in_flight = InFlight()
        self.draining = False

    async def begin(self, http: HTTPRequest, body_model: type[BaseModel]) -> tuple[RequestRecord, Any, str | None]:
        """A generation request's start: its log record, the body parsed as ``body_model`` (503 first
        if no work is admitted), and the adapter its ``model`` names (None: the base model)."""
        record = record_for(http)
        self.admitting()
        body = parse_body(body_model, await http.body())
        record.model = body.model
        record.adapter = self.adapter_of(body.model)
        return record, body, record.adapter

    # -- models -------------------------------------------------------------------------------
    def models(self) -> list[dict[str, Any]]:
        entries = [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "infeng",
                    "root": self.model_name, "parent": None}]
        for name in list(self.loop.adapters.served):
            entries.append({"id": name, "object": "model", "created": self.created, "owned_by": "infeng",
                            "root": name, "parent": self.model_name})
        return entries

    def adapter_of(self, model: str) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for anything else."""
        if model == self.model_name:
            return None
        if model in self.loop.adapters.served:
            return model
        raise APIError(404, f"the model {model!r} does not exist (serving: "
                       f"{', '.join(e['id'] for e in self.models())})", "not_found_error", "model", "model_not_found")

    def admitting(self) -> None:
        """Raise 503 unless new work is accepted (the engine loop is up, no shutdown under way)."""
        if self.loop.error is not None:
            raise unavailable(f"the engine loop failed ({self.loop.error}); the server is exiting", "engine_stopped")
        if self.draining:
            raise unavailable(f"{SHUTTING_DOWN} and accepts no new requests", "shutting_down")

    # -- bounds ---------------------------------------------------------------------------------
    def check_sequences(self, count: int) -> None:
        """A request of ``count`` sequences (n x prompts) must fit in the admission queue at all."""
        bound = self.limits.max_waiting
        if count > bound:
            raise APIError(400, f"the request asks for {count} sequences (n x prompts); this server queues at most "
                                f"{bound} (--max-queue), so it could never be admitted", param="n")

    def check_chars(self, chars: int, param: str, subject: str = "the prompt has") -> None:
        if chars > self.max_prompt_chars:
            context = self.limits.max_context
            raise APIError(400, f"{subject} {chars} characters; this model's context is {context} tokens, "
                                f"which no prompt longer than {self.max_prompt_chars} characters fits in",
                           param=param, code="context_length_exceeded")

    # -- work off the event loop ------------------------------------------------------------------
    async def constraints(self, spec: GrammarSpec | None, n: int, prompts: int) -> list | None:
        """One ``Constraint`` (n matchers) per prompt: the grammar within its limits, compiled first
        in a worker process (one compile per client at a time), then the matchers built on the text
        threads; 400 naming the limit for a grammar over one or that does not compile in time."""
        if spec is None:
            return None
        bound = self.grammar_limits.max_sequences
        if n * prompts > bound:
            raise APIError(400, f"a request with an output constraint may have at most {bound} sequences (n x "
                                f"prompts; the limit of matchers per request), not {n * prompts}", param="n",
                           code="grammar_too_large")
        try:
            release = await self.share(self.grammar_shares)
            compiled = asyncio.wrap_future(self.grammar_pool.submit(self.grammars.grammar, spec))
            compiled.add_done_callback(lambda _: release())
            await self.until_ending(compiled)
            return [await self.text_work(self.grammars.constraint, spec, n) for _ in range(prompts)]
        except GrammarBusy as e:
            raise unavailable(str(e), "grammar_compilers_busy") from None
        except GrammarError as e:
            raise APIError(400, str(e), param=e.param, code=e.code) from None

    async def until_ending(self, work: asyncio.Future) -> Any:
        """``work``'s result, or 503 if the shutdown ends what is left first (the work is left behind)."""
        ending = asyncio.ensure_future(self.ending.wait())
        try:
            await asyncio.wait({work, ending}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ending.cancel()
        if not work.done() or work.cancelled():
            raise unavailable(f"{SHUTTING_DOWN}; the request was not started", "shutting_down")
        return work.result()

    async def share(self, shares: ClientShares) -> Callable[[], None]:
        """The release of this client's turn in ``shares``, or 503 if the shutdown comes first. A
        request that gives up waiting (the client left, the shutdown) gives the turn back: its wait
        is cancelled, or the turn it already took released."""
        waiting = asyncio.ensure_future(shares.acquire(CLIENT.get()))
        try:
            return await self.until_ending(waiting)
        except BaseException:
            if not waiting.done():
                waiting.cancel()
            elif not waiting.cancelled() and waiting.exception() is None:
                waiting.result()()
            raise

    async def text_work(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the text thread pool, within ``TEXT_WORK_SECONDS`` from when it starts
        running (time spent waiting behind other requests' work is not held against it); one job
        per client at a time (a job past its budget holds its client's turn until its thread is done)."""
        if self.text_waiting >= TEXT_QUEUE_BOUND:
            raise unavailable("the server is busy preparing other prompts; retry shortly", "text_queue_full")
        event_loop = asyncio.get_running_loop()
        began = asyncio.Event()

        def run() -> Any:
            event_loop.call_soon_threadsafe(began.set)
            return fn(*args)

        self.text_waiting += 1
        try:
            release = await self.share(self.text_shares)
            future = self.text_pool.submit(run)
            done = asyncio.wrap_future(future)
            done.add_done_callback(lambda _: release())
            started = asyncio.ensure_future(began.wait())
            ending = asyncio.ensure_future(self.ending.wait())
            try:
                await asyncio.wait({started, done, ending}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:          # the client left while its work waited
                future.cancel()
                raise
            finally:
                started.cancel()
                ending.cancel()
            if not began.is_set() and not done.done():
                future.cancel()
                raise unavailable(f"{SHUTTING_DOWN}; the request was not started", "shutting_down")
        finally:
            self.text_waiting -= 1
        try:
            return await asyncio.wait_for(self.until_ending(done), TEXT_WORK_SECONDS)
        except asyncio.TimeoutError:
            raise APIError(400, f"preparing the prompt (chat template, tokenizer) took longer than "
                                f"{TEXT_WORK_SECONDS:g} s; the request was dropped",
                           code="prompt_too_expensive") from None

    # -- submission and outputs -------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], params: list[SamplingParams], n: int, adapter: str | None,
               priority: int, logprobs: int | None, prefix: str, grammars: list | None = None) -> Pending:
        self.admitting()
        pending = Pending(asyncio.Queue(), time.monotonic())
        requests = []
        for p_index, (ids, p) in enumerate(zip(prompts, params)):
            rid = f"{prefix}-{p_index}"
            req = Request(rid, ids, p, n=n, adapter=adapter, priority=priority, logprobs=logprobs, sink=self.sink,
                          context=pending.queue, grammar=grammars[p_index] if grammars else None,
                          client=CLIENT.get())
            try:
                self.loop.check(req)
            except RequestError as e:
                raise from_request_error(e) from None
            requests.append(req)
        accepted = []
        try:
            for req in requests:
                self.loop.submit(req)
                accepted.append(req)
        except (QueueFull, RequestError, EngineStopped) as e:
            for req in accepted:                     # all or nothing
                self.loop.abort(req.request_id)
            if isinstance(e, EngineStopped):
                raise unavailable(str(e), "engine_stopped") from None
            raise (queue_full(e) if isinstance(e, QueueFull) else from_request_error(e)) from None
        for p_index, req in enumerate(requests):
            for i in range(n):
                pending.choices[(req.request_id, i)] = p_index * n + i
            pending.prompt_tokens += len(req.prompt_ids) * n
        return pending

    def abort_all(self, pending: Pending) -> None:
        for rid in {rid for rid, _ in pending.choices}:
            self.loop.abort(rid)

    async def events(self, pending: Pending, texts: list[ChoiceText], http: HTTPRequest | None,
                     record: RequestRecord) -> AsyncIterator[list[tuple[int, Delta]]]:
        """Deltas as outputs arrive, until every choice is done; aborts if the client leaves."""
        metrics = self.metrics
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        next_check = time.monotonic() + DISCONNECT_POLL_SECONDS
        record.prompt_tokens = pending.prompt_tokens
        try:
            while not all(t.done for t in texts):
                try:
                    outs = await asyncio.wait_for(pending.queue.get(), timeout=DISCONNECT_POLL_SECONDS)
                except asyncio.TimeoutError:
                    outs = []
                now = time.monotonic()
                if http is not None and now >= next_check:       # a non-streamed request's client
                    next_check = now + DISCONNECT_POLL_SECONDS
                    if await http.is_disconnected():
                        record.disconnected = True
                        return
                batch = []
                for o in outs:
                    c = pending.choices[(o.request.request_id, o.index)]
                    text = texts[c]
                    if text.done:
                        continue
                    delta = text.push(o)
                    if o.token is not None:
                        if c not in first:
                            first[c] = now
                            metrics.ttft.observe(now - pending.arrival)
                            if record.first_token_at is None:
                                record.first_token_at = now
                        else:
                            metrics.itl.observe(now - last[c])
                        last[c] = now
                    if delta is None:
                        continue
                    if text.done and o.finish_reason is None:        # a stop string: end the sequence
                        self.loop.abort(o.request.request_id, o.index)
                    batch.append((c, delta))
                if batch:
                    yield batch
            metrics.e2e.observe(time.monotonic() - pending.arrival)
        finally:
            record.completion_tokens = sum(len(t.token_ids) for t in texts)
            if not all(t.done for t in texts):
                self.abort_all(pending)

    async def guarded(self, chunks: AsyncIterator[str], pending: Pending, texts: list[ChoiceText],
                      record: RequestRecord, closing: tuple[dict[str, Any], dict[str, Any] | None] | None = None
                      ) -> AsyncIterator[str]:
        """The SSE chunks, then (``closing``: the chunks' common fields and the request's
        ``stream_options``, for a chat or completion stream) a usage chunk when asked for and
        ``[DONE]``. A client that goes away mid-stream has its request aborted at once, and an
        unexpected error ends the stream with an error event and ``[DONE]``."""
        failed = False
        try:
            async for chunk in chunks:
                yield chunk
            if closing is not None:
                base, stream_options = closing
                if include_usage(self.options, stream_options):
                    yield sse({**base, "choices": [], "usage": self.usage(pending, texts)})
                yield "data: [DONE]\n\n"
        except Exception as e:
            failed = True
            record.error = f"{type(e).__name__}: {e}"
            LOGGER.exception("unhandled error in a stream", extra={"fields": {"id": record.request_id}})
            yield sse({"error": APIError(500, f"internal server error (request id {record.request_id}); it has "
                                              f"been logged", "server_error", code="internal_error").body()["error"]})
            yield "data: [DONE]\n\n"
        finally:
            if not all(t.done for t in texts):
                self.abort_all(pending)
                record.disconnected = not failed

    @staticmethod
    def usage(pending: Pending, texts: list[ChoiceText]) -> dict[str, Any]:
        completion = sum(len(t.token_ids) for t in texts)
        return {"prompt_tokens": pending.prompt_tokens, "completion_tokens": completion,
                "total_tokens": pending.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(t.cached_tokens for t in texts)}}

    @staticmethod
    def finish_reason(text: ChoiceText) -> str:
        return text.finish_reason if text.finish_reason in ("stop", "length") else (text.finish_reason or "abort")

    def failure(self, finish_reason: str | None, error: str | None) -> APIError | None:
        """The error a choice that ended this way gives its client: 500 when its sequence failed
        alone, 503 when the engine loop died or the server ended it at shutdown."""
        if finish_reason == "error":
            if error and error.startswith(CONSTRAINT_FAILED):     # the request's grammar, not the server
                return APIError(400, error, code="grammar_too_expensive")
            if self.loop.error is not None:
                return unavailable(error or f"the engine loop failed: {self.loop.error}", "engine_stopped")
            return APIError(500, f"generation failed: {error}", "server_error", code="engine_error")
        if finish_reason == "abort" and error:
            return unavailable(error, "shutting_down")
        return None

    def check_errors(self, texts: list[ChoiceText], record: RequestRecord) -> None:
        for t in texts:
            failure = self.failure(t.finish_reason, t.error)
            if failure is not None:
                record.error = failure.message
                raise failure

    def error_event(self, delta: Delta, record: RequestRecord) -> str | None:
        failure = self.failure(delta.finish_reason, delta.error)
        if failure is None:
            return None
        record.error = failure.message
        return sse({"error": failure.body()["error"]})

    async def stream_chunks(self, pending: Pending, texts: list[ChoiceText], record: RequestRecord,
                            render: Callable[[int, Delta], list[str]], opening: list[str] | None = None
                            ) -> AsyncIterator[str]:
        """A chat or completion stream's chunks: ``opening``, then ``render(choice, delta)`` of each
        delta as it arrives; a failed choice's error is an SSE error event instead (once per
        distinct error, not once per choice)."""
        for chunk in opening or ():
            yield chunk
        errors_sent: set[str] = set()
        async for batch in self.events(pending, texts, None, record):
            for c, delta in batch:
                event = self.error_event(delta, record)
                if event is None:
                    for chunk in render(c, delta):
                        yield chunk
                elif event not in errors_sent:
                    errors_sent.add(event)
                    yield event

    def streaming(self, chunks: AsyncIterator[str], pending: Pending, texts: list[ChoiceText], record: RequestRecord,
                  closing: tuple[dict[str, Any], dict[str, Any] | None] | None = None) -> StreamingResponse:
        """The SSE response of ``chunks`` (``guarded``, with its ``closing``)."""
        return StreamingResponse(self.guarded(chunks, pending, texts, record, closing), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def finished(self, pending: Pending, texts: list[ChoiceText], http: HTTPRequest,
                       record: RequestRecord) -> Response | None:
        """Wait for every choice of a non-streamed request: None when all finished well, 499 when
        the client left; a failed choice raises its error."""
        async for _ in self.events(pending, texts, http, record):
            pass
        if not all(t.done for t in texts):
            return Response(status_code=499)
        self.check_errors(texts, record)
        return None
