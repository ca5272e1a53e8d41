"""The ``Server``: the request core with its life cycle, and the FastAPI app assembled from the
routers (completions, chat, responses, tokenize, admin).

In front of the routes, three ASGI layers: ``RequestLog`` (request ids, one log line per request,
a JSON 500 for anything unexpected), the request counter of ``/metrics``, and ``AccessGuard``
(Host check on loopback, API key, JSON content type, body size). Every error a client can cause is
a 4xx with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``.

Life cycle: ``shutdown`` stops admission (503), lets running requests finish for a while, ends the
rest (streams with an error event and ``[DONE]``, others with 503) and asks to exit 0. If the
engine loop dies, every waiting request is answered 503 at once, ``/health`` says 503 and the
server asks to exit 1 (``request_exit``: what runs the server decides how)."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request as HTTPRequest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api_errors import APIError
from ..fair_share import CLIENT, ClientsInFlight
from ..grammar_worker import GrammarWorkers, TokenizerSpec
from ..http_guard import AccessGuard, AccessPolicy, is_loopback_address
from ..loop import EngineLoop
from ..metrics import ServerMetrics
from ..request_log import LOGGER, RequestLog
from . import admin, chat, completions, responses, tokenize
from .core import GRAMMAR_WORKERS, SHUTTING_DOWN, TEXT_WORKERS, RequestCore
from .options import ServeOptions
from .sink import AsyncSink

__all__ = ["Server"]

#: The routers, each ``router(core) -> APIRouter``, in the order their routes are matched.
ROUTERS = (completions.router, chat.router, responses.router, admin.router, tokenize.router)


class Server(RequestCore):
    """The API over one EngineLoop; ``app`` is the FastAPI application.

    ``request_exit(code)`` is how the server asks whatever runs it to stop (``serve`` makes it stop
    uvicorn; the process then exits with ``exit_code``): after a graceful shutdown (0) or when the
    engine loop died (1)."""

    def __init__(self, loop: EngineLoop, model_name: str, options: ServeOptions | None = None):
        super().__init__(loop, model_name, options)
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.exit_code: int | None = None
        self.request_exit: Callable[[int], None] = self._note_exit
        loop.on_fatal = self._on_fatal
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI):
            self.event_loop = asyncio.get_running_loop()
            self.sink = AsyncSink(self.event_loop)
            self.text_pool = ThreadPoolExecutor(TEXT_WORKERS, thread_name_prefix="infeng-text")
            self.grammar_pool = ThreadPoolExecutor(GRAMMAR_WORKERS, thread_name_prefix="infeng-grammar-wait")
            self.ending = asyncio.Event()
            self.grammars.workers = GrammarWorkers(TokenizerSpec(self.tokenizer.hf.to_str(), self.engine.vocab_size,
                                                                 tuple(self.tokenizer.eos_token_ids)), GRAMMAR_WORKERS)
            self.text_waiting = 0
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
        options = self.options
        # the last added is the outermost: RequestLog -> _CountRequests -> AccessGuard -> routes
        app.add_middleware(AccessGuard, policy=AccessPolicy(options.api_key, is_loopback_address(options.host),
                                                            options.max_request_bytes))
        app.add_middleware(_CountRequests, metrics=self.metrics, clients=self.clients)
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

        for router in ROUTERS:
            app.include_router(router(self))
        if options.ui:
            from ..web import mount_chat_page

            mount_chat_page(app)
        return app

    def describe(self) -> dict[str, Any]:
        """What the start-up log line says: the model, the machine side and the limits."""
        engine, limits = self.engine, self.limits
        try:
            block_bytes = int(engine.lib.ife_kv_block_bytes())
        except AttributeError:
            block_bytes = 0
        opts = self.options
        return {"model": self.model_name, "artifact": str(engine.path), "target": engine.manifest.get("target"),
                "threads": getattr(engine, "threads", None), "kv_blocks": limits.kv_blocks,
                "kv_bytes": limits.kv_blocks * block_bytes, "max_seqs": limits.max_seqs,
                "max_context": limits.max_context, "max_queue": limits.max_waiting,
                "adapters": ",".join(self.loop.adapters.served) or "-", "host": opts.host, "port": opts.port,
                "api_key": "on" if opts.api_key else "off",
                "adapter_roots": len(self.adapter_roots.roots), "max_request_bytes": opts.max_request_bytes,
                "chat_page": opts.page_url() if opts.ui else "off"}

    # -- life cycle ---------------------------------------------------------------------------
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
        left = self.loop.request_ids()
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


def _endpoint(path: str) -> str:
    for prefix in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/adapters"):
        if path.startswith(prefix):
            return prefix
    return "other"
