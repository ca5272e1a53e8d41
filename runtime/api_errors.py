"""OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, for the API handlers
and for the ASGI middleware in front of them (which answer before FastAPI sees a request)."""
from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

#: The ``type`` OpenAI gives each status (the official clients pick their exception by status).
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
               413: "invalid_request_error", 415: "invalid_request_error", 421: "invalid_request_error",
               429: "rate_limit_error"}


class APIError(Exception):
    """An error answered to the client: ``status`` and OpenAI's body (``type`` from the status
    unless given)."""

    def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    async def send(self, send, extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
        """Answer with this error through a raw ASGI ``send``."""
        payload = json.dumps(self.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                   *((k.lower().encode(), v.encode()) for k, v in (self.headers or {}).items()), *extra_headers]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
