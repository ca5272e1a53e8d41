"""``infeng serve``: the OpenAI HTTP API over one EngineLoop (FastAPI + uvicorn).

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (both with SSE streaming), ``/v1/models``,
``POST /v1/adapters`` / ``DELETE /v1/adapters/{name}``, ``/health``, ``/metrics``.

The event loop thread tokenizes, renders chat templates, detokenizes and checks stop strings; the
engine loop thread only schedules and steps. Outputs come back once per step through one sink
(``call_soon_threadsafe``) and are routed to per-request queues. Every error a client can cause is
a 4xx with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``; a full admission
queue is 429 with ``Retry-After``. A client that goes away has its request aborted.
"""
from __future__ import annotations

import asyncio
import collections
import ctypes
import json
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from infeng_common.errors import InfengError

from .chat import ChatTemplateError, render_chat
from .detokenize import ChoiceText, Delta, TokenTexts
from .loop import EngineLoop
from .metrics import ServerMetrics
from .sampling import SamplingParams
from .scheduler import QueueFull, Request, RequestError, SeqOutput

DISCONNECT_POLL_SECONDS = 0.5


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
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    # extensions (as vLLM names them)
    top_k: int = Field(0, ge=0)
    ignore_eos: bool = False
    priority: int = 0


class CompletionBody(_Body):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None


class AdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Optional[str] = None
    path: Optional[str] = None
    scale: float = 1.0
    lora_name: Optional[str] = None                # vLLM's spelling
    lora_path: Optional[str] = None


# -- errors -----------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _from_request_error(e: RequestError) -> APIError:
    type_ = "not_found_error" if e.status == 404 else "invalid_request_error"
    return APIError(e.status, str(e), type_, e.param, e.code)


def _queue_full(e: QueueFull) -> APIError:
    return APIError(429, str(e), "rate_limit_error", None, "queue_full",
                    {"Retry-After": str(max(1, round(e.retry_after)))})


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        data = json.loads(raw or b"null")
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


