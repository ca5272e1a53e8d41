"""Other views of a graph: JSON (round-trips) and Graphviz DOT (for reading, via networkx)."""
from __future__ import annotations

import json

from .graph import Graph, Weight
from .memory import MemoryPlan
from .types import parse_type


def to_json(g: Graph) -> str:
    doc = {
        "name": g.name,
        "meta": g.meta,
        "inputs": [{"name": v.name, "type": str(v.type)} for v in g.inputs],
        "weights": [{"name": w.name, "type": str(w.type), "file": w.file, "offset": w.offset,
                     "transposed": w.transposed, "attrs": w.attrs} for w in g.weights.values()],
        "nodes": [{"op": n.op, "inputs": [v.name for v in n.inputs], "weights": [w.name for w in n.weights],
                   "outputs": [{"name": v.name, "type": str(v.type)} for v in n.outputs], "attrs": n.attrs}
                  for n in g.nodes],
        "outputs": [v.name for v in g.outputs],
        "memory": g.memory.as_dict() if g.memory is not None else None,
    }
    return json.dumps(doc, indent=1)


def from_json(text: str) -> Graph:
    from .verify import verify

    doc = json.loads(text)
    g = Graph(doc["name"], doc["meta"])
    values = {}
    for v in doc["inputs"]:
        values[v["name"]] = g.add_input(v["name"], parse_type(v["type"]))
    for w in doc["weights"]:
        g.add_weight(Weight(w["name"], parse_type(w["type"]), w["file"], w["offset"], w["transposed"],
                            attrs=w["attrs"]))
    for n in doc["nodes"]:
        node = g.add_node(n["op"], [values[x] for x in n["inputs"]], [g.weights[x] for x in n["weights"]],
                          n["attrs"], out_types=[parse_type(o["type"]) for o in n["outputs"]],
                          out_names=[o["name"] for o in n["outputs"]])
        values.update({v.name: v for v in node.outputs})
    g.outputs = [values[x] for x in doc["outputs"]]
    if doc.get("memory") is not None:
        g.memory = MemoryPlan.from_dict(doc["memory"])
    verify(g)
    return g


def to_dot(g: Graph) -> str:
    """DOT text of ``g.to_networkx()``: ops as boxes, weights as notes, inputs as ellipses."""
    nxg = g.to_networkx()
    shapes = {"op": "box", "weight": "note", "input": "ellipse"}
    lines = [f'digraph "{g.name}" {{', "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
    for key, data in nxg.nodes(data=True):
        label = data["label"].replace('"', '\\"').replace("\n", "\\n")
        lines.append(f'  "{key}" [shape={shapes[data["kind"]]}, label="{label}"];')
    for a, b in nxg.edges():
        lines.append(f'  "{a}" -> "{b}";')
    lines.append("}")
    return "\n".join(lines) + "\n"
