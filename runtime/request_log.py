"""One log line per request (logger ``infeng.server``, stderr), and the catch-all for errors.

``RequestLog`` is the outermost ASGI middleware: it gives each request an id (``x-request-id`` on
the response, ``cmpl-<id>``/``chatcmpl-<id>`` in the body), a ``RequestRecord`` the handlers fill
in (model, adapter, token counts, time to first token), and, when the response is done, logs::

    request id=5f0c9d3e2a7b41c8 method=POST path=/v1/completions status=200 model=stories260K
    adapter=- prompt_tokens=5 completion_tokens=16 ttft_ms=11.2 latency_ms=84.0

(one line; ``--log-format json`` writes the same fields as one JSON object per line). A client that
went away is logged as status 499. An exception a handler did not expect becomes a JSON 500
(``server_error``, naming the request id) and one logged traceback; client errors (4xx) are logged
as their one line, never with a traceback.
"""
from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .api_errors import APIError

LOGGER = logging.getLogger("infeng.server")
#: Paths whose successful requests are not logged (health checks and scrapes arrive every few seconds).
QUIET_PATHS = frozenset({"/health", "/metrics"})
#: The status a request is logged with when its client went away before the answer was complete.
CLIENT_CLOSED = 499


@dataclass
class RequestRecord:
    """What the log line says about one request; the handlers fill in what they know."""

    request_id: str
    method: str
    path: str
    started: float = field(default_factory=time.monotonic)
    model: str | None = None
    adapter: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_at: float | None = None
    status: int | None = None
    disconnected: bool = False
    error: str | None = None                 # why a 5xx happened

    def fields(self) -> dict[str, Any]:
        now = time.monotonic()
        out: dict[str, Any] = {"id": self.request_id, "method": self.method, "path": self.path,
                               "status": CLIENT_CLOSED if self.disconnected else self.status}
        if self.model is not None:
            out["model"] = self.model
            out["adapter"] = self.adapter or "-"
        if self.prompt_tokens is not None:
            out["prompt_tokens"] = self.prompt_tokens
        if self.completion_tokens is not None:
            out["completion_tokens"] = self.completion_tokens
        if self.first_token_at is not None:
            out["ttft_ms"] = round((self.first_token_at - self.started) * 1000, 1)
        out["latency_ms"] = round((now - self.started) * 1000, 1)
        if self.error:
            out["error"] = self.error
        return out


def record_of(scope) -> RequestRecord | None:
    return scope.get("infeng.record")


class InFlight:
    """Requests being answered (not counting /health and /metrics): what a graceful shutdown waits for."""

    def __init__(self):
        self.count = 0


class RequestLog:
    """ASGI middleware: request ids, one log line per request, JSON 500 for unexpected exceptions."""

    def __init__(self, app, in_flight: InFlight | None = None):
        self.app = app
        self.in_flight = in_flight or InFlight()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = RequestRecord(uuid.uuid4().hex[:16], scope["method"], scope["path"])
        scope["infeng.record"] = record
        counted = scope["path"] not in QUIET_PATHS
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", record.request_id.encode())]}
            await send(message)

        if counted:
            self.in_flight.count += 1
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:                      # a bug, not the client's doing: log it, answer JSON
            record.error = f"{type(e).__name__}: {e}"
            LOGGER.exception("unhandled error", extra={"fields": {"id": record.request_id}})
            if started:
                return                                 # mid-stream: the response cannot change now
            record.status = 500
            await APIError(500, f"internal server error (request id {record.request_id}); it has been logged",
                           "server_error", code="internal_error").send(send_with_id)
        finally:
            if counted:
                self.in_flight.count -= 1
            if counted or (record.status or 500) >= 400:
                status = CLIENT_CLOSED if record.disconnected else (record.status or 500)
                level = logging.INFO if status < 500 else logging.WARNING
                LOGGER.log(level, "request", extra={"fields": record.fields()})


# -- formatting -----------------------------------------------------------------------------------
#: Longest value a log line carries (client strings such as ``model`` are cut to it).
MAX_FIELD_CHARS = 200


def _plain(value: Any) -> str:
    """A field's value for a key=value line: cut to MAX_FIELD_CHARS; quoted (JSON-escaped) when it
    holds a space, a quote, ``=`` or any character that is not printable, so no client string can
    forge a line or a field."""
    text = str(value)
    if len(text) > MAX_FIELD_CHARS:
        text = text[:MAX_FIELD_CHARS] + "..."
    if not text or not text.isprintable() or any(c in text for c in ' "='):
        return json.dumps(text)
    return text


class KeyValueFormatter(logging.Formatter):
    """``2026-01-01 12:00:00,000 INFO infeng.server request id=... status=200 ...``"""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        line = super().format(record)
        if fields:
            head, sep, tail = line.partition("\n")     # keep a traceback after the fields
            line = head + " " + " ".join(f"{k}={_plain(v)}" for k, v in fields.items()) + sep + tail
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time``, ``level``, ``logger``, ``event`` and the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": self.formatTime(record), "level": record.levelname.lower(),
                               "logger": record.name, "event": record.getMessage()}
        out.update({k: v[:MAX_FIELD_CHARS] if isinstance(v, str) else v
                    for k, v in (getattr(record, "fields", None) or {}).items()})
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


LOG_FORMATS = ("text", "json")
#: uvicorn's ``--log-level`` names ("trace" is uvicorn's level below debug).
LOG_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO,
              "debug": logging.DEBUG, "trace": 5}


def configure_logging(level: str = "info", fmt: str = "text") -> logging.Handler:
    """Send infeng's loggers (``infeng.server``, ``infeng.engine``) and uvicorn's to stderr in
    ``fmt`` (text or json) at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    numeric = LOG_LEVELS[level.lower()]
    for name in ("infeng", "uvicorn", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(numeric)
        logger.propagate = False
    return handler