# -- per-request consumer state ---------------------------------------------------------------
@dataclass
class _Choice:
    text: ChoiceText
    request_id: str
    index: int                                     # index within its engine request
    first_at: float | None = None
    last_at: float | None = None


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
    """The API over one EngineLoop; ``app`` is the FastAPI application."""

    def __init__(self, loop: EngineLoop, model_name: str):
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = loop.engine.tokenizer
        if self.tokenizer is None:
            raise InfengError(f"{loop.engine.path}: the artifact has no tokenizer.json; it cannot be served")
        self.model_name = model_name
        self.created = int(time.time())
        self.metrics = ServerMetrics(loop)
        self.token_texts = TokenTexts(self.tokenizer)
        self.sink: _AsyncSink | None = None
        self.app = self._build_app()

    # -- app ----------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI):
            self.sink = _AsyncSink(asyncio.get_running_loop())
            self.loop.start()
            try:
                yield
            finally:
                self.loop.stop()
                self.sink._drain()
                self.sink.close()

        app = FastAPI(title="infeng", lifespan=lifespan)
        metrics = self.metrics
        app.add_middleware(_CountRequests, metrics=metrics)

        @app.exception_handler(APIError)
        async def api_error(request: HTTPRequest, e: APIError):
            return e.response()

        @app.post("/v1/completions")
        async def completions(request: HTTPRequest):
            return await self.completions(request)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: HTTPRequest):
            return await self.chat(request)

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

        @app.get("/health")
        async def health():
            if not self.loop.alive:
                reason = f": {self.loop.error}" if self.loop.error else ""
                return JSONResponse({"status": "error", "message": f"engine loop stopped{reason}"}, status_code=503)
            return {"status": "ok"}

        @app.get("/metrics")
        async def prometheus():
            return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

        return app

    def _models(self) -> list[dict[str, Any]]:
        entries = [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "infeng",
                    "root": str(self.engine.path), "parent": None}]
        for name, entry in list(self.loop.adapters.served.items()):
            entries.append({"id": name, "object": "model", "created": self.created, "owned_by": "infeng",
                            "root": str(entry.path), "parent": self.model_name})
        return entries

    def _adapter_of(self, model: str) -> str | None:
        if model == self.model_name:
            return None
        if model in self.loop.adapters.served:
            return model
        raise APIError(404, f"the model {model!r} does not exist (serving: "
                       f"{', '.join(e['id'] for e in self._models())})", "not_found_error", "model", "model_not_found")

    # -- shared request plumbing -----------------------------------------------------------------
    def _params(self, body: _Body, max_tokens: int | None, default_max: int) -> SamplingParams:
        if body.presence_penalty or body.frequency_penalty:
            raise APIError(400, "presence_penalty and frequency_penalty are not supported", param="presence_penalty")
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            return SamplingParams(max_new_tokens=default_max if max_tokens is None else max_tokens,
                                  temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                                  stop=tuple(stop), ignore_eos=body.ignore_eos)
        except InfengError as e:
            raise APIError(400, str(e)) from None

    def _submit(self, prompts: list[list[int]], params: list[SamplingParams], n: int, adapter: str | None,
                priority: int, logprobs: int | None, prefix: str) -> _Pending:
        pending = _Pending(asyncio.Queue(), time.monotonic())
        requests = []
        for p_index, (ids, p) in enumerate(zip(prompts, params)):
            rid = f"{prefix}-{p_index}"
            req = Request(rid, ids, p, n=n, adapter=adapter, priority=priority, logprobs=logprobs, sink=self.sink,
                          context=pending.queue)
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
        except (QueueFull, RequestError) as e:
            for req in accepted:                     # all or nothing
                self.loop.abort(req.request_id)
            raise (_queue_full(e) if isinstance(e, QueueFull) else _from_request_error(e)) from None
        for p_index, req in enumerate(requests):
            for i in range(n):
                pending.choices[(req.request_id, i)] = p_index * n + i
            pending.prompt_tokens += len(req.prompt_ids) * n
        return pending

    def _abort_all(self, pending: _Pending) -> None:
        for rid in {rid for rid, _ in pending.choices}:
            self.loop.abort(rid)

    async def _events(self, pending: _Pending, texts: list[ChoiceText], http: HTTPRequest | None
                      ) -> AsyncIterator[list[tuple[int, Delta]]]:
        """Deltas as outputs arrive, until every choice is done; aborts if the client leaves."""
        metrics = self.metrics
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        next_check = time.monotonic() + DISCONNECT_POLL_SECONDS
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
            if not all(t.done for t in texts):
                self._abort_all(pending)

    async def _guarded(self, chunks: AsyncIterator[str], pending: _Pending, texts: list[ChoiceText]
                       ) -> AsyncIterator[str]:
        """The SSE chunks; a client that goes away mid-stream has its request aborted at once."""
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            if not all(t.done for t in texts):
                self._abort_all(pending)

    @staticmethod
    def _usage(pending: _Pending, texts: list[ChoiceText]) -> dict[str, Any]:
        completion = sum(len(t.token_ids) for t in texts)
        return {"prompt_tokens": pending.prompt_tokens, "completion_tokens": completion,
                "total_tokens": pending.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(t.cached_tokens for t in texts)}}

    @staticmethod
    def _finish_reason(text: ChoiceText) -> str:
        return text.finish_reason if text.finish_reason in ("stop", "length") else (text.finish_reason or "abort")

    def _check_errors(self, texts: list[ChoiceText]) -> None:
        for t in texts:
            if t.finish_reason == "error":
                raise APIError(500, f"generation failed: {t.error}", "server_error", code="engine_error")

    # -- /v1/completions ----------------------------------------------------------------------
    async def completions(self, http: HTTPRequest):
        body: CompletionBody = _parse(CompletionBody, await http.body())
        adapter = self._adapter_of(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of must equal n", param="best_of")
        prompts = self._completion_prompts(body.prompt)
        params = [self._params(body, body.max_tokens, 16) for _ in prompts]
        rid = f"cmpl-{uuid.uuid4().hex}"
        pending = self._submit(prompts, params, body.n, adapter, body.priority, body.logprobs, rid)
        stops = params[0].stop
        texts = [ChoiceText(self.tokenizer, prompts[c // body.n], stops, body.logprobs is not None)
                 for c in range(len(prompts) * body.n)]
        created = int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": body.model}
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))

            async def sse():
                async for batch in self._events(pending, texts, None):
                    for c, delta in batch:
                        if delta.finish_reason == "error":
                            yield _sse({"error": APIError(500, f"generation failed: {delta.error}", "server_error",
                                                          code="engine_error").body()["error"]})
                            continue
                        choice = {"index": c, "text": delta.text,
                                  "logprobs": self._completion_logprobs(delta.logprobs, body.logprobs)
                                  if body.logprobs is not None else None,
                                  "finish_reason": self._finish_reason(texts[c]) if delta.finish_reason else None}
                        yield _sse({**base, "choices": [choice]})
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": self._usage(pending, texts)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(self._guarded(sse(), pending, texts), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async for _ in self._events(pending, texts, http):
            pass
        if not all(t.done for t in texts):
            return Response(status_code=499)
        self._check_errors(texts)
        choices = [{"index": c, "text": t.text,
                    "logprobs": self._completion_logprobs(t.entries, body.logprobs) if body.logprobs is not None
                    else None, "finish_reason": self._finish_reason(t)} for c, t in enumerate(texts)]
        return {**base, "choices": choices, "usage": self._usage(pending, texts)}

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif prompt and all(isinstance(p, str) for p in prompt):
            prompts = [self.tokenizer.encode(p) for p in prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        elif prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            raise APIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")
        vocab = self.engine.vocab_size
        for ids in prompts:
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
        body: ChatBody = _parse(ChatBody, await http.body())
        adapter = self._adapter_of(body.model)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = render_chat(self.tokenizer, messages, body.add_generation_prompt,
                               **(body.chat_template_kwargs or {}))
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        ids = self.tokenizer.encode(text, add_bos=False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        kv = self.loop.scheduler.kv
        room = max(1, min(self.loop.scheduler.max_context, kv.n_blocks * kv.block_size) - len(ids))
        params = self._params(body, max_tokens, room)
        k = (body.top_logprobs or 0) if body.logprobs else None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        pending = self._submit([ids], [params], body.n, adapter, body.priority, k, rid)
        texts = [ChoiceText(self.tokenizer, ids, params.stop, body.logprobs) for _ in range(body.n)]
        base = {"id": rid, "object": "chat.completion.chunk" if body.stream else "chat.completion",
                "created": int(time.time()), "model": body.model}
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))

            async def sse():
                for c in range(body.n):
                    yield _sse({**base, "choices": [{"index": c, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]})
                async for batch in self._events(pending, texts, None):
                    for c, delta in batch:
                        if delta.finish_reason == "error":
                            yield _sse({"error": APIError(500, f"generation failed: {delta.error}", "server_error",
                                                          code="engine_error").body()["error"]})
                            continue
                        lp = {"content": self._chat_logprobs(delta.logprobs)} if body.logprobs else None
                        if delta.text or delta.logprobs:
                            yield _sse({**base, "choices": [{"index": c, "delta": {"content": delta.text},
                                                             "logprobs": lp, "finish_reason": None}]})
                        if delta.finish_reason:
                            yield _sse({**base, "choices": [{"index": c, "delta": {}, "logprobs": None,
                                                             "finish_reason": self._finish_reason(texts[c])}]})
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": self._usage(pending, texts)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(self._guarded(sse(), pending, texts), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async for _ in self._events(pending, texts, http):
            pass
        if not all(t.done for t in texts):
            return Response(status_code=499)
        self._check_errors(texts)
        choices = [{"index": c, "message": {"role": "assistant", "content": t.text},
                    "logprobs": {"content": self._chat_logprobs(t.entries)} if body.logprobs else None,
                    "finish_reason": self._finish_reason(t)} for c, t in enumerate(texts)]
        return {**base, "choices": choices, "usage": self._usage(pending, texts)}

    def _chat_logprobs(self, entries) -> list[dict[str, Any]]:
        tt = self.token_texts
        return [{"token": e.text, "logprob": e.logprob, "bytes": list(e.text.encode()),
                 "top_logprobs": [{"token": tt(t), "logprob": lp, "bytes": list(tt(t).encode())}
                                  for t, lp in (e.top or [])]} for e in entries]

    # -- adapters -----------------------------------------------------------------------------
    async def load_adapter(self, http: HTTPRequest):
        body: AdapterBody = _parse(AdapterBody, await http.body())
        name, path = body.name or body.lora_name, body.path or body.lora_path
        if not name or not path:
            raise APIError(400, "give the adapter's name and path: {\"name\": ..., \"path\": ...}",
                           param="name" if not name else "path")
        if name == self.model_name:
            raise APIError(400, f"{name!r} is the base model's name", param="name")
        try:
            slot = await asyncio.wrap_future(self.loop.load_adapter(name, path, body.scale))
        except InfengError as e:
            raise APIError(400, str(e), param="path", code="adapter_load_failed") from None
        return {"id": name, "object": "model", "parent": self.model_name, "root": path, "slot": slot}

    async def unload_adapter(self, name: str):
        if name not in self.loop.adapters.served:
            raise APIError(404, f"no adapter named {name!r} is loaded", "not_found_error", "name", "model_not_found")
        try:
            await asyncio.wrap_future(self.loop.unload_adapter(name))
        except InfengError as e:
            raise APIError(404, str(e), "not_found_error", "name", "model_not_found") from None
        return {"id": name, "object": "model", "deleted": True}


class _CountRequests:
    """Counts /v1/ requests by endpoint and status (plain ASGI: a BaseHTTPMiddleware would hide
    client disconnects from the handlers)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(_endpoint(scope["path"]), str(status[0])).inc()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _endpoint(path: str) -> str:
    for prefix in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/adapters"):
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


def build_server(artifact: str | Path, options: ServeOptions) -> Server:
    """Load the artifact and its adapters; every problem raises InfengError before anything listens."""
    from .engine import Engine

    engine = Engine(artifact, threads=options.threads, max_seqs=options.max_seqs, max_context=options.max_context,
                    kv_memory=options.kv_memory)
    if engine.tokenizer is None:
        raise InfengError(f"{artifact}: the artifact has no tokenizer.json; it cannot be served")
    loop = EngineLoop(engine, max_batched_tokens=options.max_batched_tokens, max_waiting=options.max_waiting,
                      prefix_cache=options.prefix_cache)
    for name, path in options.adapters.items():
        loop.load_adapter(name, path).result()
    return Server(loop, options.served_model_name or engine.manifest.get("name") or Path(artifact).name)


def serve(artifact: str | Path, options: ServeOptions) -> None:
    import uvicorn

    server = build_server(artifact, options)
    uvicorn.run(server.app, host=options.host, port=options.port, log_level=options.log_level, access_log=False,
                timeout_graceful_shutdown=5)
