"""KV cache formats: what one K or V row of one head becomes when it is written to the cache.

The numpy side of ``docs/kv-cache.md``. The attention op's reference (``ir/ops.py``) calls these
to store exactly what the ``attention_kvq`` kernels store, and codegen takes the block sizes from
here, so the interpreter, the kernels and the library's KV pool agree on one definition.

Formats (per token, per KV head, a row of ``head_dim`` values):

- ``f32``: as computed.
- ``f16``: rounded to IEEE half (round to nearest even).
- ``int8``: one f16 scale per row, ``s = f16(max|x| / 127)``, codes ``clip(rint(x / s), -127, 127)``.
- ``int4``: one f16 scale per group of ``group`` values, ``s = f16(max|x| / 7)``, codes in
  ``[-7, 7]`` stored as the nibble ``code + 8``.

Every step is float32 arithmetic the C kernels repeat bit for bit (an IEEE division, rint, the f16
conversion), so codes agree exactly when the inputs do.

Scores against an int8/int4 K are integer dot products: the query head, rotated and multiplied by
the attention scale in float32, is rounded to int16 codes with one float32 scale
(``quantize_query``: max|q| / 32767, about 1.5e-5 of the largest element), so that
``score = q_scale * k_scale * sum(q_code * k_code)`` runs on VNNI (vpdpwssd) or vpmaddwd. ``fht`` is the normalised fast
Walsh-Hadamard transform in the butterfly order the kernels use (stages h = 1, 2, 4, ...), again
bit for bit.
"""
from __future__ import annotations

import math

import numpy as np

from infeng_common.errors import InfengError

KV_FORMATS = ("f32", "f16", "int8", "int4")
QUANTIZED = ("int8", "int4")
QMAX = {"int8": 127, "int4": 7}
Q16_MAX = 32767                      # int16 query codes against an int8/int4 K
P_GROUP = 16                         # key positions per probability scale (int8 V against an int8/int4 K)
P_QMAX = 255                         # probabilities times V scales as uint8 codes
MAX_HEAD_DIM = 512                   # int8 K: 512 x 32767 x 127 still fits an int32 score
DEFAULT_GROUP = 32                   # int4 values per scale (or head_dim, when smaller)
F16_MAX = 65504.0
SCALE_BYTES = 2                      # scales are f16
BLOCK_ALIGN = 64                     # every layer's K (and V) block starts 64-byte aligned
V_QUAD = 4                           # int8 V: codes of 4 keys side by side per dim


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def default_group(head_dim: int) -> int:
    return min(DEFAULT_GROUP, head_dim)


def check_format(fmt: str, head_dim: int, group: int | None, where: str = "kv format") -> None:
    """Raise InfengError unless ``fmt`` (with ``group`` for int4) can store rows of ``head_dim``."""
    if fmt not in KV_FORMATS:
        raise InfengError(f"{where}: unknown KV format {fmt!r} (known: {', '.join(KV_FORMATS)})")
    if fmt in QUANTIZED and (head_dim % 2 or head_dim > MAX_HEAD_DIM):
        raise InfengError(f"{where}: {fmt} KV needs an even head_dim of at most {MAX_HEAD_DIM} (codes are read in "
                          f"pairs of dims), got {head_dim}")
    if fmt == "int4":
        if not group or group % 2 or head_dim % group:
            raise InfengError(f"{where}: int4 group {group} must be even and divide head_dim {head_dim}")


