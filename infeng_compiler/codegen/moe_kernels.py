"""Kernels of the mixture-of-experts ops (``ir/moe_ops.py``), registered in ``kernels.OPS`` on import.

| op | what | templates |
| --- | --- | --- |
| ``router`` | per token, the top k of E router logits and their weights (the logits come from a ``linear``) | scalar |
| ``experts`` | the step's (token, expert) pairs grouped by expert; per expert with tokens, its gate_up and down matrices through the target's linear kernels | scalar (driver), vec (its row-wise phases in vectors, every SIMD target) |
| ``head_rms_norm`` | RMS norm of each head of a row | scalar |
| ``sigmoid_gate`` | y scaled per token by sigmoid(x . w) | scalar |
| ``attention_sinks`` | ``attention`` with a learned logit per query head in every softmax denominator (GPT-OSS) | the attention templates: scalar, vec, amx |

``experts`` is a driver: it sorts the pairs by expert (a counting sort), gathers each expert's token
rows, and calls the linear kernel of the expert weights' format (f32/f16/bf16 ``linear``, int8/int4
``linear_q8``/``linear_q4`` on rows it quantizes with ``quantize_act``, fp8, MXFP4) on that expert's
slice of the stacked weight, so each chosen expert's weights are read once per step whatever the
number of its tokens, an expert no token chose is not read at all, and the pool's threads split
each expert's output rows. The activation and the weighted scatter-add run on the calling thread.
A stacked weight [E, N, K] in any format is E consecutive [N, K] layouts (``weight_nbytes / E``
bytes each).
"""
from __future__ import annotations

from typing import Any

from infeng_common.errors import UnsupportedError

from ..ir.moe_ops import EXPERT_ACTIVATIONS, GATE_UP_LAYOUTS, ROUTER_SCORING
from ..quant.act import act_row_layout
from ..quant.formats import get_format, is_quantized
from .kernels import (
    OPS,
    WEIGHT_CTYPES,
    KernelSpec,
    _all,
    _check_attention,
    _check_wdtype,
    _expect,
    _OpKernel,
    _positive,
    _rope_digest,
    kernel_prototype,
)
from .quant_kernels import linear_op


def _check_router(p: dict[str, Any]) -> None:
    _positive("E", "top_k")(p)
    _expect(p["top_k"] <= p["E"], f"router: top_k {p['top_k']} exceeds {p['E']} experts")
    _expect(p["scoring"] in ROUTER_SCORING, f"router: scoring must be one of {ROUTER_SCORING}")


def _check_experts(p: dict[str, Any]) -> None:
    _positive("E", "H", "I", "top_k")(p)
    _expect(p["activation"] in EXPERT_ACTIVATIONS, f"experts: activation must be one of {EXPERT_ACTIVATIONS}")
    _expect(p["gate_up"] in GATE_UP_LAYOUTS, f"experts: gate_up must be one of {GATE_UP_LAYOUTS}")
    _expect(p["bdtype"] in ("none", *WEIGHT_CTYPES), f"experts: bias dtype {p['bdtype']!r} has no kernels")
    _expect(p["act"] in ("f32", "q8"), f"experts: act must be f32 or q8 (MXFP4 weights), got {p['act']!r}")
    expert_linears(p)          # the weight format has linear kernels


def expert_linears(p: dict[str, Any]) -> dict[str, Any]:
    """The kernels the ``experts`` driver calls for static parameters ``p``: ``gate_up`` and ``down``
    (linear specs for the target), and ``quant_x``/``quant_act`` (``quantize_act`` specs of the rows an
    integer format reads; None for f32 rows), with each matrix's bytes per expert."""
    fmt, target, H, I = p["wformat"], p["target"], p["H"], p["I"]
    op = linear_op(fmt)

    def linear(K: int, N: int) -> KernelSpec:
        if op is None:
            _check_wdtype({"wdtype": fmt})
            return KernelSpec.make("linear", target, K=K, N=N, wdtype=fmt)
        if op == "linear_mxfp4":
            return KernelSpec.make(op, target, K=K, N=N, act=p["act"])
        return KernelSpec.make(op, target, K=K, N=N, wformat=fmt)

    def quant(K: int) -> KernelSpec | None:
        if op == "linear_mxfp4" and p["act"] == "q8":
            return KernelSpec.make("quantize_act", target, K=K, bits=8, block=32)
        if op not in ("linear_q4", "linear_q8"):
            return None
        bits = 8 if get_format(fmt).bits == 4 else 16
        return KernelSpec.make("quantize_act", target, K=K, bits=bits, block=32 if bits == 8 else 0)

    def expert_bytes(N: int, K: int) -> int:
        return get_format(fmt).nbytes((N, K)) if is_quantized(fmt) else N * K * (4 if fmt == "f32" else 2)

    return {"gate_up": linear(H, 2 * I), "down": linear(I, H), "quant_x": quant(H), "quant_act": quant(I),
            "gate_up_bytes": expert_bytes(2 * I, H), "down_bytes": expert_bytes(H, I)}


