"""The verifier: SSA well-formedness and shape rules, run after every pass."""
from __future__ import annotations

from infeng_common.errors import IRError

from . import ops
from .graph import Graph
from .memory import check_plan


def verify(g: Graph) -> None:
    """Raise IRError naming the first node that breaks a rule."""
    defined = {v.name for v in g.inputs}
    for i, n in enumerate(g.nodes):
        where = f"node {i} ({n.op} -> %{n.outputs[0].name if n.outputs else '?'})"
        for v in n.inputs:
            if v.name not in defined:
                raise IRError(f"{where}: operand %{v.name} is not defined before use")
        for w in n.weights:
            if g.weights.get(w.name) is not w:
                raise IRError(f"{where}: weight @{w.name} is not declared in the graph")
        expected = ops.infer_types(n.op, [v.type for v in n.inputs], [w.type for w in n.weights], n.attrs)
        actual = [v.type for v in n.outputs]
        if expected is not None and expected != actual:       # None: declared (value-dependent) types
            raise IRError(f"{where}: result types {[str(t) for t in actual]} but the shape rule gives "
                          f"{[str(t) for t in expected]}")
        for v in n.outputs:
            if v.name in defined:
                raise IRError(f"{where}: %{v.name} defined twice")
            defined.add(v.name)
    for v in g.outputs:
        if v.name not in defined:
            raise IRError(f"graph output %{v.name} is not defined")
    if g.memory is not None:
        check_plan(g, g.memory)
