"""``infeng serve-ray``: infeng replicas on Ray Serve, behind one OpenAI router (docs/scale-out.md).

Two deployments make the application:

- ``InfengEngine``: a replica loads the artifact once, with as many threads as Ray gives it CPUs,
  and builds the same ``Server`` as ``infeng serve`` (routes, errors, streaming: one
  implementation) over its own ``EngineLoop``. The router hands it whole HTTP requests
  (``ForwardedRequest``); it runs them through the server's ASGI app and streams the ASGI
  messages back. Adapters are Ray Serve multiplexed models: ``adapter()`` loads one into this
  replica's loop on demand, at most ``adapters_per_replica`` per replica (Ray evicts the least
  recently used), and Ray routes a request for an adapter to a replica that holds it.
- ``InfengRouter`` (the HTTP ingress): reads the request's OpenAI ``model`` field and forwards the
  request to an engine replica with that adapter as its ``multiplexed_model_id``. A replica that
  dies before anything of a response was sent has the request retried on another; after, the
  stream ends with an error event and ``[DONE]``. It answers ``/v1/models`` (the base model and
  every adapter the deployment can route to) and ``/health`` (the engine replicas, from Serve's
  controller) itself.

Per-replica Prometheus metrics go out through Ray's metrics export (``ray.serve.metrics``, tagged
with the deployment and replica): every sample of the replica's ``/metrics``, infeng's and vLLM's
names, with ``:`` written ``_`` as Ray requires (the names vLLM's own Ray metrics have).

This module imports ``ray`` (the ``infeng[ray]`` extra); nothing else in the runtime imports it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from infeng_common.errors import InfengError
from infeng_common.manifest import read_manifest

from .adapters import AdapterError
from .api_errors import APIError
from .http_guard import AccessGuard, AccessPolicy, is_loopback_address
from .json_body import parse_json
from .request_log import configure_logging
from .server import ServeOptions, Server, build_server

__all__ = ["ForwardedRequest", "InfengEngine", "InfengRouter", "RayAppArgs", "RayServeConfig", "app_builder",
           "build_app", "deploy"]

_log = logging.getLogger("infeng.ray")

ENGINE_DEPLOYMENT = "InfengEngine"
ROUTER_DEPLOYMENT = "InfengRouter"
#: Longest a replica waits for an adapter slot that running sequences hold.
ADAPTER_SLOT_WAIT_S = 300.0
#: Tries of a request whose replica died before any of its response was sent (the first included).
FORWARD_ATTEMPTS = 3
#: How often a replica copies its metrics into Ray's, and how long /health trusts the controller's word.
METRICS_PERIOD_S = 2.0
HEALTH_CACHE_S = 1.0
#: Paths whose JSON body names the model (and so the adapter) a request is for.
MODEL_ROUTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_DIED = (RayActorError, ActorDiedError, ActorUnavailableError)


# -- configuration -------------------------------------------------------------------------------
@dataclass
class RayServeConfig:
    """One infeng application on Ray Serve: the artifact, the replicas, the per-replica server."""

    artifact: Path
    options: ServeOptions = field(default_factory=ServeOptions)   # per replica; adapters are placed by Ray
    replicas: int = 1                                # fixed, or the initial count with min/max
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None    # autoscaling target per replica (default: max_seqs)
    autoscaling_options: dict[str, Any] = field(default_factory=dict)   # more of Ray's autoscaling_config
    threads_per_replica: int = 1                     # the replica's num_cpus, and its engine's threads
    adapters_per_replica: int | None = None          # resident adapters per replica (default: the artifact's slots)
    router_replicas: int = 1                         # e.g. one per node: Ray's proxies prefer a router on their node
    app_name: str = "infeng"

    def check(self) -> None:
        """InfengError (one line, naming the flag) for a value out of range or an unusable artifact."""
        self.options.check()
        for flag, value in (("--replicas", self.replicas), ("--threads-per-replica", self.threads_per_replica),
                            ("--min-replicas", self.min_replicas), ("--max-replicas", self.max_replicas),
                            ("--adapters-per-replica", self.adapters_per_replica),
                            ("--router-replicas", self.router_replicas)):
            if value is not None and value < (0 if flag == "--min-replicas" else 1):
                raise InfengError(f"{flag} {value}: must be at least {0 if flag == '--min-replicas' else 1}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise InfengError("give --min-replicas and --max-replicas together (autoscaling), or neither")
        if self.max_replicas is not None and not self.min_replicas <= self.replicas <= self.max_replicas:
            raise InfengError(f"--replicas {self.replicas} must lie between --min-replicas {self.min_replicas} "
                              f"and --max-replicas {self.max_replicas}")
        if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
            raise InfengError(f"--target-ongoing-requests {self.target_ongoing_requests}: must be positive")
        if self.options.adapters and not _adapter_slots(self.artifact):
            raise InfengError(f"{self.artifact}: the artifact has no LoRA slots for --adapter; compile it with "
                              f"--max-adapters K --max-rank R")
        for name, path in self.options.adapters.items():
            if not Path(path).is_dir():
                raise InfengError(f"--adapter {name}={path}: not a directory")

    def model_name(self) -> str:
        manifest = read_manifest(self.artifact)
        return self.options.served_model_name or manifest.get("name") or Path(self.artifact).name


# -- the request a router forwards -----------------------------------------------------------------
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


# -- the engine replica ----------------------------------------------------------------------------
class _AdapterLease:
    """One adapter multiplexed into a replica: its load in the engine loop, and the requests using it.

    Ray calls ``__del__`` (an instance attribute, so the garbage collector never does) when it
    evicts the adapter; the unload waits for the requests that already hold it, so a request never
    loses its adapter between being routed and being admitted by the scheduler."""

    def __init__(self, server: Server, name: str):
        self.server, self.name = server, name
        self.users = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.__del__ = self._unload

    def hold(self) -> None:
        self.users += 1
        self.idle.clear()

    def release(self) -> None:
        self.users -= 1
        if not self.users:
            self.idle.set()

    async def _unload(self) -> None:
        await self.idle.wait()
        if self.name in self.server.loop.adapters.served:
            await asyncio.wrap_future(self.server.loop.unload_adapter(self.name))


class InfengEngine:
    """An engine replica: the artifact loaded once, ``Server`` over its own engine loop."""

    async def __init__(self, artifact: str, options: ServeOptions, adapter_dirs: dict[str, str],
                       adapters_per_replica: int):
        configure_logging(options.log_level, options.log_format)       # one line per request, as infeng serve
        threads = _replica_threads(options.threads)
        self.server = build_server(artifact, replace(options, threads=threads, adapters={}))
        self.adapter_dirs = {name: Path(path) for name, path in adapter_dirs.items()}
        self.app = self.server.app
        self.server.request_exit = self._request_exit
        self.exit_reason: str | None = None
        self.replica_id = serve.get_replica_context().replica_id.unique_id.encode()
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()

        async def adapter(name: str) -> _AdapterLease:        # a function: Ray keeps its LRU cache on it
            return await self._load(name)

        self.adapter = serve.multiplexed(max_num_models_per_replica=max(1, adapters_per_replica))(adapter)
        self._metrics = _RayMetrics(self.server)
        self._metrics_task = asyncio.get_running_loop().create_task(self._metrics.run())
        _log.info("replica ready", extra={"fields": {"threads": threads, "model": self.server.model_name}})

    async def _load(self, name: str) -> _AdapterLease:
        """Ray's multiplexed loader: serve adapter ``name`` on this replica (slots permitting)."""
        path = self.adapter_dirs[name]
        loop = self.server.loop
        deadline = time.monotonic() + ADAPTER_SLOT_WAIT_S
        while True:
            try:
                await asyncio.wrap_future(loop.load_adapter(name, path))
                break
            except AdapterError as e:
                # every slot is held by running sequences (possible when --adapters-per-replica
                # exceeds the slots): one frees when a sequence ends
                if "slots are in use" not in str(e) or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.05)
        return _AdapterLease(self.server, name)

    def _request_exit(self, code: int) -> None:
        """The server asks to stop (its engine loop died): ``check_health`` fails, Ray replaces us."""
        self.exit_reason = f"the engine loop stopped (exit code {code})"

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine loop died is replaced."""
        loop = self.server.loop
        if self.exit_reason or loop.error is not None or not loop.alive:
            raise RuntimeError(self.exit_reason or f"the engine loop stopped: {loop.error}")

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[list[dict[str, Any]]]:
        """Run one HTTP request through the server's app; yields its ASGI messages, batched."""
        lease = None
        model_id = serve.get_multiplexed_model_id()
        if model_id:
            try:
                lease = await self.adapter(model_id)
            except InfengError as e:                 # a declared adapter this replica cannot load
                _log.error("adapter load failed", extra={"fields": {"adapter": model_id, "error": str(e)}})
                yield _error_messages(APIError(500, f"the adapter {model_id!r} cannot be loaded: {e}", "server_error",
                                               "model", "adapter_load_failed"))
                return
            lease.hold()
        messages: asyncio.Queue = asyncio.Queue()
        left = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            messages.put_nowait(message)

        task = asyncio.ensure_future(self.app(request.scope(), receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            done = False
            while not done:
                batch = [await messages.get()]
                while not messages.empty():
                    batch.append(messages.get_nowait())
                done = batch[-1] is None
                batch = [m for m in batch if m is not None]
                for message in batch:
                    if message["type"] == "http.response.start":        # which replica answered
                        message["headers"] = [*message.get("headers", []), (b"x-infeng-replica", self.replica_id)]
                if batch:
                    yield batch
            task.result()
        finally:
            left.set()                              # the router went away (or we are done): the app sees it
            if lease is not None:
                task.add_done_callback(lambda _: lease.release())

    def __del__(self) -> None:
        """Ray's graceful shutdown (after the requests in flight drained): stop the engine loop."""
        task = getattr(self, "_metrics_task", None)
        if task is not None:
            task.cancel()
        server = getattr(self, "server", None)
        if server is not None:
            server.loop.stop()


def _replica_threads(requested: int) -> int:
    """The engine's threads: the CPUs Ray reserved for this replica, within the process's affinity."""
    import ray

    assigned = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
    threads = requested or int(assigned) or 1
    return max(1, min(threads, len(os.sched_getaffinity(0))))


class _RayMetrics:
    """Copies the replica's Prometheus samples into Ray's metrics (``ray.serve.metrics`` adds the
    deployment, replica and application tags) every ``METRICS_PERIOD_S``: gauges as gauges,
    counters as counters (incremented by what they grew), histograms as their bucket, sum and
    count series (gauges: Ray histograms are fed one observation at a time)."""

    def __init__(self, server: Server):
        self.registry = server.metrics.registry
        self._gauges: dict[str, Any] = {}
        self._counters: dict[str, Any] = {}
        self._last: dict[tuple, float] = {}

    async def run(self) -> None:
        while True:
            try:
                self.export()
            except Exception:  # noqa: BLE001 (a metrics hiccup must never stop the replica)
                _log.exception("copying metrics to Ray failed")
            await asyncio.sleep(METRICS_PERIOD_S)

    def export(self) -> None:
        from ray.serve import metrics

        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                name = _ray_name(sample.name)
                tags = {k: str(v) for k, v in sample.labels.items()}
                if family.type == "counter":
                    counter = self._counters.get(name)
                    if counter is None:
                        counter = self._counters[name] = metrics.Counter(name, family.documentation,
                                                                         tag_keys=tuple(sorted(tags)))
                    key = (name, tuple(sorted(tags.items())))
                    grown = sample.value - self._last.get(key, 0.0)
                    self._last[key] = sample.value
                    if grown > 0:
                        counter.inc(grown, tags=tags)
                else:
                    gauge = self._gauges.get(name)
                    if gauge is None:
                        gauge = self._gauges[name] = metrics.Gauge(name, family.documentation,
                                                                   tag_keys=tuple(sorted(tags)))
                    gauge.set(sample.value, tags=tags)


def _ray_name(name: str) -> str:
    """A Prometheus name as Ray accepts it (no ``:``): ``vllm:num_requests_running`` ->
    ``vllm_num_requests_running``."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


# -- the router ------------------------------------------------------------------------------------
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


def _error_messages(error: APIError) -> list[dict[str, Any]]:
    """``error`` as the ASGI messages of its JSON response."""
    body = json.dumps(error.body()).encode()
    return [{"type": "http.response.start", "status": error.status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]},
            {"type": "http.response.body", "body": body, "more_body": False}]


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


# -- building and deploying ----------------------------------------------------------------------
def build_app(config: RayServeConfig):
    """The Ray Serve application (router bound to the engine deployment) for ``config``."""
    config.check()
    options = config.options
    slots = _adapter_slots(config.artifact)
    per_replica = config.adapters_per_replica or max(1, slots)
    engine_options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT, "ray_actor_options": {"num_cpus": config.threads_per_replica},
        "max_ongoing_requests": options.max_seqs, "health_check_period_s": 2.0, "health_check_timeout_s": 30.0,
        "max_constructor_retry_count": 3,           # a replica that cannot load the artifact will not next time
        "graceful_shutdown_timeout_s": options.shutdown_timeout}
    if config.max_replicas is not None:
        engine_options["autoscaling_config"] = {
            "min_replicas": config.min_replicas, "max_replicas": config.max_replicas,
            "initial_replicas": config.replicas,
            "target_ongoing_requests": config.target_ongoing_requests or options.max_seqs,
            **config.autoscaling_options}
    else:
        engine_options["num_replicas"] = config.replicas
    engine = serve.deployment(InfengEngine).options(**engine_options).bind(
        str(config.artifact), replace(options, adapters={}, threads=config.threads_per_replica),
        {k: str(v) for k, v in options.adapters.items()}, per_replica)
    router = serve.deployment(serve.ingress()(InfengRouter)).options(
        name=ROUTER_DEPLOYMENT, num_replicas=config.router_replicas, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000)
    return router.bind(engine, config.model_name(), list(options.adapters), replace(options, adapters={}))


def _adapter_slots(artifact: Path) -> int:
    """The artifact's LoRA slots (0: adapters cannot be served)."""
    return int(read_manifest(artifact).get("constants", {}).get("lora_slots", 0) or 0)


def deploy(config: RayServeConfig, address: str | None = None, blocking: bool = True) -> str:
    """Start (or join, at ``address`` or ``$RAY_ADDRESS``) a Ray cluster, run the application on ``options.host:port``
    and return its URL; with ``blocking``, serve until SIGINT/SIGTERM, then delete the application
    (and stop the cluster if this call started it)."""
    import signal
    import threading

    import ray

    configure_logging(config.options.log_level, config.options.log_format)
    app = build_app(config)
    stop = threading.Event()

    def on_signal() -> None:
        # installed before Ray starts (a signal during start-up stops cleanly) and again after
        # ray.init, whose failure handler would otherwise abort the process on SIGTERM
        if blocking:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())

    on_signal()
    address = address or os.environ.get("RAY_ADDRESS") or "local"      # "local": a new cluster on this machine
    started_here = not ray.is_initialized() and address == "local"
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        on_signal()
    url = f"http://{config.options.host}:{config.options.port}"
    try:
        serve.start(http_options={"host": config.options.host, "port": config.options.port})
        try:
            serve.run(app, name=config.app_name, route_prefix="/")
        except RuntimeError as e:                   # the replicas failed to start: say why in one line
            reason = _start_failure(config.app_name) or str(e)
            serve.delete(config.app_name)
            raise InfengError(f"the replicas did not start: {reason}") from None
        if not blocking:
            return url
        _log.warning("serving", extra={"fields": {"url": url, "app": config.app_name}})
        while not stop.wait(1.0):
            pass
        serve.delete(config.app_name)
    finally:
        if blocking and started_here:
            serve.shutdown()
            ray.shutdown()
    return url


def _start_failure(app_name: str) -> str | None:
    """The error that stopped a deployment's replicas (the last ``Error: ...`` line of its message)."""
    app = serve.status().applications.get(app_name)
    for deployment in (app.deployments.values() if app is not None else []):
        lines = [ln.strip() for ln in (deployment.message or "").splitlines() if "Error: " in ln]
        if lines:
            return lines[-1].split("Error: ", 1)[1]
    return None


class RayAppArgs(BaseModel):
    """The arguments of ``app_builder``, for ``serve run infeng_runtime.ray_serve:app_builder
    artifact=DIR replicas=2`` or an ``args:`` block of a Serve config file."""

    model_config = ConfigDict(extra="forbid")

    artifact: str
    replicas: int = Field(1, ge=1)
    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    target_ongoing_requests: float | None = Field(None, gt=0)
    autoscaling_config: dict[str, Any] = Field(default_factory=dict)   # upscale_delay_s, downscale_delay_s, ...
    threads_per_replica: int = Field(1, ge=1)
    adapters: dict[str, str] = Field(default_factory=dict)   # name -> PEFT directory
    adapters_per_replica: int | None = Field(None, ge=1)
    router_replicas: int = Field(1, ge=1)
    max_seqs: int = Field(16, ge=1)
    max_context: int | None = Field(None, ge=1)
    max_queue: int = Field(256, ge=1)
    served_model_name: str | None = None
    api_key: str | None = None
    host: str = "0.0.0.0"


def app_builder(args: RayAppArgs | dict[str, Any]):
    """The application for ``serve run`` / Serve config files (the same one ``infeng serve-ray`` runs)."""
    if not isinstance(args, RayAppArgs):
        args = RayAppArgs.model_validate(args)
    options = ServeOptions(host=args.host, max_seqs=args.max_seqs, max_context=args.max_context,
                           max_waiting=args.max_queue, served_model_name=args.served_model_name,
                           api_key=args.api_key or os.environ.get("INFENG_API_KEY"),
                           adapters={name: Path(path) for name, path in args.adapters.items()})
    return build_app(RayServeConfig(Path(args.artifact), options, replicas=args.replicas,
                                    min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                                    target_ongoing_requests=args.target_ongoing_requests,
                                    autoscaling_options=args.autoscaling_config,
                                    threads_per_replica=args.threads_per_replica,
                                    adapters_per_replica=args.adapters_per_replica,
                                    router_replicas=args.router_replicas))
