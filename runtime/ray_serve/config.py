"""What the router, the replicas and the app builder share: ``RayServeConfig`` (checked before
anything starts; declared in ``ray_options.py``, which the CLI reads without importing Ray), the
deployment names, and ``ForwardedRequest`` (a whole HTTP request, forwarded)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..api_errors import APIError
from ..ray_options import RayServeConfig, adapter_slots

__all__ = ["ENGINE_DEPLOYMENT", "ROUTER_DEPLOYMENT", "ForwardedRequest", "RayServeConfig", "adapter_slots",
           "error_messages"]


ENGINE_DEPLOYMENT = "InfengEngine"
ROUTER_DEPLOYMENT = "InfengRouter"


@dataclass
class ForwardedRequest:
    """An HTTP request as the router read it, whole (bodies are bounded by --max-request-bytes)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    client: tuple[str, int] | None
    http_version: str
    body: bytes

    @classmethod
    def of(cls, scope: dict[str, Any], body: bytes) -> ForwardedRequest:
        client = scope.get("client")
        return cls(scope["method"], scope["path"], scope.get("query_string", b""), list(scope.get("headers", [])),
                   tuple(client) if client else None, scope.get("http_version", "1.1"), body)

    def scope(self) -> dict[str, Any]:
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": self.http_version, "method": self.method,
                "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "root_path": "",
                "query_string": self.query_string, "headers": self.headers, "client": self.client,
                "server": None, "state": {}}


def error_messages(error: APIError) -> list[dict[str, Any]]:
    """``error`` as the ASGI messages of its JSON response."""
    body = json.dumps(error.body()).encode()
    return [{"type": "http.response.start", "status": error.status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]},
            {"type": "http.response.body", "body": body, "more_body": False}]
