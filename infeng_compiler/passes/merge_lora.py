"""Pass ``merge-lora(NAME)``: fold adapter NAME into the base weights, W' = W + s*B*A (DoRA: each
row rescaled to its magnitude), computed in float64 from the f32 weights, before any
quantization. The adapter comes from ``PassContext.adapters[NAME]`` (``frontends.peft.load_adapter``).
"""
from __future__ import annotations

from infeng_common.errors import InfengError

from ..ir import Graph, Weight
from .context import PassContext


class MergeLora:
    name = "merge-lora"
    tolerance = 1e-5   # relative: the merge is exact up to float32 rounding of W'

    def __init__(self, adapter: str):
        self.adapter = adapter

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        adapters = ctx.adapters
        if self.adapter not in adapters:
            raise InfengError(f"merge-lora: no adapter named {self.adapter!r} was given "
                              f"(known: {', '.join(adapters) or 'none'}; pass --lora NAME=DIR)")
        adapter = adapters[self.adapter]
        changed = False
        for node in graph.nodes:
            if node.op != "linear" or node.weights[0].name not in adapter.modules:
                continue
            base = node.weights[0]
            module = adapter.modules[base.name]
            merged = Weight(f"{base.name}+{self.adapter}", base.type.__class__("f32", base.type.shape),
                            array=module.merged(base.numpy_f32()),
                            attrs={k: v for k, v in base.attrs.items() if k == "format"})
            graph.add_weight(merged)
            node.weights[0] = merged
            changed = True
        used = {w.name for nd in graph.nodes for w in nd.weights}
        for name in [n for n in graph.weights if n not in used]:
            del graph.weights[name]
        return changed
