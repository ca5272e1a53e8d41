"""Pass ``act-precision(MODE)``: the precision of the activations that integer weights multiply.

    act-precision(int8)        every step quantizes them (int8 blocks of 32 for int4 weights, int16
                               rows for int8 weights: the ``quantize_act`` nodes as inserted)
    act-precision(f32)         no step does: the matmuls read the f32 rows (``linear_qf32``), the
                               arithmetic of a dequantize-then-f32 reference (transformers on a GGUF)
    act-precision(auto)        f32 for steps of fewer than AUTO_F32_BELOW token rows (decode, a
                               batch of decoding sequences, a speculative verification), int8 from
                               there on (prefill), where the integer kernels' arithmetic pays
    act-precision(auto,N)      the same with N rows

It rewrites the ``quantize_act`` nodes that feed integer-weight matmuls (``linear``,
``lora_linear``, ``logits``; not the MXFP4 experts' own): ``f32`` removes them, ``auto`` gives
them ``f32_below=N`` (the interpreter then passes a step of fewer rows through unchanged, as the
compiled model then reads the f32 rows). Within one path a row's result does not depend on the
step's row count; across the threshold the two paths differ by the activations' rounding.
Measured choice of the default (decode and prefill speed, agreement with transformers over 200
chat prompts on SmolLM2's GGUF): docs/quantization.md, *Activation precision*.
"""
from __future__ import annotations

from infeng_common.errors import InfengError

from ..ir import Graph
from ..quant.formats import get_format, is_quantized
from .context import PassContext

MODES = ("int8", "f32", "auto")
#: The mode a compile takes when none is given: int8, whose rows have the same bits whatever step
#: they land in; ``auto`` makes a row depend on the step's size (prefix-cache hits, other requests'
#: prefill), so the same request could give other text (docs/quantization.md, *Activation precision*).
DEFAULT_ACT_PRECISION = "int8"
#: Token rows from which ``auto`` quantizes the activations (fewer rows read f32): every decode step
#: of up to 16 sequences and every speculative verification of up to 16 rows stays f32, where the
#: weights' bytes bound the step (docs/quantization.md, *Activation precision*).
AUTO_F32_BELOW = 17
_MATMUL_OPS = ("linear", "lora_linear", "logits")


def _integer_weight(fmt: str) -> bool:
    return is_quantized(fmt) and fmt != "mxfp4" and get_format(fmt).kind == "int"


class ActPrecision:
    name = "act-precision"
    #: it removes (some of) the activation rounding the quantize pass added, whose int4 bound is 0.5
    tolerance = 0.5

    def __init__(self, mode: str = "int8", rows: str | None = None):
        if mode not in MODES:
            raise InfengError(f"act-precision: mode must be one of {', '.join(MODES)}, got {mode!r}")
        if rows is not None and mode != "auto":
            raise InfengError(f"act-precision: a row count goes with auto only, got ({mode}, {rows})")
        try:
            self.f32_below = int(rows) if rows is not None else AUTO_F32_BELOW
        except ValueError:
            raise InfengError(f"act-precision: the row count must be an integer, got {rows!r}") from None
        if self.f32_below < 1:
            raise InfengError(f"act-precision: the row count must be at least 1, got {self.f32_below}")
        self.mode = mode

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        if self.mode == "int8":
            return False
        users = graph.users()
        changed = False
        for q in [n for n in graph.nodes if n.op == "quantize_act"]:
            readers = users.get(q.output.name, [])
            if not readers or not all(u.op in _MATMUL_OPS and _integer_weight(u.weights[0].format) for u in readers):
                continue
            if self.mode == "f32":
                graph.replace_uses(q.output, q.inputs[0])
                graph.nodes.remove(q)
            elif q.attrs.get("f32_below") != self.f32_below:
                q.attrs["f32_below"] = self.f32_below
            else:
                continue
            changed = True
        if changed and self.mode == "f32":
            graph.rebuild_names()
        return changed


def act_precision_entry(mode: str) -> tuple[str, list[str]] | None:
    """The pipeline entry for ``--act-precision MODE`` (None for int8: the quantize_act nodes as
    the quantize and cast-weights passes insert them)."""
    if mode not in MODES:
        raise InfengError(f"--act-precision: one of {', '.join(MODES)}, got {mode!r}")
    return None if mode == "int8" else ("act-precision", [mode])


def act_precision_of(graph: Graph) -> dict[str, int | str] | None:
    """What the integer-weight matmuls of ``graph`` read, for the manifest: ``{"mode": "int8"}``,
    ``{"mode": "f32"}`` or ``{"mode": "auto", "f32_below": N}``; None without integer weights."""
    producers = graph.producers()
    modes = set()
    for n in graph.nodes:
        if n.op in _MATMUL_OPS and _integer_weight(n.weights[0].format):
            p = producers.get(n.inputs[0].name)
            modes.add(("auto", p.attrs["f32_below"]) if p is not None and p.op == "quantize_act"
                      and p.attrs.get("f32_below") else ("int8", 0) if p is not None and p.op == "quantize_act"
                      else ("f32", 0))
    if not modes:
        return None
    if len(modes) > 1:
        return {"mode": "mixed"}
    mode, rows = modes.pop()
    return {"mode": mode, "f32_below": rows} if mode == "auto" else {"mode": mode}
