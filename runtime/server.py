"""``infeng serve``: the OpenAI HTTP API over one EngineLoop (FastAPI + uvicorn).

Endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` (responses.py; all with SSE
streaming), ``/v1/models``, ``POST /v1/adapters`` / ``DELETE /v1/adapters/{name}``, ``/health``, ``/metrics``.

In front of the handlers, three ASGI layers: ``RequestLog`` (request ids, one log line per request,
a JSON 500 for anything unexpected), the request counter of ``/metrics``, and ``AccessGuard``
(Host check on loopback, API key, JSON content type, body size). Every error a client can cause is
a 4xx with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``.

Work per request is bounded before it starts: strict UTF-8 JSON of bounded depth (json_body.py,
also for schemas sent as text and tool calls in the output), at most ``MAX_STOP_STRINGS`` stop
strings and ``MAX_TOOLS`` tools, no more sequences than the queue can ever hold, no prompt (its
tools' JSON counted in) with more characters than the context could hold as tokens. Chat
templates and tokenizers run on a small thread pool under a time budget, never on the event loop
thread, which only routes, detokenizes and writes streams. Outputs come back once per step
through one sink (a pipe the event loop watches) and are routed to per-request queues. A client
that goes away has its request aborted.

Life cycle: SIGTERM or SIGINT stops admission (503), lets running requests finish for
``--shutdown-timeout`` seconds, ends the rest (streams with an error event and ``[DONE]``, others
with 503) and exits 0. If the engine loop dies, every waiting request is answered 503 at once,
``/health`` says 503 and the process exits 1.
"""
from __future__ import annotations

import asyncio
import collections
import ctypes
import json
import math
import os
import socket
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Union

import uvicorn
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from infeng_common.errors import InfengError

from .api_errors import APIError
from .chat import (SPECIAL_TOKEN_KEYS, TEMPLATE_GLOBALS, ChatTemplateError, message_text, render_chat,
                   template_source)
from .detokenize import ChoiceText, Delta, TokenTexts
from .exit_watchdog import exit_after
from .fair_share import CLIENT, ClientShares, ClientsInFlight
from .grammar_limits import GrammarLimits
from .grammar_worker import GrammarBusy, GrammarWorkers, TokenizerSpec
from .http_guard import AccessGuard, AccessPolicy, AdapterRoots, is_loopback_address
from .json_body import JSONRejected, loads, parse_json
from .loop import EngineLoop, EngineStopped
from .metrics import ServerMetrics
from .prefix_store import save_on_exit
from .request_log import (LOG_FORMATS, LOG_LEVELS, LOGGER, InFlight, RequestLog, RequestRecord, configure_logging,
                          record_of)
from .sampling import SEED_BOUND, SamplingParams
from .scheduler import QueueFull, Request, RequestError, SeqOutput
from .speculative import SpeculativeConfig
from .structured import CONSTRAINT_FAILED, GrammarCompiler, GrammarError, GrammarSpec, tool_call_grammar
from .tools import (ToolCall, ToolStream, arguments_object, hermes_messages, parse_forced, parse_tool_calls,
                    template_knows_tools)
from .warmup import warm_start

__all__ = ["APIError", "ServeOptions", "Server", "build_server", "serve"]

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
#: After SIGTERM, the process exits at most this long after --shutdown-timeout, whatever a thread
#: is doing (the requests left were ended at the timeout; this is for writing their last events).
SHUTDOWN_GRACE_SECONDS = 10.0
#: How long uvicorn waits for open connections once it is told to stop.
GRACEFUL_SECONDS = 5
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
PRIORITY_BOUND = 1000
#: A prompt longer than ``max_context`` times this many characters (or the vocabulary's longest
#: token, if longer) cannot fit in the context whatever it tokenizes to: refused without tokenizing.
CHARS_PER_TOKEN = 16
MAX_ADAPTER_NAME = 128
#: Most tools one request may define (OpenAI's own limit); together with the messages, their JSON
#: text counts against the prompt bound (``max_prompt_chars``) before the chat template runs.
MAX_TOOLS = 128
#: ``chat_template_kwargs`` keys that would replace the renderer's own variables.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tools", "documents", "chat_template",
                                      "additional_special_tokens", *SPECIAL_TOKEN_KEYS, *TEMPLATE_GLOBALS})
SHUTTING_DOWN = "the server is shutting down"


# -- request bodies ---------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")       # clients send fields we ignore (user, ...)

    model: str
    max_tokens: Optional[int] = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=0, lt=SEED_BOUND)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    # extensions (as vLLM names them)
    top_k: int = Field(0, ge=0)
    ignore_eos: bool = False
    priority: int = Field(0, ge=-PRIORITY_BOUND, le=PRIORITY_BOUND)
    speculative: Optional[StrictBool] = None       # per request: false never drafts (needs --speculative)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


class CompletionBody(_Body):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")       # tool_calls, tool_call_id, name, ...

    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template: Optional[str] = None            # a client's template: only with --trust-request-chat-template
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: a ``prompt``, or chat ``messages`` rendered with the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False
    tools: Optional[list[dict[str, Any]]] = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    tokens: list[int]


#: Fields of OpenAI's API this server does not implement: a request that sets one gets 400 naming
#: it, rather than an answer that silently ignores it.
UNSUPPORTED_FIELDS = ("functions", "function_call", "audio", "prediction", "web_search_options", "store",
                      "modalities")
#: vLLM's ``structured_outputs`` keys: the constraints, and options that change nothing here.
STRUCTURED_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "backend",
                      "whitespace_pattern")
TOOL_CHOICES = ("none", "auto", "required")


class AdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Optional[str] = None
    path: Optional[str] = None
    scale: float = 1.0
    lora_name: Optional[str] = None                # vLLM's spelling
    lora_path: Optional[str] = None


# -- errors -----------------------------------------------------------------------------------
def _from_request_error(e: RequestError) -> APIError:
    type_ = "not_found_error" if e.status == 404 else "invalid_request_error"
    return APIError(e.status, str(e), type_, e.param, e.code)


def _queue_full(e: QueueFull) -> APIError:
    return APIError(429, str(e), "rate_limit_error", None, "queue_full",
                    {"Retry-After": str(max(1, round(e.retry_after)))})


def _unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "server_error", None, code)


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


def _record(http: HTTPRequest) -> RequestRecord:
    record = record_of(http.scope)
    if record is None:                             # an app used without RequestLog in front
        record = http.scope["infeng.record"] = RequestRecord(uuid.uuid4().hex[:16], http.method, http.url.path)
    return record


# -- per-request consumer state ---------------------------------------------------------------
@dataclass
class _Pending:
    """One HTTP request: its engine requests and the queue their outputs arrive on."""

    queue: asyncio.Queue
    arrival: float
    choices: dict[tuple[str, int], int] = field(default_factory=dict)   # (request_id, index) -> choice no.
    prompt_tokens: int = 0


