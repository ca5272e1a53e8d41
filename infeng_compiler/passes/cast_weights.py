"""Pass ``cast-weights(dtype[,keep-quantized|all])``: store matrix weights (rank 2, and rank 3:
stacked experts) as f32, f16 or bf16.

Vectors (norm weights, biases) stay f32: they are tiny and feed additions, not dot products.
Weights imported quantized (``prequantized``: GGUF Q8_0/Q4_0/Q4_1 as q8g32/q4g32/q4g32m) keep their
codes and format (``keep-quantized``, the default, which the compile pipeline spells out when the
model has such weights: ``cast-weights(f32,keep-quantized)`` leaves a Q4_1 file's matrices 4-bit);
the matmuls that read them get the activation quantization their integer kernels read
(``quantize.quantize_activations``, as the ``quantize`` pass gives its own weights). With ``all``
(``cast-weights(f32,all)``: what an explicit ``--dtype`` asks) they are widened to the dtype too,
from their exact dequantized values.
The logical type keeps the source dtype; the storage format is the weight's ``format`` attribute,
which the printer shows, the interpreter honours (it rounds through the format) and codegen uses.
"""
from __future__ import annotations

from typing import ClassVar

from infeng_common.errors import InfengError

from ..ir import Graph
from .context import PassContext

FORMATS = ("f32", "f16", "bf16")


class CastWeights:
    name = "cast-weights"
    #: max |logits change| / max |logit| allowed per format. bf16 keeps 8 significant bits: on the
    #: tests' random models (weights of std 0.2) it moves logits by about 4%; f16 by about 0.3%.
    TOLERANCE: ClassVar[dict[str, float]] = {"f32": 0.0, "f16": 1e-2, "bf16": 6e-2}

    def __init__(self, dtype: str = "f32", which: str = "keep-quantized"):
        if dtype not in FORMATS:
            raise InfengError(f"cast-weights: dtype must be one of {', '.join(FORMATS)}, got {dtype!r}")
        if which not in ("keep-quantized", "all"):
            raise InfengError(f"cast-weights: the second argument is keep-quantized (the default: imported "
                              f"quantized weights keep their format) or all (widen them too), got {which!r}")
        self.dtype, self.widen_imported = dtype, which == "all"
        self.tolerance = self.TOLERANCE[dtype]

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        changed = False
        for w in graph.weights.values():
            if w.attrs.get("prequantized"):
                if not self.widen_imported:
                    continue
                del w.attrs["prequantized"]
            fmt = self.dtype if w.type.rank in (2, 3) else "f32"      # 3: stacked experts [E, out, in]
            if w.attrs.get("format", w.type.dtype) != fmt:
                w.attrs["format"] = fmt
                changed = True
        if any(w.attrs.get("prequantized") for w in graph.weights.values()):
            from .quantize import quantize_activations

            before = len(graph.nodes)
            quantize_activations(graph)
            changed = changed or len(graph.nodes) != before
        return changed
