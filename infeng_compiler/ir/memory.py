"""The memory plan: where every activation, every kernel's scratch rows and every weight live.

``plan-memory`` (``passes/plan_memory.py``) records it on the graph (``Graph.memory``); lowering
reads it and plans nothing itself. Two address spaces:

- the **arena**: one block of floats the library allocates for ``--max-tokens`` rows. Offsets and
  sizes are floats per token row: a buffer at ``offset`` of ``size`` is
  ``arena + offset * MAX_TOKENS``, ``size * MAX_TOKENS`` floats long. A buffer holds one value, or
  several that reuse it in place (``rope`` over a q row nothing reads afterwards), or the scratch
  rows one node's kernels need while it runs (``rows`` of ``%logits``: the rows that want logits);
- ``weights.bin``: byte offsets and sizes of every weight a kernel reads (64-byte aligned).

Live ranges are node indices, both ends included: a value is live from the node that writes it to
the last node that reads it (a ``quantize_act`` result's readers read its f32 source's rows too:
the logits gather them, an adapter's delta and an f32 fallback read them); a scratch buffer during
its node; a weight from its first reader to its last (``weights.bin`` is mapped whole: the range
says who reads it). Two arena buffers whose live ranges meet must not overlap (``check_plan``).

The text form (after ``return``; ``print_graph``/``parse`` round-trip it, docs/ir.md), stories260K:

    # memory: arena peak 5,056 bytes per token row (1,264 floats), 77 buffers, 1 scratch; weights.bin 1,040,128 bytes
    memory {arena_floats=1264, weights_bytes=1040128}
    arena %embed {offset=0, size=64, live=[0, 8]}
    arena %l0.q, %l0.q_rot {offset=64, size=64, live=[3, 6]}
    scratch rows of %logits {offset=0, size=64, live=[72, 72]}
    place @model.embed_tokens.weight {offset=0, size=131072, live=[0, 72]}
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from infeng_common.errors import IRError

if TYPE_CHECKING:
    from .graph import Graph


@dataclass(frozen=True)
class ArenaBuffer:
    """A slice of the arena (floats per token row) and the node range it is live over: the rows of
    ``values`` (one, or several written in place of each other) or, with ``scratch``, the scratch
    rows of that name which the node writing ``values[0]`` uses while it runs."""

    values: tuple[str, ...]
    offset: int
    size: int
    first: int
    last: int
    scratch: str = ""

    @property
    def label(self) -> str:
        names = ", ".join(f"%{v}" for v in self.values)
        return f"scratch {self.scratch} of {names}" if self.scratch else f"arena {names}"


@dataclass(frozen=True)
class WeightPlacement:
    """Where a weight lives in ``weights.bin`` (bytes) and the nodes that read it."""

    name: str
    offset: int
    size: int
    first: int
    last: int


@dataclass
class MemoryPlan:
    arena_floats: int                                   # the arena's peak, floats per token row
    weights_bytes: int                                  # weights.bin's size (the last weight aligned)
    buffers: list[ArenaBuffer] = field(default_factory=list)        # values' first, then scratch; by node
    weights: list[WeightPlacement] = field(default_factory=list)    # by offset

    def value_offsets(self) -> dict[str, int]:
        """Value name -> its arena offset."""
        return {v: b.offset for b in self.buffers if not b.scratch for v in b.values}

    def scratch_offsets(self) -> dict[tuple[str, str], int]:
        """(first result of the node, scratch name) -> arena offset."""
        return {(b.values[0], b.scratch): b.offset for b in self.buffers if b.scratch}

    def signature(self) -> tuple:
        return (self.arena_floats, self.weights_bytes, tuple(self.buffers), tuple(self.weights))

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (``infeng ir --format json``); ``from_dict`` reads it back."""
        return {"arena_floats": self.arena_floats, "weights_bytes": self.weights_bytes,
                "buffers": [{**asdict(b), "values": list(b.values)} for b in self.buffers],
                "weights": [asdict(w) for w in self.weights]}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> MemoryPlan:
        return cls(doc["arena_floats"], doc["weights_bytes"],
                   [ArenaBuffer(**{**b, "values": tuple(b["values"])}) for b in doc["buffers"]],
                   [WeightPlacement(**w) for w in doc["weights"]])

    # -- text --------------------------------------------------------------------------------
    def text_lines(self) -> list[str]:
        values = sum(1 for b in self.buffers if not b.scratch)
        lines = [f"# memory: arena peak {4 * self.arena_floats:,} bytes per token row ({self.arena_floats:,} floats), "
                 f"{values} buffers, {len(self.buffers) - values} scratch; weights.bin {self.weights_bytes:,} bytes",
                 f"memory {{arena_floats={self.arena_floats}, weights_bytes={self.weights_bytes}}}"]
        lines += [f"{b.label} {{offset={b.offset}, size={b.size}, live=[{b.first}, {b.last}]}}" for b in self.buffers]
        lines += [f"place @{w.name} {{offset={w.offset}, size={w.size}, live=[{w.first}, {w.last}]}}"
                  for w in self.weights]
        return lines


_NAME = r"[A-Za-z_][\w.\-+]*"
_ARENA = re.compile(rf"^arena ((?:%{_NAME})(?:\s*,\s*%{_NAME})*)\s*(\{{.*\}})$")
_SCRATCH = re.compile(rf"^scratch ({_NAME}) of %({_NAME})\s*(\{{.*\}})$")
_PLACE = re.compile(rf"^place @({_NAME})\s*(\{{.*\}})$")
#: the first word of every line of the plan's text form
PLAN_KEYWORDS = ("memory", "arena", "scratch", "place")


