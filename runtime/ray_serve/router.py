"""``InfengRouter``, the HTTP ingress: routes a request by its ``model`` to a replica holding that
adapter, retries one whose replica died before answering, answers ``/v1/models`` and ``/health``."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from ..api_errors import APIError
from ..http_guard import AccessGuard, AccessPolicy, is_loopback_address
from ..json_body import parse_json
from ..request_log import configure_logging
from ..server import ServeOptions
from .config import ENGINE_DEPLOYMENT, ForwardedRequest

_log = logging.getLogger("infeng.ray")


#: Tries of a request whose replica died before any of its response was sent (the first included).
FORWARD_ATTEMPTS = 3
HEALTH_CACHE_S = 1.0
#: Paths whose JSON body names the model (and so the adapter) a request is for.
MODEL_ROUTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_DIED = (RayActorError, ActorDiedError, ActorUnavailableError)


class InfengRouter:
    """The HTTP ingress: routes each request to an engine replica by its ``model`` (adapter)."""

    def __init__(self, engine: DeploymentHandle, model_name: str, adapters: list[str], options: ServeOptions):
        configure_logging(options.log_level, options.log_format)
        self.engine = engine
        self.model_name = model_name
        self.adapters = list(adapters)
        self.options = options
        self.created = int(time.time())
        self._health: tuple[float, int, dict[str, Any]] | None = None

    def __serve_build_asgi_app__(self):
        policy = AccessPolicy(self.options.api_key, is_loopback_address(self.options.host),
                              self.options.max_request_bytes)
        return AccessGuard(self._asgi, policy=policy)

    async def _asgi(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health" and method == "GET":
            status, payload = await self.health()
            return await _send_json(send, status, payload)
        if path == "/v1/models" and method == "GET":
            return await _send_json(send, 200, {"object": "list", "data": self._models()})
        if path.startswith("/v1/models/") and method == "GET":
            wanted = path[len("/v1/models/"):]
            for entry in self._models():
                if entry["id"] == wanted:
                    return await _send_json(send, 200, entry)
            return await APIError(404, f"the model {wanted!r} does not exist", "not_found_error", "model",
                                  "model_not_found").send(send)
        if path.startswith("/v1/adapters"):
            return await APIError(403, "a Ray deployment places the adapters given at deploy time (--adapter "
                                       "NAME=DIR); it does not load adapters at runtime", param="path",
                                  code="adapter_loads_disabled").send(send)
        if path == "/metrics":
            return await APIError(404, "per-replica metrics are exported through Ray's metrics export "
                                       "(docs/scale-out.md), not by the router", code="not_found").send(send)
        body = await _read_body(receive)
        if body is None:                                 # the client left
            return
        await self._forward(ForwardedRequest.of(scope, body), self._adapter(path, method, body), receive, send)

    def _adapter(self, path: str, method: str, body: bytes) -> str:
        """The adapter the body's ``model`` names ("" for the base model or anything else, which
        the replica answers as ``infeng serve`` would)."""
        if method != "POST" or not path.startswith(MODEL_ROUTED_PREFIXES):
            return ""
        try:
            payload = parse_json(body)
        except APIError:
            return ""
        model = payload.get("model") if isinstance(payload, dict) else None
        return model if isinstance(model, str) and model in self.adapters else ""

    async def _forward(self, request: ForwardedRequest, adapter: str, receive, send) -> None:
        started = streaming = False
        watcher = asyncio.ensure_future(receive())       # the client's disconnect
        try:
            for attempt in range(FORWARD_ATTEMPTS):
                responses = self.engine.options(stream=True, multiplexed_model_id=adapter).forward.remote(request)
                try:
                    async for batch in _until_disconnect(responses, watcher):
                        for message in batch:
                            if message["type"] == "http.response.start":
                                streaming = dict(message.get("headers", [])).get(b"content-type", b"").startswith(
                                    b"text/event-stream")
                            await send(message)
                            started = True
                    return
                except _DIED as e:
                    if not started and attempt + 1 < FORWARD_ATTEMPTS:
                        _log.warning("replica died before answering; retrying", extra={"fields": {"error": str(e)}})
                        continue
                    await _end(send, started, streaming, APIError(503, "the replica serving this request died; "
                                                                       "retry it", "server_error", None,
                                                                  "replica_died"))
                    return
                except _ClientLeft:
                    responses.cancel()
                    return
                except Exception:  # noqa: BLE001 (a bug on a replica: the client still gets OpenAI's error shape)
                    _log.exception("forwarding a request failed")
                    await _end(send, started, streaming, APIError(500, "internal server error; it has been logged",
                                                                  "server_error", None, "internal_error"))
                    return
        finally:
            watcher.cancel()

    def _models(self) -> list[dict[str, Any]]:
        entries = [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "infeng",
                    "root": self.model_name, "parent": None}]
        return entries + [{"id": name, "object": "model", "created": self.created, "owned_by": "infeng",
                           "root": name, "parent": self.model_name} for name in self.adapters]

    async def health(self) -> tuple[int, dict[str, Any]]:
        """200 while at least one engine replica runs; the replica counts by state either way."""
        now = time.monotonic()
        if self._health is None or now - self._health[0] > HEALTH_CACHE_S:
            status, payload = await asyncio.get_running_loop().run_in_executor(None, _engine_status)
            self._health = (now, status, payload)
        return self._health[1], self._health[2]


class _ClientLeft(Exception):
    pass


async def _until_disconnect(responses, watcher: asyncio.Future) -> AsyncIterator[list[dict[str, Any]]]:
    """The replica's message batches, raising ``_ClientLeft`` as soon as the client disconnects."""
    iterator = responses.__aiter__()
    while True:
        step = asyncio.ensure_future(iterator.__anext__())
        try:
            await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done() and watcher.result().get("type") == "http.disconnect":
                raise _ClientLeft()
            await asyncio.wait({step})
        finally:
            if not step.done():                  # we were cancelled (the proxy ended the request) or left
                step.cancel()
                step.add_done_callback(_retrieve)
        try:
            batch = step.result()
        except StopAsyncIteration:
            return
        yield batch


def _retrieve(task: asyncio.Future) -> None:
    """Take a cancelled step's outcome, so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


async def _end(send, started: bool, streaming: bool, error: APIError) -> None:
    """End a response that cannot go on: ``error`` if nothing was sent; an SSE error event and
    ``[DONE]`` mid-stream; otherwise the response ends where it stopped."""
    if not started:
        await error.send(send)
        return
    if streaming:
        event = f"data: {json.dumps(error.body(), separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()
        await send({"type": "http.response.body", "body": event, "more_body": False})
        return
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _engine_status() -> tuple[int, dict[str, Any]]:
    """The engine deployment's status and replica counts, from Serve's controller."""
    app_name = serve.get_replica_context().app_name
    app = serve.status().applications.get(app_name)
    deployment = app.deployments.get(ENGINE_DEPLOYMENT) if app is not None else None
    if deployment is None:
        return 503, {"status": "error", "message": "the engine deployment is not running"}
    states = {str(getattr(k, "value", k)).lower(): v for k, v in deployment.replica_states.items()}
    running = states.get("running", 0)
    payload = {"status": "ok" if running else "error", "deployment": str(getattr(deployment.status, "value",
                                                                                  deployment.status)),
               "replicas": states}
    if not running:
        payload["message"] = "no engine replica is running"
    return (200 if running else 503), payload


async def _read_body(receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_json(send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
