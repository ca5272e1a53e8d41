"""Quantized weight formats: codes, scales, exact dequantization and the packed byte layouts.

A quantized matrix ``W[N, K]`` (the Hugging Face ``[out, in]`` layout) is a ``QuantizedTensor``:
unsigned codes ``u[N, Kp]`` (``Kp``: ``K`` padded to a whole number of groups), a scale per group
(per row for the ``r`` formats) and a zero point per group. Its value is, exactly,

    W[n, k] = float32((u[n, k] - zero[n, g]) * scale[n, g])        g = k // group

computed in float32 from the scale as stored (fp16 scales widened exactly); the ``m`` formats
(GGUF's Q4_1, imported bit for bit) hold a minimum instead of a zero point:
``W[n, k] = float32(float32(u[n, k] * scale[n, g]) + min[n, g])``, as llama.cpp dequantizes. ``dequantize``
computes this; the interpreter uses it, so it predicts what the kernels compute up to the order of
accumulation. The padding columns ``K..Kp`` hold the zero point (value 0).

Formats (``docs/quantization.md`` has the byte layouts):

| name | codes | scale | zero point | bits per weight (K a multiple of the group) |
| --- | --- | --- | --- | --- |
| ``q8r`` | int8, one scale per row | f32 per row | 128 (symmetric) | 8 + 32/K |
| ``q8g32`` ``q8g64`` ``q8g128`` | int8 | fp16 per group | 128 (symmetric) | 8 + 16/G |
| ``q4g32`` ``q4g64`` ``q4g128`` | int4 | fp16 per group | 8 (symmetric) | 4 + 16/G |
| ``q4g32a`` ``q4g64a`` ``q4g128a`` | int4 | fp16 per group | u8 per group | 4 + 24/G |
| ``q4g32m`` ``q4g64m`` ``q4g128m`` | int4 | fp16 per group | fp16 minimum per group | 4 + 32/G |
| ``f8e4m3`` | fp8 e4m3 (OCP "fn": no inf, NaN only at S.1111.111) | f32 per row | — | 8 + 32/K |

Every packed layout interleaves ``ROWS_PER_BLOCK`` = 16 output rows, so that one load holds the
same k positions of 16 rows and feeds the 16 lanes of one AVX-512 accumulator (two AVX2 ones);
``N`` is padded to a multiple of 16 with rows of zero scale. Per block of 16 rows: the codes, then
the scales ([group][row]), then the zero points ([group][row]), padded to 64 bytes; except that the
int4 formats cut a block into *segments* of ``segment_groups`` groups (2 symmetric, 4 asymmetric:
the fewest whose scales and zero points fill whole cache lines), each holding its groups' codes,
then their scales, then their zero points (the last segment may hold fewer groups; each segment is
padded to 64 bytes). A decode step then reads every block as one stream in address order; with
all scales after all codes, each block was two interleaved streams, and one core streamed half as
much (docs/quantization.md). Codes:

- int8: signed bytes q = u - 128, ``[k/2][row][k%2]`` (a k-pair of 16 rows: 32 bytes, widened by
  vpmovsxbw into one vpdpwssd operand; int8 weights multiply int16 activations);
- int4: ``[k/8][row][j]`` bytes, j = 0..3, low nibble u[k0 + j], high nibble u[k0 + 4 + j]
  (k0 = 8*(k/8)): 64 bytes hold 8 k of 16 rows; masking and shifting give two vpdpbusd operands
  of 4 consecutive k each;
- fp8: ``[k][row]`` (16 bytes: one k of 16 rows, widened and converted to 16 f32 lanes).

``mxfp4`` (OCP microscaling FP4, as GPT-OSS ships its experts) is an imported format, not a
quantization target: its bytes are the checkpoint's, read without conversion (``MXFP4`` below).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from infeng_common.errors import InfengError

ROWS_PER_BLOCK = 16          # output rows interleaved in one block of the packed layout
ACT_BLOCK = 32               # activations are quantized to int8 per token in blocks of this many
BLOCK_ALIGN = 64             # every row block starts 64-byte aligned (one cache line)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class QuantFormat:
    """One storage format. ``group`` 0 means one scale per row."""

    name: str
    kind: str                # "int" or "fp8"
    bits: int                # 8 or 4
    group: int               # elements per scale along K; 0: the whole row
    asym: bool = False       # per-group zero point (else the fixed zero 2^(bits-1))
    mins: bool = False       # per-group fp16 minimum instead of a zero point (w = u * scale + min)

    # -- geometry ---------------------------------------------------------------------------
    @property
    def scale_dtype(self) -> np.dtype:
        return np.dtype(np.float32) if self.group == 0 else np.dtype(np.float16)

    @property
    def qmin(self) -> int:
        """Smallest signed code of the symmetric formats (int8 keeps -128 out: see docs)."""
        return {8: -127, 4: -8}[self.bits]

    @property
    def qmax(self) -> int:
        return {8: 127, 4: 7}[self.bits]

    @property
    def zero(self) -> int:
        """The fixed zero point of the symmetric formats: codes are stored unsigned, q + zero."""
        return 1 << (self.bits - 1)

    @property
    def umax(self) -> int:
        return (1 << self.bits) - 1

    def padded_k(self, K: int) -> int:
        """K padded to whole groups (per-row formats: to whole k-pairs for int8, none for fp8)."""
        if self.group:
            return _round_up(K, self.group)
        return _round_up(K, 2) if self.kind == "int" else K

    def groups(self, K: int) -> int:
        return 1 if self.group == 0 else self.padded_k(K) // self.group

    @property
    def segment_groups(self) -> int:
        """Groups per segment of a block (int4: 2 symmetric, 4 asymmetric, 1 with minimums: the
        fewest whose scales and zero points or minimums fill whole cache lines); 0: not segmented."""
        if self.kind != "int" or self.bits != 4:
            return 0
        return 1 if self.mins else 4 if self.asym else 2

    @property
    def group_code_bytes(self) -> int:
        """Bytes of codes of one group of 16 rows."""
        return ROWS_PER_BLOCK * self.group * self.bits // 8

    @property
    def group_meta_bytes(self) -> int:
        """Bytes of scales and zero points (or minimums) of one group of 16 rows."""
        return ROWS_PER_BLOCK * (self.scale_dtype.itemsize + self.zero_bytes)

    @property
    def zero_bytes(self) -> int:
        """Bytes of one row's zero point (u8) or minimum (fp16) per group; 0 when symmetric."""
        return 2 if self.mins else 1 if self.asym else 0

    def segments(self, K: int) -> list[tuple[int, int]]:
        """(first group, groups) of each segment of a block (one segment when not segmented)."""
        ng, sg = self.groups(K), self.segment_groups or self.groups(K)
        return [(g, min(sg, ng - g)) for g in range(0, ng, sg)]

    def segment_bytes(self, groups: int) -> int:
        """Bytes of a segment of ``groups`` groups (64-byte padded)."""
        return _round_up(groups * (self.group_code_bytes + self.group_meta_bytes), BLOCK_ALIGN)

    def block_bytes(self, K: int) -> int:
        """Bytes of one block of 16 rows (codes, then scales, then zero points; 64-byte padded)."""
        if self.segment_groups:
            return sum(self.segment_bytes(n) for _, n in self.segments(K))
        kp, ng = self.padded_k(K), self.groups(K)
        codes = ROWS_PER_BLOCK * kp * self.bits // 8
        scales = ROWS_PER_BLOCK * ng * self.scale_dtype.itemsize
        zeros = ROWS_PER_BLOCK * ng * self.zero_bytes
        return _round_up(codes + scales + zeros, BLOCK_ALIGN)

    def nbytes(self, shape: tuple[int, int]) -> int:
        N, K = shape
        return _round_up(N, ROWS_PER_BLOCK) // ROWS_PER_BLOCK * self.block_bytes(K)

    def bits_per_weight(self, shape: tuple[int, int]) -> float:
        return 8 * self.nbytes(shape) / (shape[0] * shape[1])

    def padding(self, shape: tuple[int, int]) -> dict[str, int] | None:
        """``{"N": Np, "K": Kp}`` when the layout pads the matrix, else None (for the manifest)."""
        N, K = shape
        np_, kp = _round_up(N, ROWS_PER_BLOCK), self.padded_k(K)
        return None if (np_, kp) == (N, K) else {"N": np_, "K": kp}

    # -- numerics ---------------------------------------------------------------------------
    def dequantize(self, qt: QuantizedTensor) -> np.ndarray:
        """The exact float32 values of ``qt``, logical shape [N, K]."""
        N, K = qt.shape
        scale = _expand(qt.scales.astype(np.float32), self, qt.codes.shape[1])
        if self.kind == "fp8":
            return np.ascontiguousarray((e4m3_decode(qt.codes) * scale)[:, :K], dtype=np.float32)
        if self.mins:
            low = _expand(qt.mins.astype(np.float32), self, qt.codes.shape[1])
            return np.ascontiguousarray((qt.codes.astype(np.float32) * scale + low)[:, :K], dtype=np.float32)
        zero = np.float32(self.zero) if not self.asym else _expand(qt.zeros.astype(np.float32), self, qt.codes.shape[1])
        centred = qt.codes.astype(np.float32) - zero                  # exact small integers
        return np.ascontiguousarray((centred * scale)[:, :K], dtype=np.float32)

    def all_finite(self, qt: QuantizedTensor) -> bool:
        """Whether every value of ``qt`` is finite (what ``infeng compile`` checks of each weight)."""
        return bool(np.isfinite(self.dequantize(qt)).all())

    def pack(self, qt: QuantizedTensor) -> np.ndarray:
        """The packed bytes (uint8, ``nbytes(shape)`` long) that go into weights.bin."""
        return _pack(self, qt)

    def unpack(self, data: np.ndarray, shape: tuple[int, int]) -> QuantizedTensor:
        """Inverse of ``pack``."""
        return _unpack(self, np.asarray(data, dtype=np.uint8), tuple(shape))


