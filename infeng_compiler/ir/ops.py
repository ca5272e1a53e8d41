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

from infeng_common.errors import InfengError, IRError, UnsupportedError

from . import storage
from .types import TensorType

#: A shape rule returns the result types, or None where they depend on operand *values* (primitive
#: ops of the ONNX import: their types are established by evaluation at import and declared).
ShapeRule = Callable[[list[TensorType], list[TensorType], dict[str, Any]], list[TensorType] | None]
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

    def input_count_ok(self, n: int) -> bool:
        """Inputs ending in '?' are optional (trailing), one ending in '*' takes any number."""
        required = sum(1 for i in self.inputs if not i.endswith(("?", "*")))
        return required <= n and (n <= len(self.inputs) or any(i.endswith("*") for i in self.inputs))

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
    if not opdef.input_count_ok(len(ins)):
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


@op("lora_linear", inputs=("x", "adapter_slots"), weights=("weight", "bias?"),
    attrs=("site", "target", "max_adapters", "max_rank"))
def _lora_linear_shape(ins, ws, attrs):
    """``linear`` plus, for each token whose adapter slot is >= 0, scale * (x @ A^T) @ B^T of the
    adapter loaded in that slot for site ``site`` (the base weight ``target``); tokens of slot -1
    (and slots with nothing loaded for this site) get the base product only."""
    _expect(ins[1].dtype == "i32" and ins[1].rank == 1, f"lora_linear adapter_slots must be i32[T], got {ins[1]}")
    return _linear_shape(ins[:1], ws, attrs)


@reference("lora_linear")
def _lora_linear_ref(ins, ws, attrs, step):
    x, slots = ins
    y = _linear_ref([x], ws, attrs, step)[0].astype(np.float64)
    for slot in np.unique(slots[slots >= 0]):
        module = step.lora.get(int(slot), {}).get(attrs["target"])
        if module is None:
            continue
        rows = slots == slot
        y[rows] += module.scale * ((x[rows].astype(np.float64) @ module.A.T) @ module.B.T)
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

    ``scaling`` (optional) is the config's rope_scaling: none, linear, llama3 or yarn. ``inv_freq``
    (optional) gives the inverse frequencies [head_dim/2] explicitly and overrides theta/scaling.
    """
    _expect(ins[0].shape[-1] == attrs["n_heads"] * attrs["head_dim"],
            f"rope: {ins[0]} is not {attrs['n_heads']} heads of {attrs['head_dim']}")
    _expect(attrs["head_dim"] % 2 == 0, "rope needs an even head_dim")
    return [ins[0]]


def rope_inv_freq(attrs: dict[str, Any]) -> np.ndarray:
    """Inverse frequencies [head_dim/2] after scaling, as transformers computes them (float32)."""
    if attrs.get("inv_freq") is not None:      # an explicit table (ONNX import, when no theta reproduces it)
        return np.asarray(attrs["inv_freq"], dtype=np.float32)
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
    if kind == "yarn":
        return _yarn_inv_freq(theta, dim, scaling)
    raise UnsupportedError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, yarn)")


def _yarn_inv_freq(theta: float, dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """YaRN's blend of interpolated and extrapolated frequencies, as transformers computes them."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = (theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv = (1.0 / (np.float32(factor) * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32)


