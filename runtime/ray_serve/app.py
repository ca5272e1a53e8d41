"""Building and deploying the application: ``build_app`` (the two deployments), ``deploy`` (``infeng
serve-ray``: a local or given Ray cluster, until SIGTERM) and ``app_builder`` (Ray's config files)."""
from __future__ import annotations

import logging
import os
from dataclasses import MISSING, Field, fields, replace
from pathlib import Path
from typing import Any, Optional, get_type_hints

from pydantic import ConfigDict, create_model
from pydantic import Field as PydanticField
from ray import serve

from infeng_common.errors import InfengError
from infeng_common.options import Flag, flags

from ..api.options import ServeOptions
from ..request_log import configure_logging
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


def _app_argument(spec: Flag, hint: Any, declared: Field) -> tuple[Any, Any]:
    """An option's argument of ``app_builder``: the field's type (text for a value ``spec.parse``
    reads), its default, help and numeric range."""
    if spec.parse is not None:
        default = None if declared.default in (None, MISSING) else spec.text(declared.default)
        return Optional[str], PydanticField(default, description=spec.help)
    numeric = hint in (int, float, Optional[int], Optional[float])
    bounds = {"ge": spec.low, "le": spec.high} if numeric else {}
    if declared.default_factory is not MISSING:
        return hint, PydanticField(default_factory=declared.default_factory, description=spec.help)
    return hint, PydanticField(APP_DEFAULTS.get(declared.name, declared.default), description=spec.help, **bounds)


#: Where the app builder's default differs from the command line's: replicas listen on every interface.
APP_DEFAULTS = {"host": "0.0.0.0"}
#: Options the app builder does not take: a replica's threads are ``threads_per_replica``.
NOT_APP_ARGUMENTS = ("threads",)


def _app_arguments(options_class: type) -> dict[str, tuple[Any, Any]]:
    hints = get_type_hints(options_class)
    return {f.name: _app_argument(f.metadata["flag"], hints[f.name], f) for f in fields(options_class)
            if "flag" in f.metadata and f.name not in NOT_APP_ARGUMENTS}


#: The arguments of ``app_builder``, for ``serve run infeng_runtime.ray_serve:app_builder
#: artifact=DIR replicas=2`` or an ``args:`` block of a Serve config file: every option of
#: ``RayServeConfig`` and ``ServeOptions`` by its field name, generated from their declarations.
RayAppArgs = create_model(
    "RayAppArgs", __config__=ConfigDict(extra="forbid", coerce_numbers_to_str=True),
    artifact=(str, ...), autoscaling_config=(dict[str, Any], PydanticField(default_factory=dict)),
    **_app_arguments(RayServeConfig), **_app_arguments(ServeOptions))


def _declared_values(options_class: type, args: dict[str, Any]) -> dict[str, Any]:
    """The values of ``options_class``'s declared options among ``args``: text parsed, an unset
    option with an environment variable read from it."""
    values = {}
    for name, spec in flags(options_class):
        if name in args:
            value = args[name]
            if value is None and spec.env:
                value = os.environ.get(spec.env)
            values[name] = spec.parse(value, spec.flag) if spec.parse and value is not None else value
    return values


def app_builder(args: Any):
    """The application for ``serve run`` / Serve config files (the same one ``infeng serve-ray`` runs)."""
    if not isinstance(args, RayAppArgs):
        args = RayAppArgs.model_validate(args)
    given = args.model_dump()
    options = ServeOptions(**_declared_values(ServeOptions, given))
    return build_app(RayServeConfig(Path(args.artifact), options, autoscaling_options=args.autoscaling_config,
                                    **_declared_values(RayServeConfig, given)))