def _expand(per_group: np.ndarray, fmt: QuantFormat, kp: int) -> np.ndarray:
    """[N, groups] -> [N, Kp] (one value per element)."""
    if fmt.group == 0:
        return np.broadcast_to(per_group.reshape(-1, 1), (per_group.shape[0], kp))
    return np.repeat(per_group, fmt.group, axis=1)


@dataclass
class QuantizedTensor:
    """Codes and scales of one matrix. ``codes`` uint8 [N, Kp]: unsigned integer codes (q + zero)
    or e4m3 bytes; ``scales`` [N, groups] in the format's scale dtype; ``zeros`` uint8
    [N, groups] for the asymmetric formats, ``mins`` fp16 [N, groups] for the ``m`` formats."""

    format: str
    shape: tuple[int, int]
    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None = None
    mins: np.ndarray | None = None

    @property
    def fmt(self) -> QuantFormat:
        return get_format(self.format)

    def dequantize(self) -> np.ndarray:
        return self.fmt.dequantize(self)

    def pack(self) -> np.ndarray:
        return self.fmt.pack(self)


# ---------------------------------------------------------------------------------------------
# the catalogue
_NAME = re.compile(r"^q(8|4)(?:r|g(32|64|128))([am]?)$")


@lru_cache(maxsize=None)
def get_format(name: str) -> QuantFormat:
    """The format called ``name``; ``InfengError`` listing the known ones otherwise."""
    if name == "mxfp4":
        return MXFP4
    if name == "f8e4m3":
        return QuantFormat("f8e4m3", "fp8", 8, 0)
    m = _NAME.match(name)
    if m and not (m.group(3) and (m.group(1) == "8" or m.group(2) is None)):
        return QuantFormat(name, "int", int(m.group(1)), int(m.group(2) or 0), m.group(3) == "a", m.group(3) == "m")
    raise InfengError(f"unknown quantized format {name!r}; known: {', '.join(QUANT_FORMATS)}")