def quantized_row_floats(spec: KernelSpec | None, K: int) -> int:
    """Arena floats per row of ``quantize_act`` rows of width K (0 without quantization)."""
    return 0 if spec is None else act_row_layout(K, spec["bits"])["row_bytes"] // 4


#: Rows of one expert from which the driver's row-wise phases (gather, activation, scatter-add) run
#: over the pool: below, a dispatch (a few microseconds) costs more than the rows.
_PARALLEL_ROWS = 16


def _plan_experts(p: dict[str, Any], isa: str) -> dict[str, Any]:
    kernels = expert_linears(p)
    called = [s for s in (kernels["gate_up"], kernels["down"], kernels["quant_x"], kernels["quant_act"]) if s]
    return {"linears": kernels, "called_prototypes": [kernel_prototype(s) for s in dict.fromkeys(called)],
            "x_row_floats": quantized_row_floats(kernels["quant_x"], p["H"]),
            "act_row_floats": quantized_row_floats(kernels["quant_act"], p["I"]),
            "B": WEIGHT_CTYPES.get(p["bdtype"], "float"), "parallel_rows": _PARALLEL_ROWS}


OPS.update({
    "router": _OpKernel(
        ("E", "top_k", "scoring", "renormalize"),
        "void {sym}(const float *logits /* [T, E] */, int T, float *weights /* [T, top_k] */, "
        "int32_t *ids /* [T, top_k] */)",
        ("scalar",),
        lambda p: [f"e{p['E']}", f"k{p['top_k']}", p["scoring"], "norm" if p["renormalize"] else "raw"],
        _check_router, scalar_reason="top-k selection over E logits per token, weights in double: "
                                     "sequential compares, E x top_k per token"),
    "experts": _OpKernel(
        ("E", "H", "I", "top_k", "activation", "gate_up", "alpha", "limit", "wformat", "bdtype", "act", "target"),
        "void {sym}(ife_pool *pool, const float *x /* [T, H] */, int T, const float *route_weights /* [T, top_k] */, "
        "const int32_t *route_ids /* [T, top_k] */, const void *gate_up /* [E, 2I, H] */, const void *down /* [E, H, I] */, "
        "const void *gate_up_bias /* [E, 2I] or NULL */, const void *down_bias /* [E, H] or NULL */, "
        "int32_t *pairs /* [T * top_k] work */, float *xg /* [T, H] work */, void *xq /* [T, quantized H row] work */, "
        "float *h /* [T, 2I] work */, float *act /* [T, I] work */, void *actq /* [T, quantized I row] work */, "
        "float *y /* [T, H] work */, float *out /* [T, H] */)",
        ("scalar",),
        lambda p: [p["wformat"], f"e{p['E']}", f"h{p['H']}", f"i{p['I']}", f"k{p['top_k']}", p["activation"],
                   p["gate_up"], f"b{p['bdtype']}", *(["q8"] if p["act"] == "q8" else [])],
        _check_experts, _plan_experts, vec=True),
    "head_rms_norm": _OpKernel(
        ("H", "head_dim", "eps"),
        "void {sym}(const float *x /* [T, H] */, int T, const float *w /* [head_dim] */, float *out /* [T, H] */)",
        ("scalar",),
        lambda p: [f"h{p['H']}", f"d{p['head_dim']}"],
        _all(_positive("H", "head_dim"), lambda p: _expect(p["H"] % p["head_dim"] == 0, "head_rms_norm: H is not "
                                                                                          "whole heads")),
        scalar_reason="sums of squares in double, as the reference; the scaling loop -O3 vectorises"),
    "sigmoid_gate": _OpKernel(
        ("N", "K", "wdtype"),
        "void {sym}(const float *y /* [T, N] */, const float *x /* [T, K] */, int T, const {W} *w /* [K] */, "
        "float *out /* [T, N] */)",
        ("scalar",),
        lambda p: [p["wdtype"], f"n{p['N']}", f"k{p['K']}"],
        _all(_positive("N", "K"), _check_wdtype),
        scalar_reason="one dot product and a sigmoid in double per token; the scaling loop -O3 vectorises"),
})

#: ``attention`` with sinks: its parameters, prototype and templates, plus ``sinks`` (one float per
#: query head, a table in the kernel: the online softmax starts from max = sink, denominator = 1).
_attention = OPS["attention"]
OPS["attention_sinks"] = _OpKernel(
    _attention.params + ("sinks",), _attention.prototype, _attention.variants,
    lambda p: [*_attention.symbol_parts(p), f"sink{_rope_digest(p['sinks'])}"],
    _all(_check_attention, lambda p: _expect(isinstance(p["sinks"], tuple) and len(p["sinks"]) == p["n_heads"],
                                             f"attention_sinks: sinks must hold n_heads = {p['n_heads']} values")),
    _attention.plan, vec=_attention.vec)


def check_expert_formats(gate_up_format: str, down_format: str, where: str) -> None:
    if gate_up_format != down_format:
        raise UnsupportedError(f"experts: gate_up is {gate_up_format} but down is {down_format}; the kernels "
                               f"take one format for both ({where})")
