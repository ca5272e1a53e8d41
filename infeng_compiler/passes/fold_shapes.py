"""Pass ``fold-shapes``: constant-fold the shape arithmetic of an imported ONNX graph, keeping the
sequence length symbolic.

A value that depends only on the sequence length (``Shape`` of anything, constants, positions,
and what is computed from them alone) is evaluated at two probe lengths. Equal at both: it is a
constant and becomes ``const``. A 1-D integer vector (or scalar) whose entries are each either
equal at both lengths or grow exactly with the length is a shape: it becomes ``const`` with "T"
("T+k") entries, e.g. ``{value=[1, "T", 4, 16]}``. Everything else that depends on the length
(the causal mask, rotary cos/sin tables, position ranges) stays computed: the ``raise`` pass
recognises it by value. Values computed from weights are never folded (that would copy weights).
The assumption is the usual one of symbolic shape inference: shape arithmetic that is affine in
the length at two lengths is affine at all lengths.
"""
from __future__ import annotations

import numpy as np

from ..ir import Graph, TensorType, Weight
from .context import PassContext
from .rewrite import (
    INLINE_LIMIT,
    PROBE_LENGTHS,
    dead_code_elimination,
    evaluate,
    length_only_values,
    make_node,
    place,
    weight_derived_values,
)

#: Folded constants up to this many elements are inline values; larger ones become inline weights.
_MAX_FOLD = 1 << 16


class FoldShapes:
    name = "fold-shapes"
    tolerance = 0.0

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        static = length_only_values(graph) - weight_derived_values(graph)
        wanted = {v.name for n in graph.nodes if n.op != "const" for v in n.outputs if v.name in static}
        if not wanted:
            return False
        p, q = PROBE_LENGTHS
        at_p, at_q = evaluate(graph, p, only=static), evaluate(graph, q, only=static)
        changed = False
        for node in list(graph.nodes):
            if node.op == "const" or len(node.outputs) != 1 or node.output.name not in wanted:
                continue
            v = node.output
            a, b = np.asarray(at_p[v.name]), np.asarray(at_q[v.name])
            attrs = self.fold(a, b, v.type)
            if attrs is None:
                continue
            if isinstance(attrs, np.ndarray):
                w = graph.add_weight(Weight(graph.fresh(v.name + ".folded"), v.type, array=attrs))
                new = make_node(graph, "const", [], [w], out_types=[v.type], name=v.name + ".c")
            else:
                new = make_node(graph, "const", [], [], attrs, out_types=[v.type], name=v.name + ".c")
            place(graph, [new], node)
            graph.replace_uses(v, new.output)
            changed = True
        dead_code_elimination(graph)
        return changed

    @staticmethod
    def fold(a: np.ndarray, b: np.ndarray, vtype: TensorType):
        dtype = vtype.dtype
        if a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True):
            if a.size <= INLINE_LIMIT:
                return {"value": a.tolist(), "dtype": dtype}
            return np.ascontiguousarray(a) if a.size <= _MAX_FOLD else None
        if a.dtype.kind not in "iu" or a.shape != b.shape or a.ndim > 1 or a.size > INLINE_LIMIT:
            return None
        p, q = PROBE_LENGTHS
        entries = []
        for x, y in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist()):
            if x == y:
                entries.append(x)
            elif y - x == q - p:
                entries.append("T" if x == p else f"T{x - p:+d}")
            else:
                return None
        return {"value": entries if a.ndim else entries[0], "dtype": dtype}
