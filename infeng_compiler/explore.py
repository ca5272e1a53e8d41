"""The IR explorer (docs/web.md): what every pass did to a model's graph, as data for a page.

``explorer_data`` runs a model's compile pipeline (as ``infeng ir --after all`` does), keeps a
snapshot of the graph after the import and after every pass, the diff between consecutive
snapshots, and the lowered step: for each node of the final graph, the kernel calls it lowers to
and each kernel's rendered C source. A per-node profile (``infeng bench --profile --node-profile
FILE``) adds time per node, share of the step, GB/s and roofline fraction.

The page (``explorer/``: html, js, css; text nodes only, never HTML from the data) is served by
``infeng explore`` or written into one self-contained file by ``infeng ir --html FILE``.
``model_explorer_graph`` writes the same nodes in Google Model Explorer's JSON graph format, and
``model_explorer_node_data`` the profile as its node data (the heat overlay there).
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np

from infeng_common.errors import InfengError

from .codegen.target import Target
from .ir.graph import Graph, Node, Weight
from .ir.printer import format_node

#: Kernel calls kept per node (a node lowered to more shows its first ones).
MAX_CALLS_PER_NODE = 8
LAYER_OF_VALUE = re.compile(r"^l(\d+)\.")
LAYER_OF_WEIGHT = re.compile(r"\blayers\.(\d+)\.")
PAGE_FILES = ("explorer.html", "explorer.js", "explorer.css")


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.ndarray):
        return f"array{list(value.shape)} {value.dtype}"
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def node_id(n: Node, index: int) -> str:
    """A node's name in every stage: its first result (``l3.q``), as the profile names it."""
    return n.outputs[0].name if n.outputs else f"#{index}"


def layer_of(n: Node) -> int | None:
    """The transformer layer a node belongs to, from its result or weight names (None: outside)."""
    for v in n.outputs:
        match = LAYER_OF_VALUE.match(v.name)
        if match:
            return int(match.group(1))
    for w in n.weights:
        match = LAYER_OF_WEIGHT.search(w.name)
        if match:
            return int(match.group(1))
    return None


def weight_view(w: Weight, with_stats: bool) -> dict[str, Any]:
    from .codegen.lower import weight_nbytes

    view: dict[str, Any] = {"name": w.name, "type": str(w.type), "format": w.format, "bytes": weight_nbytes(w)}
    if with_stats:
        try:
            data = w.numpy_f32()
        except (InfengError, OSError, ValueError) as e:    # a weight without data (parsed from text)
            view["stats_error"] = str(e)
            return view
        view["stats"] = {"min": float(data.min()), "max": float(data.max()), "mean": float(data.mean()),
                         "std": float(data.std()), "abs_mean": float(np.abs(data).mean()),
                         "zeros": float((data == 0).mean())}
    return view


def snapshot(g: Graph, with_stats: bool = False) -> list[dict[str, Any]]:
    """The graph's nodes as the page shows them (the same graph object changes pass after pass)."""
    return [{"id": node_id(n, i), "op": n.op, "text": format_node(n), "layer": layer_of(n),
             "inputs": [v.name for v in n.inputs],
             "outputs": [{"name": v.name, "type": str(v.type), "dtype": v.type.dtype,
                          "shape": [str(d) for d in v.type.shape]} for v in n.outputs],
             "weights": [weight_view(w, with_stats) for w in n.weights],
             "attrs": _json_safe(n.attrs)} for i, n in enumerate(g.nodes)]


def stage_diff(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, list]:
    """Nodes added, removed and changed (same id, another IR line) from ``before`` to ``after``."""
    old = {n["id"]: n["text"] for n in before}
    new = {n["id"]: n["text"] for n in after}
    return {"added": [i for i in new if i not in old],
            "removed": [{"id": i, "text": old[i]} for i in old if i not in new],
            "changed": [{"id": i, "before": old[i], "after": new[i]} for i in new if i in old and old[i] != new[i]]}


