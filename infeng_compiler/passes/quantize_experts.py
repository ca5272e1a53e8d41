"""The expert weights of the ``quantize`` pass: stacked [E, N, K] matrices of ``experts`` nodes
quantized in the policy's default format, expert by expert.

A stacked weight is quantized as its [E*N, K] matrix: rows are quantized independently (per row or
per group along K, padded to whole groups), and with N a multiple of the 16 rows of a packed block, its layout is E
consecutive [N, K] layouts, which is what the experts driver reads (``codegen/moe_kernels.py``).
The node gets ``act_quant`` [bits, block] for an integer format, so the reference rounds the rows
each matrix multiplies as the driver's ``quantize_act`` does. Experts whose shapes the format does
not fit stay in their float format.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import Graph
from ..ir.types import bf16_to_f32
from ..quant.act import ACT_FORMS
from ..quant.formats import ROWS_PER_BLOCK, get_format, is_quantized
from ..quant.search import quantize


@dataclass
class ExpertQuantization:
    """One stacked expert weight quantized: its name, format, [E*N, K] and packed bytes."""

    name: str
    format: str
    shape: tuple[int, int]
    nbytes: int


def fits(fmt: str, shape: tuple[int, ...]) -> bool:
    """Whether ``fmt`` holds a stacked [E, N, K] weight as E whole [N, K] layouts (K may be padded to
    whole groups, as the policy's ``pad`` does)."""
    return get_format(fmt).kind in ("int", "fp8") and shape[1] % ROWS_PER_BLOCK == 0


def quantize_experts(graph: Graph, fmt: str, search: bool = True) -> list[ExpertQuantization]:
    """Quantize the gate_up and down weights of every ``experts`` node to ``fmt`` (when both fit)."""
    if not is_quantized(fmt) or get_format(fmt).kind not in ("int", "fp8"):
        return []
    done: dict[str, ExpertQuantization] = {}
    for node in graph.find("experts"):
        matrices = node.weights[:2]
        if any(w.attrs.get("prequantized") or not fits(fmt, tuple(w.type.shape)) for w in matrices):
            continue
        for w in matrices:
            if w.name in done:
                continue
            E, N, K = w.type.shape
            raw = np.asarray(w.raw())
            f32 = bf16_to_f32(raw) if w.type.dtype == "bf16" else np.asarray(raw, dtype=np.float32)
            w.quant = quantize(f32.reshape(E * N, K), get_format(fmt), search=search)
            w.attrs["format"] = fmt
            done[w.name] = ExpertQuantization(w.name, fmt, (E * N, K), get_format(fmt).nbytes((E * N, K)))
        q = get_format(fmt)
        if q.kind == "int":          # int4 weights read int8 rows in blocks, int8 weights int16 rows
            bits = 8 if q.bits == 4 else 16
            node.attrs["act_quant"] = [bits, ACT_FORMS[bits]]
    return list(done.values())
