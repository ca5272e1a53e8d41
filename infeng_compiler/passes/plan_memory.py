"""``plan-memory``: the static arena and ``weights.bin`` layout, recorded on the graph (``Graph.memory``,
``ir/memory.py``) so that ``infeng ir --after plan-memory`` shows it, the verifier checks it and
lowering only reads it.

The arena is planned by a linear scan over the node order, in floats per token row: a node's
results take slices first (``rope`` writes over its input in place when nothing reads that input
afterwards), then its kernels' scratch rows (``codegen/footprint.py``) are taken and given back,
then every value whose live range ends at the node is given back: its inputs read for the last
time, the f32 rows under int rows read for the last time (``ir/memory.py``), a result nobody
reads. A freed slice is reused by the next value of the same (16-float aligned) width, the most
recently freed first; the arena's peak is the highest offset reached. Weights are placed in
``weights.bin`` in the order the nodes first read them, each 64-byte aligned.
"""
from __future__ import annotations

from ..codegen.footprint import ARENA_ALIGN, align, has_rows, scratch_rows, stored_weights, value_floats, weight_nbytes
from ..ir import Graph
from ..ir.memory import ArenaBuffer, MemoryPlan, WeightPlacement, value_live_ranges, weight_live_ranges
from .context import PassContext


class _Arena:
    """Linear-scan allocation of per-row float slices; a freed slice is reused by an equal width."""

    def __init__(self) -> None:
        self.top = 0
        self.free: dict[int, list[int]] = {}

    def take(self, width: int) -> int:
        width = align(width, ARENA_ALIGN)
        if self.free.get(width):
            return self.free[width].pop()
        offset, self.top = self.top, self.top + width
        return offset

    def give(self, offset: int, width: int) -> None:
        self.free.setdefault(align(width, ARENA_ALIGN), []).append(offset)


def plan_memory(graph: Graph) -> MemoryPlan:
    """The memory plan of ``graph`` as it stands (module doc)."""
    producers = graph.producers()
    live = value_live_ranges(graph)
    arena = _Arena()
    slices: dict[str, tuple[int, int]] = {}     # value name -> (offset, floats per row) of its slice
    holding: dict[str, list[str]] = {}         # value name -> the values its slice holds (in place: several)
    buffers: list[ArenaBuffer] = []
    ending: dict[int, list[str]] = {}          # node index -> the values whose live range ends there
    for name, (_, last) in live.items():
        ending.setdefault(last, []).append(name)
    for i, n in enumerate(graph.nodes):
        x = n.inputs[0] if n.inputs else None
        alias = x if n.op == "rope" and x is not None and live.get(x.name, (0, -1))[1] == i else None
        if has_rows(n):
            for v in n.outputs:
                if alias is not None:
                    slices[v.name], holding[v.name] = slices[alias.name], holding.pop(alias.name) + [v.name]
                else:
                    width = value_floats(v, n)
                    slices[v.name], holding[v.name] = (arena.take(width), width), [v.name]
        taken = [(name, width, arena.take(width)) for name, width in scratch_rows(n, producers)]
        for name, width, offset in taken:
            buffers.append(ArenaBuffer((n.outputs[0].name,), offset, align(width, ARENA_ALIGN), i, i, name))
            arena.give(offset, width)
        for name in dict.fromkeys([v.name for v in n.inputs if v.name in live and live[v.name][1] == i] +
                                  ending.get(i, [])):   # the inputs first, then the f32 rows under int rows
            if name in slices and (alias is None or name != alias.name):
                arena.give(*slices[name])
    for values in holding.values():
        offset, width = slices[values[0]]
        buffers.append(ArenaBuffer(tuple(values), offset, align(width, ARENA_ALIGN), live[values[0]][0],
                                   max(live[v][1] for v in values)))
    buffers.sort(key=lambda b: (b.first, bool(b.scratch)))
    weights_bytes, weights = _place_weights(graph)
    return MemoryPlan(arena.top, weights_bytes, buffers, weights)


def _place_weights(graph: Graph) -> tuple[int, list[WeightPlacement]]:
    """(weights.bin's size, each weight the kernels read at its offset), in first-read order."""
    live = weight_live_ranges(graph)
    placed: dict[str, WeightPlacement] = {}
    top = 0
    for n in graph.nodes:
        for w in stored_weights(n):
            if w.name not in placed:
                nbytes = weight_nbytes(w)
                placed[w.name] = WeightPlacement(w.name, top, nbytes, *live[w.name])
                top = align(top + nbytes)
    return top, list(placed.values())


class PlanMemory:
    """Record the memory plan on the graph (``Graph.memory``); exact (it changes no value)."""

    name = "plan-memory"
    tolerance = 0.0

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        plan = plan_memory(graph)
        changed = graph.memory is None or graph.memory.signature() != plan.signature()
        graph.memory = plan
        return changed