def parse_plan_line(plan: MemoryPlan | None, line: str, where: str,
                    parse_attrs: Any) -> MemoryPlan:
    """Add one line of the text form to ``plan`` (``memory {...}`` starts it); ``parse_attrs``
    reads the ``{key=<json>}`` attributes (the IR parser's)."""
    if line.startswith("memory "):
        attrs = parse_attrs(line[len("memory "):], where)
        return MemoryPlan(_int(attrs, "arena_floats", where), _int(attrs, "weights_bytes", where))
    if plan is None:
        raise IRError(f"{where}: {line.split()[0]} line before the 'memory {{...}}' line")
    if m := _ARENA.match(line):
        values, attrs = tuple(v.strip().lstrip("%") for v in m.group(1).split(",")), m.group(2)
        scratch = ""
    elif m := _SCRATCH.match(line):
        scratch, values, attrs = m.group(1), (m.group(2),), m.group(3)
    elif m := _PLACE.match(line):
        a = parse_attrs(m.group(2), where)
        plan.weights.append(WeightPlacement(m.group(1), _int(a, "offset", where), _int(a, "size", where),
                                            *_live(a, where)))
        return plan
    else:
        raise IRError(f"{where}: bad memory plan line {line!r}")
    a = parse_attrs(attrs, where)
    plan.buffers.append(ArenaBuffer(values, _int(a, "offset", where), _int(a, "size", where), *_live(a, where),
                                    scratch))
    return plan


def _int(attrs: dict[str, Any], key: str, where: str) -> int:
    value = attrs.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise IRError(f"{where}: memory plan attribute {key} must be a non-negative integer, got {value!r}")
    return value


def _live(attrs: dict[str, Any], where: str) -> tuple[int, int]:
    live = attrs.get("live")
    if not (isinstance(live, list) and len(live) == 2 and all(isinstance(i, int) for i in live) and
            0 <= live[0] <= live[1]):
        raise IRError(f"{where}: memory plan attribute live must be [first, last] node indices, got {live!r}")
    return live[0], live[1]


# -- checks ------------------------------------------------------------------------------------
def value_live_ranges(g: Graph) -> dict[str, tuple[int, int]]:
    """Value name -> (index of the node that writes it, index of the last node that reads it or
    the rows it was quantized from), for every value a node writes."""
    producers = g.producers()
    live = {v.name: (i, i) for i, n in enumerate(g.nodes) for v in n.outputs}
    for i, n in enumerate(g.nodes):
        for v in n.inputs:
            read = [v.name]
            p = producers.get(v.name)
            if p is not None and p.op == "quantize_act":
                read.append(p.inputs[0].name)
            for name in read:
                if name in live:
                    live[name] = (live[name][0], i)
    return live


def weight_live_ranges(g: Graph) -> dict[str, tuple[int, int]]:
    """Weight name -> (index of its first reader, index of its last)."""
    live: dict[str, tuple[int, int]] = {}
    for i, n in enumerate(g.nodes):
        for w in n.weights:
            live[w.name] = (live.get(w.name, (i, i))[0], i)
    return live


def overlapping(buffers: list[Any]) -> list[tuple[Any, Any]]:
    """Pairs of buffers (``offset``, ``size``, ``first``, ``last``) live at one node that share
    memory (a sweep over offsets: only buffers that share memory are compared)."""
    by_offset = sorted(buffers, key=lambda b: b.offset)
    pairs = []
    for i, a in enumerate(by_offset):
        for b in by_offset[i + 1:]:
            if b.offset >= a.offset + a.size:
                break
            if a.first <= b.last and b.first <= a.last and b.size and a.size:
                pairs.append((a, b))
    return pairs


def check_plan(g: Graph, plan: MemoryPlan) -> None:
    """Raise IRError unless ``plan`` fits ``g``: every value it names is written by a node and
    read only within its buffer's live range, every buffer lies inside the arena, every weight
    it places is declared and read only within its range, and no two buffers (arena or
    weights.bin) live at one node overlap."""
    values = value_live_ranges(g)
    for b in plan.buffers:
        if b.offset + b.size > plan.arena_floats:
            raise IRError(f"memory plan: {b.label} ends at {b.offset + b.size}, past the arena's "
                          f"{plan.arena_floats} floats")
        for name in b.values:
            if name not in values:
                raise IRError(f"memory plan: {b.label} names %{name}, which no node writes")
            first, last = values[name]
            if b.scratch and (b.first, b.last) != (first, first):
                raise IRError(f"memory plan: {b.label} must be live during its node ({first}) only")
            if not b.scratch and not (b.first <= first and last <= b.last):
                raise IRError(f"memory plan: %{name} is live over nodes [{first}, {last}], outside its buffer's "
                              f"[{b.first}, {b.last}]")
    weights = weight_live_ranges(g)
    for w in plan.weights:
        if w.name not in g.weights:
            raise IRError(f"memory plan: places @{w.name}, which the graph does not declare")
        if w.offset + w.size > plan.weights_bytes:
            raise IRError(f"memory plan: @{w.name} ends at byte {w.offset + w.size}, past weights.bin's "
                          f"{plan.weights_bytes}")
        first, last = weights.get(w.name, (w.first, w.last))
        if not (w.first <= first and last <= w.last):
            raise IRError(f"memory plan: @{w.name} is read over nodes [{first}, {last}], outside its "
                          f"placement's [{w.first}, {w.last}]")
    clashes = overlapping(plan.buffers)
    if clashes:
        a, b = clashes[0]
        raise IRError(f"memory plan: {a.label} and {b.label} are live at one node and overlap in the arena")
    whole = [WeightPlacement(w.name, w.offset, w.size, 0, 0) for w in plan.weights]     # mapped for the whole step
    clashes = overlapping(whole)
    if clashes:
        a, b = clashes[0]
        raise IRError(f"memory plan: @{a.name} and @{b.name} overlap in weights.bin")
