"""The pass manager: a pipeline is data (pass names with arguments), run in order, the graph
verified and timed after each pass and optionally dumped as ``NN-<pass>.ir``.

    pipeline = parse_pipeline("cast-weights(f16)")
    PassManager(pipeline, dump_dir="dumps").run(graph)
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from infeng_common.errors import InfengError

from ..ir import Graph, print_graph, verify


class Pass(Protocol):
    name: str
    tolerance: float          # max relative change of the logits the pass may introduce

    def run(self, graph: Graph, ctx: dict[str, Any]) -> bool: ...


#: pass name -> factory taking the positional arguments of the pipeline entry.
PASSES: dict[str, Callable[..., Pass]] = {}


def register(name: str) -> Callable:
    def deco(factory: Callable[..., Pass]) -> Callable[..., Pass]:
        PASSES[name] = factory
        return factory

    return deco


_ENTRY = re.compile(r"^\s*([a-z][a-z0-9\-]*)\s*(?:\((.*)\))?\s*$")


def parse_pipeline(text: str) -> list[tuple[str, list[str]]]:
    """``"a,b(x,y)"`` -> ``[("a", []), ("b", ["x", "y"])]``."""
    entries, depth, cur = [], 0, ""
    for ch in text + ",":
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            if cur.strip():
                m = _ENTRY.match(cur)
                if not m:
                    raise InfengError(f"bad pipeline entry {cur.strip()!r}; expected name or name(args)")
                args = [a.strip() for a in (m.group(2) or "").split(",") if a.strip()]
                entries.append((m.group(1), args))
            cur = ""
        else:
            cur += ch
    return entries


def format_pipeline(entries: list[tuple[str, list[str]]]) -> str:
    return ",".join(f"{n}({','.join(a)})" if a else n for n, a in entries)


@dataclass
class PassRecord:
    name: str
    args: list[str]
    tolerance: float          # what the pass declares it may change the logits by
    changed: bool
    seconds: float


@dataclass
class PassManager:
    pipeline: list[tuple[str, list[str]]]
    dump_dir: Path | None = None
    records: list[PassRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        from . import catalogue  # noqa: F401  (registers every pass)

        unknown = [n for n, _ in self.pipeline if n not in PASSES]
        if unknown:
            raise InfengError(f"unknown pass {unknown[0]!r}; known passes: {', '.join(sorted(PASSES))}")

    def run(self, graph: Graph, ctx: dict[str, Any] | None = None,
            after: Callable[[str, Graph], None] | None = None) -> Graph:
        ctx = ctx if ctx is not None else {}
        if self.dump_dir:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            (self.dump_dir / "00-input.ir").write_text(print_graph(graph))
        for i, (name, args) in enumerate(self.pipeline, start=1):
            p = PASSES[name](*args)
            t0 = time.perf_counter()
            changed = p.run(graph, ctx)
            verify(graph)
            self.records.append(PassRecord(name, list(args), p.tolerance, changed, time.perf_counter() - t0))
            if self.dump_dir:
                (self.dump_dir / f"{i:02d}-{name}.ir").write_text(print_graph(graph))
            if after:
                after(name, graph)
        return graph
