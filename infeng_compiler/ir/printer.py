"""The IR text form: one line per node, a type on every value, weights declared with their source.

    graph @name(%tokens: i32[T], %positions: i32[T]) {
      meta {"family": "llama", ...}
      weight @model.norm.weight : f32[64] {file="/path/model.safetensors", offset=4096}
      %h = embedding(%tokens, @model.embed_tokens.weight) : f32[T,64]
      %q, %k, %v = split(%qkv) : f32[T,64], f32[T,32], f32[T,32] {sizes=[64, 32, 32]}
      return %logits
    }
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
    source: dict[str, Any] = {}
    if w.file is not None:
        source["file"] = w.file
        source["offset"] = w.offset
    elif w.array is not None or w.quant is not None:
        source["inline"] = True
    if w.transposed:
        source["transposed"] = True
    source.update(w.attrs)
    tail = f" {format_attrs(source)}" if source else ""
    return f"weight @{w.name} : {w.type}{tail}"


def format_node(n: Node) -> str:
    outs = ", ".join(f"%{v.name}" for v in n.outputs)
    operands = ", ".join([f"%{v.name}" for v in n.inputs] + [f"@{w.name}" for w in n.weights])
    types = ", ".join(str(v.type) for v in n.outputs)
    attrs = format_attrs(n.attrs)
    return f"{outs} = {n.op}({operands}) : {types}" + (f" {attrs}" if attrs else "")


def print_graph(g: Graph, weights: bool = True) -> str:
    ins = ", ".join(f"%{v.name}: {v.type}" for v in g.inputs)
    lines = [f"graph @{g.name}({ins}) {{"]
    if g.meta:
        lines.append(f"  meta {json.dumps(g.meta)}")
    if weights:
        lines += [f"  {format_weight(w)}" for w in g.weights.values()]
    lines += [f"  {format_node(n)}" for n in g.nodes]
    lines.append("  return " + ", ".join(f"%{v.name}" for v in g.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"
