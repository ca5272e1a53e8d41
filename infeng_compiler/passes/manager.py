"""The pass manager: a pipeline is data (pass names with arguments), run in order, the graph
verified and timed after each pass and optionally dumped as ``NN-<pass>.ir``.

    pipeline = parse_pipeline("cast-weights(f16)")
    PassManager(pipeline, dump_dir="dumps").run(graph, PassContext(model_dir=Path("model")))

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
from typing import TYPE_CHECKING, Protocol

from infeng_common.errors import InfengError
from infeng_common.peft import LoraAdapter

from ..ir import Graph, print_graph, verify

if TYPE_CHECKING:
    from .quantize import QuantReport


class CalibrationTokenizer(Protocol):
    """What calibration needs of a tokenizer (``infeng_common.tokenizer.Tokenizer`` has it)."""

    bos_token_id: int | None

    def encode(self, text: str, add_bos: bool | None = ...) -> list[int]: ...


@dataclass
class PassContext:
    """What a pass may read besides the graph and its arguments, and what passes report back."""

    # inputs
    adapters: dict[str, LoraAdapter] = field(default_factory=dict)   # name -> adapter (merge-lora)
    tokenizer: CalibrationTokenizer | None = None     # encodes calibration text; None: built from model_dir
    model_dir: Path | None = None                     # the model's tokenizer files
    progress: Callable[[int, int], None] | None = None   # (chunks done, chunks) during calibration
    # reports
    quant_report: QuantReport | None = None           # quantize: formats, bytes, AWQ scales
    calib_tokens: int = 0                             # quantize: calibration tokens run
    kv_calib_tokens: int = 0                          # kv-format: calibration tokens run for K centring

    def calibration_tokenizer(self, graph: Graph, where: str) -> CalibrationTokenizer:
        """The tokenizer a pass calibrates with: ``tokenizer``, else the one in ``model_dir``."""
        if self.tokenizer is not None:
            return self.tokenizer
        if self.model_dir is None:
            raise InfengError(f"{where}: calibration needs the model's tokenizer; run it from infeng compile/eval "
                              "(PassContext.model_dir or PassContext.tokenizer)")
        from infeng_common.tokenizer import Tokenizer

        return Tokenizer(Path(self.model_dir), graph.meta.get("bos_token_id"), graph.meta.get("eos_token_ids"))


class Pass(Protocol):
    name: str
    tolerance: float          # max relative change of the logits the pass may introduce

    def run(self, graph: Graph, ctx: PassContext) -> bool: ...


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

    def run(self, graph: Graph, ctx: PassContext | None = None,
            after: Callable[[str, Graph], None] | None = None) -> Graph:
        ctx = ctx if ctx is not None else PassContext()
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
