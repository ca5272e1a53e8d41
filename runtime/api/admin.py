"""The endpoints around generation: ``GET /v1/models`` (the base model and its adapters),
``POST /v1/adapters`` / ``DELETE /v1/adapters/{name}`` (adapters loaded at runtime from under
``--adapter-root``), ``/health``, Prometheus ``/metrics`` and ``/version``."""
from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from infeng_common.errors import InfengError

from ..api_errors import APIError
from .bodies import AdapterBody, parse_body
from .core import SHUTTING_DOWN, RequestCore, post_routes, record_for

MAX_ADAPTER_NAME = 128


def router(core: RequestCore) -> APIRouter:
    routes = post_routes(core, {"/v1/adapters": load_adapter})

    @routes.get("/v1/models")
    async def models():
        return {"object": "list", "data": core.models()}

    @routes.get("/v1/models/{model:path}")
    async def model(model: str):
        for entry in core.models():
            if entry["id"] == model:
                return entry
        raise APIError(404, f"the model {model!r} does not exist", "not_found_error", "model", "model_not_found")

    @routes.delete("/v1/adapters/{name}")
    async def unload_adapter_route(name: str):
        return await unload_adapter(core, name)

    @routes.get("/version")
    async def version():
        return {"version": package_version()}

    @routes.get("/health")
    async def health():
        loop = core.loop
        if loop.error is not None or not loop.alive:
            reason = f": {loop.error}" if loop.error else ""
            return JSONResponse({"status": "error", "message": f"engine loop stopped{reason}"}, status_code=503)
        if core.draining:
            return JSONResponse({"status": "draining", "message": SHUTTING_DOWN}, status_code=503)
        return {"status": "ok"}

    @routes.get("/metrics")
    async def prometheus():
        return Response(core.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return routes


async def load_adapter(core: RequestCore, http: HTTPRequest):
    record = record_for(http)
    if not core.adapter_roots:
        raise APIError(403, "this server does not load adapters at runtime (start it with --adapter-root DIR "
                            "to allow adapter directories under DIR)", param="path", code="adapter_loads_disabled")
    core.admitting()
    body: AdapterBody = parse_body(AdapterBody, await http.body())
    name, given = body.name or body.lora_name, body.path or body.lora_path
    if not name or not given:
        raise APIError(400, "give the adapter's name and path: {\"name\": ..., \"path\": ...}",
                       param="name" if not name else "path")
    record.model = record.adapter = name
    if len(name) > MAX_ADAPTER_NAME or not name.isprintable() or any(c.isspace() or c == "/" for c in name):
        raise APIError(400, f"an adapter name has at most {MAX_ADAPTER_NAME} printable characters, no spaces "
                            f"and no '/'", param="name")
    if name == core.model_name:
        raise APIError(400, f"{name!r} is the base model's name", param="name")
    copies: list[Path] = []

    def load_from_a_copy() -> int:           # copies files: off the event loop
        with core.adapter_roots.snapshot(given) as path:     # a private copy of the files checked
            copies.append(path)
            return core.loop.load_adapter(name, path, body.scale).result()

    try:
        slot = await asyncio.to_thread(load_from_a_copy)
    except APIError:
        raise
    except InfengError as e:
        message = str(e)
        for path in copies:
            message = message.replace(str(path), given)
        raise APIError(400, message, param="path", code="adapter_load_failed") from None
    except Exception as e:                      # a file the readers choke on (safetensors, OS errors)
        raise APIError(400, f"the adapter at {given!r} cannot be read ({type(e).__name__})", param="path",
                       code="adapter_load_failed") from None
    return {"id": name, "object": "model", "parent": core.model_name, "root": name, "slot": slot}


async def unload_adapter(core: RequestCore, name: str):
    if name not in core.loop.adapters.served:
        raise APIError(404, f"no adapter named {name!r} is loaded", "not_found_error", "name", "model_not_found")
    try:
        await asyncio.wrap_future(core.loop.unload_adapter(name))
    except InfengError as e:
        raise APIError(404, str(e), "not_found_error", "name", "model_not_found") from None
    return {"id": name, "object": "model", "deleted": True}


def package_version() -> str:
    try:
        from importlib.metadata import version
        return version("infeng")
    except Exception:                              # not installed as a distribution
        return "0+unknown"
