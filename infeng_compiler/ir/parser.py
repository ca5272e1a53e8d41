"""Parser for the IR text form written by ``printer.py``; ``parse(print_graph(g)) == g``."""
from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from infeng_common.errors import IRError

from .graph import Graph, Weight
from .memory import PLAN_KEYWORDS, parse_plan_line
from .types import parse_type

_NAME = r"[A-Za-z_][\w.\-+]*"
_HEADER = re.compile(rf"^graph @({_NAME})\((.*)\)\s*\{{$")
_WEIGHT = re.compile(rf"^weight @({_NAME}) : ([a-z0-9]+\[[^\]]*\])\s*(\{{.*\}})?$")
_NODE = re.compile(rf"^((?:%{_NAME})(?:\s*,\s*%{_NAME})*)\s*=\s*([a-z_0-9]+)\((.*?)\)\s*:\s*(.*)$")
_TYPE = re.compile(r"[a-z0-9]+\[[^\]]*\]")


def parse_attrs(text: str, where: str) -> dict[str, Any]:
    """Parse ``{key=<json>, key=<json>}``."""
    text = text.strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise IRError(f"{where}: attributes must be in braces: {text!r}")
    decoder = json.JSONDecoder()
    attrs: dict[str, Any] = {}
    i, body = 0, text[1:-1]
    while True:
        while i < len(body) and body[i] in " ,":
            i += 1
        if i >= len(body):
            return attrs
        eq = body.find("=", i)
        if eq < 0:
            raise IRError(f"{where}: expected key=value in {text!r}")
        key = body[i:eq].strip()
        try:
            value, i = decoder.raw_decode(body, eq + 1)
        except json.JSONDecodeError as e:
            raise IRError(f"{where}: bad value for attribute {key!r}: {e}") from None
        attrs[key] = value


def parse(text: str, arrays: dict[str, np.ndarray] | None = None) -> Graph:
    """Parse IR text. ``arrays`` supplies data for weights declared ``inline``."""
    arrays = arrays or {}
    lines = [(i + 1, ln.strip()) for i, ln in enumerate(text.splitlines())]
    lines = [(i, ln) for i, ln in lines if ln and not ln.startswith("#")]
    if not lines:
        raise IRError("empty IR text")
    lineno, first = lines[0]
    m = _HEADER.match(first)
    if not m:
        raise IRError(f"line {lineno}: expected 'graph @name(inputs) {{', got {first!r}")
    g = Graph(m.group(1))
    values: dict[str, Any] = {}
    for part in _split_top(m.group(2)):
        name, _, type_text = part.partition(":")
        name = name.strip().lstrip("%")
        values[name] = g.add_input(name, parse_type(type_text))

    for lineno, ln in lines[1:]:
        where = f"line {lineno}"
        if ln == "}":
            break
        if ln.startswith("meta "):
            g.meta = json.loads(ln[5:])
        elif ln.startswith("weight "):
            _parse_weight(g, ln, where, arrays)
        elif ln.startswith("return"):
            names = [n.strip().lstrip("%") for n in ln[len("return"):].split(",") if n.strip()]
            g.outputs = [_lookup(values, n, where) for n in names]
        elif ln.split(" ", 1)[0] in PLAN_KEYWORDS:
            g.memory = parse_plan_line(g.memory, ln, where, parse_attrs)
        else:
            _parse_node(g, ln, where, values)
    from .verify import verify

    verify(g)
    return g


def _parse_weight(g: Graph, ln: str, where: str, arrays: dict[str, np.ndarray]) -> None:
    m = _WEIGHT.match(ln)
    if not m:
        raise IRError(f"{where}: bad weight declaration {ln!r}")
    attrs = parse_attrs(m.group(3), where) if m.group(3) else {}
    name, type_text = m.group(1), m.group(2)
    source = attrs.pop("source", None)
    if source is not None:                  # q4g32m[576,576] {source="f32"}: stored as q4g32m
        storage, bracket, dims = type_text.partition("[")
        type_text = f"{source}{bracket}{dims}"
        attrs["format"] = storage
    w = Weight(name, parse_type(type_text), file=attrs.pop("file", None), offset=attrs.pop("offset", 0),
               transposed=attrs.pop("transposed", False))
    if attrs.pop("inline", False) or name in arrays:
        w.array = arrays.get(name)
    w.attrs = attrs
    g.add_weight(w)


def _parse_node(g: Graph, ln: str, where: str, values: dict[str, Any]) -> None:
    m = _NODE.match(ln)
    if not m:
        raise IRError(f"{where}: cannot parse {ln!r}")
    out_names = [n.strip().lstrip("%") for n in m.group(1).split(",")]
    op = m.group(2)
    type_text, brace, attr_text = m.group(4).partition("{")   # types never contain braces
    types = [parse_type(t) for t in _TYPE.findall(type_text)]
    attrs = parse_attrs(brace + attr_text, where) if brace else {}
    if len(types) != len(out_names):
        raise IRError(f"{where}: {len(out_names)} results but {len(types)} types")
    ins, ws = [], []
    for operand in (o.strip() for o in m.group(3).split(",") if o.strip()):
        if operand.startswith("%"):
            ins.append(_lookup(values, operand[1:], where))
        elif operand.startswith("@"):
            if operand[1:] not in g.weights:
                raise IRError(f"{where}: weight {operand} is not declared")
            ws.append(g.weights[operand[1:]])
        else:
            raise IRError(f"{where}: operand {operand!r} is neither %value nor @weight")
    node = g.add_node(op, ins, ws, attrs, out_types=types, out_names=out_names)
    for v in node.outputs:
        values[v.name] = v


def _lookup(values: dict[str, Any], name: str, where: str):
    if name not in values:
        raise IRError(f"{where}: %{name} is used before it is defined")
    return values[name]


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p for p in parts if p.strip()]
