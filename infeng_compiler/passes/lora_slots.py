"""Pass ``lora-slots(K, R[, targets])``: give linear layers K run-time adapter slots of rank <= R.

Each targeted ``linear`` becomes ``lora_linear(x, %adapter_slots, @W)`` with a site number; the
graph gains the input ``%adapter_slots: i32[T]`` (the slot of each token, -1 for none). Adapters
are loaded into slots at run time (``Engine.load_adapter``) without recompiling. ``targets`` is a
'+'-separated list of module suffixes (``q_proj+v_proj``), default every linear layer.
"""
from __future__ import annotations

from infeng_common.errors import InfengError

from ..ir import Graph, TensorType
from .context import PassContext


class LoraSlots:
    name = "lora-slots"
    tolerance = 0.0   # with no adapter loaded the graph computes exactly what it did

    def __init__(self, max_adapters: str = "4", max_rank: str = "16", targets: str = ""):
        try:
            self.max_adapters, self.max_rank = int(max_adapters), int(max_rank)
        except ValueError:
            raise InfengError(f"lora-slots: K and R must be integers, got {max_adapters!r}, {max_rank!r}") from None
        if self.max_adapters < 1 or self.max_rank < 1:
            raise InfengError("lora-slots: K and R must be >= 1")
        self.targets = [t for t in targets.split("+") if t]

    def wanted(self, weight_name: str) -> bool:
        module = weight_name.split("+")[0].removesuffix(".weight")
        return not self.targets or any(module == t or module.endswith("." + t) for t in self.targets)

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        if any(v.name == "adapter_slots" for v in graph.inputs):
            return False
        nodes = [n for n in graph.nodes if n.op == "linear" and self.wanted(n.weights[0].name)]
        if not nodes:
            raise InfengError(f"lora-slots: no linear layer matches targets {'+'.join(self.targets)}")
        slots = graph.add_input("adapter_slots", TensorType("i32", ("T",)))
        for site, n in enumerate(nodes):
            n.op = "lora_linear"
            n.inputs = [n.inputs[0], slots]
            n.attrs = {"site": site, "target": n.weights[0].name.split("+")[0],
                       "max_adapters": self.max_adapters, "max_rank": self.max_rank}
        return True