def kernel_views(graph: Graph, target: Target, max_tokens: int, block_size: int) -> tuple[dict, dict[str, str], str]:
    """(node id -> its kernel calls, kernel symbol -> rendered C source, the lowering's summary line)."""
    from .codegen.kernels import render_kernel
    from .codegen.lower import describe, lower

    lowered = lower(graph, target, max_tokens=max_tokens, block_size=block_size)
    ids = [node_id(n, i) for i, n in enumerate(graph.nodes)]
    calls: dict[str, list[dict[str, Any]]] = {}
    sources: dict[str, str] = {}
    for call in lowered.calls:
        entries = calls.setdefault(ids[call.node], [])
        if len(entries) >= MAX_CALLS_PER_NODE:
            continue
        if call.spec is None:
            entries.append({"code": call.code, "guard": call.guard})
            continue
        symbol = call.spec.symbol
        if symbol not in sources:
            sources[symbol] = render_kernel(call.spec)
        entries.append({"symbol": symbol, "isa": call.spec.isa, "args": call.args, "guard": call.guard,
                        "params": {k: _json_safe(v) for k, v in call.spec.params}})
    return calls, sources, describe(lowered).splitlines()[0].lstrip("# ")


def read_node_profile(path: Path) -> dict[str, Any]:
    """A per-node profile written by ``infeng bench --profile --node-profile FILE``."""
    try:
        profile = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InfengError(f"{path}: not a node profile ({e})") from None
    if not isinstance(profile, dict) or not isinstance(profile.get("nodes"), list):
        raise InfengError(f"{path}: not a node profile (write one with infeng bench ARTIFACT --profile "
                          f"--node-profile FILE)")
    return profile


def explorer_data(model: str | Path, options, profile: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every stage of ``model``'s pipeline under ``options`` (a ``CompileOptions``), diffs, kernels
    and C sources of the final graph, and ``profile`` (``read_node_profile``) when given."""
    from .codegen.target import get_target
    from .compile import run_pipeline

    stages: list[dict[str, Any]] = []

    def keep(name: str, g: Graph) -> None:
        nodes = snapshot(g)
        diff = stage_diff(stages[-1]["nodes"], nodes) if stages else None
        stages.append({"name": name, "nodes": nodes, "diff": diff})

    passed = run_pipeline(model, options, after=keep)
    graph = passed.graph
    target = get_target(options.target)
    calls, sources, summary = kernel_views(graph, target, options.max_tokens, options.block_size)
    final = snapshot(graph, with_stats=True)
    for n in final:
        n["kernels"] = calls.get(n["id"], [])
    stages.append({"name": "lower", "nodes": final, "diff": stage_diff(stages[-1]["nodes"], final),
                   "note": summary})
    records = {r.name: r for r in passed.manager.records}
    for stage in stages:
        record = records.get(stage["name"])
        if record is not None:
            stage.update(seconds=record.seconds, tolerance=record.tolerance, args=record.args)
    return {"model": graph.name, "source": str(model), "target": target.name, "stages": stages, "sources": sources,
            "profile": profile}


def explorer_html(data: dict[str, Any]) -> str:
    """One self-contained HTML file: the page with its script, style and ``data`` inline, behind a
    CSP (a meta tag) that allows exactly that script and style and no request anywhere."""
    page = _page_file("explorer.html")
    style = _page_file("explorer.css")
    script = _page_file("explorer.js")
    payload = json.dumps(data).replace("</", "<\\/")     # nothing in the data can end the script element
    policy = (f"default-src 'none'; script-src '{_csp_hash(script)}'; style-src '{_csp_hash(style)}'; "
              f"img-src data:; base-uri 'none'; form-action 'none'")
    page = page.replace('<meta charset="utf-8">',
                        f'<meta charset="utf-8">\n<meta http-equiv="Content-Security-Policy" content="{policy}">')
    page = page.replace('<link rel="stylesheet" href="explorer.css">', f"<style>{style}</style>")
    return page.replace('<script src="explorer.js" defer></script>',
                        f'<script type="application/json" id="ir-data">{payload}</script>\n<script>{script}</script>')


def _csp_hash(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def serve_explorer(data: dict[str, Any], host: str, port: int, announce: Callable[[str], None]) -> None:
    """Serve the page and ``data`` at http://HOST:PORT/ until interrupted (``infeng explore``)."""
    import uvicorn
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import Response

    from infeng_runtime.http_guard import AccessGuard, AccessPolicy, is_loopback_address
    from infeng_runtime.web import page_headers, page_response

    app = FastAPI(title="infeng explore", docs_url=None, redoc_url=None, openapi_url=None)
    # bound to loopback, it answers only requests addressed to loopback (no DNS rebinding), as serve does
    app.add_middleware(AccessGuard, policy=AccessPolicy(loopback_only=is_loopback_address(host)))
    payload = json.dumps(data)

    @app.get("/")
    async def page() -> Response:
        return page_response("explorer.html", _page_file("explorer.html"))

    @app.get("/data.json")
    async def graph_data() -> Response:
        return Response(payload, media_type="application/json", headers=page_headers())

    @app.get("/{name}")
    async def asset(name: str) -> Response:
        if name not in PAGE_FILES:
            raise HTTPException(404)
        return page_response(name, _page_file(name))

    from infeng_runtime.server import bind_listener

    listener = bind_listener(host, port)
    shown = f"[{host}]" if ":" in host else host
    announce(f"IR explorer: http://{shown}:{port}/ (Ctrl-C stops it)")
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])


