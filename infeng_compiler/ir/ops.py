"""The op registry: every IR op once, with its signature, shape rule and numpy reference.

A reference takes the input arrays, the weights widened to float32, the node's attributes and the
step context (``interp.Step``: positions, sequence ids, rows that want logits, KV cache) and
returns the output arrays. The interpreter is nothing more than these references run in order.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import IRError, UnsupportedError
from .types import TensorType

ShapeRule = Callable[[list[TensorType], list[TensorType], dict[str, Any]], list[TensorType]]
Reference = Callable[[list[np.ndarray], list[np.ndarray], dict[str, Any], Any], list[np.ndarray]]


@dataclass(frozen=True)
class OpDef:
    name: str
    inputs: tuple[str, ...]          # names of value operands
    weights: tuple[str, ...]         # names of weight operands; a trailing '?' marks optional
    attrs: tuple[str, ...]           # attributes the op requires
    shape: ShapeRule
    reference: Reference
    doc: str

    def weight_count_ok(self, n: int) -> bool:
        required = sum(1 for w in self.weights if not w.endswith("?"))
        return required <= n <= len(self.weights)


REGISTRY: dict[str, OpDef] = {}


def op(name: str, inputs: tuple[str, ...], weights: tuple[str, ...] = (), attrs: tuple[str, ...] = ()):
    """Register ``fn`` (the shape rule); ``fn.reference`` is set by ``@reference``."""

    def register(shape_rule: ShapeRule) -> ShapeRule:
        REGISTRY[name] = OpDef(name, inputs, weights, attrs, shape_rule, _missing_reference(name),
                               (shape_rule.__doc__ or "").strip())
        return shape_rule

    return register


def reference(name: str):
    def register(fn: Reference) -> Reference:
        REGISTRY[name] = dataclasses.replace(REGISTRY[name], reference=fn)
        return fn

    return register


def _missing_reference(name: str) -> Reference:
    def fail(*_: Any) -> list[np.ndarray]:
        raise IRError(f"op {name} has no numpy reference")

    return fail


def get(name: str) -> OpDef:
    try:
        return REGISTRY[name]
    except KeyError:
        raise IRError(f"unknown op {name!r}") from None


def infer_types(name: str, ins: list[TensorType], ws: list[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
    opdef = get(name)
    if len(ins) != len(opdef.inputs):
        raise IRError(f"{name} takes {len(opdef.inputs)} inputs ({', '.join(opdef.inputs)}), got {len(ins)}")
    if not opdef.weight_count_ok(len(ws)):
        raise IRError(f"{name} takes weights ({', '.join(opdef.weights)}), got {len(ws)}")
    missing = [a for a in opdef.attrs if a not in attrs]
    if missing:
        raise IRError(f"{name} is missing attributes {missing}")
    return opdef.shape(ins, ws, attrs)


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise IRError(msg)


def _f32(*shape) -> TensorType:
    return TensorType("f32", tuple(shape))


# ---------------------------------------------------------------------------------------------
# embedding / positions
@op("embedding", inputs=("ids",), weights=("table",))
def _embedding_shape(ins, ws, attrs):
    """Rows of ``table`` [V,H] picked by token ids [T] -> f32[T,H]."""
    _expect(ins[0].dtype == "i32" and ins[0].rank == 1, f"embedding ids must be i32[T], got {ins[0]}")
    _expect(ws[0].rank == 2, f"embedding table must be rank 2, got {ws[0]}")
    return [_f32(ins[0].shape[0], ws[0].shape[1])]


@reference("embedding")
def _embedding_ref(ins, ws, attrs, step):
    ids = ins[0]
    if ids.size and (ids.min() < 0 or ids.max() >= ws[0].shape[0]):
        raise IRError(f"embedding index out of range [0, {ws[0].shape[0]})")
    return [ws[0][ids]]


# ---------------------------------------------------------------------------------------------
# norms
@op("rms_norm", inputs=("x",), weights=("weight",), attrs=("eps",))
def _rms_norm_shape(ins, ws, attrs):
    """x / sqrt(mean(x^2) + eps) * weight, over the last axis."""
    _expect(ws[0].shape == (ins[0].shape[-1],), f"rms_norm weight {ws[0]} does not match {ins[0]}")
    return [ins[0]]


@reference("rms_norm")
def _rms_norm_ref(ins, ws, attrs, step):
    x = ins[0].astype(np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + attrs["eps"])
    return [(y * ws[0]).astype(np.float32)]


@op("layer_norm", inputs=("x",), weights=("weight", "bias"), attrs=("eps",))
def _layer_norm_shape(ins, ws, attrs):
    """(x - mean) / sqrt(var + eps) * weight + bias, over the last axis."""
    _expect(ws[0].shape == (ins[0].shape[-1],), f"layer_norm weight {ws[0]} does not match {ins[0]}")
    return [ins[0]]


@reference("layer_norm")
def _layer_norm_ref(ins, ws, attrs, step):
    x = ins[0].astype(np.float64)
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return [((x - mu) / np.sqrt(var + attrs["eps"]) * ws[0] + ws[1]).astype(np.float32)]


# ---------------------------------------------------------------------------------------------
# linear algebra
@op("linear", inputs=("x",), weights=("weight", "bias?"))
def _linear_shape(ins, ws, attrs):
    """x [T,K] @ weight[N,K]^T (+ bias[N]) -> f32[T,N]. Weights keep the Hugging Face [out, in] layout."""
    x, w = ins[0], ws[0]
    _expect(w.rank == 2 and x.shape[-1] == w.shape[1], f"linear: input {x} does not match weight {w}")
    if len(ws) > 1:
        _expect(ws[1].shape == (w.shape[0],), f"linear: bias {ws[1]} does not match weight {w}")
    return [_f32(*x.shape[:-1], w.shape[0])]


@reference("linear")
def _linear_ref(ins, ws, attrs, step):
    y = ins[0] @ ws[0].T
    if len(ws) > 1:
        y = y + ws[1]
    return [y.astype(np.float32)]


@op("logits", inputs=("x",), weights=("weight",))
def _logits_shape(ins, ws, attrs):
    """The rows that want logits (``R`` of the step) times the output embedding [V,H]^T -> f32[R,V]."""
    _expect(ins[0].shape[-1] == ws[0].shape[1], f"logits: input {ins[0]} does not match weight {ws[0]}")
    return [_f32("R", ws[0].shape[0])]


@reference("logits")
def _logits_ref(ins, ws, attrs, step):
    rows = ins[0][step.logits_rows]
    return [(rows @ ws[0].T).astype(np.float32)]


@op("split", inputs=("x",), attrs=("sizes",))
def _split_shape(ins, ws, attrs):
    """Split the last axis into consecutive pieces of ``sizes``."""
    _expect(sum(attrs["sizes"]) == ins[0].shape[-1], f"split sizes {attrs['sizes']} do not sum to {ins[0]}")
    return [_f32(*ins[0].shape[:-1], s) for s in attrs["sizes"]]


@reference("split")
def _split_ref(ins, ws, attrs, step):
    cuts = np.cumsum(attrs["sizes"])[:-1]
    return [np.ascontiguousarray(p) for p in np.split(ins[0], cuts, axis=-1)]


# ---------------------------------------------------------------------------------------------
# elementwise
def _same_as_first(ins, ws, attrs):
    for t in ins[1:]:
        _expect(t.shape == ins[0].shape, f"operands {ins[0]} and {t} differ in shape")
    return [ins[0]]


op("add", inputs=("a", "b"))(_same_as_first)
reference("add")(lambda ins, ws, attrs, step: [ins[0] + ins[1]])

op("silu_mul", inputs=("gate", "up"))(_same_as_first)


@reference("silu_mul")
def _silu_mul_ref(ins, ws, attrs, step):
    g = ins[0].astype(np.float64)
    return [(g / (1.0 + np.exp(-g)) * ins[1]).astype(np.float32)]


@op("gelu", inputs=("x",), attrs=("approximate",))
def _gelu_shape(ins, ws, attrs):
    """GELU; ``approximate`` is "tanh" (GPT-2's gelu_new) or "none" (erf)."""
    _expect(attrs["approximate"] in ("tanh", "none"), f"gelu approximate must be tanh or none")
    return [ins[0]]


_erf = np.vectorize(math.erf, otypes=[np.float64])


@reference("gelu")
def _gelu_ref(ins, ws, attrs, step):
    x = ins[0].astype(np.float64)
    if attrs["approximate"] == "tanh":
        y = 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    else:
        y = 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    return [y.astype(np.float32)]


# ---------------------------------------------------------------------------------------------
# rotary position embedding
@op("rope", inputs=("x", "positions"), attrs=("n_heads", "head_dim", "theta"))
def _rope_shape(ins, ws, attrs):
    """Rotate each head's halves (the Hugging Face "rotate_half" layout) by position * inv_freq.

    ``scaling`` (optional) is the config's rope_scaling: none, linear or llama3.
    """
    _expect(ins[0].shape[-1] == attrs["n_heads"] * attrs["head_dim"],
            f"rope: {ins[0]} is not {attrs['n_heads']} heads of {attrs['head_dim']}")
    _expect(attrs["head_dim"] % 2 == 0, "rope needs an even head_dim")
    return [ins[0]]


def rope_inv_freq(attrs: dict[str, Any]) -> np.ndarray:
    """Inverse frequencies [head_dim/2] after scaling, as transformers computes them (float32)."""
    hd, theta = attrs["head_dim"], attrs["theta"]
    dim = attrs.get("rotary_dim", hd)
    inv = (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(np.float32)
    scaling = attrs.get("scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return (inv / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise UnsupportedError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


@reference("rope")
def _rope_ref(ins, ws, attrs, step):
    x, pos = ins
    h, hd = attrs["n_heads"], attrs["head_dim"]
    inv = rope_inv_freq(attrs)
    angles = pos.astype(np.float32)[:, None] * inv[None, :]          # [T, hd/2], float32 like torch
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    xh = x.reshape(x.shape[0], h, hd)
    half = hd // 2
    x1, x2 = xh[..., :half], xh[..., half:]
    out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return [out.reshape(x.shape).astype(np.float32)]


# ---------------------------------------------------------------------------------------------
# attention
@op("attention", inputs=("q", "k", "v", "positions"),
    attrs=("layer", "n_heads", "n_kv_heads", "head_dim", "scale"))
def _attention_shape(ins, ws, attrs):
    """Causal attention of each token over its sequence's KV cache (GQA).

    The new K/V rows are appended to the cache of layer ``layer`` at their positions first; then
    every query attends to the positions <= its own (and > own - ``window`` when set).
    """
    q, k, v = ins[:3]
    h, kvh, hd = attrs["n_heads"], attrs["n_kv_heads"], attrs["head_dim"]
    _expect(q.shape[-1] == h * hd, f"attention: q {q} is not {h} heads of {hd}")
    _expect(k.shape[-1] == kvh * hd and v.shape[-1] == kvh * hd, f"attention: k {k} / v {v} not {kvh} heads of {hd}")
    _expect(h % kvh == 0, f"attention: {h} query heads not a multiple of {kvh} KV heads")
    return [q]


@reference("attention")
def _attention_ref(ins, ws, attrs, step):
    q, k, v, pos = ins
    h, kvh, hd = attrs["n_heads"], attrs["n_kv_heads"], attrs["head_dim"]
    window = attrs.get("window")
    layer = attrs["layer"]
    T = q.shape[0]
    for s in np.unique(step.seq_ids):
        rows = np.nonzero(step.seq_ids == s)[0]
        step.kv.write(layer, int(s), pos[rows], k[rows].reshape(-1, kvh, hd), v[rows].reshape(-1, kvh, hd))
    out = np.empty((T, h, hd), dtype=np.float32)
    group = h // kvh
    for s in np.unique(step.seq_ids):
        rows = np.nonzero(step.seq_ids == s)[0]
        p = pos[rows]
        K, V = step.kv.read(layer, int(s), int(p.max()) + 1)                  # [L, kvh, hd]
        K = np.ascontiguousarray(np.repeat(K, group, axis=1).transpose(1, 2, 0), dtype=np.float64)  # [h,hd,L]
        V = np.ascontiguousarray(np.repeat(V, group, axis=1).transpose(1, 0, 2), dtype=np.float64)  # [h,L,hd]
        qs = np.ascontiguousarray(q[rows].reshape(-1, h, hd).transpose(1, 0, 2), dtype=np.float64)  # [h,t,hd]
        scores = (qs @ K) * attrs["scale"]                                      # [h, t, L]
        j = np.arange(K.shape[-1])
        allowed = j[None, :] <= p[:, None]
        if window:
            allowed &= j[None, :] > p[:, None] - window
        scores = np.where(allowed[None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        prob = np.exp(scores)
        prob /= prob.sum(axis=-1, keepdims=True)
        out[rows] = (prob @ V).transpose(1, 0, 2)
    return [out.reshape(T, h * hd)]