def groups_per_row(fmt: str, head_dim: int, group: int | None) -> int:
    """Scales per (token, head): 1 for int8, head_dim / group for int4, 0 for float formats."""
    return {"int8": 1, "int4": head_dim // (group or head_dim)}.get(fmt, 0)


# ---------------------------------------------------------------------------------------------
# the Hadamard rotation
def hadamard(n: int) -> np.ndarray:
    """The normalised Walsh-Hadamard matrix H / sqrt(n) (Sylvester order), float64. Symmetric and
    orthogonal: its own inverse."""
    if not is_power_of_two(n):
        raise InfengError(f"the Walsh-Hadamard rotation needs a power-of-two size, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def fht_norm(n: int) -> np.float32:
    """The normalisation 1/sqrt(n) as the kernels hold it (a float32 constant)."""
    return np.float32(1.0 / math.sqrt(n))


def fht(x: np.ndarray) -> np.ndarray:
    """Normalised fast Walsh-Hadamard transform over the last axis, float32 butterflies in the
    kernels' order (h = 1, 2, 4, ...: x[i], x[i+h] -> x[i] + x[i+h], x[i] - x[i+h]), then one
    multiplication by 1/sqrt(n). Equals ``x @ hadamard(n)`` up to float32 rounding."""
    n = x.shape[-1]
    if not is_power_of_two(n):
        raise InfengError(f"the Walsh-Hadamard rotation needs a power-of-two size, got {n}")
    lead = x.shape[:-1]
    y = np.array(x, dtype=np.float32).reshape(-1, n)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = np.stack([a + b, a - b], axis=2)
        h *= 2
    return (y.reshape(*lead, n) * fht_norm(n)).astype(np.float32)


def fht_heads(x: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """``fht`` of every head of rows [T, n_heads * head_dim]."""
    return fht(x.reshape(-1, n_heads, head_dim)).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# formats
def round_f16(x: np.ndarray) -> np.ndarray:
    """float32 -> f16 (round to nearest even, overflow to inf) -> float32."""
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def quantize(x: np.ndarray, fmt: str, group: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [..., d], scales float32 (f16 values) [..., d / group]) of rows ``x`` [..., d]."""
    x = np.asarray(x, dtype=np.float32)
    d = x.shape[-1]
    g = d if fmt == "int8" else (group or d)
    qmax = np.float32(QMAX[fmt])
    xg = x.reshape(*x.shape[:-1], d // g, g)
    amax = np.abs(xg).max(axis=-1)
    scale = round_f16(np.minimum(amax / qmax, np.float32(F16_MAX)))
    safe = np.where(scale > 0, scale, np.float32(1.0))
    codes = np.clip(np.rint(xg / safe[..., None]), -qmax, qmax)
    codes = np.where(scale[..., None] > 0, codes, 0).astype(np.int8)
    return codes.reshape(x.shape), scale


def quantize_query(q_scaled: np.ndarray) -> np.ndarray:
    """Query heads [..., head_dim] (rotated, times the attention scale, float32) as the kernels use
    them against an int8/int4 K: int16 codes ``rint(q / s)``, ``s = max|q| / 32767`` (float32),
    returned as ``codes * s`` in float64."""
    q = np.asarray(q_scaled, dtype=np.float32)
    scale = np.abs(q).max(axis=-1, keepdims=True) / np.float32(Q16_MAX)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    codes = np.where(scale > 0, np.rint(q / safe), 0.0)
    return codes.astype(np.float64) * scale.astype(np.float64)


def query_codes(q_scaled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int16 codes as float64 [..., head_dim], float32 scale [..., 1]) of ``quantize_query``."""
    q = np.asarray(q_scaled, dtype=np.float32)
    scale = (np.abs(q).max(axis=-1, keepdims=True) / np.float32(Q16_MAX)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    return np.where(scale > 0, np.rint(q / safe), 0.0).astype(np.float64), scale


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once, as an FMA instruction (the product of two float32 is exact in
    float64; the sum is rounded twice only when it needs more than 53 bits, which the kernels' operands
    never come near)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float32)


def integer_scores(q_codes: np.ndarray, q_scale: np.ndarray, k_codes: np.ndarray, k_scales: np.ndarray) -> np.ndarray:
    """Scores of int16 query codes against int8/int4 K codes, float32, bit for bit as the kernels:
    per scale group g, ``s = fma(float(dot_g), q_scale * k_scale_g, s)`` from s = 0.

    q_codes [h, t, d], q_scale [h, t, 1]; k_codes [h, L, d], k_scales [h, L, groups] -> [h, t, L]."""
    d, groups = q_codes.shape[-1], k_scales.shape[-1]
    size = d // groups
    score = np.zeros(q_codes.shape[:2] + k_codes.shape[1:2], np.float32)
    for g in range(groups):
        cols = slice(g * size, (g + 1) * size)
        dot = (q_codes[..., cols] @ k_codes[..., cols].transpose(0, 2, 1)).astype(np.float32)   # exact, then rounded
        score = fma32(dot, (q_scale * k_scales[:, None, :, g]).astype(np.float32), score)
    return score


# e^x as the kernels compute it (templates/kernels/common.h.j2, ife_exp512: Cephes' polynomial)
_EXP_LO, _EXP_HI = np.float32(-104.0), np.float32(88.3762626647949)
_LOG2E, _LN2_HI, _LN2_LO = np.float32(1.44269504088896341), np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_P = [np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                  1.6666665459e-1, 5.0000001201e-1)]


def exp_kernel(x: np.ndarray) -> np.ndarray:
    """e^x in float32 with the operations of ``ife_exp512`` (and the scalar ``exp_kernel`` of the
    attention_kvq template), so that probability codes agree with the kernels bit for bit."""
    x = np.minimum(np.maximum(np.asarray(x, np.float32), _EXP_LO), _EXP_HI)
    n = np.rint((x * _LOG2E).astype(np.float32))
    r = fma32(-n, _LN2_HI, x)
    r = fma32(-n, _LN2_LO, r)
    p = np.full_like(x, _EXP_P[0])
    for c in _EXP_P[1:]:
        p = fma32(p, r, c)
    p = fma32(p, (r * r).astype(np.float32), (r + np.float32(1.0)).astype(np.float32))
    return np.ldexp(p, n.astype(np.int32)).astype(np.float32)


def quantized_pv(scores: np.ndarray, store: np.ndarray, v_codes: np.ndarray, v_scales: np.ndarray,
                 top: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """P·V over int8 V rows with the probabilities as uint8 codes, as the kernels compute it.

    For each group of P_GROUP key positions (P_GROUP g .. P_GROUP g + P_GROUP - 1) and query head:
    m = the group's largest score over the keys ``store`` selects, e_j = exp(s_j - m) (``exp_kernel``),
    w_j = e_j * (key j's V scale), codes c_j = rint(w_j / t) with t = max w / 255, so
    sum_j e^(s_j - top) v_j ~= e^(m - top) t sum_j c_j v_code_j: the inner sum is an integer dot
    product (vpdpbusd). Returns (numerator [h, t, d], denominator [h, t]) relative to ``top``
    (float64), the denominator from the unrounded e_j.

    scores [h, t, L] float32 (exact, ``integer_scores``), store [h or 1, t, L] bool, v_codes [h, L, d],
    v_scales [h, L], top [h, t, 1]."""
    h, t, L = scores.shape
    padded = -(-L // P_GROUP) * P_GROUP
    pad = ((0, 0), (0, 0), (0, padded - L))
    s = np.pad(scores, pad).reshape(h, t, -1, P_GROUP)
    keep = np.pad(np.broadcast_to(store, scores.shape), pad).reshape(h, t, -1, P_GROUP)
    m = np.where(keep, s, -np.inf).max(axis=-1, keepdims=True)                   # [h, t, groups, 1]
    used = np.isfinite(m)
    e = np.where(keep, exp_kernel(np.where(keep, s - np.where(used, m, 0), 0).astype(np.float32)), 0)
    sv = np.pad(v_scales, ((0, 0), (0, padded - L))).reshape(h, 1, -1, P_GROUP).astype(np.float32)
    w = (e * sv).astype(np.float32)
    step = (w.max(axis=-1, keepdims=True) / np.float32(P_QMAX)).astype(np.float32)
    codes = np.where(step > 0, np.rint((w / np.where(step > 0, step, 1)).astype(np.float32)), 0)
    factor = np.where(used, np.exp(np.where(used, m, 0).astype(np.float64) - top[..., None]), 0.0)
    weights = (codes * (step * factor)).reshape(h, t, padded)[..., :L]
    return weights @ v_codes.astype(np.float64), (e * factor).sum(axis=(-1, -2))


def dequantize(codes: np.ndarray, scales: np.ndarray, fmt: str, group: int | None = None) -> np.ndarray:
    d = codes.shape[-1]
    g = d if fmt == "int8" else (group or d)
    cg = codes.reshape(*codes.shape[:-1], d // g, g).astype(np.float32)
    return (cg * scales[..., None]).reshape(codes.shape).astype(np.float32)


def store_rows(x: np.ndarray, fmt: str, group: int | None = None) -> np.ndarray:
    """What the cache holds for rows ``x`` [..., head_dim], read back as float32."""
    if fmt == "f32":
        return np.asarray(x, dtype=np.float32)
    if fmt == "f16":
        return round_f16(x)
    if fmt in QUANTIZED:
        return dequantize(*quantize(x, fmt, group), fmt, group)
    raise InfengError(f"unknown KV format {fmt!r} (known: {', '.join(KV_FORMATS)})")


# ---------------------------------------------------------------------------------------------
# block layout (bytes); the C layout is described in docs/kv-cache.md and templates/kernels/attention_kvq
def codes_bytes(fmt: str, block_size: int, n_kv_heads: int, head_dim: int, value: bool = False) -> int:
    """Bytes of a block's codes (its values, for f32/f16), before the scales. int8 V codes are kept
    V_QUAD keys to a dim (one 32-bit lane of vpdpbusd), so their rows are padded to a multiple of V_QUAD."""
    rows = -(-block_size // V_QUAD) * V_QUAD if value and fmt == "int8" else block_size
    return rows * n_kv_heads * {"f32": 4 * head_dim, "f16": 2 * head_dim, "int8": head_dim, "int4": head_dim // 2}[fmt]


def block_bytes(fmt: str, block_size: int, n_kv_heads: int, head_dim: int, group: int | None,
                value: bool = False) -> int:
    """Bytes of one layer's K (or, value=True, V) block of ``block_size`` tokens, padded to 64 bytes."""
    scales = block_size * n_kv_heads * SCALE_BYTES * groups_per_row(fmt, head_dim, group) if fmt in QUANTIZED else 0
    n = codes_bytes(fmt, block_size, n_kv_heads, head_dim, value) + scales
    return -(-n // BLOCK_ALIGN) * BLOCK_ALIGN


def attention_kv_formats(attrs: dict) -> tuple[str, str, int | None]:
    """(k_format, v_format, int4 group) of an attention node's attributes."""
    k, v = attrs.get("k_format", "f32"), attrs.get("v_format", "f32")
    group = attrs.get("kv_group") or (default_group(attrs["head_dim"]) if "int4" in (k, v) else None)
    return k, v, group


def plain_f32(attrs: dict) -> bool:
    """True for an attention layer with the original f32 cache ([block, kv_heads, head_dim] floats,
    the ``attention`` kernels), False for one that needs the ``attention_kvq`` kernels."""
    k, v, _ = attention_kv_formats(attrs)
    return (k, v) == ("f32", "f32") and not attrs.get("rotate_qk") and not attrs.get("kv_window")


def layer_block_bytes(attrs: dict, block_size: int) -> tuple[int, int]:
    """(K, V) bytes of one KV block of an attention layer."""
    kvh, hd = attrs["n_kv_heads"], attrs["head_dim"]
    if plain_f32(attrs):
        return (block_size * kvh * hd * 4,) * 2
    k, v, group = attention_kv_formats(attrs)
    return block_bytes(k, block_size, kvh, hd, group), block_bytes(v, block_size, kvh, hd, group, value=True)


def graph_kv_bytes_per_token(graph, block_size: int) -> float:
    """KV bytes one token takes in the paged store over all layers (block padding spread)."""
    total = sum(sum(layer_block_bytes(n.attrs, block_size)) for n in graph.nodes if n.op == "attention")
    return total / block_size