QUANT_FORMATS = ("q8r", "q8g32", "q8g64", "q8g128", "q4g32", "q4g64", "q4g128", "q4g32a", "q4g64a", "q4g128a",
                 "q4g32m", "q4g64m", "q4g128m", "f8e4m3")
#: Formats that are not quantized: the plain float storage of ``cast-weights``.
FLOAT_FORMATS = ("f32", "f16", "bf16")


#: Formats read from checkpoints as they are (never chosen by a quantization policy).
IMPORTED_FORMATS = ("mxfp4",)


def is_quantized(name: str) -> bool:
    """Whether ``name`` is a packed format (``QuantizedTensor`` codes and scales), not a float one."""
    return name in QUANT_FORMATS or name in IMPORTED_FORMATS


# ---------------------------------------------------------------------------------------------
# fp8 e4m3 ("fn": bias 7, 3 mantissa bits, max 448, no infinities)
@lru_cache(maxsize=1)
def _e4m3_table() -> np.ndarray:
    """float32 value of every code 0..255 (NaN for 0x7f and 0xff)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, mant = (codes >> 3) & 0xF, codes & 0x7
    mag = np.where(exp == 0, mant / 8.0 * 2.0 ** -6, (1 + mant / 8.0) * 2.0 ** (exp - 7.0))
    values = (sign * mag).astype(np.float32)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values


E4M3_MAX = 448.0


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    return _e4m3_table()[np.asarray(codes, dtype=np.uint8)]


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest e4m3 code (ties to even), saturating at +-448."""
    x = np.asarray(x, dtype=np.float32)
    positive = _e4m3_table()[:0x7F]                      # codes 0..126, increasing
    mag = np.minimum(np.abs(x), np.float32(E4M3_MAX))
    hi = np.clip(np.searchsorted(positive, mag, side="left"), 0, 0x7E)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = mag - positive[lo], positive[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    return np.where(np.signbit(x), code | 0x80, code).astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# packing
def _pad_rows(a: np.ndarray, rows: int, fill: int | float = 0) -> np.ndarray:
    if a.shape[0] == rows:
        return a
    pad = np.full((rows - a.shape[0],) + a.shape[1:], fill, dtype=a.dtype)
    return np.concatenate([a, pad], axis=0)


def _pack(fmt: QuantFormat, qt: QuantizedTensor) -> np.ndarray:
    N, K = qt.shape
    kp, ng = fmt.padded_k(K), fmt.groups(K)
    if qt.codes.shape != (N, kp) or qt.scales.shape != (N, ng):
        raise InfengError(f"{fmt.name}: codes {qt.codes.shape} / scales {qt.scales.shape} do not fit shape {qt.shape}")
    n_blocks = _round_up(N, ROWS_PER_BLOCK) // ROWS_PER_BLOCK
    R = ROWS_PER_BLOCK
    pad_code = 0 if fmt.kind == "fp8" else (fmt.zero if not fmt.asym else 0)
    codes = _pad_rows(qt.codes, n_blocks * R, pad_code).reshape(n_blocks, R, kp)
    if fmt.kind == "fp8":
        # byte [k, r]: one k position of 16 rows (one vpmovzxbw feeds 16 outputs)
        code_bytes = codes.transpose(0, 2, 1).reshape(n_blocks, -1)
    elif fmt.bits == 8:
        # int8 q = u - 128 (two's complement), byte [k/2, r, k%2]: a k-pair of 16 rows, which
        # vpmovsxbw widens into the 16 lanes of a vpdpwssd operand
        signed = (codes ^ np.uint8(0x80)).reshape(n_blocks, R, kp // 2, 2)
        code_bytes = signed.transpose(0, 2, 1, 3).reshape(n_blocks, -1)
    else:
        # byte [k/8, r, j]: low nibble k = 8*(k/8) + j, high nibble k = 8*(k/8) + 4 + j, j = 0..3
        octs = codes.reshape(n_blocks, R, kp // 8, 2, 4).transpose(0, 2, 1, 3, 4)
        code_bytes = (octs[..., 0, :] | (octs[..., 1, :] << 4)).astype(np.uint8).reshape(n_blocks, -1)
    scales = _pad_rows(np.ascontiguousarray(qt.scales, dtype=fmt.scale_dtype), n_blocks * R)
    scale_bytes = scales.reshape(n_blocks, R, ng).transpose(0, 2, 1).copy().view(np.uint8).reshape(n_blocks, -1)
    zero_bytes = None
    if fmt.asym:
        zeros = _pad_rows(qt.zeros.astype(np.uint8), n_blocks * R)
        zero_bytes = zeros.reshape(n_blocks, R, ng).transpose(0, 2, 1).reshape(n_blocks, -1)
    elif fmt.mins:
        if qt.mins is None or qt.mins.shape != (N, ng):
            raise InfengError(f"{fmt.name}: minimums {None if qt.mins is None else qt.mins.shape} do not fit "
                              f"shape {qt.shape}")
        mins = _pad_rows(np.ascontiguousarray(qt.mins, dtype=np.float16), n_blocks * R)
        zero_bytes = mins.reshape(n_blocks, R, ng).transpose(0, 2, 1).copy().view(np.uint8).reshape(n_blocks, -1)
    out = np.zeros((n_blocks, fmt.block_bytes(K)), dtype=np.uint8)
    for at, (g0, g1) in _segment_spans(fmt, K):
        pieces = [code_bytes[:, g0 * fmt.group_code_bytes:g1 * fmt.group_code_bytes] if fmt.segment_groups else code_bytes,
                  scale_bytes[:, g0 * R * fmt.scale_dtype.itemsize:g1 * R * fmt.scale_dtype.itemsize]]
        if zero_bytes is not None:
            pieces.append(zero_bytes[:, g0 * R * fmt.zero_bytes:g1 * R * fmt.zero_bytes])
        body = np.concatenate(pieces, axis=1)
        out[:, at:at + body.shape[1]] = body
    return out.reshape(-1)


def _segment_spans(fmt: QuantFormat, K: int) -> list[tuple[int, tuple[int, int]]]:
    """(byte offset in a block, (first group, end group)) of each segment."""
    spans, at = [], 0
    for g0, n in fmt.segments(K):
        spans.append((at, (g0, g0 + n)))
        at += fmt.segment_bytes(n) if fmt.segment_groups else 0
    return spans


def _unpack(fmt: QuantFormat, data: np.ndarray, shape: tuple[int, int]) -> QuantizedTensor:
    N, K = shape
    if data.size != fmt.nbytes(shape):
        raise InfengError(f"{fmt.name}: {data.size} bytes, a [{N}, {K}] matrix takes {fmt.nbytes(shape)}")
    kp, ng, R = fmt.padded_k(K), fmt.groups(K), ROWS_PER_BLOCK
    n_blocks = _round_up(N, R) // R
    blocks = data.reshape(n_blocks, fmt.block_bytes(K))
    if fmt.segment_groups:      # back to all codes, then all scales, then all zero points
        code_part, meta_part = [], []
        for at, (g0, g1) in _segment_spans(fmt, K):
            n_code = (g1 - g0) * fmt.group_code_bytes
            code_part.append(blocks[:, at:at + n_code])
            meta_part.append(blocks[:, at + n_code:at + n_code + (g1 - g0) * fmt.group_meta_bytes])
        scale_part = [m[:, :m.shape[1] // fmt.group_meta_bytes * R * 2] for m in meta_part]
        zero_part = [m[:, m.shape[1] // fmt.group_meta_bytes * R * 2:] for m in meta_part]
        blocks = np.concatenate(code_part + scale_part + zero_part, axis=1)
    n_code = R * kp * fmt.bits // 8
    raw = blocks[:, :n_code]
    if fmt.kind == "fp8":
        codes = raw.reshape(n_blocks, kp, R).transpose(0, 2, 1)
    elif fmt.bits == 8:
        codes = raw.reshape(n_blocks, kp // 2, R, 2).transpose(0, 2, 1, 3) ^ np.uint8(0x80)
    else:
        octs = raw.reshape(n_blocks, kp // 8, R, 4).transpose(0, 2, 1, 3)
        codes = np.stack([octs & 0xF, octs >> 4], axis=3)
    codes = np.ascontiguousarray(codes.reshape(n_blocks * R, kp)[:N])
    n_scale = R * ng * fmt.scale_dtype.itemsize
    scales = blocks[:, n_code:n_code + n_scale].copy().view(fmt.scale_dtype)
    scales = np.ascontiguousarray(scales.reshape(n_blocks, ng, R).transpose(0, 2, 1).reshape(-1, ng)[:N])
    zeros = mins = None
    if fmt.asym:
        z = blocks[:, n_code + n_scale:n_code + n_scale + R * ng]
        zeros = np.ascontiguousarray(z.reshape(n_blocks, ng, R).transpose(0, 2, 1).reshape(-1, ng)[:N])
    elif fmt.mins:
        z = blocks[:, n_code + n_scale:n_code + n_scale + R * ng * 2].copy().view(np.float16)
        mins = np.ascontiguousarray(z.reshape(n_blocks, ng, R).transpose(0, 2, 1).reshape(-1, ng)[:N])
    return QuantizedTensor(fmt.name, shape, codes, scales, zeros, mins)


# ---------------------------------------------------------------------------------------------
# MXFP4 (OCP Microscaling FP4): e2m1 elements in blocks of 32 sharing an e8m0 power-of-two scale
#: e2m1 values of the codes 0..15 (sign bit 3): transformers' ``FP4_VALUES``.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
MXFP4_BLOCK = 32             # elements per e8m0 scale
MXFP4_BLOCK_BYTES = 16       # two e2m1 codes per byte
E8M0_BIAS = 127              # an e8m0 byte s stands for 2^(s - 127)


@dataclass(frozen=True)
class MXFP4Format(QuantFormat):
    """GPT-OSS's MXFP4 tensors, kept as the checkpoint stores them.

    A matrix ``W[..., N, K]`` (K a multiple of 32) is two tensors: ``*_blocks`` uint8
    ``[..., N, K/32, 16]``, byte j of a block holding element 2j in its low nibble and element
    2j + 1 in its high nibble, and ``*_scales`` uint8 ``[..., N, K/32]`` (e8m0). Its value is,
    exactly (transformers' ``convert_moe_packed_tensors``: a table lookup and ``ldexp``),

        W[n, k] = E2M1_VALUES[code(n, k)] * 2^(scales[n, k // 32] - 127)

    The packed bytes (``weights.bin``) are the checkpoint's bytes, matrix by matrix: a matrix's
    blocks ``[N, K/32, 16]`` then its scales ``[N, K/32]``; a stack ``[E, N, K]`` of experts is E
    such matrices one after another (expert e at ``e * N * K * 17 / 32``), as every packed format
    stacks. ``QuantizedTensor.codes`` holds the blocks, ``scales`` the e8m0 bytes; both keep the
    checkpoint's shapes (memory-mapped).
    """

    def padded_k(self, K: int) -> int:
        return K

    def groups(self, K: int) -> int:
        return K // MXFP4_BLOCK

    @property
    def segment_groups(self) -> int:
        return 0

    def block_bytes(self, K: int) -> int:
        raise InfengError("mxfp4 has no blocks of 16 rows: its rows are the checkpoint's")

    def nbytes(self, shape: tuple[int, ...]) -> int:
        *outer, K = shape
        _check_mxfp4_k(K)
        return int(np.prod(outer, dtype=np.int64)) * K // MXFP4_BLOCK * (MXFP4_BLOCK_BYTES + 1)

    def padding(self, shape: tuple[int, ...]) -> dict[str, int] | None:
        return None

    def dequantize(self, qt: QuantizedTensor) -> np.ndarray:
        """float32 ``[..., N, K]``; exact (every value is a small integer times a power of two)."""
        blocks, scales = np.asarray(qt.codes, dtype=np.uint8), np.asarray(qt.scales, dtype=np.uint8)
        values = _e2m1_pairs()[blocks].reshape(*blocks.shape[:-1], MXFP4_BLOCK)     # one f32 buffer
        if np.any(scales == 0xFF):          # 2^128 overflows f32: ldexp keeps 0 * 2^128 = 0, as transformers
            with np.errstate(over="ignore"):
                np.ldexp(values, scales.astype(np.int32)[..., None] - E8M0_BIAS, out=values)
        else:                               # a power of two times an e2m1 value: exact, and 10x faster
            values *= _e8m0_values()[scales][..., None]
        return values.reshape(tuple(qt.shape))

    def all_finite(self, qt: QuantizedTensor) -> bool:
        """e2m1 values are finite and so is every e8m0 scale but 0xFF (2^128, beyond f32), which
        overflows a code of magnitude 1 or more (magnitude bits 0x6 of a nibble set; 0.5 x 2^128 is
        still finite): no dequantization (it took minutes for the 20B-shape experts)."""
        top = np.asarray(qt.scales, dtype=np.uint8) == 0xFF
        return not top.any() or not (np.asarray(qt.codes, dtype=np.uint8)[top] & 0x66).any()

    def pack(self, qt: QuantizedTensor) -> np.ndarray:
        _check_mxfp4(qt)
        matrices = int(np.prod(qt.shape[:-2], dtype=np.int64))
        return np.concatenate([np.asarray(qt.codes, dtype=np.uint8).reshape(matrices, -1),
                               np.asarray(qt.scales, dtype=np.uint8).reshape(matrices, -1)], axis=1).reshape(-1)

    def unpack(self, data: np.ndarray, shape: tuple[int, ...]) -> QuantizedTensor:
        data = np.asarray(data, dtype=np.uint8)
        if data.size != self.nbytes(tuple(shape)):
            raise InfengError(f"mxfp4: {data.size} bytes, a {list(shape)} matrix takes {self.nbytes(tuple(shape))}")
        *outer, N, K = shape
        n_blocks = K // MXFP4_BLOCK
        per_matrix = data.reshape(int(np.prod(outer, dtype=np.int64)), -1)
        split = N * n_blocks * MXFP4_BLOCK_BYTES
        blocks = per_matrix[:, :split].reshape(*outer, N, n_blocks, MXFP4_BLOCK_BYTES)
        return QuantizedTensor("mxfp4", tuple(shape), blocks, per_matrix[:, split:].reshape(*outer, N, n_blocks))


MXFP4 = MXFP4Format("mxfp4", "mxfp4", 4, MXFP4_BLOCK)


@lru_cache(maxsize=1)
def _e8m0_values() -> np.ndarray:
    """float32 2^(s - 127) of every e8m0 byte s (2^-127 is a subnormal; 0xFF overflows to inf)."""
    with np.errstate(over="ignore"):
        return np.ldexp(np.float32(1.0), np.arange(256) - E8M0_BIAS).astype(np.float32)


@lru_cache(maxsize=1)
def _e2m1_pairs() -> np.ndarray:
    """[256, 2] float32: the two e2m1 values of every byte (low nibble first: element 2j, 2j + 1)."""
    byte = np.arange(256)
    return np.stack([E2M1_VALUES[byte & 0x0F], E2M1_VALUES[byte >> 4]], axis=1)


def _check_mxfp4_k(K: int) -> None:
    if K % MXFP4_BLOCK:
        raise InfengError(f"mxfp4: the input dimension K = {K} is not a multiple of {MXFP4_BLOCK}")


def _check_mxfp4(qt: QuantizedTensor) -> None:
    *outer, K = qt.shape
    _check_mxfp4_k(K)
    want_blocks = (*outer, K // MXFP4_BLOCK, MXFP4_BLOCK_BYTES)
    if tuple(np.shape(qt.codes)) != want_blocks or tuple(np.shape(qt.scales)) != want_blocks[:-1]:
        raise InfengError(f"mxfp4: blocks {tuple(np.shape(qt.codes))} / scales {tuple(np.shape(qt.scales))} do not "
                          f"fit shape {list(qt.shape)} (want {want_blocks} and {want_blocks[:-1]})")


def mxfp4_tensor(blocks: np.ndarray, scales: np.ndarray) -> QuantizedTensor:
    """The ``QuantizedTensor`` of a checkpoint's ``*_blocks`` [..., N, K/32, 16] and ``*_scales``
    [..., N, K/32] (uint8, memory-mapped or not: they are kept, not copied)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise InfengError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 3 or blocks.shape[-1] != MXFP4_BLOCK_BYTES:
        raise InfengError(f"mxfp4: blocks must be [..., N, K/32, {MXFP4_BLOCK_BYTES}], got {list(blocks.shape)}")
    qt = QuantizedTensor("mxfp4", (*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK), blocks, scales)
    _check_mxfp4(qt)
    return qt


def mxfp4_quantize(w: np.ndarray) -> QuantizedTensor:
    """Round float32 ``w`` [..., N, K] to MXFP4 as llama.cpp and gguf-py do: the block's scale
    exponent is floor(log2(max |w|)) - 2 (so the largest magnitude lands on 4..8, clipped to 6), each
    element the nearest e2m1 value (ties to the lower code). For tests and synthetic checkpoints."""
    w = np.asarray(w, dtype=np.float32)
    *outer, K = w.shape
    _check_mxfp4_k(K)
    blocks = w.reshape(-1, MXFP4_BLOCK)
    amax = np.abs(blocks).max(axis=1)
    with np.errstate(divide="ignore"):
        exponent = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, np.float32(1e-38)))) - 2, -E8M0_BIAS)
    exponent = np.clip(exponent, -E8M0_BIAS, 127).astype(np.int32)
    scaled = blocks / np.ldexp(np.float32(1.0), exponent)[:, None].astype(np.float32)
    codes = np.empty(blocks.shape, np.uint8)
    for start in range(0, blocks.shape[0], 1 << 16):          # bounded temporaries
        part = scaled[start:start + (1 << 16)]
        codes[start:start + (1 << 16)] = np.abs(part[..., None] - E2M1_VALUES).argmin(axis=-1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    n_blocks = K // MXFP4_BLOCK
    return QuantizedTensor("mxfp4", tuple(w.shape), packed.reshape(*outer, n_blocks, MXFP4_BLOCK_BYTES),
                           (exponent + E8M0_BIAS).astype(np.uint8).reshape(*outer, n_blocks))


def mxfp4_to_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """llama.cpp's ``block_mxfp4`` bytes (``e8m0`` scale, then 16 bytes: element j in the low nibble
    of byte j, element j + 16 in the high one) of the GPT-OSS tensors: the codes moved, not
    re-rounded (``convert_hf_to_gguf.py``'s ``transform_nibble_layout``). [..., N, K/32 * 17]."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    codes = np.stack([blocks & np.uint8(0x0F), blocks >> np.uint8(4)], axis=-1).reshape(*blocks.shape[:-1], MXFP4_BLOCK)
    qs = codes[..., :MXFP4_BLOCK // 2] | (codes[..., MXFP4_BLOCK // 2:] << np.uint8(4))
    out = np.concatenate([np.asarray(scales, dtype=np.uint8)[..., None], qs.astype(np.uint8)], axis=-1)
    return out.reshape(*blocks.shape[:-2], -1)
