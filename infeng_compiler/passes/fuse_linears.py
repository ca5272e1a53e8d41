"""Pass ``fuse-linears``: sibling linears become one.

The ``linear`` nodes that read the same value with weights in the same storage format (Q, K and V after
the attention norm; gate and up after the MLP norm) are replaced by one ``linear`` over their
weights stacked along the output axis, followed by a ``split`` that gives each old result back
under its old name. A decode step then streams one matrix per site instead of three (or two):
fewer kernel calls and thread-pool jobs, and longer streams for the prefetcher.

    %l0.q = linear(%n, @q) : f32[T,576]           %l0.q_k_v = linear(%n, @q+k+v) : f32[T,960]
    %l0.k = linear(%n, @k) : f32[T,192]    ->     %l0.q, %l0.k, %l0.v = split(%l0.q_k_v) {sizes=[576, 192, 192]}
    %l0.v = linear(%n, @v) : f32[T,192]

Every output row is the same dot product as before; only the float32 summation order inside a
matrix product may change (BLAS blocks a taller matrix differently), hence 1e-5. (With quantized
activations such a last-bit difference can move an activation code downstream; the quantize pass's
tolerance covers that.) It runs after the passes that rewrite
single projections by name (merge-lora, lora-slots, fht-kv, quantize), so it is last in the
default pipeline; a quantized weight is stacked code for code, scales and zero points with it
(``lora_linear`` nodes are left alone: their adapters are per projection).
"""
from __future__ import annotations

import os

import numpy as np

from ..ir import Graph, Node, Weight
from ..quant.formats import QuantizedTensor, is_quantized
from .context import PassContext


class FuseLinears:
    name = "fuse-linears"
    tolerance = 1e-5   # relative: the same dot products, possibly summed in another order

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        siblings: dict[tuple, list[Node]] = {}
        for node in graph.nodes:
            if node.op == "linear":
                w = node.weights[0]
                key = (node.inputs[0].name, w.format, len(node.weights))
                siblings.setdefault(key, []).append(node)
        groups = [nodes for nodes in siblings.values() if len(nodes) > 1]
        for nodes in groups:
            self.fuse(graph, nodes)
        if groups:
            used = {w.name for n in graph.nodes for w in n.weights}
            for name in [n for n in graph.weights if n not in used]:
                del graph.weights[name]
        return bool(groups)

    @staticmethod
    def fuse(graph: Graph, nodes: list[Node]) -> None:
        outs = [n.output for n in nodes]
        sizes = [v.type.shape[-1] for v in outs]
        weights = [stack([n.weights[i] for n in nodes]) for i in range(len(nodes[0].weights))]
        for w in weights:
            graph.add_weight(w)
        prefix = os.path.commonprefix([v.name for v in outs]).rpartition(".")[0]
        name = graph.fresh(f"{prefix}.{'_'.join(v.name[len(prefix) + 1:] for v in outs)}" if prefix
                           else "_".join(v.name for v in outs))
        linear = graph.add_node("linear", [nodes[0].inputs[0]], weights, name=name)
        graph.nodes.pop()                       # placed below, where the first sibling was
        split = Node("split", [linear.output], [], outs, {"sizes": sizes})     # the old values, by name
        at = graph.nodes.index(nodes[0])
        graph.nodes = [n for n in graph.nodes if not any(n is m for m in nodes)]
        graph.nodes[at:at] = [linear, split]


def stack(parts: list[Weight]) -> Weight:
    """One weight holding ``parts`` one after another along the first axis."""
    first = parts[0]
    shape = (sum(p.type.shape[0] for p in parts),) + tuple(first.type.shape[1:])
    name = "+".join([first.name] + [p.name.rpartition(".")[0].rpartition(".")[2] or p.name for p in parts[1:]])
    attrs = {k: v for k, v in first.attrs.items() if k == "format"}
    if is_quantized(first.format):
        qts = [p.quantized() for p in parts]
        quant = QuantizedTensor(first.format, (shape[0], qts[0].shape[1]),
                                np.concatenate([q.codes for q in qts]), np.concatenate([q.scales for q in qts]),
                                None if qts[0].zeros is None else np.concatenate([q.zeros for q in qts]),
                                None if qts[0].mins is None else np.concatenate([q.mins for q in qts]))
        return Weight(name, first.type.__class__(first.type.dtype, shape), attrs=attrs, quant=quant)
    # float formats: the parts as stored (their sources may differ: a folded rotation is f32)
    return Weight(name, first.type.__class__(first.format, shape),
                  array=np.concatenate([p.stored() for p in parts]), attrs=attrs)