def _page_file(name: str) -> str:
    return (files(__package__) / "explorer" / name).read_text(encoding="utf-8")


def model_explorer_graph(data: dict[str, Any]) -> dict[str, Any]:
    """The final stage in Model Explorer's JSON graph format (a GraphCollection): nodes with their
    layer as namespace, IR line, weights, kernels and profile as attributes, edges by value."""
    stage = data["stages"][-1]
    timing = {n["name"]: n for n in (data.get("profile") or {}).get("nodes", [])}
    producers: dict[str, tuple[str, int]] = {}
    nodes = []
    for n in stage["nodes"]:
        for i, out in enumerate(n["outputs"]):
            producers[out["name"]] = (n["id"], i)
    inputs = sorted({v for n in stage["nodes"] for v in n["inputs"] if v not in producers})
    for name in inputs:
        nodes.append({"id": f"input:{name}", "label": "input", "namespace": "",
                      "attrs": [{"key": "name", "value": name}], "incomingEdges": [],
                      "outputsMetadata": [{"id": "0", "attrs": [{"key": "tensor_name", "value": name}]}]})
        producers[name] = (f"input:{name}", 0)
    for n in stage["nodes"]:
        attrs = [{"key": "ir", "value": n["text"]}]
        attrs += [{"key": k, "value": json.dumps(v)} for k, v in n["attrs"].items()]
        for w in n["weights"]:
            attrs.append({"key": f"weight {w['name']}", "value": f"{w['format']} {w['type']} {w['bytes']} bytes"})
        for k in n.get("kernels", []):
            attrs.append({"key": "kernel", "value": k.get("symbol") or k.get("code", "")})
        for key in ("ms", "pct_of_step", "gb_s", "roofline_frac"):
            if n["id"] in timing and timing[n["id"]].get(key) is not None:
                attrs.append({"key": key, "value": str(timing[n["id"]][key])})
        namespace = f"layer_{n['layer']}" if n["layer"] is not None else ""
        nodes.append({
            "id": n["id"], "label": n["op"], "namespace": namespace, "attrs": attrs,
            "incomingEdges": [{"sourceNodeId": producers[v][0], "sourceNodeOutputId": str(producers[v][1]),
                               "targetNodeInputId": str(i)} for i, v in enumerate(n["inputs"]) if v in producers],
            "outputsMetadata": [{"id": str(i), "attrs": [{"key": "tensor_name", "value": o["name"]},
                                                         {"key": "shape", "value": "[" + ", ".join(o["shape"]) + "]"},
                                                         {"key": "dtype", "value": o["dtype"]}]}
                                for i, o in enumerate(n["outputs"])]})
    return {"label": f"{data['model']} ({data['target']})", "graphs": [{"id": data["model"], "nodes": nodes}]}


def model_explorer_node_data(data: dict[str, Any]) -> dict[str, Any]:
    """The profile's share of the step per node as Model Explorer node data (a ``ModelNodeData``:
    graph id -> results and a white-to-red gradient), the heat overlay of ``model_explorer_graph``."""
    rows = (data.get("profile") or {}).get("nodes", [])
    return {data["model"]: {"results": {row["name"]: {"value": row["pct_of_step"]} for row in rows},
                            "gradient": [{"stop": 0, "bgColor": "#ffffff"}, {"stop": 1, "bgColor": "#ff0000"}]}}
