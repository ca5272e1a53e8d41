"""Graph-rewriting helpers shared by the ONNX passes (``fold-shapes``, ``raise``, ``dce``): probe
evaluation of a single sequence (through the interpreter), the set of values that depend only on
the sequence length, dead-code elimination, node construction at a position.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..interp import Interpreter, KVStore, Step
from ..ir import Graph, Node, TensorType, Value

#: The two sequence lengths an ONNX import evaluates every node at (the frontend, to declare types;
#: ``fold-shapes``, to fold shapes); their difference tells ``T`` from constants.
PROBE_LENGTHS = (7, 12)
#: Inline constants up to this many elements are printed as values, larger ones become weights.
INLINE_LIMIT = 16


def probe_step(length: int) -> Step:
    """The step a probe evaluation runs: one sequence of ``length`` tokens from position 0."""
    return Step(np.zeros(length, dtype=np.int32), np.arange(length), KVStore())


def probe_inputs(graph: Graph, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    vocab = int(graph.meta.get("vocab_size") or 2)
    return {"tokens": np.random.default_rng(seed).integers(0, vocab, size=length).astype(np.int32),
            "positions": np.arange(length, dtype=np.int32)}


def evaluate(graph: Graph, length: int, only: set[str] | None = None,
             env: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Every value of ``graph`` (or of the nodes producing ``only``) for one probe sequence."""
    env = dict(env or probe_inputs(graph, length))
    nodes = [n for n in graph.nodes if only is None or any(v.name in only for v in n.outputs)]
    produced = {v.name for n in nodes for v in n.outputs}
    for node in nodes:
        x = node.inputs[0] if node.op == "shape" else None
        if x is not None and x.name not in env and x.name not in produced:   # only its shape is read
            env[x.name] = placeholder(x.type, length)
    return Interpreter(graph).run(env, probe_step(length), nodes)


def placeholder(vtype: TensorType, length: int) -> np.ndarray:
    """An array of type ``vtype`` at sequence length ``length`` (contents undefined)."""
    dims = [length + (int(d[1:]) if len(d) > 1 else 0) if isinstance(d, str) else d for d in vtype.shape]
    return np.zeros(dims, dtype=np.bool_ if vtype.dtype == "bool" else np.float32)


def length_only_values(graph: Graph) -> set[str]:
    """Values that depend only on the sequence length: shapes, constants, positions (a probe's
    positions are 0..T-1) and whatever is computed from them alone."""
    static = {"positions"}
    for n in graph.nodes:
        if n.op == "shape" or all(v.name in static for v in n.inputs):
            static.update(v.name for v in n.outputs)
    return static


def weight_derived_values(graph: Graph) -> set[str]:
    """Values computed from a weight (folding them would copy the weight into the graph)."""
    heavy: set[str] = set()
    for n in graph.nodes:
        if n.op != "shape" and (n.weights or any(v.name in heavy for v in n.inputs)):
            heavy.update(v.name for v in n.outputs)
    return heavy


def dead_code_elimination(graph: Graph) -> bool:
    """Drop nodes whose results nobody reads and weights no node uses."""
    live = {v.name for v in graph.outputs}
    kept = []
    for n in reversed(graph.nodes):
        if any(v.name in live for v in n.outputs):
            kept.append(n)
            live.update(v.name for v in n.inputs)
    changed = len(kept) != len(graph.nodes)
    graph.nodes = kept[::-1]
    used = {w.name for n in graph.nodes for w in n.weights}
    dead_weights = [name for name in graph.weights if name not in used]
    for name in dead_weights:
        del graph.weights[name]
    graph.rebuild_names()
    return changed or bool(dead_weights)


def make_node(graph: Graph, op: str, inputs: list[Value], weights=None, attrs: dict[str, Any] | None = None,
              name: str | None = None, out_types: list[TensorType] | None = None,
              out_names: list[str] | None = None) -> Node:
    """A node built like ``Graph.add_node`` but not placed; ``place`` puts it in."""
    node = graph.add_node(op, inputs, weights, attrs, name=None if out_names else graph.fresh(name or op),
                          out_types=out_types, out_names=out_names)
    graph.nodes.pop()
    return node


def place(graph: Graph, nodes: list[Node], before: Node) -> None:
    at = graph.nodes.index(before)
    graph.nodes[at:at] = nodes
