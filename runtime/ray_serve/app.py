"""Building and deploying the application: ``build_app`` (the two deployments), ``deploy`` (``infeng
serve-ray``: a local or given Ray cluster, until SIGTERM) and ``app_builder`` (Ray's config files)."""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from infeng_common.errors import InfengError

from ..request_log import configure_logging
from ..server import ServeOptions
from .config import ENGINE_DEPLOYMENT, ROUTER_DEPLOYMENT, RayServeConfig, adapter_slots
from .replica import InfengEngine
from .router import InfengRouter

_log = logging.getLogger("infeng.ray")


def build_app(config: RayServeConfig):
    """The Ray Serve application (router bound to the engine deployment) for ``config``."""
    config.check()
    options = config.options
    slots = adapter_slots(config.artifact)
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