def _gil_holding_write() -> Callable[[int], None]:
    """``write(fd, "\\0", 1)`` without releasing the GIL (libc through ctypes.PyDLL).

    Waking the event loop with ``call_soon_threadsafe`` sends on a socket, which releases the GIL:
    the event loop thread wakes, takes the GIL and keeps it for all of its Python work (every
    stream's chunks), and the engine thread waits that long before it can start the next forward
    call. Writing with the GIL held lets the engine thread go on into the forward call, which
    releases the GIL; the event loop then does its work while the library computes."""
    try:
        write = ctypes.PyDLL(None).write
        write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        write.restype = ctypes.c_ssize_t
        return lambda fd: write(fd, b"\0", 1) and None     # a full pipe (EAGAIN) already means "wake"
    except (OSError, AttributeError):                        # no libc symbols: the plain way
        def plain(fd: int) -> None:
            try:
                os.write(fd, b"\0")
            except BlockingIOError:
                pass
        return plain


_wake_fd = _gil_holding_write()


class _AsyncSink:
    """Called on the engine thread once per step: queues the outputs and wakes the event loop
    (through a pipe it watches), which routes them to per-request queues."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: collections.deque[list[SeqOutput]] = collections.deque()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        loop.add_reader(self._read_fd, self._drain)
        self.closed = False

    def __call__(self, outs: list[SeqOutput]) -> None:
        if not self.closed:
            self.pending.append(outs)
            _wake_fd(self._write_fd)

    def _drain(self) -> None:
        try:
            os.read(self._read_fd, 65536)
        except BlockingIOError:
            pass
        while self.pending:
            self._route(self.pending.popleft())

    def close(self) -> None:
        self.closed = True
        self.loop.remove_reader(self._read_fd)
        os.close(self._read_fd)
        os.close(self._write_fd)

    @staticmethod
    def _route(outs: list[SeqOutput]) -> None:
        by_queue: dict[int, tuple[asyncio.Queue, list[SeqOutput]]] = {}
        for o in outs:
            q = o.request.context
            entry = by_queue.get(id(q))
            if entry is None:
                by_queue[id(q)] = (q, [o])
            else:
                entry[1].append(o)
        for q, batch in by_queue.values():
            q.put_nowait(batch)


class Server:
    """The API over one EngineLoop; ``app`` is the FastAPI application.

    ``request_exit(code)`` is how the server asks whatever runs it to stop (``serve`` makes it stop
    uvicorn; the process then exits with ``exit_code``): after a graceful shutdown (0) or when the
    engine loop died (1)."""

    def __init__(self, loop: EngineLoop, model_name: str, options: ServeOptions | None = None):
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = loop.engine.tokenizer
        if self.tokenizer is None:
            raise InfengError(f"{loop.engine.path}: the artifact has no tokenizer.json; it cannot be served")
        self.options = options or ServeOptions()
        self.model_name = model_name
        self.created = int(time.time())
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
        self.max_prompt_chars = max(CHARS_PER_TOKEN, longest_token) * loop.scheduler.max_context
        self.sink: _AsyncSink | None = None
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.text_pool: ThreadPoolExecutor | None = None
        self.in_flight = InFlight()
        self.draining = False
        self.exit_code: int | None = None
        self.request_exit: Callable[[int], None] = self._note_exit
        loop.on_fatal = self._on_fatal
        self.app = self._build_app()

    # -- app ----------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI):
            self.event_loop = asyncio.get_running_loop()
            self.sink = _AsyncSink(self.event_loop)
            self.text_pool = ThreadPoolExecutor(TEXT_WORKERS, thread_name_prefix="infeng-text")
            self.grammar_pool = ThreadPoolExecutor(GRAMMAR_WORKERS, thread_name_prefix="infeng-grammar-wait")
            self.ending = asyncio.Event()
            self.grammars.workers = GrammarWorkers(TokenizerSpec(self.tokenizer.hf.to_str(), self.engine.vocab_size,
                                                                 tuple(self.tokenizer.eos_token_ids)), GRAMMAR_WORKERS)
            self.text_waiting = 0                   # requests whose text work waits for a thread
            self.loop.start()
            LOGGER.info("serving", extra={"fields": self.describe()})
            try:
                yield
            finally:
                self.loop.stop()
                self.sink._drain()
                self.sink.close()
                self.text_pool.shutdown(wait=False, cancel_futures=True)
                self.grammar_pool.shutdown(wait=False, cancel_futures=True)
                self.grammars.workers.close()

        app = FastAPI(title="infeng", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        metrics = self.metrics
        options = self.options
        # the last added is the outermost: RequestLog -> _CountRequests -> AccessGuard -> routes
        app.add_middleware(AccessGuard, policy=AccessPolicy(options.api_key, is_loopback_address(options.host),
                                                            options.max_request_bytes))
        app.add_middleware(_CountRequests, metrics=metrics, clients=self.clients)
        app.add_middleware(RequestLog, in_flight=self.in_flight)

        @app.exception_handler(APIError)
        async def api_error(request: HTTPRequest, e: APIError):
            return e.response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: HTTPRequest, e: StarletteHTTPException):
            message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
                       f"{request.url.path}"}.get(e.status_code, str(e.detail))
            return APIError(e.status_code, message, code="not_found" if e.status_code == 404 else None,
                            headers=e.headers).response()

        @app.post("/v1/completions")
        async def completions(request: HTTPRequest):
            return await self.completions(request)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: HTTPRequest):
            return await self.chat(request)

        from .responses import ResponsesAPI  # it builds on this module

        responses_api = ResponsesAPI(self)

        @app.post("/v1/responses")
        async def responses(request: HTTPRequest):
            return await responses_api.create(request)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": self._models()}

        @app.get("/v1/models/{model:path}")
        async def model(model: str):
            for entry in self._models():
                if entry["id"] == model:
                    return entry
            raise APIError(404, f"the model {model!r} does not exist", "not_found_error", "model", "model_not_found")

        @app.post("/v1/adapters")
        async def load_adapter(request: HTTPRequest):
            return await self.load_adapter(request)

        @app.delete("/v1/adapters/{name}")
        async def unload_adapter(name: str):
            return await self.unload_adapter(name)

        @app.post("/tokenize")
        async def tokenize(request: HTTPRequest):
            return await self.tokenize(request)

        @app.post("/detokenize")
        async def detokenize(request: HTTPRequest):
            return await self.detokenize(request)

        @app.get("/version")
        async def version():
            return {"version": _version()}

        @app.get("/health")
        async def health():
            if self.loop.error is not None or not self.loop.alive:
                reason = f": {self.loop.error}" if self.loop.error else ""
                return JSONResponse({"status": "error", "message": f"engine loop stopped{reason}"}, status_code=503)
            if self.draining:
                return JSONResponse({"status": "draining", "message": SHUTTING_DOWN}, status_code=503)
            return {"status": "ok"}

        @app.get("/metrics")
        async def prometheus():
            return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

        if options.ui:
            from .web import mount_chat_page

            mount_chat_page(app)
        return app

    def describe(self) -> dict[str, Any]:
        """What the start-up log line says: the model, the machine side and the limits."""
        engine, kv = self.engine, self.loop.scheduler.kv
        try:
            block_bytes = int(engine.lib.ife_kv_block_bytes())
        except AttributeError:
            block_bytes = 0
        opts = self.options
        return {"model": self.model_name, "artifact": str(engine.path), "target": engine.manifest.get("target"),
                "threads": getattr(engine, "threads", None), "kv_blocks": kv.n_blocks,
                "kv_bytes": kv.n_blocks * block_bytes, "max_seqs": kv.max_seqs,
                "max_context": self.loop.scheduler.max_context, "max_queue": self.loop.scheduler.max_waiting,
                "adapters": ",".join(self.loop.adapters.served) or "-", "host": opts.host, "port": opts.port,
                "api_key": "on" if opts.api_key else "off",
                "adapter_roots": len(self.adapter_roots.roots), "max_request_bytes": opts.max_request_bytes,
                "chat_page": opts.page_url() if opts.ui else "off"}

    def _models(self) -> list[dict[str, Any]]:
        entries = [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "infeng",
                    "root": self.model_name, "parent": None}]
        for name in list(self.loop.adapters.served):
            entries.append({"id": name, "object": "model", "created": self.created, "owned_by": "infeng",
                            "root": name, "parent": self.model_name})
        return entries

    def _adapter_of(self, model: str) -> str | None:
        if model == self.model_name:
            return None
        if model in self.loop.adapters.served:
            return model
        raise APIError(404, f"the model {model!r} does not exist (serving: "
                       f"{', '.join(e['id'] for e in self._models())})", "not_found_error", "model", "model_not_found")

    # -- life cycle ---------------------------------------------------------------------------
    def _admitting(self) -> None:
        """Raise 503 unless new work is accepted (the engine loop is up, no shutdown under way)."""
        if self.loop.error is not None:
            raise _unavailable(f"the engine loop failed ({self.loop.error}); the server is exiting", "engine_stopped")
        if self.draining:
            raise _unavailable(f"{SHUTTING_DOWN} and accepts no new requests", "shutting_down")

    def _note_exit(self, code: int) -> None:
        if self.exit_code is None:
            self.exit_code = code

    def _on_fatal(self, error: BaseException) -> None:
        """The engine loop died (called on its thread, after every request in flight got an error)."""
        event_loop = self.event_loop
        if event_loop is not None and not event_loop.is_closed():
            event_loop.call_soon_threadsafe(self._fatal, error)

    def _fatal(self, error: BaseException) -> None:
        LOGGER.error("engine loop failed; exiting", extra={"fields": {"error": f"{type(error).__name__}: {error}"}})
        self.request_exit(1)

    async def shutdown(self, timeout: float) -> None:
        """Stop admission, let the requests in flight finish for ``timeout`` seconds, end the rest
        (their clients get an error: an SSE error event then ``[DONE]``, or 503), then
        ``request_exit(0)``."""
        if self.draining:
            return
        self.draining = True
        clock = asyncio.get_running_loop().time
        LOGGER.info("shutting down", extra={"fields": {"in_flight": self.in_flight.count, "timeout_s": timeout}})
        deadline = clock() + timeout
        while self.in_flight.count and clock() < deadline:
            await asyncio.sleep(0.05)
        with self.loop.lock:
            left = list(self.loop.scheduler.requests)
        self.ending.set()                         # requests still preparing their prompt: 503 now
        if left:
            LOGGER.warning("ending requests at the shutdown timeout", extra={"fields": {"requests": len(left)}})
            for rid in left:
                self.loop.abort(rid, error=f"{SHUTTING_DOWN}: the request did not finish within the shutdown "
                                           f"timeout ({timeout:g} s)")
            deadline = clock() + 5.0              # their handlers answer at once; let them write it
            while self.in_flight.count and clock() < deadline:
                await asyncio.sleep(0.02)
        self.request_exit(0)

    # -- shared request plumbing -----------------------------------------------------------------
    def _params(self, body: _Body, max_tokens: int | None, default_max: int) -> SamplingParams:
        if body.presence_penalty or body.frequency_penalty:
            raise APIError(400, "presence_penalty and frequency_penalty are not supported", param="presence_penalty")
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stop):
            raise APIError(400, f"a stop string may have at most {MAX_STOP_CHARS} characters", param="stop")
        try:
            return SamplingParams(max_new_tokens=default_max if max_tokens is None else max_tokens,
                                  temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                                  stop=tuple(stop), ignore_eos=body.ignore_eos, speculative=body.speculative)
        except InfengError as e:
            raise APIError(400, str(e)) from None

    def _check_sequences(self, count: int) -> None:
        """A request of ``count`` sequences (n x prompts) must fit in the admission queue at all."""
        bound = self.loop.scheduler.max_waiting
        if count > bound:
            raise APIError(400, f"the request asks for {count} sequences (n x prompts); this server queues at most "
                                f"{bound} (--max-queue), so it could never be admitted", param="n")

    def _check_chars(self, chars: int, param: str, subject: str = "the prompt has") -> None:
        if chars > self.max_prompt_chars:
            context = self.loop.scheduler.max_context
            raise APIError(400, f"{subject} {chars} characters; this model's context is {context} tokens, "
                                f"which no prompt longer than {self.max_prompt_chars} characters fits in",
                           param=param, code="context_length_exceeded")

    @staticmethod
    def _check_unsupported(body: BaseModel) -> None:
        """400 naming a field of OpenAI's API that this server does not implement."""
        extra = body.model_extra or {}
        for name in UNSUPPORTED_FIELDS:
            value = extra.get(name)
            if value is None or (name == "store" and value is False) or (name == "modalities" and value == ["text"]):
                continue
            raise APIError(400, f"{name} is not supported by this server", param=name)

    @staticmethod
    def _grammar_spec(body: _Body) -> GrammarSpec | None:
        """The request's constraint: ``response_format``, ``structured_outputs`` or ``guided_*``
        (at most one of them)."""
        specs: list[GrammarSpec] = []
        rf = body.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                specs.append(GrammarSpec("json_object", None, "response_format"))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict):
                    raise APIError(400, "response_format.json_schema must be an object with a schema",
                                   param="response_format.json_schema")
                schema = js.get("schema", js.get("json_schema", {}))
                specs.append(GrammarSpec("json", schema if schema is not None else {}, "response_format.json_schema"))
            elif kind not in ("text", None):
                raise APIError(400, f"response_format type {kind!r} is not supported (text, json_object, "
                                    f"json_schema)", param="response_format.type")
        so = body.structured_outputs
        if so is not None:
            for key, value in so.items():
                if key in STRUCTURED_OPTIONS:
                    continue
                if key not in STRUCTURED_KINDS:
                    raise APIError(400, f"structured_outputs.{key} is not supported (json, regex, choice, grammar, "
                                        f"json_object)", param=f"structured_outputs.{key}")
                if value is None or (key == "json_object" and value is False):
                    continue
                specs.append(GrammarSpec(STRUCTURED_KINDS[key], None if key == "json_object" else value,
                                         f"structured_outputs.{key}"))
        for key, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            value = getattr(body, key)
            if value is not None:
                specs.append(GrammarSpec(kind, value, key))
        for i, spec in enumerate(specs):
            if spec.kind == "json" and isinstance(spec.value, str):   # a schema sent as JSON text
                try:
                    specs[i] = GrammarSpec("json", loads(spec.value), spec.param)
                except JSONRejected as e:
                    raise APIError(400, f"{spec.param}: the schema {e}", param=spec.param) from None
        if len(specs) > 1:
            raise APIError(400, f"give one output constraint, not {specs[0].param} and {specs[1].param}",
                           param=specs[1].param)
        return specs[0] if specs else None

    async def _constraints(self, spec: GrammarSpec | None, n: int, prompts: int) -> list | None:
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
            release = await self._share(self.grammar_shares)
            compiled = asyncio.wrap_future(self.grammar_pool.submit(self.grammars.grammar, spec))
            compiled.add_done_callback(lambda _: release())
            await self._until_ending(compiled)
            return [await self._text_work(self.grammars.constraint, spec, n) for _ in range(prompts)]
        except GrammarBusy as e:
            raise _unavailable(str(e), "grammar_compilers_busy") from None
        except GrammarError as e:
            raise APIError(400, str(e), param=e.param, code=e.code) from None

    async def _until_ending(self, work: asyncio.Future) -> Any:
        """``work``'s result, or 503 if the shutdown ends what is left first (the work is left behind)."""
        ending = asyncio.ensure_future(self.ending.wait())
        try:
            await asyncio.wait({work, ending}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ending.cancel()
        if not work.done() or work.cancelled():
            raise _unavailable(f"{SHUTTING_DOWN}; the request was not started", "shutting_down")
        return work.result()

    async def _share(self, shares: ClientShares) -> Callable[[], None]:
        """The release of this client's turn in ``shares``, or 503 if the shutdown comes first. A
        request that gives up waiting (the client left, the shutdown) gives the turn back: its wait
        is cancelled, or the turn it already took released."""
        waiting = asyncio.ensure_future(shares.acquire(CLIENT.get()))
        try:
            return await self._until_ending(waiting)
        except BaseException:
            if not waiting.done():
                waiting.cancel()
            elif not waiting.cancelled() and waiting.exception() is None:
                waiting.result()()
            raise

    async def _text_work(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the text thread pool, within ``TEXT_WORK_SECONDS`` from when it starts
        running (time spent waiting behind other requests' work is not held against it); one job
        per client at a time (a job past its budget holds its client's turn until its thread is done)."""
        if self.text_waiting >= TEXT_QUEUE_BOUND:
            raise _unavailable("the server is busy preparing other prompts; retry shortly", "text_queue_full")
        event_loop = asyncio.get_running_loop()
        began = asyncio.Event()

        def run() -> Any:
            event_loop.call_soon_threadsafe(began.set)
            return fn(*args)

        self.text_waiting += 1
        try:
            release = await self._share(self.text_shares)
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
                raise _unavailable(f"{SHUTTING_DOWN}; the request was not started", "shutting_down")
        finally:
            self.text_waiting -= 1
        try:
            return await asyncio.wait_for(self._until_ending(done), TEXT_WORK_SECONDS)
        except asyncio.TimeoutError:
            raise APIError(400, f"preparing the prompt (chat template, tokenizer) took longer than "
                                f"{TEXT_WORK_SECONDS:g} s; the request was dropped",
                           code="prompt_too_expensive") from None

    def _submit(self, prompts: list[list[int]], params: list[SamplingParams], n: int, adapter: str | None,
                priority: int, logprobs: int | None, prefix: str, grammars: list | None = None) -> _Pending:
        self._admitting()
        pending = _Pending(asyncio.Queue(), time.monotonic())
        requests = []
        for p_index, (ids, p) in enumerate(zip(prompts, params)):
            rid = f"{prefix}-{p_index}"
            req = Request(rid, ids, p, n=n, adapter=adapter, priority=priority, logprobs=logprobs, sink=self.sink,
                          context=pending.queue, grammar=grammars[p_index] if grammars else None,
                          client=CLIENT.get())
            try:
                self.loop.scheduler.check(req)
            except RequestError as e:
                raise _from_request_error(e) from None
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
                raise _unavailable(str(e), "engine_stopped") from None
            raise (_queue_full(e) if isinstance(e, QueueFull) else _from_request_error(e)) from None
        for p_index, req in enumerate(requests):
            for i in range(n):
                pending.choices[(req.request_id, i)] = p_index * n + i
            pending.prompt_tokens += len(req.prompt_ids) * n
        return pending

    def _abort_all(self, pending: _Pending) -> None:
        for rid in {rid for rid, _ in pending.choices}:
            self.loop.abort(rid)

    async def _events(self, pending: _Pending, texts: list[ChoiceText], http: HTTPRequest | None,
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
                self._abort_all(pending)

    async def _guarded(self, chunks: AsyncIterator[str], pending: _Pending, texts: list[ChoiceText],
                       record: RequestRecord) -> AsyncIterator[str]:
        """The SSE chunks; a client that goes away mid-stream has its request aborted at once, and
        an unexpected error ends the stream with an error event and ``[DONE]``."""
        failed = False
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as e:
            failed = True
            record.error = f"{type(e).__name__}: {e}"
            LOGGER.exception("unhandled error in a stream", extra={"fields": {"id": record.request_id}})
            yield _sse({"error": APIError(500, f"internal server error (request id {record.request_id}); it has "
                                               f"been logged", "server_error", code="internal_error").body()["error"]})
            yield "data: [DONE]\n\n"
        finally:
            if not all(t.done for t in texts):
                self._abort_all(pending)
                record.disconnected = not failed

    @staticmethod
    def _usage(pending: _Pending, texts: list[ChoiceText]) -> dict[str, Any]:
        completion = sum(len(t.token_ids) for t in texts)
        return {"prompt_tokens": pending.prompt_tokens, "completion_tokens": completion,
                "total_tokens": pending.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(t.cached_tokens for t in texts)}}

    @staticmethod
    def _finish_reason(text: ChoiceText) -> str:
        return text.finish_reason if text.finish_reason in ("stop", "length") else (text.finish_reason or "abort")

    def _failure(self, finish_reason: str | None, error: str | None) -> APIError | None:
        """The error a choice that ended this way gives its client: 500 when its sequence failed
        alone, 503 when the engine loop died or the server ended it at shutdown."""
        if finish_reason == "error":
            if error and error.startswith(CONSTRAINT_FAILED):     # the request's grammar, not the server
                return APIError(400, error, code="grammar_too_expensive")
            if self.loop.error is not None:
                return _unavailable(error or f"the engine loop failed: {self.loop.error}", "engine_stopped")
            return APIError(500, f"generation failed: {error}", "server_error", code="engine_error")
        if finish_reason == "abort" and error:
            return _unavailable(error, "shutting_down")
        return None

    def _check_errors(self, texts: list[ChoiceText], record: RequestRecord) -> None:
        for t in texts:
            failure = self._failure(t.finish_reason, t.error)
            if failure is not None:
                record.error = failure.message
                raise failure

    def _error_event(self, delta: Delta, record: RequestRecord) -> str | None:
        failure = self._failure(delta.finish_reason, delta.error)
        if failure is None:
            return None
        record.error = failure.message
        return _sse({"error": failure.body()["error"]})

    # -- /v1/completions ----------------------------------------------------------------------
    async def completions(self, http: HTTPRequest):
        record = _record(http)
        self._admitting()
        body: CompletionBody = _parse(CompletionBody, await http.body())
        record.model = body.model
        adapter = record.adapter = self._adapter_of(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of must equal n", param="best_of")
        self._check_unsupported(body)
        params = self._params(body, body.max_tokens, 16)
        spec = self._grammar_spec(body)
        prompts = await self._completion_prompts(body.prompt, body.n)
        grammars = await self._constraints(spec, body.n, len(prompts))
        rid = f"cmpl-{record.request_id}"
        pending = self._submit(prompts, [params] * len(prompts), body.n, adapter, body.priority, body.logprobs, rid,
                               grammars)
        stops = params.stop
        texts = [ChoiceText(self.tokenizer, prompts[c // body.n], stops, body.logprobs is not None)
                 for c in range(len(prompts) * body.n)]
        created = int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": body.model}
        if body.stream:
            include_usage = self.options.always_include_usage or bool((body.stream_options or {}).get("include_usage"))

            async def sse():
                errors_sent: set[str] = set()
                async for batch in self._events(pending, texts, None, record):
                    for c, delta in batch:
                        event = self._error_event(delta, record)
                        if event is not None:
                            if event not in errors_sent:             # once, not once per choice
                                errors_sent.add(event)
                                yield event
                            continue
                        choice = {"index": c, "text": delta.text,
                                  "logprobs": self._completion_logprobs(delta.logprobs, body.logprobs)
                                  if body.logprobs is not None else None,
                                  "finish_reason": self._finish_reason(texts[c]) if delta.finish_reason else None}
                        yield _sse({**base, "choices": [choice]})
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": self._usage(pending, texts)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(self._guarded(sse(), pending, texts, record), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async for _ in self._events(pending, texts, http, record):
            pass
        if not all(t.done for t in texts):
            return Response(status_code=499)
        self._check_errors(texts, record)
        choices = [{"index": c, "text": t.text,
                    "logprobs": self._completion_logprobs(t.entries, body.logprobs) if body.logprobs is not None
                    else None, "finish_reason": self._finish_reason(t)} for c, t in enumerate(texts)]
        return {**base, "choices": choices, "usage": self._usage(pending, texts)}

    async def _completion_prompts(self, prompt: Any, n: int) -> list[list[int]]:
        """Token ids of each prompt; text is bounded by characters first, then tokenized off the
        event loop thread."""
        texts: list[str] = []
        if isinstance(prompt, str):
            texts = [prompt]
        elif prompt and all(isinstance(p, str) for p in prompt):
            texts = list(prompt)
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        elif prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            raise APIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")
        self._check_sequences(n * len(texts or prompts))
        if texts:
            for text in texts:
                self._check_chars(len(text), "prompt")
            return await self._text_work(self.tokenizer.encode_batch, texts, None)   # releases the GIL
        vocab, context = self.engine.vocab_size, self.loop.scheduler.max_context
        for ids in prompts:
            if len(ids) > context:
                raise APIError(400, f"this model's context is {context} tokens; the prompt has {len(ids)}",
                               param="prompt", code="context_length_exceeded")
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return prompts

    def _completion_logprobs(self, entries, k: int | None) -> dict[str, Any]:
        tt = self.token_texts
        return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{tt(t): lp for t, lp in (e.top or [])} for e in entries] if k else None,
                "text_offset": [e.offset for e in entries]}

    # -- /v1/chat/completions -----------------------------------------------------------------
    async def chat(self, http: HTTPRequest):
        record = _record(http)
        self._admitting()
        body: ChatBody = _parse(ChatBody, await http.body())
        record.model = body.model
        adapter = record.adapter = self._adapter_of(body.model)
        self._check_sequences(body.n)
        self._check_unsupported(body)
        ids, params, grammars, mode, named = await self.prepare_chat(body)
        k = (body.top_logprobs or 0) if body.logprobs else None
        rid = f"chatcmpl-{record.request_id}"
        pending = self._submit([ids], [params], body.n, adapter, body.priority, k, rid, grammars)
        texts = [ChoiceText(self.tokenizer, ids, params.stop, body.logprobs) for _ in range(body.n)]
        base = {"id": rid, "object": "chat.completion.chunk" if body.stream else "chat.completion",
                "created": int(time.time()), "model": body.model}
        single_call = body.parallel_tool_calls is False
        if body.stream:
            include_usage = self.options.always_include_usage or bool((body.stream_options or {}).get("include_usage"))
            streams = [ToolStream(named, forced=mode == "required") if mode != "none" else None
                       for _ in range(body.n)]

            async def sse():
                errors_sent: set[str] = set()
                for c in range(body.n):
                    yield _sse({**base, "choices": [{"index": c, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]})
                async for batch in self._events(pending, texts, None, record):
                    for c, delta in batch:
                        event = self._error_event(delta, record)
                        if event is not None:
                            if event not in errors_sent:             # once, not once per choice
                                errors_sent.add(event)
                                yield event
                            continue
                        lp = {"content": self._chat_logprobs(delta.logprobs)} if body.logprobs else None
                        stream = streams[c]
                        if stream is None:
                            deltas = [{"content": delta.text}] if delta.text else []
                        else:
                            events = stream.push(delta.text) if delta.text else []
                            if delta.finish_reason:
                                events += stream.finish()
                            deltas = _tool_deltas(stream, events, single_call)
                        if lp is not None and delta.logprobs and not deltas:
                            deltas = [{}]
                        for d in deltas:
                            yield _sse({**base, "choices": [{"index": c, "delta": d, "logprobs": lp,
                                                             "finish_reason": None}]})
                            lp = None
                        if delta.finish_reason:
                            reason = self._finish_reason(texts[c])
                            if stream is not None and stream.calls and reason == "stop" and mode != "named":
                                reason = "tool_calls"
                            yield _sse({**base, "choices": [{"index": c, "delta": {}, "logprobs": None,
                                                             "finish_reason": reason}]})
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": self._usage(pending, texts)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(self._guarded(sse(), pending, texts, record), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async for _ in self._events(pending, texts, http, record):
            pass
        if not all(t.done for t in texts):
            return Response(status_code=499)
        self._check_errors(texts, record)
        choices = []
        for c, t in enumerate(texts):
            message, reason = self._assistant_message(t, mode, named, single_call)
            choices.append({"index": c, "message": message,
                            "logprobs": {"content": self._chat_logprobs(t.entries)} if body.logprobs else None,
                            "finish_reason": reason})
        return {**base, "choices": choices, "usage": self._usage(pending, texts)}

    async def prepare_chat(self, body: ChatBody) -> tuple[list[int], SamplingParams, list | None, str, str | None]:
        """A chat request made ready to submit (also the Responses API's, responses.py): the
        prompt's ids, the sampling parameters, the grammar constraints (or None), the tool mode
        (none, auto, required, named) and the named function."""
        template, kwargs = self._template_args(body.chat_template, body.chat_template_kwargs)
        tools, mode, named = self._tool_choice(body)
        spec = self._grammar_spec(body)
        if mode in ("required", "named"):
            if spec is not None:
                raise APIError(400, f"tool_choice {mode!r} and {spec.param} both constrain the output; give one",
                               param="tool_choice")
            spec = tool_call_grammar(tools, named)
        messages = [self._message(m, i) for i, m in enumerate(body.messages)]
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            ids = await self._text_work(self._render, messages, body.add_generation_prompt, template, kwargs,
                                        tools if mode != "none" else None)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        kv = self.loop.scheduler.kv
        room = max(1, min(self.loop.scheduler.max_context, kv.n_blocks * kv.block_size) - len(ids))
        params = self._params(body, max_tokens, room)
        grammars = await self._constraints(spec, body.n, 1)
        return ids, params, grammars, mode, named

    def _template_args(self, chat_template: str | None, template_kwargs: dict[str, Any] | None
                       ) -> tuple[str | None, dict[str, Any]]:
        """A request's chat template (only with --trust-request-chat-template) and extra variables."""
        kwargs = dict(template_kwargs or {})
        template = chat_template if chat_template is not None else kwargs.pop("template", None)
        if template is not None:
            param = "chat_template" if chat_template is not None else "chat_template_kwargs.template"
            if not self.options.trust_request_chat_template:
                raise APIError(400, "this server does not run chat templates sent by clients (start it with "
                                    "--trust-request-chat-template to allow them)", param=param)
            if not isinstance(template, str):
                raise APIError(400, "a chat template must be a string", param=param)
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise APIError(400, f"chat_template_kwargs cannot set {', '.join(reserved)}: the server renders those "
                                f"itself", param="chat_template_kwargs")
        return template, kwargs

    @staticmethod
    def _tool_choice(body: ChatBody) -> tuple[list[dict[str, Any]] | None, str, str | None]:
        """(tools, mode, name): mode is none, auto, required or named (name: the function)."""
        tools = body.tools or None
        for i, tool in enumerate(tools or ()):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if tool.get("type", "function") != "function" or not isinstance(fn, dict):
                raise APIError(400, "only function tools are supported: {\"type\": \"function\", \"function\": "
                                    "{\"name\": ..., \"parameters\": ...}}", param=f"tools.{i}")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise APIError(400, "a function needs a name", param=f"tools.{i}.function.name")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise APIError(400, "a function's parameters must be a JSON schema object",
                               param=f"tools.{i}.function.parameters")
        choice, named = body.tool_choice, None
        if choice is None:
            mode = "auto" if tools else "none"
        elif isinstance(choice, str):
            if choice not in TOOL_CHOICES:
                raise APIError(400, f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function",
                               param="tool_choice")
            mode = choice
        else:
            fn = choice.get("function")
            if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(400, "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                               param="tool_choice")
            mode, named = "named", fn["name"]
        if mode != "none" and not tools:
            raise APIError(400, f"tool_choice {choice if isinstance(choice, str) else 'named'!r} needs tools",
                           param="tool_choice")
        if named is not None and named not in {t["function"]["name"] for t in tools}:
            raise APIError(400, f"tool_choice names {named!r}, which is not among the tools", param="tool_choice")
        return tools, mode, named

    def _assistant_message(self, text: ChoiceText, mode: str, named: str | None,
                           single_call: bool) -> tuple[dict[str, Any], str]:
        """The non-streamed ``message`` of a choice and its finish reason, tool calls parsed."""
        reason = self._finish_reason(text)
        if mode == "none":
            return {"role": "assistant", "content": text.text}, reason
        if mode == "auto":
            content, calls = parse_tool_calls(text.text)
        else:
            content, calls = None, parse_forced(text.text, named)
        calls = calls[:1] if single_call else calls
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
            if reason == "stop" and mode != "named":
                reason = "tool_calls"
        return message, reason

    def _message(self, message: ChatMessage, index: int) -> dict[str, Any]:
        """A message as the template sees it: content parts joined, ``content: null`` (an
        assistant turn that only calls tools) as empty text."""
        if isinstance(message.content, list):
            for part in message.content:
                kind = part.get("type", "text")
                if kind != "text":
                    raise APIError(400, f"{kind!r} content parts are not supported (text only)",
                                   param=f"messages.{index}.content")
                if not isinstance(part.get("text", ""), str):
                    raise APIError(400, "a text content part's text must be a string",
                                   param=f"messages.{index}.content")
        out = message.model_dump(exclude_none=True)
        out["content"] = message_text(message.content) if message.content is not None else ""
        calls = out.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      for c in calls):
                raise APIError(400, "tool_calls must be a list of {\"id\", \"type\": \"function\", \"function\": "
                                    "{\"name\", \"arguments\"}}", param=f"messages.{index}.tool_calls")
        return out

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, template: str | None,
                kwargs: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's token ids (on a text worker thread). The messages and tools, then the
        rendered text, must fit ``max_prompt_chars`` before anything costly runs on them."""
        if tools:
            chars = sum(len(m["content"]) for m in messages) + len(json.dumps(tools, ensure_ascii=False))
            self._check_chars(chars, "tools", "the messages and tools have")
        try:
            if template_knows_tools(template_source(self.tokenizer, template)):
                messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": arguments_object(
                    c["function"].get("arguments"))}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
                    for m in messages]
                text = render_chat(self.tokenizer, messages, add_generation_prompt, template=template, tools=tools,
                                   **kwargs)
            else:
                text = render_chat(self.tokenizer, hermes_messages(messages, tools), add_generation_prompt,
                                   template=template, **kwargs)
        except ChatTemplateError:
            raise
        except Exception as e:                      # a template that trips over these messages' values
            raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
        self._check_chars(len(text), "messages", "the rendered prompt has")
        return self.tokenizer.encode_batch([text], False)[0]

    def _chat_logprobs(self, entries) -> list[dict[str, Any]]:
        tt = self.token_texts
        return [{"token": e.text, "logprob": e.logprob, "bytes": list(e.text.encode()),
                 "top_logprobs": [{"token": tt(t), "logprob": lp, "bytes": list(tt(t).encode())}
                                  for t, lp in (e.top or [])]} for e in entries]

    # -- /tokenize, /detokenize ----------------------------------------------------------------
    async def tokenize(self, http: HTTPRequest):
        """vLLM's /tokenize: the ids the engine would get for a prompt or for chat messages."""
        self._admitting()
        body: TokenizeBody = _parse(TokenizeBody, await http.body())
        if body.model is not None:
            self._adapter_of(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            template, kwargs = self._template_args(None, body.chat_template_kwargs)
            messages = [self._message(m, i) for i, m in enumerate(body.messages)]
            self._check_chars(sum(len(m["content"]) for m in messages), "messages")
            try:
                ids = await self._text_work(self._render, messages, body.add_generation_prompt, template, kwargs,
                                            body.tools)
            except ChatTemplateError as e:
                raise APIError(400, str(e), param="messages") from None
        else:
            self._check_chars(len(body.prompt), "prompt")
            ids = (await self._text_work(self.tokenizer.encode_batch, [body.prompt],
                                         None if body.add_special_tokens else False))[0]
        out = {"count": len(ids), "max_model_len": self.loop.scheduler.max_context, "tokens": ids,
               "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = [self.tokenizer.hf.id_to_token(t) for t in ids]
        return out

    async def detokenize(self, http: HTTPRequest):
        """vLLM's /detokenize: the text of token ids (at most the model's context of them). The
        body is parsed, checked and decoded on a text thread: a body of a million ids takes the
        parser a tenth of a second, which the event loop must not spend."""
        self._admitting()
        body: DetokenizeBody = await self._text_work(self._detokenize_body, await http.body())
        if body.model is not None:
            self._adapter_of(body.model)
        return {"prompt": await self._text_work(self.tokenizer.decode, body.tokens, False)}

    def _detokenize_body(self, raw: bytes) -> DetokenizeBody:
        """A /detokenize body, its ids bounded and in the vocabulary (on a text thread)."""
        body: DetokenizeBody = _parse(DetokenizeBody, raw)
        limit = self.loop.scheduler.max_context
        if len(body.tokens) > limit:
            raise APIError(400, f"at most {limit} token ids (the model's context, --max-context), got "
                                f"{len(body.tokens)}", param="tokens")
        vocab = self.engine.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return body

    # -- adapters -----------------------------------------------------------------------------
    async def load_adapter(self, http: HTTPRequest):
        record = _record(http)
        if not self.adapter_roots:
            raise APIError(403, "this server does not load adapters at runtime (start it with --adapter-root DIR "
                                "to allow adapter directories under DIR)", param="path", code="adapter_loads_disabled")
        self._admitting()
        body: AdapterBody = _parse(AdapterBody, await http.body())
        name, given = body.name or body.lora_name, body.path or body.lora_path
        if not name or not given:
            raise APIError(400, "give the adapter's name and path: {\"name\": ..., \"path\": ...}",
                           param="name" if not name else "path")
        record.model = record.adapter = name
        if len(name) > MAX_ADAPTER_NAME or not name.isprintable() or any(c.isspace() or c == "/" for c in name):
            raise APIError(400, f"an adapter name has at most {MAX_ADAPTER_NAME} printable characters, no spaces "
                                f"and no '/'", param="name")
        if name == self.model_name:
            raise APIError(400, f"{name!r} is the base model's name", param="name")
        copies: list[Path] = []

        def load_from_a_copy() -> int:           # copies files: off the event loop
            with self.adapter_roots.snapshot(given) as path:     # a private copy of the files checked
                copies.append(path)
                return self.loop.load_adapter(name, path, body.scale).result()

        try:
            slot = await asyncio.to_thread(load_from_a_copy)
        except APIError:
            raise
        except InfengError as e:
            message = str(e)
            for path in copies:
                message = message.replace(str(path), given)
            raise APIError(400, message, param="path", code="adapter_load_failed") from None
        except Exception as e:                      # a file the readers choke on (safetensors, OS errors)
            raise APIError(400, f"the adapter at {given!r} cannot be read ({type(e).__name__})", param="path",
                           code="adapter_load_failed") from None
        return {"id": name, "object": "model", "parent": self.model_name, "root": name, "slot": slot}

    async def unload_adapter(self, name: str):
        if name not in self.loop.adapters.served:
            raise APIError(404, f"no adapter named {name!r} is loaded", "not_found_error", "name", "model_not_found")
        try:
            await asyncio.wrap_future(self.loop.unload_adapter(name))
        except InfengError as e:
            raise APIError(404, str(e), "not_found_error", "name", "model_not_found") from None
        return {"id": name, "object": "model", "deleted": True}


class _CountRequests:
    """Counts /v1/ requests by endpoint and status, and the clients with one in flight (plain ASGI:
    a BaseHTTPMiddleware would hide client disconnects from the handlers)."""

    def __init__(self, app, metrics: ServerMetrics, clients: ClientsInFlight):
        self.app, self.metrics, self.clients = app, metrics, clients

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        client = (scope.get("client") or ("",))[0]
        CLIENT.set(client)                                    # fair shares are per peer address
        with self.clients.request(client):
            await self._count(scope, receive, send)

    async def _count(self, scope, receive, send):
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(_endpoint(scope["path"]), str(status[0])).inc()


def _tool_deltas(stream: ToolStream, events: list[tuple[str, Any]], single_call: bool) -> list[dict[str, Any]]:
    """Chat ``delta`` objects for a choice's tool-stream events, as OpenAI streams them: content
    text, a call's id, name and arguments, then (for a named function) more arguments."""
    deltas: list[dict[str, Any]] = []
    for kind, value in events:
        if kind == "content":
            if value:
                deltas.append({"content": value})
            continue
        index = 0 if kind == "arguments" else next(i for i, c in enumerate(stream.calls) if c is value)
        if single_call and index > 0:
            continue
        if kind == "arguments":
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": value}}]})
        else:
            call: ToolCall = value                  # a named call's arguments follow in pieces
            deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function", "function": {
                "name": call.name, "arguments": "" if kind == "call_start" else call.arguments}}]})
    return deltas


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("infeng")
    except Exception:                              # not installed as a distribution
        return "0+unknown"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _endpoint(path: str) -> str:
    for prefix in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/adapters"):
        if path.startswith(prefix):
            return prefix
    return "other"


# -- entry point --------------------------------------------------------------------------------
@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    threads: int = 0
    max_seqs: int = 16
    max_context: int | None = None
    kv_memory: int | None = None
    max_waiting: int = 256
    max_batched_tokens: int | None = None
    prefix_cache: bool = True
    served_model_name: str | None = None
    adapters: dict[str, Path] = field(default_factory=dict)
    log_level: str = "info"
    log_format: str = "text"
    api_key: str | None = None
    adapter_roots: list[Path] = field(default_factory=list)
    trust_request_chat_template: bool = False
    max_request_bytes: int = 4 * 2 ** 20
    shutdown_timeout: float = 30.0
    speculative: SpeculativeConfig | None = None   # drafting for every request that does not say false
    always_include_usage: bool = False             # vLLM's --enable-force-include-usage
    grammar_timeout: float = GrammarLimits.compile_seconds
    grammar_mask_timeout: float = GrammarLimits.mask_seconds
    max_grammar_bytes: int = GrammarLimits.max_bytes
    prefix_cache_dir: Path | None = None           # warm restarts: prefix_store.py
    warmup: bool = False                           # one step of every shape before the port opens
    ui: bool = True                                # the chat page at / (--no-ui: the API alone)

    def page_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(max_bytes=self.max_grammar_bytes, compile_seconds=self.grammar_timeout,
                             mask_seconds=self.grammar_mask_timeout)

    def check(self) -> None:
        """Raise InfengError (one line, naming the flag) for a value out of range."""
        ranges = [("--port", self.port, 1, 65535), ("--threads", self.threads, 0, None),
                  ("--max-seqs", self.max_seqs, 1, None), ("--max-context", self.max_context, 1, None),
                  ("--max-queue", self.max_waiting, 1, None),
                  ("--max-batched-tokens", self.max_batched_tokens, 1, None),
                  ("--max-request-bytes", self.max_request_bytes, 1024, None),
                  ("--shutdown-timeout", self.shutdown_timeout, 0, None),
                  ("--grammar-timeout", self.grammar_timeout, 0.1, 600),
                  ("--grammar-mask-timeout", self.grammar_mask_timeout, 0.1, 600),
                  ("--max-grammar-bytes", self.max_grammar_bytes, 16, 2 ** 26)]
        for flag, value, low, high in ranges:
            if value is None:
                continue
            if not math.isfinite(value) or value < low or (high is not None and value > high):
                bound = f"between {low} and {high}" if high is not None else f"at least {low}"
                raise InfengError(f"{flag} {value}: must be {bound}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise InfengError(f"--log-level {self.log_level}: must be one of {', '.join(LOG_LEVELS)}")
        if self.log_format not in LOG_FORMATS:
            raise InfengError(f"--log-format {self.log_format}: must be one of {', '.join(LOG_FORMATS)}")
        if self.api_key is not None and not self.api_key.strip():
            raise InfengError("--api-key (or INFENG_API_KEY) is empty")
        AdapterRoots(self.adapter_roots)
        if self.prefix_cache_dir is not None and not self.prefix_cache:
            raise InfengError("--prefix-cache-dir needs the prefix cache (drop --no-prefix-cache)")


def build_server(artifact: str | Path, options: ServeOptions) -> Server:
    """Load the artifact and its adapters; every problem raises InfengError before anything listens."""
    from .engine import Engine

    options.check()
    engine = Engine(artifact, threads=options.threads, max_seqs=options.max_seqs, max_context=options.max_context,
                    kv_memory=options.kv_memory)
    if engine.tokenizer is None:
        raise InfengError(f"{artifact}: the artifact has no tokenizer.json; it cannot be served")
    loop = EngineLoop(engine, max_batched_tokens=options.max_batched_tokens, max_waiting=options.max_waiting,
                      prefix_cache=options.prefix_cache, speculative=options.speculative)
    for name, path in options.adapters.items():
        loop.load_adapter(name, path).result()
    return Server(loop, options.served_model_name or engine.manifest.get("name") or Path(artifact).name, options)


def serve(artifact: str | Path, options: ServeOptions) -> None:
    """Run the server until SIGTERM/SIGINT (drained, exit 0) or until the engine loop dies (exit 1)."""
    options.check()
    configure_logging(options.log_level, options.log_format)
    listener = bind_listener(options.host, options.port)
    server = build_server(artifact, options)
    warm_start(server.engine, options.warmup, options.prefix_cache_dir)
    config = uvicorn.Config(server.app, host=options.host, port=options.port, log_level=options.log_level,
                            log_config=None, access_log=False, timeout_graceful_shutdown=GRACEFUL_SECONDS)
    runner = _UvicornServer(config, server)
    if options.ui and options.log_format == "text":
        print(f"chat page: {options.page_url()}", file=sys.stderr, flush=True)

    def request_exit(code: int) -> None:
        if server.exit_code is None:
            server.exit_code = code
            if code:                              # the engine loop died: no drain, but a stuck thread
                exit_after(GRACEFUL_SECONDS + SHUTDOWN_GRACE_SECONDS, lambda: server.exit_code)   # must not hold us
        runner.should_exit = True

    server.request_exit = request_exit
    runner.run(sockets=[listener])
    if server.exit_code:
        raise SystemExit(server.exit_code)
    if options.prefix_cache_dir is not None:
        save_on_exit(server.engine, options.prefix_cache_dir)


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the artifact loads, so an address in use (or one this host
    does not have) is one line and exit 2 at once rather than uvicorn's exit 1 after the load."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise InfengError(f"--host {host}: {e.strerror or e}") from None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
    except OSError as e:
        listener.close()
        raise InfengError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return listener


class _UvicornServer(uvicorn.Server):
    """uvicorn's server with this shutdown: the first SIGTERM/SIGINT starts ``Server.shutdown``
    (drain, then exit 0); a second one exits at once (code 1). The signals are not re-raised after
    serving, as uvicorn would, so a drained server exits 0 rather than by the signal."""

    def __init__(self, config: uvicorn.Config, api: Server):
        super().__init__(config)
        self.api = api
        self.signalled = False

    def handle_exit(self, sig, frame) -> None:
        event_loop = self.api.event_loop
        if self.signalled or event_loop is None:
            if self.signalled:
                self.api._note_exit(1)
                self.force_exit = True
            self.should_exit = True
            return
        self.signalled = True
        timeout = self.api.options.shutdown_timeout
        exit_after(timeout + SHUTDOWN_GRACE_SECONDS, lambda: self.api.exit_code)
        event_loop.call_soon_threadsafe(lambda: event_loop.create_task(self.api.shutdown(timeout)))
