"""The IR text form: one line per node, a type on every value, weights declared with their source.

    graph @name(%tokens: i32[T], %positions: i32[T]) {
      meta {"family": "llama", ...}
      weight @model.norm.weight : f32[64] {file="/path/model.safetensors", offset=4096}
      weight @model.layers.0.mlp.up_proj.weight : q4g32m[256,64] {source="f32", inline=true}
      %h = embedding(%tokens, @model.embed_tokens.weight) : f32[T,64]
      %q, %k, %v = split(%qkv) : f32[T,64], f32[T,32], f32[T,32] {sizes=[64, 32, 32]}
      return %logits
      memory {arena_floats=1264, weights_bytes=1040128}
      arena %h {offset=0, size=64, live=[0, 5]}
      ...
    }

The ``memory`` lines are the plan ``plan-memory`` records (``ir/memory.py``), after ``return``.
"""
from __future__ import annotations

import json
from typing import Any

from .graph import Graph, Node, Weight


def format_attrs(attrs: dict[str, Any]) -> str:
    if not attrs:
        return ""
    return "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in attrs.items()) + "}"


def format_weight(w: Weight) -> str:
    """``weight @name : TYPE {...}``. TYPE names the storage: a weight a pass stores in another format
    than its source element type (``format``, e.g. 4-bit q4g32m) prints that format with its shape,
    and its source element type as ``source``: ``q4g32m[576,576] {source="f32", ...}``."""
    attrs = dict(w.attrs)
    storage = attrs.get("format")
    type_text = str(w.type)
    source: dict[str, Any] = {}
    if storage is not None and storage != w.type.dtype:
        del attrs["format"]
        type_text = f"{storage}[{','.join(str(d) for d in w.type.shape)}]"
        source["source"] = w.type.dtype
    if w.file is not None:
        source["file"] = w.file
        source["offset"] = w.offset
    elif w.array is not None or w.quant is not None:
        source["inline"] = True
    if w.transposed:
        source["transposed"] = True
    source.update(attrs)
    tail = f" {format_attrs(source)}" if source else ""
    return f"weight @{w.name} : {type_text}{tail}"


def format_node(n: Node) -> str:
    outs = ", ".join(f"%{v.name}" for v in n.outputs)
    operands = ", ".join([f"%{v.name}" for v in n.inputs] + [f"@{w.name}" for w in n.weights])
    types = ", ".join(str(v.type) for v in n.outputs)
    attrs = format_attrs(n.attrs)
    return f"{outs} = {n.op}({operands}) : {types}" + (f" {attrs}" if attrs else "")


def print_graph(g: Graph, weights: bool = True, meta_note: str | None = None) -> str:
    """The text form; ``meta_note``, when given, replaces the ``meta`` line by a comment saying
    where it was printed (``infeng ir --after all`` prints a long meta once)."""
    ins = ", ".join(f"%{v.name}: {v.type}" for v in g.inputs)
    lines = [f"graph @{g.name}({ins}) {{"]
    if g.meta:
        lines.append(f"  # meta {meta_note}" if meta_note else f"  meta {json.dumps(g.meta)}")
    if weights:
        lines += [f"  {format_weight(w)}" for w in g.weights.values()]
    lines += [f"  {format_node(n)}" for n in g.nodes]
    lines.append("  return " + ", ".join(f"%{v.name}" for v in g.outputs))
    if g.memory is not None:
        lines += [f"  {line}" for line in g.memory.text_lines()]
    lines.append("}")
    return "\n".join(lines) + "\n"
