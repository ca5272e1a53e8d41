"""``InfengEngine``, the engine replica: the artifact loaded once, the same ``Server`` as ``infeng
serve`` over its own engine loop, adapters as Ray Serve multiplexed models, metrics exported to Ray."""
from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from ray import serve

from infeng_common.errors import InfengError

from ..adapters import AdapterError
from ..api_errors import APIError
from ..request_log import configure_logging
from ..server import ServeOptions, Server, build_server
from .config import ForwardedRequest, error_messages

_log = logging.getLogger("infeng.ray")


#: Longest a replica waits for an adapter slot that running sequences hold.
ADAPTER_SLOT_WAIT_S = 300.0
#: How often a replica copies its metrics into Ray's, and how long /health trusts the controller's word.
METRICS_PERIOD_S = 2.0


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
                yield error_messages(APIError(500, f"the adapter {model_id!r} cannot be loaded: {e}", "server_error",
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
