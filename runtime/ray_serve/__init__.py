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

config.py (what router and replicas exchange; ``RayServeConfig`` is declared in ``ray_options.py``,
outside this package, so the command line reads it without Ray), replica.py (``InfengEngine``),
router.py (``InfengRouter``), app.py (``build_app``, ``deploy``, ``app_builder``, whose arguments
``RayAppArgs`` are generated from the option declarations). This package
imports ``ray`` (the ``infeng[ray]`` extra); nothing else in the runtime imports it.
"""
from .app import RayAppArgs, app_builder, build_app, deploy
from .config import ENGINE_DEPLOYMENT, ROUTER_DEPLOYMENT, ForwardedRequest, RayServeConfig
from .replica import InfengEngine
from .router import InfengRouter

__all__ = ["ENGINE_DEPLOYMENT", "ROUTER_DEPLOYMENT", "ForwardedRequest", "InfengEngine", "InfengRouter", "RayAppArgs",
           "RayServeConfig", "app_builder", "build_app", "deploy"]
