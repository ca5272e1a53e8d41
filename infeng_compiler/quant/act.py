"""Activation quantization: what the integer kernels feed to their dot products.

Two forms, chosen by the weights a value feeds (``passes/quantize.py``):

- int8 in blocks of 32 per token (``bits=8, block=32``), for int4 weights (``vpdpbusd``);
- int16 with one scale per token (``bits=16, block=0``), for int8 weights (``vpdpwssd``): the
  int8 form would add as much error as the int8 weights themselves (docs/quantization.md).

Bit-exact definition (the C kernels compute the same, in float32), per token and block (the row
zero-padded to a whole block; ``block=0``: the whole row), with ``Q = 2^(bits-1) - 1``:

    amax = max |x|                     over the block
    d    = amax / Q                    the block's scale
    id   = amax > 0 ? Q / amax : 0
    q    = round_to_nearest_even(x * id)          in [-Q, Q]
    sum  = sum of the block's q                  (int32, for the weights' zero points)

``fake_quant`` returns ``q * d`` [T, K]: the values the kernels' dot products see, which the
``quantize_act`` op's reference gives the interpreter.
"""
from __future__ import annotations

import numpy as np

from .formats import ACT_BLOCK

ACT_FORMS = {8: ACT_BLOCK, 16: 0}     # bits -> block (0: one scale per token)


def act_qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def quantize_act(x: np.ndarray, block: int = ACT_BLOCK, bits: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [T, Kp] int8/int16, d float32 [T, blocks], sums int32 [T, blocks]) for ``x`` [T, K]."""
    x = np.asarray(x, dtype=np.float32)
    T, K = x.shape
    block = block or K
    kp = -(-K // block) * block
    xp = np.zeros((T, kp), np.float32)
    xp[:, :K] = x
    xb = xp.reshape(T, kp // block, block)
    amax = np.abs(xb).max(axis=2)
    Q = np.float32(act_qmax(bits))
    d = (amax / Q).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, Q / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int8 if bits == 8 else np.int16)
    return q.reshape(T, kp), d, q.astype(np.int32).sum(axis=2)


def fake_quant(x: np.ndarray, block: int = ACT_BLOCK, bits: int = 8) -> np.ndarray:
    """``x`` rounded through the integer form: the float32 values ``q * d`` [T, K]."""
    T, K = np.shape(x)
    q, d, _ = quantize_act(x, block, bits)
    deq = q.reshape(T, d.shape[1], -1).astype(np.float32) * d[..., None]
    return np.ascontiguousarray(deq.reshape(T, -1)[:, :K], dtype=np.float32)


#: Activation rows are padded to a multiple of this many elements (zeros): every weight format's
#: padded K (whole groups of up to 128) fits in the row.
ACT_ROW_PAD = 128


def act_row_layout(K: int, bits: int) -> dict[str, int]:
    """Byte layout of one token's quantized row, as ``quantize_act`` kernels write it and the
    integer ``linear`` kernels read it (64-byte aligned rows):

    - bits 8: int8 codes [kp], float32 scales [kp/32] at ``d_offset``, int32 sums [kp/32] at
      ``sum_offset``;
    - bits 16: int16 codes [kp], one float32 scale at ``d_offset``.
    """
    kp = -(-K // ACT_ROW_PAD) * ACT_ROW_PAD
    if bits == 8:
        blocks = kp // ACT_BLOCK
        d_offset, sum_offset = kp, kp + 4 * blocks
        end = sum_offset + 4 * blocks
    elif bits == 16:
        blocks = 1
        d_offset = sum_offset = 2 * kp
        end = d_offset + 4
    else:
        raise ValueError(f"activation bits must be 8 or 16, got {bits}")
    return {"kp": kp, "blocks": blocks, "d_offset": d_offset, "sum_offset": sum_offset,
            "row_bytes": -(-end // 64) * 64}


def pack_act_rows(x: np.ndarray, bits: int) -> np.ndarray:
    """The bytes ``quantize_act`` kernels write for ``x`` [T, K]: uint8 [T, row_bytes] (tests)."""
    T, K = x.shape
    lay = act_row_layout(K, bits)
    q, d, sums = quantize_act(x, ACT_FORMS[bits], bits)
    out = np.zeros((T, lay["row_bytes"]), np.uint8)
    codes = np.zeros((T, lay["kp"]), q.dtype)
    codes[:, :q.shape[1]] = q
    out[:, :codes.itemsize * lay["kp"]] = codes.view(np.uint8)
    out[:, lay["d_offset"]:lay["d_offset"] + 4 * lay["blocks"]] = np.pad(d, ((0, 0), (0, lay["blocks"] - d.shape[1]))).astype(np.float32).view(np.uint8)
    if bits == 8:
        s = np.pad(sums, ((0, 0), (0, lay["blocks"] - sums.shape[1]))).astype(np.int32)
        out[:, lay["sum_offset"]:lay["sum_offset"] + 4 * lay["blocks"]] = s.view(np.uint8)
    return out
