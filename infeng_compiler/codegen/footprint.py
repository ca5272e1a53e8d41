"""What each op's kernels need in memory besides the graph's values: the arena rows of a value, the
scratch rows a node's kernels use while it runs, and the weights they read from ``weights.bin``.

``plan-memory`` (``passes/plan_memory.py``) plans with these; ``lower.py`` reads the plan and
passes the kernels the scratch by the names given here. No scratch depends on the ISA today; a
kernel whose scratch did would take the target here.
"""
from __future__ import annotations

import math

from infeng_common.errors import UnsupportedError

from ..ir import Node, Value, Weight
from ..ir.ops import attention_weights
from ..quant.act import act_row_layout
from ..quant.formats import get_format, is_quantized
from .moe_kernels import expert_linears, quantized_row_floats
from .quant_kernels import linear_op

WEIGHT_ALIGN = 64
#: arena slices start on 16-float (64-byte) boundaries
ARENA_ALIGN = 16


def align(n: int, to: int = WEIGHT_ALIGN) -> int:
    return (n + to - 1) // to * to


def weight_nbytes(w: Weight) -> int:
    """Bytes of a weight in weights.bin: its quantized layout, or its elements in f32/f16/bf16."""
    if is_quantized(w.format):
        shape = tuple(w.type.shape)           # stacked experts [E, N, K]: E layouts of [N, K], one [E*N, K]
        return get_format(w.format).nbytes(shape if len(shape) == 2 else (math.prod(shape[:-1]), shape[-1]))
    return w.type.numel() * (4 if w.format == "f32" else 2)


def static_width(v: Value) -> int:
    """The last dimension of ``v``, which must be a constant (the arena is sized per row)."""
    w = v.type.shape[-1]
    if not isinstance(w, int):
        raise UnsupportedError(f"%{v.name}: the last dimension must be static, got {v.type}")
    return w


def value_floats(v: Value, producer: Node | None) -> int:
    """Arena floats per token row of ``v`` (written by ``producer``): its width, or a quantized
    activation row's bytes / 4."""
    if producer is not None and producer.op == "quantize_act":
        return act_row_layout(static_width(v), producer.attrs["bits"])["row_bytes"] // 4
    return static_width(v)


def has_rows(n: Node) -> bool:
    """Whether ``n``'s results live in the arena (``logits`` writes the caller's buffer)."""
    return n.op != "logits"


def scratch_rows(n: Node, producers: dict[str, Node]) -> list[tuple[str, int]]:
    """(name, floats per token row) of each scratch buffer ``n``'s kernels use while it runs, in
    the order they are taken (they are given back in that order after the node)."""
    if n.op == "logits":
        hidden = n.weights[0].type.shape[1]
        rows = [("rows", hidden)]                         # the gathered rows that want logits
        q = producers.get(n.inputs[0].name)
        if linear_op(n.weights[0].format) in ("linear_q4", "linear_q8") and q is not None and q.op == "quantize_act":
            rows.append(("qrows", act_row_layout(hidden, q.attrs["bits"])["row_bytes"] // 4))   # those rows quantized
        return rows
    if n.op == "lora_linear":
        q = producers.get(n.inputs[0].name)
        if q is not None and q.op == "quantize_act":      # the adapter reads the f32 values of int rows
            return [("rows", n.weights[0].type.shape[1])]
        return []
    if n.op == "router":
        return [("logits", n.weights[0].type.shape[0])]
    if n.op == "experts":
        return [(name, width) for name, width in expert_work_rows(n).items() if width]
    return []


def expert_work_rows(n: Node) -> dict[str, int]:
    """The ``experts`` driver's work rows (floats per token row; 0: not used), by its argument name."""
    gate_up = n.weights[0]
    E, two_i, H = gate_up.type.shape
    top_k = n.inputs[1].type.shape[-1]
    act = "q8" if gate_up.format == "mxfp4" and n.attrs.get("act_quant") == [8, 32] else "f32"
    # the quantized rows' layout is the same on every target: ask for the scalar kernels'
    linears = expert_linears({"wformat": gate_up.format, "target": "scalar", "H": H, "I": two_i // 2, "act": act})
    return {"pairs": top_k, "xg": H, "h": two_i, "act": two_i // 2, "y": H,
            "xq": quantized_row_floats(linears["quant_x"], H),
            "actq": quantized_row_floats(linears["quant_act"], two_i // 2)}


def stored_weights(n: Node) -> list[Weight]:
    """The weights ``n``'s kernels read from weights.bin, in the order they are placed there (a
    bias before its matrix; attention's ``sinks`` become a table in the kernel, not a weight)."""
    if n.op in ("linear", "lora_linear", "router"):
        return n.weights[1:2] + n.weights[:1]
    if n.op == "attention":
        k_mean, _ = attention_weights(n.weights, n.attrs)
        return [k_mean] if k_mean is not None else []
    return list(n.weights)
