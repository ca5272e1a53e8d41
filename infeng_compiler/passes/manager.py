"""The pass manager: a pipeline is data (pass names with arguments, in named phases), run in
order, the graph verified and timed after each pass and optionally dumped as ``NN-<pass>.ir``.

    pipeline = parse_pipeline("cast-weights(f16)")
    PassManager(pipeline, dump_dir="dumps").run(graph, PassContext(model_dir=Path("model")))

The passes are the ones ``catalogue.PASS_TABLE`` lists; a pipeline given as entries alone falls
into phases by that table (consecutive entries of one phase are one phase); ``pipeline.py`` builds
the compile pipeline's phases from the options, empty phases included.

A pass reads the graph, its own arguments (the pipeline entry) and the ``PassContext``: the inputs
that are not pipeline text (loaded adapters, the tokenizer calibration encodes with, a progress
callback) and the typed reports passes leave for the driver (the quantization report, calibration
token counts). Nothing else travels between passes.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from infeng_common.errors import InfengError

from ..ir import Graph, print_graph, verify
from .catalogue import PASS_TABLE, PASSES
from .context import CalibrationTokenizer, Pass, PassContext

__all__ = ["CalibrationTokenizer", "Entry", "Pass", "PassContext", "PassManager", "PassRecord", "Phase",
           "format_pipeline", "parse_pipeline", "phases_of"]

#: One pipeline entry: a pass name and its arguments.
Entry = tuple[str, list[str]]


@dataclass
class Phase:
    """A named run of pipeline entries (``catalogue.PHASES``)."""

    name: str
    entries: list[Entry]

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "passes": [format_pipeline([e]) for e in self.entries]}


def phases_of(entries: list[Entry]) -> list[Phase]:
    """``entries`` grouped by the phase the pass table gives each (consecutive runs)."""
    unknown = [n for n, _ in entries if n not in PASS_TABLE]
    if unknown:
        raise InfengError(f"unknown pass {unknown[0]!r}; known passes: {', '.join(sorted(PASS_TABLE))}")
    phases: list[Phase] = []
    for name, args in entries:
        phase = PASS_TABLE[name].phase
        if not phases or phases[-1].name != phase:
            phases.append(Phase(phase, []))
        phases[-1].entries.append((name, args))
    return phases


_ENTRY = re.compile(r"^\s*([a-z][a-z0-9\-]*)\s*(?:\((.*)\))?\s*$")


def parse_pipeline(text: str) -> list[Entry]:
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


def format_pipeline(entries: list[Entry]) -> str:
    return ",".join(f"{n}({','.join(a)})" if a else n for n, a in entries)


@dataclass
class PassRecord:
    name: str
    args: list[str]
    tolerance: float          # what the pass declares it may change the logits by
    changed: bool
    seconds: float
    phase: str = ""


@dataclass
class PassManager:
    pipeline: list[Entry]
    dump_dir: Path | None = None
    records: list[PassRecord] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)    # default: ``phases_of(pipeline)``

    def __post_init__(self) -> None:
        grouped = phases_of(self.pipeline)
        if not self.phases:
            self.phases = grouped
        elif [e for p in self.phases for e in p.entries] != list(self.pipeline):
            raise InfengError("PassManager: the phases do not hold the pipeline's entries")

    @classmethod
    def from_phases(cls, phases: list[Phase], dump_dir: Path | None = None) -> PassManager:
        return cls([e for p in phases for e in p.entries], dump_dir, phases=phases)

    def run(self, graph: Graph, ctx: PassContext | None = None,
            after: Callable[[str, Graph], None] | None = None,
            after_phase: Callable[[str, Graph], None] | None = None,
            before: Callable[[str], None] | None = None) -> Graph:
        """Run every pass; ``before(pass name)`` before each pass, ``after(pass name, graph)`` after
        it, ``after_phase(phase name, graph)`` after each phase (an empty one too)."""
        ctx = ctx if ctx is not None else PassContext()
        if self.dump_dir:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            (self.dump_dir / "00-input.ir").write_text(print_graph(graph))
        i = 0
        for phase in self.phases:
            for name, args in phase.entries:
                i += 1
                if before:
                    before(name)
                p = PASSES[name](*args)
                t0 = time.perf_counter()
                changed = p.run(graph, ctx)
                verify(graph)
                self.records.append(PassRecord(name, list(args), p.tolerance, changed, time.perf_counter() - t0,
                                               phase.name))
                if self.dump_dir:
                    (self.dump_dir / f"{i:02d}-{name}.ir").write_text(print_graph(graph))
                if after:
                    after(name, graph)
            if after_phase:
                after_phase(phase.name, graph)
        return graph
