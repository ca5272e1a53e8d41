"""``serve`` (the OpenAI HTTP API) and ``serve-ray`` (the same on Ray Serve): their parameters are
generated from ``ServeOptions`` and ``RayServeConfig`` (and ``CompileOptions`` for a model that is
not an artifact)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from infeng_common.errors import InfengError
from infeng_runtime.api.options import ServeOptions
from infeng_runtime.ray_options import RayServeConfig

from .app import app, fails_cleanly
from .compile_cmds import SERVE_COMPILE, SERVING_MAX_ADAPTERS, compile_options, serving_artifact, serving_max_adapters
from .params import OptionGroup, takes


#: What ``serve`` offers of ``ServeOptions``: all of it; ``serve-ray`` offers the address of Ray's
#: HTTP proxy and these per replica (its replicas' threads are ``--threads-per-replica``).
SERVE = OptionGroup(ServeOptions, panel="Server")
RAY_PROXY = OptionGroup(ServeOptions, panel="Ray's HTTP proxy", only=("host", "port"))
RAY_REPLICA = OptionGroup(ServeOptions, panel="Each replica",
                          only=("max_seqs", "max_context", "max_queue", "served_model_name",
                                "api_key", "max_request_bytes", "kv_memory", "max_batched_tokens", "prefix_cache",
                                "trust_request_chat_template", "shutdown_timeout", "always_include_usage",
                                "log_format", "log_level", "speculative", "adapters"))


@app.command("serve")
@fails_cleanly
@takes(SERVE, SERVE_COMPILE)
def serve_command(model: str = typer.Argument(..., help="compiled artifact, or a model (dir, .gguf, .onnx, Hub id) "
                                                           "compiled into the artifact cache first"),
                  max_adapters: Optional[int] = typer.Option(None, "--max-adapters", min=0,
                                                             rich_help_panel=SERVE_COMPILE.panel,
                                                             help="LoRA slots when compiling MODEL (default: 4 with "
                                                                  "--adapter or --adapter-root, else none)"),
                  **values):
    """Serve MODEL over the OpenAI HTTP API (completions, chat, SSE streaming, adapters, /metrics)
    and a chat page at / (docs/web.md).

    A model that is not an artifact is compiled first with the compile options, into a
    content-addressed cache: the next start with the same model and options reuses it."""
    from infeng_runtime.server import serve

    options = ServeOptions(**SERVE.values(values))
    options.check()
    slots = serving_max_adapters(max_adapters, len(options.adapters), bool(options.adapter_roots))
    artifact = serving_artifact(model, compile_options(SERVE_COMPILE, values, max_adapters=slots))
    serve(artifact, options)


@app.command("serve-ray")
@fails_cleanly
@takes(OptionGroup(RayServeConfig, panel="Replicas"), RAY_PROXY, RAY_REPLICA, SERVE_COMPILE)
def serve_ray_command(model: Path = typer.Argument(..., help="compiled artifact, or a model compiled into the "
                                                               "artifact cache first (every node must see the path)"),
                      address: Optional[str] = typer.Option(None, "--address",
                                                            help="join this Ray cluster (default: start one here)"),
                      max_adapters: Optional[int] = SERVING_MAX_ADAPTERS, **values):
    """Serve MODEL on Ray Serve: engine replicas behind one OpenAI router.

    Adapters are placed on replicas by Ray's model multiplexing, replicas autoscale on requests in
    flight (docs/scale-out.md). Starts a Ray cluster here, or joins --address (or $RAY_ADDRESS);
    serves until SIGINT/SIGTERM. Each replica takes the options of `infeng serve`."""
    try:
        from infeng_runtime.ray_serve import deploy
    except ImportError as e:
        raise InfengError(f"serve-ray needs Ray Serve: pip install 'infeng[ray]' ({e})") from None

    ray_values = OptionGroup(RayServeConfig).values(values)
    options = ServeOptions(**RAY_PROXY.values(values), **RAY_REPLICA.values(values),
                           threads=ray_values["threads_per_replica"])
    RayServeConfig(model, options, **ray_values).check_options()       # before MODEL is compiled
    artifact = serving_artifact(model, compile_options(
        SERVE_COMPILE, values, max_adapters=serving_max_adapters(max_adapters, len(options.adapters))))
    config = RayServeConfig(artifact, options, **ray_values)
    config.check()
    deploy(config, address=address)
