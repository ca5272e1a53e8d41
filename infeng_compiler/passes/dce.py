"""Pass ``dce``: remove nodes whose results nobody reads, and weights no node uses."""
from __future__ import annotations

from ..ir import Graph
from .context import PassContext
from .rewrite import dead_code_elimination


class DeadCodeElimination:
    name = "dce"
    tolerance = 0.0

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        return dead_code_elimination(graph)
