"""``infeng serve``: the OpenAI HTTP API over one EngineLoop (FastAPI + uvicorn).

The API itself is the ``runtime/api/`` package: a request core (``api/core.py``) under sibling
routers (``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``, ``/tokenize`` and
``/detokenize``, and ``/v1/models``, ``/v1/adapters``, ``/health``, ``/metrics``, ``/version``),
assembled with its middleware and life cycle into ``Server`` (``api/app.py``). This module runs it:
the artifact and adapters loaded (``build_server``), the socket bound first, uvicorn, and signals.

Life cycle: SIGTERM or SIGINT stops admission (503), lets running requests finish for
``--shutdown-timeout`` seconds, ends the rest (streams with an error event and ``[DONE]``, others
with 503) and exits 0. If the engine loop dies, every waiting request is answered 503 at once,
``/health`` says 503 and the process exits 1.
"""
from __future__ import annotations

import socket
import sys
from pathlib import Path

import uvicorn

from infeng_common.errors import InfengError

from .api.app import Server
from .api.options import ServeOptions
from .api_errors import APIError
from .exit_watchdog import exit_after
from .loop import EngineLoop
from .prefix_store import save_on_exit
from .request_log import configure_logging
from .warmup import warm_start

__all__ = ["APIError", "ServeOptions", "Server", "build_server", "serve"]

#: After SIGTERM, the process exits at most this long after --shutdown-timeout, whatever a thread
#: is doing (the requests left were ended at the timeout; this is for writing their last events).
SHUTDOWN_GRACE_SECONDS = 10.0
#: How long uvicorn waits for open connections once it is told to stop.
GRACEFUL_SECONDS = 5


def build_server(artifact: str | Path, options: ServeOptions) -> Server:
    """Load the artifact and its adapters; every problem raises InfengError before anything listens."""
    from .engine import Engine

    options.check()
    engine = Engine(artifact, threads=options.threads, max_seqs=options.max_seqs, max_context=options.max_context,
                    kv_memory=options.kv_memory)
    if engine.tokenizer is None:
        raise InfengError(f"{artifact}: the artifact has no tokenizer.json; it cannot be served")
    loop = EngineLoop(engine, max_batched_tokens=options.max_batched_tokens, max_waiting=options.max_queue,
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
