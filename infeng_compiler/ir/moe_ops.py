"""IR ops of mixture-of-experts models, registered with the op registry (``ops.py``) on import.

| op | operands | attributes | results |
| --- | --- | --- | --- |
| ``router`` | x ``[T,H]``, @weight ``[E,H]``, @bias? ``[E]`` | ``top_k``, ``scoring``, ``renormalize`` | f32[T,k] weights, i32[T,k] expert ids |
| ``experts`` | x ``[T,H]``, weights ``[T,k]``, ids ``[T,k]``; @gate_up ``[E,2I,H]``, @down ``[E,H,I]``, @gate_up_bias? ``[E,2I]``, @down_bias? ``[E,H]`` | ``activation``, ``gate_up``, (``alpha``, ``limit``) | f32[T,H] |
| ``head_rms_norm`` | x ``[T,heads*hd]``, @weight ``[hd]`` | ``eps``, ``head_dim`` | like x |
| ``sigmoid_gate`` | y ``[T,H]``, x ``[T,K]``, @weight ``[1,K]`` | | y * sigmoid(x . w) |

Routing as each family does it (``scoring``):

- ``softmax`` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): softmax over all E logits, the top k of the
  probabilities, divided by their sum when ``renormalize`` (Mixtral always; Qwen/OLMoE when the
  config's ``norm_topk_prob``).
- ``topk_softmax`` (GPT-OSS): the top k logits (router bias included), softmax over those k.

The chosen experts come in descending order of their scores, ties to the lower expert id (as
``torch.topk`` gives them for distinct values).

``experts`` runs, for each token and each of its k chosen experts ``e`` with weight ``r``,
``r * (down[e] @ act(gate_up[e] @ x + gate_up_bias[e]) + down_bias[e])`` and sums over the k.
Weights keep the [out, in] layout of ``linear``: ``gate_up`` stacks each expert's gate rows then
its up rows (``gate_up="concat"``) or interleaves them, gate row j at 2j and up row j at 2j+1
(``gate_up="interleaved"``, GPT-OSS). ``activation``: ``silu`` (silu(gate) * up) or
``swiglu_clamp`` (GPT-OSS: gate clamped to <= limit, up to [-limit, limit],
``(up + 1) * gate * sigmoid(alpha * gate)``). ``act_quant`` [bits, block] (optional, set with integer
expert weights): the rows each matrix multiplies are rounded through ``quantize_act``'s integer
form first, as the kernels do. A quantized stacked weight may come as its [E*N, K] matrix.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import storage
from .graph import Weight
from .ops import _expect, op, reference
from .types import DTYPES, TensorType

ROUTER_SCORING = ("softmax", "topk_softmax")
EXPERT_ACTIVATIONS = ("silu", "swiglu_clamp")
GATE_UP_LAYOUTS = ("concat", "interleaved")


# ---------------------------------------------------------------------------------------------
# router
@op("router", inputs=("x",), weights=("weight", "bias?"), attrs=("top_k", "scoring", "renormalize"))
def _router_shape(ins, ws, attrs):
    """Per token, the ``top_k`` experts of ``x @ weight^T (+ bias)`` and their weights -> f32[T,k], i32[T,k]."""
    x, w = ins[0], ws[0]
    _expect(x.rank == 2 and w.rank == 2 and x.shape[-1] == w.shape[1], f"router: input {x} does not match weight {w}")
    _expect(len(ws) == 1 or ws[1].shape == (w.shape[0],), f"router: bias {ws[-1]} does not match weight {w}")
    k = attrs["top_k"]
    _expect(isinstance(k, int) and 0 < k <= w.shape[0], f"router: top_k must be in [1, {w.shape[0]}], got {k!r}")
    _expect(attrs["scoring"] in ROUTER_SCORING, f"router: scoring must be one of {ROUTER_SCORING}, got {attrs['scoring']!r}")
    _expect(isinstance(attrs["renormalize"], bool), "router: renormalize must be true or false")
    T = x.shape[0]
    return [TensorType("f32", (T, k)), TensorType("i32", (T, k))]


def route(logits: np.ndarray, top_k: int, scoring: str, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Expert weights f32[T,k] and ids i32[T,k] from router logits [T,E] (float32)."""
    logits = logits.astype(np.float32)
    if scoring == "softmax":
        z = logits.astype(np.float64)
        probs = np.exp(z - z.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
        chosen = np.take_along_axis(probs, ids, axis=-1)
        if renormalize:
            chosen = chosen / chosen.sum(axis=-1, keepdims=True)
    else:
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
        z = np.take_along_axis(logits, ids, axis=-1).astype(np.float64)
        chosen = np.exp(z - z.max(axis=-1, keepdims=True))
        chosen /= chosen.sum(axis=-1, keepdims=True)
    return chosen.astype(np.float32), ids.astype(np.int32)


@reference("router")
def _router_ref(ins, ws, attrs, step):
    logits = ins[0].astype(np.float32) @ ws[0].T
    if len(ws) > 1:
        logits = logits + ws[1]
    return list(route(logits, attrs["top_k"], attrs["scoring"], attrs["renormalize"]))


# ---------------------------------------------------------------------------------------------
# experts
@op("experts", inputs=("x", "route_weights", "route_ids"), weights=("gate_up", "down", "gate_up_bias?", "down_bias?"),
    attrs=("activation", "gate_up"))
def _experts_shape(ins, ws, attrs):
    """The gated FFN of each token's chosen experts, weighted by the router and summed -> f32[T,H]."""
    x, rw, ids = ins
    gu, down = ws[0], ws[1]
    _expect(gu.rank == 3 and down.rank == 3, f"experts: gate_up {gu} and down {down} must be [E, out, in]")
    E, two_i, H = gu.shape
    _expect(two_i % 2 == 0 and down.shape == (E, H, two_i // 2),
            f"experts: down {down} does not match gate_up {gu} (expected [{E},{H},{two_i // 2}])")
    _expect(x.rank == 2 and x.shape[-1] == H, f"experts: input {x} does not match gate_up {gu}")
    _expect(rw.dtype == "f32" and ids.dtype == "i32" and rw.shape == ids.shape and rw.rank == 2,
            f"experts: route weights {rw} and ids {ids} must be f32[T,k] and i32[T,k]")
    _expect(len(ws) in (2, 4), "experts: biases come both (gate_up_bias, down_bias) or not at all")
    if len(ws) == 4:
        _expect(ws[2].shape == (E, two_i) and ws[3].shape == (E, H),
                f"experts: biases {ws[2]}, {ws[3]} do not match [{E},{two_i}], [{E},{H}]")
    _expect(attrs["activation"] in EXPERT_ACTIVATIONS,
            f"experts: activation must be one of {EXPERT_ACTIVATIONS}, got {attrs['activation']!r}")
    _expect(attrs["gate_up"] in GATE_UP_LAYOUTS, f"experts: gate_up must be one of {GATE_UP_LAYOUTS}")
    if attrs["activation"] == "swiglu_clamp":
        _expect("alpha" in attrs and "limit" in attrs, "experts: swiglu_clamp needs alpha and limit")
    return [TensorType("f32", (x.shape[0], H))]


def split_gate_up(h: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """The gate and up halves of gate_up rows' products ``h`` [..., 2I]."""
    if layout == "interleaved":
        return h[..., 0::2], h[..., 1::2]
    half = h.shape[-1] // 2
    return h[..., :half], h[..., half:]


def expert_activation(gate: np.ndarray, up: np.ndarray, attrs: dict) -> np.ndarray:
    """act(gate, up) of ``experts`` in float64."""
    gate, up = gate.astype(np.float64), up.astype(np.float64)
    if attrs["activation"] == "silu":
        return gate / (1.0 + np.exp(-gate)) * up
    limit, alpha = attrs["limit"], attrs["alpha"]
    gate = np.minimum(gate, limit)
    up = np.clip(up, -limit, limit)
    return (up + 1.0) * gate / (1.0 + np.exp(-alpha * gate))


@reference("experts")
def _experts_ref(ins, ws, attrs, step):
    x, rw, ids = ins
    H, I = x.shape[1], ws[1].shape[-1]
    gu, down = ws[0].reshape(-1, 2 * I, H), ws[1].reshape(-1, H, I)
    quant = attrs.get("act_quant")

    def rounded(rows: np.ndarray) -> np.ndarray:
        if not quant:
            return rows
        return storage.round_activations(rows, quant[1], quant[0])

    out = np.zeros((x.shape[0], H), dtype=np.float64)
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)
        h = rounded(x[rows].astype(np.float32)) @ gu[e].T
        if len(ws) == 4:
            h = h + ws[2][e]
        act = expert_activation(*split_gate_up(h, attrs["gate_up"]), attrs).astype(np.float32)
        y = (rounded(act) @ down[e].T).astype(np.float64)
        if len(ws) == 4:
            y += ws[3][e]
        np.add.at(out, rows, y * rw[rows, slots][:, None])
    return [out.astype(np.float32)]


# ---------------------------------------------------------------------------------------------
# per-head RMS norm (Qwen3-MoE's q_norm / k_norm) and the sigmoid gate of Qwen2-MoE's shared expert
@op("head_rms_norm", inputs=("x",), weights=("weight",), attrs=("eps", "head_dim"))
def _head_rms_norm_shape(ins, ws, attrs):
    """rms_norm of each head_dim slice of a row (one weight [head_dim] for every head)."""
    hd = attrs["head_dim"]
    _expect(isinstance(hd, int) and hd > 0 and ins[0].shape[-1] % hd == 0,
            f"head_rms_norm: {ins[0]} is not a whole number of heads of {hd}")
    _expect(ws[0].shape == (hd,), f"head_rms_norm weight {ws[0]} is not [{hd}]")
    return [ins[0]]


@reference("head_rms_norm")
def _head_rms_norm_ref(ins, ws, attrs, step):
    x = ins[0].astype(np.float64).reshape(ins[0].shape[0], -1, attrs["head_dim"])
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + attrs["eps"]) * ws[0]
    return [y.reshape(ins[0].shape).astype(np.float32)]


@op("sigmoid_gate", inputs=("y", "x"), weights=("weight",))
def _sigmoid_gate_shape(ins, ws, attrs):
    """y [T,N] scaled per token by sigmoid(x [T,K] . weight [1,K])."""
    y, x = ins
    _expect(ws[0].shape == (1, x.shape[-1]), f"sigmoid_gate weight {ws[0]} is not [1,{x.shape[-1]}]")
    _expect(y.shape[0] == x.shape[0], f"sigmoid_gate: {y} and {x} differ in tokens")
    return [y]


@reference("sigmoid_gate")
def _sigmoid_gate_ref(ins, ws, attrs, step):
    y, x = ins
    g = (x.astype(np.float32) @ ws[0].T).astype(np.float64)
    return [(y * (1.0 / (1.0 + np.exp(-g)))).astype(np.float32)]


# ---------------------------------------------------------------------------------------------
# expert weights made of several checkpoint tensors
@dataclass(frozen=True)
class TensorPart:
    """One checkpoint tensor of a stacked weight: where it lives and its stored shape."""

    file: str
    offset: int
    shape: tuple[int, ...]


@dataclass(eq=False)
class StackedWeight(Weight):
    """A weight [E, ...] stacked from E checkpoint tensors (one per expert), each memory-mapped on
    first use; ``swap_last`` stores each part as the transpose of its last two logical dims (GPT-OSS
    keeps expert matrices [in, out])."""

    parts: tuple[TensorPart, ...] = ()
    swap_last: bool = False
    _stacked: np.ndarray | None = field(default=None, repr=False)

    def raw(self) -> np.ndarray:
        if self.array is not None:
            return self.array
        if self._stacked is None:
            np_dtype = DTYPES[self.type.dtype][0]
            maps = [np.memmap(p.file, dtype=np_dtype, mode="r", offset=p.offset, shape=p.shape) for p in self.parts]
            data = np.stack(maps) if len(maps) > 1 else maps[0]
            if self.swap_last:
                data = data.swapaxes(-1, -2)
            self._stacked = np.ascontiguousarray(data.reshape(self.type.shape))
        return self._stacked

    def signature(self) -> tuple:
        return super().signature() + (self.parts, self.swap_last)
