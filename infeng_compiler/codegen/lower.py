"""Lowering: an IR graph -> the straight-line forward step as kernel calls over a static arena.

Every activation value, every kernel's scratch rows and every weight sit where the graph's memory
plan puts them (``Graph.memory``, recorded by the ``plan-memory`` pass: arena slices in floats per
token row, ``MAX_TOKENS`` rows each, and byte offsets into ``weights.bin``); lowering plans nothing
itself. Each call names a ``KernelSpec``; identical specs (all layers of a model) share one
rendered kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infeng_common.errors import InfengError, UnsupportedError

from ..ir import Graph, Node, Value, Weight
from ..ir.ops import attention_weights, rope_inv_freq
from ..quant.act import act_row_layout
from ..quant.formats import get_format, is_quantized
from ..quant.kv import QUANTIZED, attention_kv_formats, layer_block_bytes, plain_f32
from . import quant_kernels  # noqa: F401  (registers the quantized kernels)
from .footprint import align, expert_work_rows, static_width, weight_nbytes
from .kernels import KVQ_RING_ALIGN, KernelSpec
from .moe_kernels import check_expert_formats, expert_linears
from .quant_kernels import linear_op
from .target import Target

__all__ = ["Call", "LoweredModel", "ProfileEntry", "WeightSlot", "align", "describe", "lower", "weight_nbytes"]


@dataclass
class WeightSlot:
    """Where a weight lives in weights.bin, in which format."""

    name: str
    format: str                 # f32, f16, bf16
    shape: tuple[int, ...]
    offset: int
    nbytes: int


#: Token rows from which a row-wise kernel's call splits its rows over the pool's threads
#: (model.c.j2's ife_row_range); fewer rows (decode, small batches) call it once.
ROW_SPLIT_MIN_T = 64


def row_bytes(spec: KernelSpec) -> tuple[int, ...]:
    """For a kernel that takes no pool and computes each token row from that row alone (norms,
    activation quantization, elementwise ops, a split's column copies, RoPE): bytes per token row
    of each of its arguments (0 for one that is not a row matrix: ``T``, a norm's weights); () for
    any other kernel. Its rows split over the pool's threads give the same bits as one call."""
    f = 4                                            # bytes per float
    if spec.op == "rms_norm":
        return (f * spec["H"], 0, 0, f * spec["H"])
    if spec.op == "layer_norm":
        return (f * spec["H"], 0, 0, 0, f * spec["H"])
    if spec.op == "quantize_act":
        return (f * spec["K"], 0, act_row_layout(spec["K"], spec["bits"])["row_bytes"])
    if spec.op in ("silu_mul", "add"):
        return (f * spec["N"], f * spec["N"], 0, f * spec["N"])
    if spec.op == "gelu":
        return (f * spec["N"], 0, f * spec["N"])
    if spec.op == "copy_cols":
        return (f * spec["IN"], 0, f * spec["WIDTH"])
    if spec.op == "rope":
        return (f * spec["n_heads"] * spec["head_dim"], 0, 4)      # positions: one int32 per row
    return ()


@dataclass
class Call:
    """One kernel call of the forward step, with the IR line it implements."""

    spec: KernelSpec | None      # None for plain C (memcpy)
    args: list[str]
    comment: str
    code: str = ""               # used instead of a kernel call when spec is None
    guard: str = ""              # C condition the call runs under, if any
    node: int = 0                # index of the IR node (and of its profile entry)
    rows: tuple[int, ...] = ()   # row-wise kernel: bytes per token row of each argument (0: not a row matrix)
    row_job: int = -1            # its case in model.c's ife_row_range


@dataclass
class ProfileEntry:
    """What a profiled build times: one IR node, with the static work it does per token row."""

    name: str                    # the node's first result, e.g. "l3.q"
    op: str
    weight_bytes: int            # weight bytes the node reads per call
    flops_per_row: int           # multiply-adds x 2 per token row (0 where it depends on context)


@dataclass
class LoweredModel:
    target: Target
    calls: list[Call]
    specs: list[KernelSpec]                 # unique, in first-use order
    weights: list[WeightSlot]
    weights_bytes: int
    arena_floats_per_row: int               # arena floats per token row
    constants: dict[str, Any] = field(default_factory=dict)
    profile: list[ProfileEntry] = field(default_factory=list)   # one per IR node, in order


def describe(lowered: LoweredModel) -> str:
    """The lowered model as text (``infeng ir --after lower``): one line per kernel call of the
    forward step with its symbol, static parameters and arguments (weights at their byte offsets in
    weights.bin, activations at their arena slices: floats per token row), then the IR line."""
    lines = [(f"# lowered for {lowered.target.name}: {len(lowered.calls)} calls of {len(lowered.specs)} kernels, "
              f"weights {lowered.weights_bytes:,} bytes, arena {lowered.arena_floats_per_row:,} floats per token row")]
    for call in lowered.calls:
        guard = f"if ({call.guard}) " if call.guard else ""
        if call.spec is None:
            lines.append(f"{guard}{call.code}  // {call.comment}")
            continue
        params = ", ".join(f"{k}={v}" for k, v in call.spec.params)
        lines.append(f"{guard}{call.spec.symbol}({', '.join(call.args)})  // [{call.spec.isa}: {params}] "
                     f"{call.comment}")
    return "\n".join(lines) + "\n"


def _and(*conditions: str) -> str:
    """C conditions joined by &&, the empty ones left out."""
    return " && ".join(c for c in conditions if c)


def lower(graph: Graph, target: Target, *, max_tokens: int, block_size: int) -> LoweredModel:
    return _Lowering(graph, target, max_tokens, block_size).run()


class _Lowering:
    def __init__(self, graph: Graph, target: Target, max_tokens: int, block_size: int):
        if graph.memory is None:
            raise InfengError(f"{graph.name}: the graph has no memory plan; run the plan-memory pass (the "
                              f"pipeline's memory phase) before lowering")
        self.g, self.target = graph, target
        self.max_tokens, self.block_size = max_tokens, block_size
        self.calls: list[Call] = []
        self.specs: dict[KernelSpec, None] = {}
        plan = graph.memory
        self.weight_slots: dict[str, WeightSlot] = {
            p.name: WeightSlot(p.name, graph.weights[p.name].format, tuple(graph.weights[p.name].type.shape), p.offset,
                               p.size) for p in plan.weights}
        self.slice = plan.value_offsets()                # value name -> arena offset (floats per row)
        self.scratch_slice = plan.scratch_offsets()      # (node's first result, scratch name) -> arena offset
        self.node = 0                            # index of the node being lowered
        self.lora_sites: list[dict[str, Any]] = []   # one per lora_linear node
        self.lora_shape = (0, 0)                 # (adapter slots, max rank)
        self.kv_layers: list[dict[str, Any]] = []    # per attention layer: KV block bytes, ring sizes

    # -- helpers --------------------------------------------------------------------------
    def spec(self, op: str, **params: Any) -> KernelSpec:
        spec = KernelSpec.make(op, self.target.name, **params)
        self.specs.setdefault(spec, None)
        return spec

    def weight(self, w: Weight) -> str:
        """C expression for a weight pointer, at its offset in weights.bin."""
        slot = self.weight_slots.get(w.name)
        if slot is None or slot.nbytes != weight_nbytes(w):
            raise self.stale_plan(f"@{w.name} " + ("is not placed in weights.bin" if slot is None else
                                                   f"takes {weight_nbytes(w)} bytes, placed as {slot.nbytes}"))
        ctype = "float" if slot.format == "f32" else "uint8_t" if is_quantized(slot.format) else "uint16_t"
        return f"(const {ctype} *)(weights + {slot.offset})"

    def buf(self, v: Value) -> str:
        if v.name not in self.slice:
            raise self.stale_plan(f"%{v.name} has no arena slice")
        return f"(arena + {self.slice[v.name]} * IFE_MAX_TOKENS)"

    def scratch(self, n: Node, name: str) -> str:
        """The arena rows of scratch buffer ``name`` of node ``n`` (``footprint.scratch_rows``)."""
        key = (n.outputs[0].name, name)
        if key not in self.scratch_slice:
            raise self.stale_plan(f"no scratch {name!r} for %{key[0]}")
        return f"(arena + {self.scratch_slice[key]} * IFE_MAX_TOKENS)"

    def stale_plan(self, what: str) -> InfengError:
        return InfengError(f"{self.g.name}: the memory plan does not fit the graph ({what}); plan-memory must run "
                           f"after every pass that changes the graph")

    width = staticmethod(static_width)

    # -- the walk -------------------------------------------------------------------------
    def run(self) -> LoweredModel:
        from ..ir.printer import format_node

        self.producers, self.users = self.g.producers(), self.g.users()
        graph_inputs = {v.name for v in self.g.inputs}
        unknown = graph_inputs - {"tokens", "positions", "adapter_slots"}
        if unknown:
            raise UnsupportedError(f"codegen does not know how to feed graph inputs {sorted(unknown)}")
        profile = []
        for i, n in enumerate(self.g.nodes):
            self.node = i
            profile.append(self.profile_entry(n))
            getattr(self, f"lower_{n.op}", self.unsupported)(n, format_node(n))
        c = self.g.meta
        attn = [n for n in self.g.nodes if n.op == "attention"]
        return LoweredModel(
            self.target, self.calls, list(self.specs), list(self.weight_slots.values()), self.g.memory.weights_bytes,
            self.g.memory.arena_floats,
            {"max_tokens": self.max_tokens, "block_size": self.block_size, "vocab_size": c["vocab_size"],
             "hidden_size": c["hidden_size"], "n_layers": len(attn),
             "n_kv_heads": attn[0].attrs["n_kv_heads"] if attn else 0,
             "head_dim": attn[0].attrs["head_dim"] if attn else 0,
             "lora_slots": self.lora_shape[0], "lora_rank": self.lora_shape[1], "lora_sites": self.lora_sites,
             "kv_layers": self.kv_layers, "row_split_min_t": ROW_SPLIT_MIN_T, **self.expert_constants()},
            profile)

    def expert_constants(self) -> dict[str, Any]:
        """For MoE models: the bytes of the stacked expert weights (gate_up, down and their biases) and
        the share of them one token reads (top_k / E), so a decode roofline counts the active bytes."""
        nodes = list(self.g.find("experts"))
        if not nodes:
            return {}
        names = {w.name for n in nodes for w in n.weights}
        share = max(n.inputs[1].type.shape[-1] / n.weights[0].type.shape[0] for n in nodes)
        return {"expert_weights_bytes": sum(self.weight_slots[name].nbytes for name in names),
                "experts_per_token_share": share}

    def quantized_from(self, v: Value) -> Value | None:
        """The f32 value ``v`` quantizes, when a ``quantize_act`` produces ``v``."""
        p = self.producers.get(v.name)
        return p.inputs[0] if p is not None and p.op == "quantize_act" else None

    @staticmethod
    def profile_entry(n: Node) -> ProfileEntry:
        weight_bytes = sum(weight_nbytes(w) for w in n.weights)
        if n.op == "embedding":
            weight_bytes = weight_nbytes(n.weights[0]) // n.weights[0].type.shape[0]
        flops = 2 * n.weights[0].type.numel() if n.op in ("linear", "logits") else 0
        if n.op == "experts":        # one token reads its top_k of the E experts, 3 matrix products each
            top_k, n_experts = n.inputs[1].type.shape[-1], n.weights[0].type.shape[0]
            weight_bytes = weight_bytes * top_k // n_experts
            flops = 2 * (n.weights[0].type.numel() + n.weights[1].type.numel()) * top_k // n_experts
        return ProfileEntry(n.outputs[0].name, n.op, weight_bytes, flops)

    def unsupported(self, n: Node, comment: str) -> None:
        raise UnsupportedError(f"codegen has no kernel for op {n.op!r} ({comment})")

    def emit(self, spec: KernelSpec | None, args: list[str], comment: str, code: str = "", guard: str = "") -> None:
        rows = row_bytes(spec) if spec is not None and "T" in args else ()
        if rows and len(rows) != len(args):
            raise InfengError(f"codegen: {spec.op} takes {len(rows)} arguments per row_bytes, the call {len(args)}")
        job = sum(1 for c in self.calls if c.rows) if rows else -1
        self.calls.append(Call(spec, args, comment, code, guard, self.node, rows, job))

    # -- one method per op ----------------------------------------------------------------
    def lower_embedding(self, n: Node, comment: str) -> None:
        table = n.weights[0]
        ids = "tokens" if n.inputs[0].name == "tokens" else "positions"
        if is_quantized(table.format):
            spec = self.spec("embedding_q", V=table.type.shape[0], H=table.type.shape[1], wformat=table.format)
        else:
            spec = self.spec("embedding", V=table.type.shape[0], H=table.type.shape[1], wdtype=table.format)
        self.emit(spec, [ids, "T", self.weight(table), self.buf(n.output)], comment)

    def lower_rms_norm(self, n: Node, comment: str) -> None:
        spec = self.spec("rms_norm", H=self.width(n.output), eps=float(n.attrs["eps"]))
        self.emit(spec, [self.buf(n.inputs[0]), "T", self.weight(n.weights[0]), self.buf(n.output)], comment)

    def lower_layer_norm(self, n: Node, comment: str) -> None:
        spec = self.spec("layer_norm", H=self.width(n.output), eps=float(n.attrs["eps"]))
        self.emit(spec, [self.buf(n.inputs[0]), "T", self.weight(n.weights[0]), self.weight(n.weights[1]),
                         self.buf(n.output)], comment)

    def lower_linear(self, n: Node, comment: str) -> None:
        w = n.weights[0]
        bias = self.weight(n.weights[1]) if len(n.weights) > 1 else "NULL"
        x = self.buf(n.inputs[0])
        op = linear_op(w.format)
        if op is None:
            spec = self.spec("linear", K=w.type.shape[1], N=w.type.shape[0], wdtype=w.format)
        elif op == "linear_mxfp4":
            spec = self.mxfp4_spec(w, n.inputs[0])
            x = f"(const void *){x}"
        elif op == "linear_f8":
            spec = self.spec(op, K=w.type.shape[1], N=w.type.shape[0], wformat=w.format)
        else:
            self.integer_linear(n.inputs[0], x, w, bias, self.buf(n.output), "T", "", comment)
            return
        self.emit(spec, ["pool", x, "T", self.weight(w), bias, self.buf(n.output)], comment)

    def integer_linear(self, v: Value, x: str, w: Weight, bias: str, y: str, rows: str, guard: str,
                       comment: str) -> None:
        """The linear of an integer weight ``w`` over ``rows`` rows of ``x`` (the arena rows of
        ``v``): its int8/int16 kernel when a ``quantize_act`` produces ``v``, the f32-activation
        kernel (``linear_qf32``) on the f32 rows otherwise and, with the quantize_act's
        ``f32_below=N``, for steps of fewer than N token rows (passes/act_precision.py). ``guard``:
        a C condition every call also runs under."""
        K, N = w.type.shape[1], w.type.shape[0]
        f32 = self.spec("linear_qf32", K=K, N=N, wformat=w.format)
        source = self.quantized_from(v)
        if source is None:
            self.emit(f32, ["pool", f"(const void *){x}", rows, self.weight(w), bias, y], comment, guard=guard)
            return
        below = self.producers[v.name].attrs.get("f32_below", 0)
        if below:
            f32_x = self.buf(source) if x == self.buf(v) else x       # logits pass their gathered f32 rows
            self.emit(f32, ["pool", f"(const void *){f32_x}", rows, self.weight(w), bias, y],
                      comment + "  [f32 activations]", guard=_and(guard, f"T < {below}"))
        spec = self.spec(linear_op(w.format), K=K, N=N, wformat=w.format)
        qx = self.quantized_rows(v, w.format, comment) if x == self.buf(v) else f"(const void *){x}"
        self.emit(spec, ["pool", qx, rows, self.weight(w), bias, y], comment,
                  guard=_and(guard, f"T >= {below}" if below else ""))

    def mxfp4_spec(self, w: Weight, x: Value | None) -> KernelSpec:
        """The MXFP4 linear of ``w``: int8 activation rows when a ``quantize_act`` (8 bits, blocks of
        32) produces ``x``, f32 rows otherwise (``x`` None: f32, the logits' gathered rows)."""
        p = self.producers.get(x.name) if x is not None else None
        act = "q8" if p is not None and p.op == "quantize_act" and (p.attrs["bits"], p.attrs["block"]) == (8, 32) else "f32"
        return self.spec("linear_mxfp4", K=w.type.shape[1], N=w.type.shape[0], act=act)

    def quantized_rows(self, v: Value, weight_format: str, comment: str) -> str:
        """The quantized activation rows ``v`` holds for an integer weight of ``weight_format``."""
        p = self.producers.get(v.name)
        bits = 8 if get_format(weight_format).bits == 4 else 16
        if p is None or p.op != "quantize_act" or p.attrs["bits"] != bits:
            raise UnsupportedError(f"{weight_format} weights read int{bits} activation rows from a quantize_act "
                                   f"node (the quantize pass inserts them); got %{v.name} ({comment})")
        return f"(const void *){self.buf(v)}"

    def lower_quantize_act(self, n: Node, comment: str) -> None:
        users = self.users.get(n.output.name, [])
        if users and all(u.op == "logits" for u in users):
            return                                       # logits quantize only the rows they gather
        spec = self.spec("quantize_act", K=self.width(n.inputs[0]), bits=n.attrs["bits"], block=n.attrs["block"])
        below = n.attrs.get("f32_below", 0)
        self.emit(spec, [self.buf(n.inputs[0]), "T", f"(uint8_t *){self.buf(n.output)}"], comment,
                  guard=f"T >= {below}" if below else "")

    def lower_lora_linear(self, n: Node, comment: str) -> None:
        """The base product, then each token's adapter delta from its slot (``lora_apply``)."""
        self.lower_linear(n, comment)
        w, a = n.weights[0], n.attrs
        site = a["site"]
        self.lora_sites.append({"site": site, "target": a["target"], "in": w.type.shape[1], "out": w.type.shape[0]})
        self.lora_shape = (a["max_adapters"], a["max_rank"])
        spec = self.spec("lora_apply", K=w.type.shape[1], N=w.type.shape[0], R=a["max_rank"],
                         slots=a["max_adapters"])
        x = self.buf(n.inputs[0])
        q = self.producers.get(n.inputs[0].name)
        if q is not None and q.op == "quantize_act":      # the delta reads the values the rows stand for
            K = w.type.shape[1]
            x = self.scratch(n, "rows")
            below = q.attrs.get("f32_below", 0)
            deq = self.spec("dequantize_act", K=K, bits=q.attrs["bits"], block=q.attrs["block"])
            self.emit(deq, [f"(const uint8_t *){self.buf(n.inputs[0])}", "T", x], comment + "  [adapter input]",
                      guard=_and("adapter_slots", f"T >= {below}" if below else ""))
            if below:                                     # fewer rows: the f32 rows themselves
                x = f"(T < {below} ? {self.buf(q.inputs[0])} : {x})"
        self.emit(spec, [x, "T", "adapter_slots", f"m->lora_rank[{site}]",
                         f"m->lora_scale[{site}]", f"m->lora_a[{site}]", f"m->lora_bt[{site}]", self.buf(n.output)],
                  comment + "  [adapter deltas]", guard="adapter_slots")

    def lower_logits(self, n: Node, comment: str) -> None:
        w = n.weights[0]
        hidden = w.type.shape[1]
        x = self.scratch(n, "rows")
        source = self.quantized_from(n.inputs[0]) or n.inputs[0]
        gather = self.spec("gather_rows", H=hidden)
        self.emit(gather, [self.buf(source), "logits_rows", "R", x], comment + "  [rows that want logits]",
                  guard="R > 0")
        op = linear_op(w.format)
        if op in ("linear_q4", "linear_q8"):
            self.integer_logits(n, w, x, comment)
            return
        if op is None:
            spec = self.spec("linear", K=hidden, N=w.type.shape[0], wdtype=w.format)
        elif op == "linear_mxfp4":
            spec = self.mxfp4_spec(w, None)                                # reads the gathered f32 rows
        else:
            spec = self.spec(op, K=hidden, N=w.type.shape[0], wformat=w.format)
        self.emit(spec, ["pool", x, "R", self.weight(w), "NULL", "logits"], comment, guard="R > 0")

    def integer_logits(self, n: Node, w: Weight, x: str, comment: str) -> None:
        """Logits of an integer weight over the R gathered f32 rows at ``x``: quantized first (on
        the steps whose ``quantize_act`` quantizes), as ``integer_linear`` chooses."""
        hidden = w.type.shape[1]
        q = self.producers.get(n.inputs[0].name)
        if q is None or q.op != "quantize_act":
            self.integer_linear(n.inputs[0], x, w, "NULL", "logits", "R", "R > 0", comment)
            return
        self.quantized_rows(n.inputs[0], w.format, comment)               # checks the activation form
        below = q.attrs.get("f32_below", 0)
        if below:
            self.emit(self.spec("linear_qf32", K=hidden, N=w.type.shape[0], wformat=w.format),
                      ["pool", f"(const void *){x}", "R", self.weight(w), "NULL", "logits"],
                      comment + "  [f32 activations]", guard=f"R > 0 && T < {below}")
        guard = f"R > 0 && T >= {below}" if below else "R > 0"
        qrows = self.scratch(n, "qrows")
        quant = self.spec("quantize_act", K=hidden, bits=q.attrs["bits"], block=q.attrs["block"])
        self.emit(quant, [x, "R", f"(uint8_t *){qrows}"], comment + "  [quantize those rows]", guard=guard)
        self.emit(self.spec(linear_op(w.format), K=hidden, N=w.type.shape[0], wformat=w.format),
                  ["pool", f"(const void *){qrows}", "R", self.weight(w), "NULL", "logits"], comment, guard=guard)

    def lower_rope(self, n: Node, comment: str) -> None:
        x, out = n.inputs[0], n.output
        if self.slice[x.name] != self.slice[out.name]:
            self.emit(None, [], comment + "  [copy: the input is read again later]",
                      code=f"memcpy({self.buf(out)}, {self.buf(x)}, sizeof(float) * (size_t)T * {self.width(x)});")
        inv = [float(f) for f in rope_inv_freq(n.attrs)]
        spec = self.spec("rope", n_heads=n.attrs["n_heads"], head_dim=n.attrs["head_dim"], inv_freq=tuple(inv))
        self.emit(spec, [self.buf(out), "T", "positions"], comment)

    def lower_attention(self, n: Node, comment: str) -> None:
        a = n.attrs
        layer = a["layer"]
        k_format, v_format, group = attention_kv_formats(a)
        ring_rows = align(a["kv_window"] + self.max_tokens, KVQ_RING_ALIGN) if a.get("kv_window") else 0
        self.kv_layers.append(self.kv_layer(a, k_format, v_format, ring_rows))
        q, k, v = (self.buf(x) for x in n.inputs[:3])
        k_mean_weight, sinks = attention_weights(n.weights, a)
        if sinks is not None and not (plain_f32(a) and k_mean_weight is None):
            raise UnsupportedError(f"attention sinks (GPT-OSS) have kernels for an f32 KV cache only: {comment}")
        if plain_f32(a) and k_mean_weight is None:
            shape = {"n_heads": a["n_heads"], "n_kv_heads": a["n_kv_heads"], "head_dim": a["head_dim"],
                     "block_size": self.block_size, "scale": float(a["scale"]), "window": int(a.get("window") or 0)}
            if sinks is not None:       # the sinks become a table in the kernel (moe_kernels.py)
                spec = self.spec("attention_sinks", **shape, sinks=tuple(float(s) for s in sinks.numpy_f32()))
            else:
                spec = self.spec("attention", **shape)
            self.emit(spec, ["pool", q, k, v, "T", "positions", "seq_slots", "block_table", "max_blocks",
                             f"m->k_cache[{layer}]", f"m->v_cache[{layer}]", self.buf(n.output)], comment)
            return
        # a quantized / rotated / windowed KV cache (docs/kv-cache.md)
        spec = self.spec("attention_kvq", n_heads=a["n_heads"], n_kv_heads=a["n_kv_heads"], head_dim=a["head_dim"],
                         block_size=self.block_size, scale=float(a["scale"]), window=int(a.get("window") or 0),
                         k_format=k_format, v_format=v_format, group=group or 0,
                         rotate=bool(a.get("rotate_qk")), kv_window=int(a.get("kv_window") or 0), ring_rows=ring_rows)
        rings = self.kv_layers[-1]
        k_mean = self.weight(n.weights[0]) if n.weights else "NULL"        # centred K (passes/kv_cache.py)
        self.emit(spec, ["pool", q, k, v, k_mean, "T", "positions", "seq_slots", "block_table", "max_blocks",
                         f"m->k_cache[{layer}]", f"m->v_cache[{layer}]",
                         f"m->k_ring[{layer}]" if rings["k_ring"] else "NULL",
                         f"m->v_ring[{layer}]" if rings["v_ring"] else "NULL",
                         "m->ring_lo" if ring_rows else "NULL", self.buf(n.output)], comment)

    def kv_layer(self, a: dict[str, Any], k_format: str, v_format: str, ring_rows: int) -> dict[str, Any]:
        """Bytes of one KV block of this layer (K, V) and f16 ring elements per sequence slot."""
        if a["layer"] != len(self.kv_layers):
            raise UnsupportedError(f"attention layers must be numbered 0, 1, ... in order; found layer {a['layer']} "
                                   f"after {len(self.kv_layers)} layers")
        kvh, hd = a["n_kv_heads"], a["head_dim"]
        k_bytes, v_bytes = layer_block_bytes(a, self.block_size)
        return {"k_format": k_format, "v_format": v_format, "k_bytes": k_bytes, "v_bytes": v_bytes,
                "ring_rows": ring_rows,
                "k_ring": kvh * hd * ring_rows if k_format in QUANTIZED else 0,
                "v_ring": kvh * hd * ring_rows if v_format in QUANTIZED else 0}

    def lower_silu_mul(self, n: Node, comment: str) -> None:
        spec = self.spec("silu_mul", N=self.width(n.output))
        self.emit(spec, [self.buf(n.inputs[0]), self.buf(n.inputs[1]), "T", self.buf(n.output)], comment)

    def lower_gelu(self, n: Node, comment: str) -> None:
        spec = self.spec("gelu", N=self.width(n.output), approximate=n.attrs["approximate"])
        self.emit(spec, [self.buf(n.inputs[0]), "T", self.buf(n.output)], comment)

    def lower_add(self, n: Node, comment: str) -> None:
        spec = self.spec("add", N=self.width(n.output))
        self.emit(spec, [self.buf(n.inputs[0]), self.buf(n.inputs[1]), "T", self.buf(n.output)], comment)

    def lower_split(self, n: Node, comment: str) -> None:
        x = n.inputs[0]
        offset = 0
        for out in n.outputs:
            width = self.width(out)
            spec = self.spec("copy_cols", IN=self.width(x), OFFSET=offset, WIDTH=width)
            self.emit(spec, [self.buf(x), "T", self.buf(out)], comment)
            offset += width

    # -- mixture of experts (docs/moe.md) --------------------------------------------------
    def lower_router(self, n: Node, comment: str) -> None:
        """The router logits through a linear kernel, then the top-k selection."""
        w = n.weights[0]
        if linear_op(w.format) is not None:
            raise UnsupportedError(f"router weights in format {w.format} have no kernel (f32/f16/bf16): {comment}")
        E, H = w.type.shape
        logits = self.scratch(n, "logits")
        bias = self.weight(n.weights[1]) if len(n.weights) > 1 else "NULL"
        self.emit(self.spec("linear", K=H, N=E, wdtype=w.format),
                  ["pool", self.buf(n.inputs[0]), "T", self.weight(w), bias, logits], comment + "  [router logits]")
        weights, ids = n.outputs
        spec = self.spec("router", E=E, top_k=n.attrs["top_k"], scoring=n.attrs["scoring"],
                         renormalize=n.attrs["renormalize"])
        self.emit(spec, [logits, "T", self.buf(weights), f"(int32_t *){self.buf(ids)}"], comment)

    def lower_experts(self, n: Node, comment: str) -> None:
        """The expert-grouped driver over the linear kernels of the expert weights' format, with its
        work rows in the arena (moe_kernels.py)."""
        gate_up, down = n.weights[:2]
        check_expert_formats(gate_up.format, down.format, comment)
        E, two_i, H = gate_up.type.shape
        biases = n.weights[2:]
        bdtype = biases[0].format if biases else "none"
        if biases and biases[1].format != bdtype:
            raise UnsupportedError(f"experts: biases in formats {bdtype} and {biases[1].format}: {comment}")
        a = n.attrs
        top_k = n.inputs[1].type.shape[-1]
        spec = self.spec("experts", E=E, H=H, I=two_i // 2, top_k=top_k, activation=a["activation"], gate_up=a["gate_up"],
                         alpha=float(a.get("alpha", 0.0)), limit=float(a.get("limit", 0.0)), wformat=gate_up.format,
                         bdtype=bdtype, target=self.target.name,
                         act="q8" if gate_up.format == "mxfp4" and a.get("act_quant") == [8, 32] else "f32")
        linears = expert_linears(dict(spec.params))
        for called in (linears["gate_up"], linears["down"], linears["quant_x"], linears["quant_act"]):
            if called is not None:
                self.specs.setdefault(called, None)
        buf = {name: self.scratch(n, name) for name, width in expert_work_rows(n).items() if width}
        x, rw, ids = n.inputs
        self.emit(spec, ["pool", self.buf(x), "T", self.buf(rw), f"(const int32_t *){self.buf(ids)}",
                         self.weight(gate_up), self.weight(down),
                         self.weight(biases[0]) if biases else "NULL", self.weight(biases[1]) if biases else "NULL",
                         f"(int32_t *){buf['pairs']}", buf["xg"], buf.get("xq", "NULL"), buf["h"], buf["act"],
                         buf.get("actq", "NULL"), buf["y"], self.buf(n.output)], comment)

    def lower_head_rms_norm(self, n: Node, comment: str) -> None:
        spec = self.spec("head_rms_norm", H=self.width(n.output), head_dim=n.attrs["head_dim"], eps=float(n.attrs["eps"]))
        self.emit(spec, [self.buf(n.inputs[0]), "T", self.weight(n.weights[0]), self.buf(n.output)], comment)

    def lower_sigmoid_gate(self, n: Node, comment: str) -> None:
        w = n.weights[0]
        if linear_op(w.format) is not None:
            raise UnsupportedError(f"sigmoid_gate weights in format {w.format} have no kernel (f32/f16/bf16): {comment}")
        spec = self.spec("sigmoid_gate", N=self.width(n.output), K=w.type.shape[1], wdtype=w.format)
        self.emit(spec, [self.buf(n.inputs[0]), self.buf(n.inputs[1]), "T", self.weight(w), self.buf(n.output)], comment)
