"""Pass ``experts-act(q8)``: the experts of MXFP4 (or float) weights read int8 rows.

Sets ``act_quant=[8, 32]`` on every ``experts`` node whose weights are MXFP4: the driver then
quantizes each expert's gathered rows and activations to int8 in blocks of 32 (``quantize_act``)
and calls ``linear_mxfp4`` with ``act=q8``, which multiplies e2m1 codes by int8 codes
(``vpdpbusd``) instead of widening them to f32: what llama.cpp computes for MXFP4, and faster at
decode (docs/moe.md). The reference rounds the same rows, so the interpreter predicts the kernels.
Integer expert formats set ``act_quant`` themselves (``quantize``); other nodes are left alone.
"""
from __future__ import annotations

from infeng_common.errors import InfengError

from ..ir import Graph
from ..quant.act import ACT_FORMS
from .context import PassContext


class ExpertsAct:
    name = "experts-act"
    #: max |logits change| / max |logit|: int8 rows in blocks of 32, as the int4 preset's activations
    #: (passes/quantize.py measures them at about 1e-2 on real models)
    tolerance = 2e-2

    def __init__(self, form: str = "q8"):
        if form != "q8":
            raise InfengError(f"experts-act: the only activation form is q8 (int8 in blocks of 32), got {form!r}")

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        changed = False
        for node in graph.find("experts"):
            if node.weights[0].format == "mxfp4" and node.attrs.get("act_quant") != [8, ACT_FORMS[8]]:
                node.attrs["act_quant"] = [8, ACT_FORMS[8]]
                changed = True
        return changed