def rope_attention_factor(attrs: dict[str, Any]) -> float:
    """The factor YaRN multiplies cos and sin by (1 for the other kinds). It scales q and k alike, so
    frontends fold its square into the attention scale instead of scaling the rotation."""
    scaling = attrs.get("scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


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
#: Optional attributes of ``attention`` that describe its KV cache (set by the ``kv-format`` and
#: ``fht-kv`` passes; absent means f32 K and V, no rotation, no f16 window). See docs/kv-cache.md.
KV_ATTRS = ("k_format", "v_format", "kv_group", "rotate_qk", "kv_window")


def attention_weights(ws: list, attrs: dict[str, Any]) -> tuple[Any, Any]:
    """(k_mean, sinks) of an attention node's weight operands (either may be None): with the
    ``sinks`` attribute set the last operand is the sinks, a first one before it is k_mean."""
    sinks = ws[-1] if attrs.get("sinks") and ws else None
    rest = ws[:-1] if sinks is not None else ws
    return (rest[0] if rest else None), sinks


@op("attention", inputs=("q", "k", "v", "positions"), weights=("k_mean?", "sinks?"),
    attrs=("layer", "n_heads", "n_kv_heads", "head_dim", "scale"))
def _attention_shape(ins, ws, attrs):
    """Causal attention of each token over its sequence's KV cache (GQA).

    The new K/V rows are appended to the cache of layer ``layer`` at their positions first; then
    every query attends to the positions <= its own (and > own - ``window`` when set).

    KV cache attributes (optional): ``k_format``/``v_format`` (f32, f16, int8, int4: what a row
    becomes when written), ``kv_group`` (int4 values per scale), ``rotate_qk`` (q and k rotated
    per head by the normalised Walsh-Hadamard transform before k is stored; scores unchanged in
    exact arithmetic), ``kv_window`` (the last ``kv_window`` positions before each query are read
    from an f16 copy instead of the int8/int4 store).

    Optional weight ``k_mean`` f32[n_kv_heads * head_dim]: a fixed vector subtracted from every k
    row (after RoPE and the rotation) before it is stored. Exact for attention: it shifts all scores
    of a query by the same q·k_mean, which softmax ignores; it centres K so that its quantization
    step is set by the spread, not by the channel means (docs/kv-cache.md).

    Optional weight ``sinks`` f32[n_heads] (with the attribute ``sinks=true``; GPT-OSS): a learned
    logit per query head that joins every softmax denominator and attends to nothing.
    """
    q, k, v = ins[:3]
    h, kvh, hd = attrs["n_heads"], attrs["n_kv_heads"], attrs["head_dim"]
    _expect(q.shape[-1] == h * hd, f"attention: q {q} is not {h} heads of {hd}")
    _expect(k.shape[-1] == kvh * hd and v.shape[-1] == kvh * hd, f"attention: k {k} / v {v} not {kvh} heads of {hd}")
    _expect(h % kvh == 0, f"attention: {h} query heads not a multiple of {kvh} KV heads")
    k_mean, sinks = attention_weights(ws, attrs)
    _expect(k_mean is None or (k_mean.rank == 1 and k_mean.shape[0] == kvh * hd),
            f"attention: k_mean must be f32[{kvh * hd}] (one value per KV head and dim), got {k_mean}")
    _expect(sinks is None or sinks.shape == (h,), f"attention: sinks must be [{h}] (one per query head), got {sinks}")
    _expect(len(ws) <= 1 + bool(attrs.get("sinks")), "attention: a second weight operand needs sinks=true")
    if any(a in attrs for a in KV_ATTRS):
        kv = storage.kv()
        kf, vf, group = kv.attention_kv_formats(attrs)
        try:
            kv.check_format(kf, hd, group, "attention k_format")
            kv.check_format(vf, hd, group, "attention v_format")
        except InfengError as e:
            raise IRError(str(e)) from None
        _expect(not attrs.get("rotate_qk") or kv.is_power_of_two(hd),
                f"attention: rotate_qk needs a power-of-two head_dim, got {hd}")
        window = attrs.get("kv_window", 0)
        _expect(isinstance(window, int) and window >= 0, f"attention: kv_window must be an int >= 0, got {window!r}")
    return [q]


@reference("attention")
def _attention_ref(ins, ws, attrs, step):
    q, k, v, pos = ins
    h, kvh, hd = attrs["n_heads"], attrs["n_kv_heads"], attrs["head_dim"]
    window = attrs.get("window")
    layer = attrs["layer"]
    T = q.shape[0]
    k_mean, _ = attention_weights(ws, attrs)
    kv_cache = any(a in attrs for a in KV_ATTRS) or k_mean is not None
    if not kv_cache:
        for s in np.unique(step.seq_ids):
            rows = np.nonzero(step.seq_ids == s)[0]
            step.kv.write(layer, int(s), pos[rows], k[rows].reshape(-1, kvh, hd), v[rows].reshape(-1, kvh, hd))
        return [_attend(q, pos, step, attrs, ws)]
    # store what the attention_kvq kernels store (docs/kv-cache.md)
    kv = storage.kv()
    QUANTIZED, store_rows, round_f16 = kv.QUANTIZED, kv.store_rows, kv.round_f16
    kf, vf, group = kv.attention_kv_formats(attrs)
    if attrs.get("rotate_qk"):
        q, k = kv.fht_heads(q, h, hd), kv.fht_heads(k, kvh, hd)
    if k_mean is not None:   # centred K: every score of a query moves by q·k_mean, softmax does not see it
        k = (k - k_mean[None, :]).astype(np.float32)
    k3, v3 = k.reshape(-1, kvh, hd), v.reshape(-1, kvh, hd)
    rows_of = {"k": store_rows(k3, kf, group), "v": store_rows(v3, vf, group)}
    if kf in QUANTIZED and vf == "int8":      # integer P·V: exact scores and V codes need the codes themselves
        rows_of["k_codes"], rows_of["k_scales"] = kv.quantize(k3, kf, group)
        rows_of["v_codes"], rows_of["v_scales"] = kv.quantize(v3, vf, group)
    if attrs.get("kv_window", 0) and (kf in QUANTIZED or vf in QUANTIZED):
        # the f16 copy of the last kv_window positions (quantized formats only)
        rows_of["recent_k"] = round_f16(k3) if kf in QUANTIZED else rows_of["k"]
        rows_of["recent_v"] = round_f16(v3) if vf in QUANTIZED else rows_of["v"]
    for s in np.unique(step.seq_ids):
        rows = np.nonzero(step.seq_ids == s)[0]
        step.kv.write(layer, int(s), pos[rows], **{name: x[rows] for name, x in rows_of.items()})
    return [_attend(q, pos, step, attrs, ws)]


def _dot_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b^T`` over the last two axes ([h, t, d] x [h, L, d] -> [h, t, L]). The transpose is
    made contiguous first: numpy's batched matmul runs a transposed operand through its own loop,
    a hundred times slower than BLAS on the calibration shapes."""
    return a @ np.ascontiguousarray(b.swapaxes(-1, -2))


def _attend(q: np.ndarray, pos: np.ndarray, step, attrs: dict, ws: list) -> np.ndarray:
    """Every query of ``q`` (rotated when the cache is) over its sequence's cached rows."""
    h, kvh, hd = attrs["n_heads"], attrs["n_kv_heads"], attrs["head_dim"]
    window, layer, T = attrs.get("window"), attrs["layer"], q.shape[0]
    per_kv = h // kvh
    _, sink_weight = attention_weights(ws, attrs)
    sinks = None if sink_weight is None else np.asarray(sink_weight, dtype=np.float64)      # [h]
    kv = storage.kv()
    QUANTIZED, integer_scores, quantized_pv, query_codes = kv.QUANTIZED, kv.integer_scores, kv.quantized_pv, kv.query_codes
    kf, vf, _ = kv.attention_kv_formats(attrs)
    integer_k = kf in QUANTIZED
    integer_pv = integer_k and vf == "int8"
    recent = attrs.get("kv_window", 0) if (kf in QUANTIZED or vf in QUANTIZED) else 0

    def heads(x):                # [L, kvh, ...] -> [h, L, ...] float64 (each KV head for its query heads)
        return np.ascontiguousarray(np.repeat(x, per_kv, axis=1).swapaxes(0, 1), dtype=np.float64)

    def by_head(x):              # [t, h * hd] or [t, h, hd] -> [h, t, hd] float64
        return np.ascontiguousarray(x.reshape(-1, h, hd).transpose(1, 0, 2), dtype=np.float64)

    if integer_k:    # scores against int8/int4 K use the scaled query rounded to int16 (quant/kv.py)
        q_scaled = (q.reshape(T, h, hd) * np.float32(attrs["scale"])).astype(np.float32)
        q_codes, q_scale = query_codes(by_head(q_scaled).astype(np.float32))          # [h, T, hd], [h, T, 1]
    out = np.empty((T, h, hd), dtype=np.float32)
    for s in np.unique(step.seq_ids):
        rows = np.nonzero(step.seq_ids == s)[0]
        p = pos[rows]
        length = int(p.max()) + 1
        K, V = (heads(x) for x in step.kv.read(layer, int(s), length))           # [h, L, hd]
        if integer_pv:   # scores bit for bit as the kernels: probability codes depend on them
            k_codes, k_scales = (heads(x) for x in step.kv.read(layer, int(s), length, "k_codes", "k_scales"))
            scores = integer_scores(q_codes[:, rows], q_scale[:, rows], k_codes, k_scales.astype(np.float32))
            scores = scores.astype(np.float64)                                    # [h, t, L]
        elif integer_k:  # the same integer dot products, in float64
            scores = _dot_rows(q_codes[:, rows] * q_scale[:, rows], K)
        else:
            scores = _dot_rows(by_head(q[rows]), K) * attrs["scale"]
        j = np.arange(length)
        allowed = (j[None, :] <= p[:, None])[None]                                # [1, t, L]
        if window:
            allowed &= (j[None, :] > p[:, None] - window)[None]
        in_recent = np.zeros_like(allowed)
        if recent:       # positions p - kv_window < j <= p come from the f16 copy
            Kr, Vr = (heads(x) for x in step.kv.read(layer, int(s), length, "recent_k", "recent_v"))
            in_recent = (j[None, :] > p[:, None] - recent)[None] & allowed
            query = by_head(q_scaled[rows]) if integer_k else by_head(q[rows]) * attrs["scale"]
            scores = np.where(in_recent, _dot_rows(query, Kr), scores)
        scores = np.where(allowed, scores, -np.inf)
        top = scores.max(axis=-1, keepdims=True)
        if sinks is not None:    # the sink joins the max and the denominator, attends to nothing
            top = np.maximum(top, sinks[:, None, None])
            sink_mass = np.exp(sinks[:, None] - top[..., 0])                      # [h, t]
        prob = np.exp(scores - top)
        if integer_pv:   # int8 V from the store: probabilities as uint8 codes (quant/kv.quantized_pv)
            v_codes, v_scales = (heads(x) for x in step.kv.read(layer, int(s), length, "v_codes", "v_scales"))
            num, den = quantized_pv(scores.astype(np.float32), allowed & ~in_recent, v_codes, v_scales[..., 0], top)
            if sinks is not None:
                den += sink_mass
            if recent:
                num += np.where(in_recent, prob, 0.0) @ Vr
                den += np.where(in_recent, prob, 0.0).sum(axis=-1)
            out[rows] = (num / den[..., None]).transpose(1, 0, 2)
            continue
        prob /= prob.sum(axis=-1, keepdims=True) + (sink_mass[..., None] if sinks is not None else 0.0)
        if recent:
            out[rows] = (np.where(in_recent, 0.0, prob) @ V + np.where(in_recent, prob, 0.0) @ Vr).transpose(1, 0, 2)
        else:
            out[rows] = (prob @ V).transpose(1, 0, 2)
    return out.reshape(T, h * hd)


# =============================================================================================
# primitive ops (ONNX import, before raising)
#
# One op per ONNX operator of the subset a torch-exported decoder uses, with ONNX semantics
# (N-d tensors, broadcasting, batch dimension, parameter tensors as operands). The ONNX frontend
# emits them and the ``fold-shapes``/``raise`` passes turn them back into the ops above; codegen
# has no kernels for them. Their result types depend on operand values (a Reshape's shape is a
# tensor), so the frontend establishes them by evaluating the graph at two sequence lengths and
# declares them; the shape rules below only check operand counts.
# =============================================================================================
#: ONNX operator -> primitive op name (snake case; ``_nd`` where a transformer op has the name).
ONNX_PRIMITIVES: dict[str, str] = {}


def _primitive(onnx_name: str, name: str, inputs: tuple[str, ...], fn: Callable[..., Any]) -> None:
    """Register primitive ``name`` for ONNX ``onnx_name``; ``fn(*inputs, attrs=...)`` -> array or list."""
    ONNX_PRIMITIVES[onnx_name] = name
    op(name, inputs=inputs)(lambda ins, ws, attrs: None)

    def ref(ins, ws, attrs, step, fn=fn):
        out = fn(*ins, **attrs) if attrs else fn(*ins)
        return [np.asarray(o) for o in out] if isinstance(out, list) else [np.asarray(out)]

    reference(name)(ref)


def _same_dtype(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    return lambda x, **a: fn(x).astype(x.dtype)


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    return lambda a, b, **_: np.asarray(fn(a, b)).astype(np.result_type(a.dtype, b.dtype) if a.dtype != bool else bool)


def _div(a, b, **_):
    if np.issubdtype(a.dtype, np.integer):
        return np.trunc(a / b).astype(a.dtype)
    return (a / b).astype(a.dtype)


def _axes(axes, attr_axes=None) -> tuple[int, ...] | None:
    got = attr_axes if axes is None else axes
    return None if got is None else tuple(int(a) for a in np.asarray(got).reshape(-1))


def _reduce(fn):
    def run(x, axes=None, keepdims=1, noop_with_empty_axes=0, **attrs):
        ax = _axes(axes, attrs.get("axes_attr"))
        if not ax:
            if noop_with_empty_axes:
                return x
            ax = None
        return fn(x.astype(np.float64) if x.dtype.kind == "f" else x, axis=ax, keepdims=bool(keepdims)).astype(x.dtype)
    return run


def _softmax(x, axis=-1, **_):
    z = x.astype(np.float64)
    z = np.exp(z - z.max(axis=axis, keepdims=True))
    return (z / z.sum(axis=axis, keepdims=True)).astype(x.dtype)


def _gather(data, indices, axis=0, **_):
    idx = np.where(indices < 0, indices + data.shape[axis], indices)
    return np.take(data, idx, axis=axis)


def _reshape(x, shape, allowzero=0, **_):
    dims = [int(d) for d in shape]
    if not allowzero:
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return x.reshape(dims)


def _unsqueeze(x, axes=None, **attrs):
    ax = _axes(axes, attrs.get("axes_attr"))
    rank = x.ndim + len(ax)
    return x.reshape(_insert_ones(x.shape, sorted(a % rank for a in ax)))


def _insert_ones(shape, axes):
    out = list(shape)
    for a in axes:
        out.insert(a, 1)
    return out


def _squeeze(x, axes=None, **attrs):
    ax = _axes(axes, attrs.get("axes_attr"))
    return np.squeeze(x, axis=None if ax is None else tuple(a % x.ndim for a in ax))


def _slice(x, starts, ends, axes=None, steps=None, **_):
    axes = range(len(starts)) if axes is None else [int(a) % x.ndim for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    index = [slice(None)] * x.ndim
    for a, b, e, s in zip(axes, starts, ends, steps):
        index[a] = slice(int(b), int(e), int(s))
    return x[tuple(index)]


def _split(x, split=None, axis=0, num_outputs=None, **_):
    if split is None:
        n = x.shape[axis]
        size = -(-n // num_outputs)
        split = [size] * (num_outputs - 1) + [n - size * (num_outputs - 1)]
    cuts = np.cumsum([int(s) for s in split])[:-1]
    return [np.ascontiguousarray(p) for p in np.split(x, cuts, axis=axis)]


def _expand(x, shape, **_):
    return np.array(np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(int(d) for d in shape))))


def _shape(x, start=0, end=None, **_):
    return np.array(x.shape[start:end], dtype=np.int64)


def _cumsum(x, axis, exclusive=0, reverse=0, **_):
    ax = int(np.asarray(axis).reshape(()))
    y = np.flip(x, ax) if reverse else x
    out = np.cumsum(y, axis=ax, dtype=x.dtype)
    if exclusive:
        out = np.concatenate([np.zeros_like(np.take(out, [0], axis=ax)), np.delete(out, -1, axis=ax)], axis=ax)
    return np.flip(out, ax) if reverse else out


def _gather_nd(data, indices, batch_dims=0, **_):
    if batch_dims:
        raise UnsupportedError("GatherND with batch_dims > 0 is not supported")
    return data[tuple(np.moveaxis(indices, -1, 0))]


def _layer_normalization(x, scale, bias=None, axis=-1, epsilon=1e-5, **_):
    if axis != -1 and axis != x.ndim - 1:
        raise UnsupportedError("LayerNormalization over more than the last axis is not supported")
    z = x.astype(np.float64)
    mu = z.mean(axis=-1, keepdims=True)
    y = (z - mu) / np.sqrt(((z - mu) ** 2).mean(axis=-1, keepdims=True) + epsilon) * scale
    return (y + bias if bias is not None else y).astype(x.dtype)


def _gemm(a, b, c=None, alpha=1.0, beta=1.0, transA=0, transB=0, **_):
    y = alpha * ((a.T if transA else a) @ (b.T if transB else b))
    return (y + beta * c if c is not None else y).astype(a.dtype)


def _trilu(x, k=None, upper=1, **_):
    k = 0 if k is None else int(np.asarray(k).reshape(()))
    return np.triu(x, k) if upper else np.tril(x, k)


def _where(cond, a, b, **_):
    return np.where(cond, a, b).astype(np.result_type(a.dtype, b.dtype))


for _onnx, _name, _inputs, _fn in [
    ("MatMul", "matmul", ("a", "b"), lambda a, b, **_: np.matmul(a, b)),
    ("Gemm", "gemm", ("a", "b", "c?"), _gemm),
    ("Add", "add_nd", ("a", "b"), _binary(np.add)),
    ("Sub", "sub", ("a", "b"), _binary(np.subtract)),
    ("Mul", "mul", ("a", "b"), _binary(np.multiply)),
    ("Div", "div", ("a", "b"), _div),
    ("Pow", "pow", ("x", "y"), lambda x, y, **_: np.power(x, y).astype(x.dtype)),
    ("Max", "max", ("x*",), lambda *xs, **_: np.maximum.reduce(np.broadcast_arrays(*xs))),
    ("Min", "min", ("x*",), lambda *xs, **_: np.minimum.reduce(np.broadcast_arrays(*xs))),
    ("Sqrt", "sqrt", ("x",), _same_dtype(np.sqrt)),
    ("Reciprocal", "reciprocal", ("x",), _same_dtype(np.reciprocal)),
    ("Neg", "neg", ("x",), _same_dtype(np.negative)),
    ("Abs", "abs", ("x",), _same_dtype(np.abs)),
    ("Exp", "exp", ("x",), _same_dtype(np.exp)),
    ("Log", "log", ("x",), _same_dtype(np.log)),
    ("Sigmoid", "sigmoid", ("x",), _same_dtype(lambda x: 1.0 / (1.0 + np.exp(-x.astype(np.float64))))),
    ("Tanh", "tanh", ("x",), _same_dtype(np.tanh)),
    ("Erf", "erf", ("x",), _same_dtype(lambda x: _erf(x.astype(np.float64)))),
    ("Cos", "cos", ("x",), _same_dtype(np.cos)),
    ("Sin", "sin", ("x",), _same_dtype(np.sin)),
    ("Relu", "relu", ("x",), _same_dtype(lambda x: np.maximum(x, 0))),
    ("IsNaN", "is_nan", ("x",), lambda x, **_: np.isnan(x)),
    ("IsInf", "is_inf", ("x",), lambda x, **_: np.isinf(x)),
    ("Not", "not", ("x",), lambda x, **_: np.logical_not(x)),
    ("And", "and", ("a", "b"), lambda a, b, **_: np.logical_and(a, b)),
    ("Or", "or", ("a", "b"), lambda a, b, **_: np.logical_or(a, b)),
    ("Equal", "equal", ("a", "b"), lambda a, b, **_: np.equal(a, b)),
    ("Less", "less", ("a", "b"), lambda a, b, **_: np.less(a, b)),
    ("LessOrEqual", "less_or_equal", ("a", "b"), lambda a, b, **_: np.less_equal(a, b)),
    ("Greater", "greater", ("a", "b"), lambda a, b, **_: np.greater(a, b)),
    ("GreaterOrEqual", "greater_or_equal", ("a", "b"), lambda a, b, **_: np.greater_equal(a, b)),
    ("Where", "where", ("cond", "a", "b"), _where),
    ("ReduceMean", "reduce_mean", ("x", "axes?"), _reduce(np.mean)),
    ("ReduceSum", "reduce_sum", ("x", "axes?"), _reduce(np.sum)),
    ("ReduceMax", "reduce_max", ("x", "axes?"), _reduce(np.max)),
    ("Softmax", "softmax", ("x",), _softmax),
    ("Gather", "gather", ("data", "indices"), _gather),
    ("GatherND", "gather_nd", ("data", "indices"), _gather_nd),
    ("Reshape", "reshape", ("x", "shape"), _reshape),
    ("Transpose", "transpose", ("x",), lambda x, perm=None, **_: np.transpose(x, perm)),
    ("Unsqueeze", "unsqueeze", ("x", "axes?"), _unsqueeze),
    ("Squeeze", "squeeze", ("x", "axes?"), _squeeze),
    ("Concat", "concat", ("x*",), lambda *xs, axis=0, **_: np.concatenate(xs, axis=axis)),
    ("Slice", "slice", ("x", "starts", "ends", "axes?", "steps?"), _slice),
    ("Split", "split_nd", ("x", "split?"), _split),
    ("Expand", "expand", ("x", "shape"), _expand),
    ("Tile", "tile", ("x", "repeats"), lambda x, r, **_: np.tile(x, [int(n) for n in r])),
    ("Cast", "cast", ("x",), lambda x, to, **_: x.astype(DTYPE_NUMPY[to])),
    ("Identity", "identity", ("x",), lambda x, **_: x),
    ("Shape", "shape", ("x",), _shape),
    ("Size", "size", ("x",), lambda x, **_: np.array(x.size, dtype=np.int64)),
    ("Range", "range", ("start", "limit", "delta"),
     lambda s, l, d, **_: np.arange(s.item(), l.item(), d.item()).astype(s.dtype)),
    ("ConstantOfShape", "constant_of_shape", ("shape",),
     lambda shape, value=0.0, dtype="f32", **_: np.full([int(d) for d in shape], value, DTYPE_NUMPY[dtype])),
    ("CumSum", "cum_sum", ("x", "axis"), _cumsum),
    ("Trilu", "trilu", ("x", "k?"), _trilu),
    ("LayerNormalization", "layer_normalization", ("x", "scale", "bias?"), _layer_normalization),
]:
    _primitive(_onnx, _name, _inputs, _fn)

#: Numpy dtypes of IR element types, for ``cast`` and constants (bf16 is not computed on).
DTYPE_NUMPY = {"f32": np.float32, "f16": np.float16, "f64": np.float64, "i32": np.int32, "i64": np.int64,
               "bool": np.bool_}


def const_array(attrs: dict[str, Any], seq_len: int | None = None) -> np.ndarray:
    """The value of a ``const`` node given inline: ``value`` (nested lists; "T" or "T+k" entries are
    the sequence length) as ``dtype``."""
    def subst(v):
        if isinstance(v, list):
            return [subst(x) for x in v]
        if isinstance(v, str):
            if seq_len is None:
                raise IRError(f"const value {v!r} needs the sequence length")
            return seq_len + (int(v[1:]) if len(v) > 1 else 0)
        return v
    return np.array(subst(attrs["value"]), dtype=DTYPE_NUMPY[attrs["dtype"]])


@op("const", inputs=(), weights=("value?",))
def _const_shape(ins, ws, attrs):
    """A constant: a weight operand (ONNX initializer) or an inline ``value`` of ``dtype``; inline
    entries "T" (or "T+k") stand for the sequence length (folded shape arithmetic)."""
    _expect(bool(ws) != ("value" in attrs), "const takes either a weight operand or a value attribute")
    return ws[:1] if ws else None


@reference("const")
def _const_ref(ins, ws, attrs, step):
    if ws:
        return [ws[0]]
    return [const_array(attrs, len(step.seq_ids))]


@op("add_batch", inputs=("x",))
def _add_batch_shape(ins, ws, attrs):
    """x[None]: the batch dimension (of size 1) that an ONNX graph carries."""
    return [TensorType(ins[0].dtype, (1,) + ins[0].shape)]


reference("add_batch")(lambda ins, ws, attrs, step: [ins[0][None]])


@op("drop_batch", inputs=("x",))
def _drop_batch_shape(ins, ws, attrs):
    """x[0] of a batch of one."""
    _expect(ins[0].rank >= 1 and ins[0].shape[0] == 1, f"drop_batch needs a leading dimension of 1, got {ins[0]}")
    return [TensorType(ins[0].dtype, ins[0].shape[1:])]


reference("drop_batch")(lambda ins, ws, attrs, step: [ins[0][0]])

#: Every primitive op (codegen has no kernel for them; ``raise`` must leave none behind).
PRIMITIVE_OPS = frozenset(ONNX_PRIMITIVES.values()) | {"const", "add_batch", "drop_batch"}
