"""Kernel specs and their rendering: one C translation unit per (op, ISA, static shape).

A ``KernelSpec`` names an op, a target ISA and the static parameters the kernel is specialised
on. ``render_kernel`` picks the op's template for the nearest ISA at or below the requested one
(``templates/kernels/<op>/<isa>.c.j2``), computes the tiling decisions here in Python and renders
a self-contained translation unit that includes ``ife_kernels.h`` (``render_common``) and defines
one function with external linkage, ``spec.symbol``. ``render_support`` renders the thread pool
and CPU check, which must be compiled without ISA flags (see ``library_sources``).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from importlib.resources import files
from typing import Any

import jinja2
import numpy as np

from infeng_common.errors import UnsupportedError

from .target import FEATURES_ENV, TARGETS, Target

#: File names of the shared sources in a library.
COMMON_HEADER = "ife_kernels.h"
SUPPORT_SOURCE = "ife_support.c"

#: C element type of the weights of each weight dtype.
WEIGHT_CTYPES = {"f32": "float", "f16": "uint16_t", "bf16": "uint16_t"}
_WEIGHT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


# ---------------------------------------------------------------------------------------------
# specs
@dataclass(frozen=True)
class KernelSpec:
    """One kernel: ``op``, target ISA name and the sorted static parameters."""

    op: str
    isa: str
    params: tuple[tuple[str, Any], ...]

    @classmethod
    def make(cls, op: str, isa: str, **params: Any) -> KernelSpec:
        """Validate and normalise ``params`` (floats become float32 values, sequences tuples)."""
        kernel = _op_kernel(op)
        if isa not in TARGETS:
            raise UnsupportedError(f"unknown ISA {isa!r} for kernel {op}; known: {', '.join(TARGETS)}")
        missing = set(kernel.params) - set(params)
        extra = set(params) - set(kernel.params)
        if missing or extra:
            raise UnsupportedError(f"kernel {op} takes parameters {', '.join(kernel.params)}; "
                                   f"missing {sorted(missing)}, unexpected {sorted(extra)}")
        normal = {name: _normalise(params[name]) for name in kernel.params}
        kernel.check(normal)
        return cls(op, isa, tuple(sorted(normal.items())))

    def __getitem__(self, name: str) -> Any:
        return dict(self.params)[name]

    @property
    def symbol(self) -> str:
        """The C function name, e.g. ``ife_linear_f16_k576_n1536_avx512``."""
        parts = _op_kernel(self.op).symbol_parts(dict(self.params))
        return "_".join(["ife", self.op, *parts, self.isa.replace("-", "_")])


def _normalise(value: Any) -> Any:
    if isinstance(value, (float, np.floating)):
        return float(np.float32(value))
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(_normalise(v) for v in np.asarray(value).tolist())
    return value


def _sym_float(value: float) -> str:
    """Shortest float32 spelling, made an identifier: 1e-05 -> 1em05, 0.125 -> 0p125."""
    text = str(np.float32(value))
    return text.replace("-", "m").replace("+", "").replace(".", "p")


def c_float(value: float) -> str:
    """A C float literal that reads back the exact float32 value (9 significant digits)."""
    v = float(np.float32(value))
    if not math.isfinite(v):
        raise UnsupportedError(f"non-finite constant {value} in a kernel")
    text = f"{v:.9g}"
    if "." not in text and "e" not in text:
        text += ".0"
    return text + "f"


# ---------------------------------------------------------------------------------------------
# per-op definitions
@dataclass(frozen=True)
class _OpKernel:
    params: tuple[str, ...]                               # static parameters, all required
    prototype: str                                        # C declaration; {sym} and {W} filled in
    variants: tuple[str, ...]                             # ISAs with their own template, scalar first
    symbol_parts: Callable[[dict[str, Any]], list[str]]
    check: Callable[[dict[str, Any]], None] = lambda p: None
    plan: Callable[[dict[str, Any], str], dict[str, Any]] = lambda p, isa: {}
    # ISAs whose template only covers some parameter values (else fall back further down)
    variant_if: Callable[[str, dict[str, Any]], bool] = lambda isa, p: True
    # written once over the ISA vocabulary: kernels/<op>/vec.c.j2 renders it for every SIMD target
    vec: bool = False
    # ISAs whose instructions change the vec kernel's algorithm without a template of their own: it
    # renders with their plan (linear's vdpbf16ps on avx512-bf16), where variant_if takes them
    vec_variants: tuple[str, ...] = ()
    # why the SIMD targets render the scalar template (an op with neither vec nor a reason fails the
    # op x target matrix test)
    scalar_reason: str | None = None


#: ISAs with a vocabulary header, kernels/isa/<isa>.h.j2 (ife_kernels.h takes the best the compiler
#: flags allow): a target renders an op's vec.c.j2 as the nearest of these in its lineage.
VOCABULARIES = ("avx512", "avx2")


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise UnsupportedError(message)


def _check_wdtype(p: dict[str, Any]) -> None:
    _expect(p["wdtype"] in WEIGHT_CTYPES, f"weight dtype {p['wdtype']!r} has no kernels "
                                          f"(supported: {', '.join(WEIGHT_CTYPES)})")


def _positive(*names: str) -> Callable[[dict[str, Any]], None]:
    def check(p: dict[str, Any]) -> None:
        for name in names:
            _expect(isinstance(p[name], int) and p[name] > 0, f"kernel parameter {name} must be a positive int, got {p[name]!r}")
    return check


def _all(*checks: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def check(p: dict[str, Any]) -> None:
        for c in checks:
            c(p)
    return check


#: f32 lanes per vector register of each ISA template.
_LANES = {"scalar": 1, "avx2": 8, "avx512": 16, "avx512-bf16": 16}
_L1_BYTES = 32 * 1024
_L2_BYTES = 1024 * 1024


@dataclass(frozen=True)
class _LinearTiles:
    """Register tiles of the linear kernel for one ISA template (measured on Zen 4, see docs)."""

    dot_rows: int         # batched-decode tile: weight rows (4: a tile's sums leave as one 4-vector) x ...
    dot_tokens: int       # ... up to this many token rows, one accumulator per output
    mr: int               # packed micro-kernel token rows (accumulators: mr x 2 vectors)


_LINEAR_TILES = {"avx2": _LinearTiles(dot_rows=4, dot_tokens=2, mr=6),           # 16 ymm: 8 acc + 4 w + x
                 "avx512": _LinearTiles(dot_rows=4, dot_tokens=6, mr=8),         # 32 zmm: 24 acc + 4 w + x
                 "avx512-bf16": _LinearTiles(dot_rows=4, dot_tokens=6, mr=8)}
#: Token rows from which the packed GEMM beats the dot tiles. Measured (1 thread, f16, K x N =
#: 576x1536 and 1536x576): dot tiles 105-113 GFLOP/s from T=8 to T=128; the GEMM, which packs W
#: on every call, 45-63 at T=16, 65-82 at 32, 82-95 at 64, 94-105 at 128. At 2048x8192 the GEMM
#: draws level at T=64 (f32) to 128 (f16).
_GEMM_MIN_T = 64
#: Batched decode prefetches the next dot tile's weights into L1 while the token rows and two tiles
#: of weights take at most this much (three quarters of L1), else into L2 (measured: T=8 at K=576
#: or T=4 at K=1536 ran 1.5-2x faster prefetching into L2, T<=4 at K=576 1.2-1.6x slower).
_DOT_PF_L1_BYTES = 3 * _L1_BYTES // 4
#: Accumulators per output along K at T=1: enough independent FMA chains to cover the FMA latency.
#: The dot tiles (T >= 2) keep one per output, so with f32/f16/bf16 weights a row's last bits can
#: differ between T = 1 and T >= 2: summing T = 1 their way (one or two rows per FMA chain) ran
#: 1.1-1.7x slower per call (576x1536 and 2048x8192 f16 from DRAM, interleaved A/B, 1 thread).
_GEMV_UNROLL = 4
#: ... but where x's row takes at least half of L1 (f32 x from K = 4096), T = 1 reads this many
#: weight rows at once, one accumulator each (k order, as the dot tiles): one row at a time x no
#: longer stays in L1 against the streamed weights, and its reloads from L2 take the L1 miss slots
#: the weight stream needs. f16 8192x2048 from DRAM (bench/gemv_variants.py, Zen 4): 1 thread
#: 10.2 -> 23.9 GB/s (AVX-512), 8.8 -> 21.1 (AVX2); 2 threads 20.3 -> 31.8 and 15.6 -> 33.0. At
#: K = 2048 one row at a time stays ahead (24 GB/s against 20 for 8 rows, 1 thread).
_GEMV_ROWS = 8
_GEMV_ROWS_MIN_X_BYTES = _L1_BYTES // 2
#: Largest k depth of a packed block: an MR x KC tile of x stays in L1 (8 x 512 x 4 B = 16 KiB).
_GEMM_MAX_KC = 512
#: Work items per matrix the packed path aims for, so that threads get balanced ranges.
_GEMM_MIN_ITEMS = 8
#: Token rows from which the amx linear (bf16 and f16 weights) multiplies on the tile unit; below it
#: the avx512-bf16 (bf16) or avx512 (f16) paths run. Not measured: this project's hosts have no AMX,
#: so it is to be measured per kernel on one, as GEMM_MIN_T was. 16 is one whole A tile of token
#: rows: below it every tile product is partly empty, and W is re-laid into tiles on every call, which
#: must be amortised over the rows (counting 512 bf16 multiply-adds a cycle for TDPBF16PS, 64 for
#: vdpbf16ps and about a tenth of a cycle per weight to re-lay, the tiles draw level at about 8 rows
#: compute-bound; the avx512 packed GEMM, which also packs per call, needed 64 against the dot tiles).
#: Tests lower it so that short prompts take the tile path.
AMX_MIN_T = 16
#: Linear templates that take only some weight dtypes (the others fall back along the target's base):
#: vdpbf16ps and the AMX-BF16 tiles multiply bf16, and f16 as two bf16 (amx.c.j2); f32 weights stay on
#: the f32 FMAs, which the tiles could match only with three bf16 parts per weight and per activation.
_LINEAR_WDTYPES = {"avx512-bf16": ("bf16",), "amx": ("bf16", "f16")}
#: The amx micro-kernel: 2 x 2 C tiles of 16 x 16 f32, so MR token rows x NR output columns.
_AMX_TILE = 16                # token rows of an A/C tile = columns of a B/C tile = bf16 pairs per row
_AMX_MR = 2 * _AMX_TILE
_AMX_NR = 2 * _AMX_TILE
#: Bf16 pairs in a row of a packed k block, over all planes of x: the MR rows of x take 32 KiB (L1).
_AMX_MAX_KC_PAIRS = 256


def _plan_linear(p: dict[str, Any], isa: str) -> dict[str, Any]:
    """Tiling of the linear kernel for one template ISA (see docs/codegen.md)."""
    if isa == "amx":
        return _plan_linear_amx(p)
    K, N, wbytes = p["K"], p["N"], _WEIGHT_BYTES[p["wdtype"]]
    # a work item's weight rows stay in half of L1 while every token tile passes over them
    rows_in_l1 = max(1, _L1_BYTES // 2 // (K * wbytes))
    if isa == "scalar":
        return {"rows_per_item": rows_in_l1}
    lanes, tiles = _LANES[isa], _LINEAR_TILES[isa]
    k_chunk = 2 * lanes if isa == "avx512-bf16" else lanes        # elements per vector of weights
    nr = 2 * lanes                                                 # panel = two vectors of outputs
    kc = min(_round_up(K, 2), _GEMM_MAX_KC)                        # even: bf16 pairs
    # a packed block of NC x KC f32 takes at most a quarter of L2
    nc_in_l2 = max(nr, _L2_BYTES // 4 // (kc * 4) // nr * nr)
    nc = min(nc_in_l2, _round_up(-(-N // _GEMM_MIN_ITEMS), nr))
    x_row_bytes = _round_up(K, k_chunk) * 2 if isa == "avx512-bf16" else K * 4   # x as the T = 1 path reads it
    return {
        "gemv_unroll": _GEMV_UNROLL, "gemv_rows": _GEMV_ROWS if x_row_bytes >= _GEMV_ROWS_MIN_X_BYTES else 1,
        "dot_rows": tiles.dot_rows, "dot_tokens": tiles.dot_tokens,
        "gemv_block": _round_up(rows_in_l1, tiles.dot_rows), "pf_l1_bytes": _DOT_PF_L1_BYTES,
        "k_tail": K % k_chunk, "bf16_dot": isa == "avx512-bf16",
        "gemm_min_t": _GEMM_MIN_T, "mr": tiles.mr, "nr": nr, "kc": kc, "nc": nc, "amx": False,
    }


def _plan_linear_amx(p: dict[str, Any]) -> dict[str, Any]:
    """The amx linear: its fallback template's plan below AMX_MIN_T token rows (avx512-bf16 for bf16
    weights, avx512 for f16), and the packed path's blocking for the tile micro-kernel from there."""
    fallback = "avx512-bf16" if p["wdtype"] == "bf16" else "avx512"
    pair_k = 2 if p["wdtype"] == "bf16" else 1         # k per bf16 pair: two bf16 weights, or f16 as (hi, lo)
    x_parts = 1 if p["wdtype"] == "bf16" else 2        # x rounded to bf16, or kept as bf16 hi + lo (f16)
    kc = min(_round_up(p["K"], pair_k * _AMX_TILE), pair_k * _AMX_MAX_KC_PAIRS // x_parts)   # whole tiles
    pair_row_bytes = kc // pair_k * 4
    nc_in_l2 = max(_AMX_NR, _L2_BYTES // 4 // pair_row_bytes // _AMX_NR * _AMX_NR)
    nc = min(nc_in_l2, _round_up(-(-p["N"] // _GEMM_MIN_ITEMS), _AMX_NR))
    return {**_plan_linear(p, fallback), "amx": True, "fallback_isa": fallback, "pair_k": pair_k,
            "x_parts": x_parts, "gemm_min_t": AMX_MIN_T, "mr": _AMX_MR, "nr": _AMX_NR, "kc": kc, "nc": nc}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


#: f32 lanes of a vector of the ISA vocabulary (kernels/isa/*.h.j2: IFE_VL on every vocabulary).
VOCABULARY_LANES = 16


def _plan_row_tail(size: str) -> Callable[[dict[str, Any], str], dict[str, Any]]:
    """Elements of a row of ``size`` left after whole vocabulary vectors (none on scalar)."""
    return lambda p, isa: {"tail": p[size] % (1 if isa == "scalar" else VOCABULARY_LANES)}


def _check_attention(p: dict[str, Any]) -> None:
    _positive("n_heads", "n_kv_heads", "head_dim", "block_size")(p)
    _expect(p["n_heads"] % p["n_kv_heads"] == 0,
            f"attention: {p['n_heads']} query heads are not a multiple of {p['n_kv_heads']} KV heads")
    _expect(isinstance(p["window"], int) and p["window"] >= 0, f"attention window must be an int >= 0, got {p['window']!r}")
    _expect(math.isfinite(p["scale"]) and p["scale"] > 0, f"attention scale must be positive, got {p['scale']}")


#: Query rows of one sequence from which the amx attention takes the tiles (a run of them: a prefill
#: chunk). Above the longest verification step (1 + 32 drafted tokens, runtime/spec/config.py): the
#: tile path sums other terms in another order (bf16 parts, per chunk), and a verification row must
#: get the bits the one-row decode gets (greedy speculation is exact on native builds,
#: tests/test_speculative.py), so verify and decode rows stay on the AVX-512 path. From 64 rows a
#: run fills 4 tiles, over which the costs that do not scale with the rows (K/V re-laid per tile and
#: chunk, S and P through memory) are shared. Not measured: the development hosts have no AMX;
#: measure the crossover on an AMX host.
AMX_ATTENTION_MIN_T = 64
#: Keys per chunk of the amx attention: K and V re-laid as bf16 tiles once per chunk (for all GROUP
#: heads), one online-softmax update per chunk; 2 tiles of P, 4 of S.
_AMX_ATTENTION_KEYS = 64
#: bf16 parts per value on the amx attention's tiles. 2: x = hi + lo (hi the nearest bf16, lo the bf16
#: nearest to x - hi) and each product as hi·hi + hi·lo + lo·hi (3 tile products, 2^-16 relative):
#: the f32 models' tests hold the compiled model to 1e-4 of the interpreter's logits, which one bf16
#: part (2^-9 per rounding of Q, K, P, V: 8e-3 on stories260K's prefill) misses by far, and a native
#: build takes the amx target wherever the CPU has AMX. 1: one part (rounded), a third of the products.
AMX_ATTENTION_PARTS = 2


def _plan_attention(p: dict[str, Any], isa: str) -> dict[str, Any]:
    """The amx template's run threshold, key chunk and bf16 parts (the other templates take none)."""
    if isa != "amx":
        return {}
    # (A part, B part) per tile product; neighbours share a part, so it stays in its tile
    products = [(0, 1), (0, 0), (1, 0)] if AMX_ATTENTION_PARTS == 2 else [(0, 0)]
    return {"amx_min_t": AMX_ATTENTION_MIN_T, "amx_keys": _AMX_ATTENTION_KEYS, "amx_parts": AMX_ATTENTION_PARTS,
            "amx_products": products}


def _check_attention_kvq(p: dict[str, Any]) -> None:
    from infeng_common.errors import InfengError

    from ..quant.kv import check_format, is_power_of_two

    _check_attention(p)
    hd = p["head_dim"]
    for side in ("k_format", "v_format"):
        try:
            check_format(p[side], hd, p["group"] or None, f"attention_kvq {side}")
        except InfengError as e:      # quant.kv speaks InfengError; kernels raise UnsupportedError
            raise UnsupportedError(str(e)) from None
    _expect(not p["rotate"] or is_power_of_two(hd), f"attention_kvq: rotation needs a power-of-two head_dim, got {hd}")
    _expect(isinstance(p["kv_window"], int) and p["kv_window"] >= 0, "attention_kvq: kv_window must be an int >= 0")
    if p["kv_window"]:
        _expect(p["ring_rows"] > p["kv_window"] and p["ring_rows"] % KVQ_RING_ALIGN == 0,
                f"attention_kvq: ring_rows must exceed kv_window and be a multiple of {KVQ_RING_ALIGN}")


#: Keys per score vector of the attention_kvq AVX-512 template, keys per chunk (a row's keys are cut at
#: its multiples when they are split across threads), and the groups of rows per thread below which
#: they are split.
_KVQ_TILE = 16                 # also quant.kv.P_GROUP: a tile is one probability group
#: Columns of an f16 ring are a multiple of this: the AVX-512 template reads a tile of keys as
#: contiguous ring columns, and every tile it uses (16 keys, or a whole block of 2, 4 or 8) divides it,
#: so no tile wraps around the ring whatever the block size.
KVQ_RING_ALIGN = _KVQ_TILE
_KVQ_CHUNK_KEYS = 64
_KVQ_SPLIT_BELOW = 4
#: Cache blocks read ahead by software prefetch, and the cache level they are brought to. The hardware
#: prefetcher does not follow a block's reads well: each KV head's tile of an int8 block reads codes,
#: then scales at the block's end (30 layers of smollm135 at 2048 keys, one thread, from DRAM: 3.7 ms
#: without, 1.4 ms with; L1 instead of L2: 2.7-2.9 ms; 1-8 blocks ahead within noise), and an f16
#: block of 8 KV heads reads V rows 1 KiB apart (llama1b, `bench/attention.py`: 7.6 -> 5.3 ms on one
#: thread, 5.8 -> 3.4 ms on two); smollm135's f16 blocks (3 heads) are within noise either way.
_KVQ_PREFETCH_BLOCKS = 2
_KVQ_PREFETCH_HINT = "_MM_HINT_T1"


def _plan_attention_kvq(p: dict[str, Any], isa: str) -> dict[str, Any]:
    """Block byte layout (quant/kv.py) and, for AVX-512, tiles of keys and the decode split."""
    from ..quant.kv import P_GROUP, QUANTIZED, V_QUAD, block_bytes, codes_bytes, fht_norm

    B, kvh, hd = p["block_size"], p["n_kv_heads"], p["head_dim"]
    group = p["group"] or hd
    tile = _KVQ_TILE if B % _KVQ_TILE == 0 else B
    return {"qgroup": group, "fht_norm": float(fht_norm(hd)),
            "int_pv": p["k_format"] in QUANTIZED and p["v_format"] == "int8", "p_group": P_GROUP,
            "k_codes_bytes": codes_bytes(p["k_format"], B, kvh, hd),
            "v_codes_bytes": codes_bytes(p["v_format"], B, kvh, hd, value=True), "v_quad": V_QUAD,
            "k_block_bytes": block_bytes(p["k_format"], B, kvh, hd, group),
            "v_block_bytes": block_bytes(p["v_format"], B, kvh, hd, group, value=True),
            "tile": tile, "chunk_tiles": max(1, _KVQ_CHUNK_KEYS // tile), "split_below": _KVQ_SPLIT_BELOW,
            "prefetch_blocks": _KVQ_PREFETCH_BLOCKS, "prefetch_hint": _KVQ_PREFETCH_HINT,
            "k_chains": _kvq_score_chains(p)}


#: Score accumulators in flight per KV head (query heads x chains per head): a vpdpwssd / FMA has
#: 4-5 cycles of latency and two issue per cycle, so one chain per query head (3 for smollm135) left
#: the score loop waiting on latency (perf: the loop's time sat on the accumulator moves). One layer of
#: smollm135 at 2048 keys, one decode token, cache-resident, Zen 4: f16 72 -> 65 us, int8 56 -> 54 us.
_KVQ_SCORE_CHAINS = 8


def _kvq_score_chains(p: dict[str, Any]) -> int:
    """Chains per query head: a power of two dividing both the dims and the dim pairs of a scale group."""
    per_kv = p["n_heads"] // p["n_kv_heads"]
    pairs = (p["group"] or p["head_dim"]) // 2 if p["k_format"] == "int4" else p["head_dim"] // 2
    chains = 1
    while chains * 2 * per_kv <= _KVQ_SCORE_CHAINS and pairs % (chains * 2) == 0 and p["head_dim"] % (chains * 2) == 0:
        chains *= 2
    return chains


def _attention_kvq_variant(isa: str, p: dict[str, Any]) -> bool:
    """The vector template covers blocks of a multiple of 16 keys (or 2, 4, 8; not for the integer
    P·V of int8 V against an int8/int4 K, whose probability groups of 16 positions are its tiles), and
    int4 V heads of <= 16 (power-of-two groups) or a multiple of 32 (groups a multiple of 16); other
    shapes use the scalar template."""
    from ..quant.kv import P_GROUP, QUANTIZED

    if isa == "scalar":
        return True
    B, hd, group = p["block_size"], p["head_dim"], p["group"] or p["head_dim"]
    int_pv = p["k_format"] in QUANTIZED and p["v_format"] == "int8"
    ok = B % P_GROUP == 0 if int_pv else (B % _KVQ_TILE == 0 or B in (2, 4, 8))
    if p["v_format"] == "int4":
        ok &= (hd <= _KVQ_TILE and group & (group - 1) == 0) or (hd % (2 * _KVQ_TILE) == 0 and group % _KVQ_TILE == 0)
    return ok


def _check_rope(p: dict[str, Any]) -> None:
    _positive("n_heads", "head_dim")(p)
    _expect(p["head_dim"] % 2 == 0, f"rope needs an even head_dim, got {p['head_dim']}")
    _expect(isinstance(p["inv_freq"], tuple) and len(p["inv_freq"]) == p["head_dim"] // 2,
            f"rope inv_freq must hold head_dim/2 = {p['head_dim'] // 2} values")


def _check_copy_cols(p: dict[str, Any]) -> None:
    _positive("IN", "WIDTH")(p)
    _expect(isinstance(p["OFFSET"], int) and 0 <= p["OFFSET"] and p["OFFSET"] + p["WIDTH"] <= p["IN"],
            f"copy_cols: columns [{p['OFFSET']}, {p['OFFSET']} + {p['WIDTH']}) are not inside {p['IN']}")


def _rope_digest(inv_freq: tuple[float, ...]) -> str:
    return hashlib.sha256(np.asarray(inv_freq, dtype=np.float32).tobytes()).hexdigest()[:8]


_F32 = "const float *"
OPS: dict[str, _OpKernel] = {
    "embedding": _OpKernel(
        ("V", "H", "wdtype"),
        "void {sym}(const int32_t *ids /* [T] */, int T, const {W} *table /* [V, H] */, float *out /* [T, H] */)",
        ("scalar",),
        lambda p: [p["wdtype"], f"v{p['V']}", f"h{p['H']}"],
        _all(_positive("V", "H"), _check_wdtype), vec=True),
    "rms_norm": _OpKernel(
        ("H", "eps"),
        "void {sym}(const float *x /* [T, H] */, int T, const float *w /* [H] */, float *out /* [T, H] */)",
        ("scalar",),
        lambda p: [f"h{p['H']}", f"eps{_sym_float(p['eps'])}"], _positive("H"), _plan_row_tail("H"), vec=True),
    "layer_norm": _OpKernel(
        ("H", "eps"),
        "void {sym}(const float *x /* [T, H] */, int T, const float *w /* [H] */, const float *b /* [H] */, "
        "float *out /* [T, H] */)",
        ("scalar",),
        lambda p: [f"h{p['H']}", f"eps{_sym_float(p['eps'])}"], _positive("H"), vec=True),
    "linear": _OpKernel(
        ("K", "N", "wdtype"),
        "void {sym}(ife_pool *pool, const float *x /* [T, K] */, int T, const {W} *w /* [N, K] */, "
        "const float *bias /* [N] or NULL */, float *y /* [T, N] */)",
        ("scalar", "amx"),
        lambda p: [p["wdtype"], f"k{p['K']}", f"n{p['N']}"],
        _all(_positive("K", "N"), _check_wdtype), _plan_linear,
        variant_if=lambda isa, p: p["wdtype"] in _LINEAR_WDTYPES.get(isa, WEIGHT_CTYPES), vec=True,
        vec_variants=("avx512-bf16",)),
    "rope": _OpKernel(
        ("n_heads", "head_dim", "inv_freq"),
        "void {sym}(float *x /* [T, n_heads * head_dim], in place */, int T, const int32_t *pos /* [T] */)",
        ("scalar",),
        lambda p: [f"h{p['n_heads']}", f"d{p['head_dim']}", f"f{_rope_digest(p['inv_freq'])}"], _check_rope, vec=True),
    "attention": _OpKernel(
        ("n_heads", "n_kv_heads", "head_dim", "block_size", "scale", "window"),
        "void {sym}(ife_pool *pool, const float *q /* [T, n_heads * head_dim] */, "
        "const float *k /* [T, n_kv_heads * head_dim] */, const float *v /* [T, n_kv_heads * head_dim] */, "
        "int T, const int32_t *pos /* [T] */, const int32_t *seq /* [T] */, "
        "const int32_t *block_table /* [n_slots, max_blocks] */, int max_blocks, "
        "float *k_cache /* [n_blocks, block_size, n_kv_heads, head_dim] */, "
        "float *v_cache /* [n_blocks, block_size, n_kv_heads, head_dim] */, float *out /* [T, n_heads * head_dim] */)",
        ("scalar", "amx"),
        lambda p: [f"h{p['n_heads']}", f"kv{p['n_kv_heads']}", f"d{p['head_dim']}", f"b{p['block_size']}",
                   f"s{_sym_float(p['scale'])}", f"w{p['window']}"],
        _check_attention, _plan_attention, vec=True),
    "attention_kvq": _OpKernel(
        ("n_heads", "n_kv_heads", "head_dim", "block_size", "scale", "window", "k_format", "v_format", "group",
         "rotate", "kv_window", "ring_rows"),
        "void {sym}(ife_pool *pool, const float *q /* [T, n_heads * head_dim] */, "
        "const float *k /* [T, n_kv_heads * head_dim] */, const float *v /* [T, n_kv_heads * head_dim] */, "
        "const float *k_mean /* [n_kv_heads * head_dim] subtracted from every k row, or NULL */, "
        "int T, const int32_t *pos /* [T] */, const int32_t *seq /* [T] */, "
        "const int32_t *block_table /* [n_slots, max_blocks] */, int max_blocks, "
        "uint8_t *k_cache /* [n_blocks, K block bytes] */, uint8_t *v_cache /* [n_blocks, V block bytes] */, "
        "uint16_t *k_ring /* [n_slots, n_kv_heads, head_dim, ring_rows] f16, or NULL */, "
        "uint16_t *v_ring /* [n_slots, ring_rows, n_kv_heads * head_dim] f16, or NULL */, "
        "const int32_t *ring_lo /* [T] first position in the ring, or NULL */, float *out /* [T, n_heads * head_dim] */)",
        ("scalar",),
        lambda p: [f"h{p['n_heads']}", f"kv{p['n_kv_heads']}", f"d{p['head_dim']}", f"b{p['block_size']}",
                   f"s{_sym_float(p['scale'])}", f"w{p['window']}", f"k{p['k_format']}", f"v{p['v_format']}",
                   f"g{p['group']}", "fht" if p["rotate"] else "nofht", f"kw{p['kv_window']}", f"ring{p['ring_rows']}"],
        _check_attention_kvq, _plan_attention_kvq, variant_if=_attention_kvq_variant, vec=True),
    "silu_mul": _OpKernel(
        ("N",),
        "void {sym}(const float *gate /* [T, N] */, const float *up /* [T, N] */, int T, float *out /* [T, N] */)",
        ("scalar",),
        lambda p: [f"n{p['N']}"], _positive("N"), vec=True),
    "gelu": _OpKernel(
        ("N", "approximate"),
        "void {sym}(const float *x /* [T, N] */, int T, float *out /* [T, N] */)",
        ("scalar",),
        lambda p: [p["approximate"], f"n{p['N']}"],
        _all(_positive("N"), lambda p: _expect(p["approximate"] in ("tanh", "none"),
                                                f"gelu approximate must be 'tanh' or 'none', got {p['approximate']!r}")),
        vec=True),
    "add": _OpKernel(
        ("N",),
        "void {sym}(const float *a /* [T, N] */, const float *b /* [T, N] */, int T, float *out /* [T, N] */)",
        ("scalar",),
        lambda p: [f"n{p['N']}"], _positive("N"), vec=True),
    "copy_cols": _OpKernel(
        ("IN", "OFFSET", "WIDTH"),
        "void {sym}(const float *x /* [T, IN] */, int T, float *out /* [T, WIDTH] */)",
        ("scalar",),
        lambda p: [f"in{p['IN']}", f"o{p['OFFSET']}", f"w{p['WIDTH']}"], _check_copy_cols,
        scalar_reason="a memcpy per row: libc's copy is already vectorised"),
    "gather_rows": _OpKernel(
        ("H",),
        "void {sym}(const float *x /* [T, H] */, const int32_t *rows /* [R] */, int R, float *out /* [R, H] */)",
        ("scalar",),
        lambda p: [f"h{p['H']}"], _positive("H"), scalar_reason="a memcpy per row: libc's copy is already vectorised"),
    "lora_apply": _OpKernel(
        ("K", "N", "R", "slots"),
        "void {sym}(const float *x /* [T, K] */, int T, const int32_t *slots /* [T], -1 = none, or NULL */, "
        "const int32_t *rank /* [slots] */, const float *scale /* [slots] */, "
        "const float *a /* [slots, R, K] */, const float *bt /* [slots, R, N] */, float *y /* [T, N], += */)",
        ("scalar",),
        lambda p: [f"k{p['K']}", f"n{p['N']}", f"r{p['R']}", f"s{p['slots']}"], _positive("K", "N", "R", "slots"),
        vec=True),
}


def _op_kernel(op: str) -> _OpKernel:
    try:
        return OPS[op]
    except KeyError:
        raise UnsupportedError(f"no kernel template for op {op!r}; kernels exist for: {', '.join(OPS)}") from None


def template_isa(spec: KernelSpec) -> str:
    """The ISA whose template renders ``spec``: the nearest at or below ``spec.isa`` that has one of
    its own, or a vocabulary where the op is written over it (``template_name``)."""
    kernel = _op_kernel(spec.op)
    params = dict(spec.params)
    for isa in TARGETS[spec.isa].lineage():
        has_template = isa in kernel.variants or isa in kernel.vec_variants or (kernel.vec and isa in VOCABULARIES)
        if has_template and kernel.variant_if(isa, params):
            return isa
    raise AssertionError(f"{spec.op} has no scalar template")


def op_template(op: str, target: str) -> str:
    """Which template ``target`` renders ``op`` from, whatever its shapes: an ISA with a template of
    its own, ``vec`` (written over the vocabulary), or ``scalar`` (shapes an ISA template does not
    cover fall back further down: ``variant_if``)."""
    kernel = _op_kernel(op)
    for isa in TARGETS[target].lineage():
        if isa in kernel.variants and isa != "scalar":
            return isa
        if isa in kernel.vec_variants:
            return f"vec ({isa})"
        if kernel.vec and isa in VOCABULARIES:
            return f"vec ({isa})"
    return "scalar"


def simd_targets() -> list[str]:
    """Every target with vector instructions, emulated ones aside (the op x target matrix's columns)."""
    return [name for name, t in TARGETS.items() if name != "scalar" and not t.emulated]


def template_matrix() -> dict[str, dict[str, str]]:
    """op -> SIMD target -> the template it renders (``op_template``), for every op in OPS."""
    return {op: {target: op_template(op, target) for target in simd_targets()} for op in sorted(OPS)}


def template_matrix_markdown() -> str:
    """The op x target matrix as a markdown table (docs/codegen.md holds it), each scalar row's reason
    after it."""
    targets = simd_targets()
    lines = ["| op | " + " | ".join(targets) + " | why scalar |", "| --- |" + " --- |" * (len(targets) + 1)]
    for op, row in template_matrix().items():
        reason = OPS[op].scalar_reason if "scalar" in row.values() else None
        lines.append(f"| `{op}` | " + " | ".join(row[t] for t in targets) + f" | {reason or ''} |")
    return "\n".join(lines) + "\n"


def template_name(spec: KernelSpec) -> str:
    """The template that renders ``spec``: ``kernels/<op>/<isa>.c.j2``, or ``kernels/<op>/vec.c.j2``."""
    isa = template_isa(spec)
    own = isa in _op_kernel(spec.op).variants
    return f"kernels/{spec.op}/{isa if own else 'vec'}.c.j2"


# ---------------------------------------------------------------------------------------------
# rendering
@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    root = files("infeng_templates")

    def load(name: str) -> str | None:
        path = root.joinpath(*name.split("/"))
        return path.read_text(encoding="utf-8") if path.is_file() else None

    env = jinja2.Environment(loader=jinja2.FunctionLoader(load), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["cf"] = c_float
    env.globals["member"] = enum_member
    return env


#: Column of the comment after an enum member in generated C.
_COMMENT_COLUMN = 36


def enum_member(name: str, value: Any, comment: str | None = None) -> str:
    """``NAME = value,`` with its comment aligned, for the shape enums of generated C."""
    text = f"{name} = {value},"
    return f"{text:<{_COMMENT_COLUMN}}/* {comment} */" if comment else text


def render_template(name: str, **context: Any) -> str:
    """Render ``templates/<name>`` with StrictUndefined."""
    return _environment().get_template(name).render(**context)


def render_kernel(spec: KernelSpec) -> str:
    """The C translation unit defining ``spec.symbol``."""
    kernel = _op_kernel(spec.op)
    params = dict(spec.params)
    isa = template_isa(spec)
    context = dict(params, sym=spec.symbol, isa=isa, target_isa=spec.isa, prototype=kernel_prototype(spec),
                   W=WEIGHT_CTYPES.get(params.get("wdtype", "f32")), **kernel.plan(params, isa))
    name = template_name(spec)
    body = render_template(name, **context)
    return f"/* {spec.symbol}: {spec.op} for target {spec.isa}, rendered from {name} ({isa}) */\n" + body


def kernel_prototype(spec: KernelSpec) -> str:
    """The C declaration of ``spec.symbol`` (no trailing semicolon)."""
    params = dict(spec.params)
    return _op_kernel(spec.op).prototype.format(sym=spec.symbol, W=WEIGHT_CTYPES.get(params.get("wdtype", "f32")))


def render_common() -> str:
    """``ife_kernels.h``: pool API, conversions and ISA helpers, guarded by the compiler's ISA macros."""
    return render_template("kernels/common.h.j2")


#: Thread pool polling (templates/support.c.j2): the longest a worker polls for the next job before
#: blocking, the budget after a job where a worker came late (descheduled), how often a polling
#: worker yields its core, how long the caller polls for the chunks workers are running before
#: blocking, and how often a poller reads the clock.
POOL_SPIN_NS = 200_000
POOL_SPIN_MIN_NS = 5_000
POOL_YIELD_NS = 20_000
POOL_DONE_SPIN_NS = 20_000
POOL_SPIN_CHECK_EVERY = 64
#: Chunks per thread's range in ife_parallel_for: what an idle thread can steal.
POOL_CHUNKS_PER_THREAD = 8
#: Processor ids ``ife_default_threads`` can tell apart.
POOL_MAX_CPUS = 4096


def render_support(target: Target) -> str:
    """``ife_support.c``: thread pool, scratch buffers and the CPU check for ``target``."""
    return render_template("support.c.j2", target=target, features_env=FEATURES_ENV, spin_ns=POOL_SPIN_NS,
                           spin_min_ns=POOL_SPIN_MIN_NS, yield_ns=POOL_YIELD_NS, done_spin_ns=POOL_DONE_SPIN_NS,
                           spin_check_every=POOL_SPIN_CHECK_EVERY, chunks_per_thread=POOL_CHUNKS_PER_THREAD,
                           max_cpus=POOL_MAX_CPUS)


def library_sources(specs: list[KernelSpec], target: Target) -> tuple[dict[str, str], set[str]]:
    """All sources of a kernel library for ``target`` and the names to compile without ISA flags.

    One file per unique kernel (``<symbol>.c``) plus ``ife_kernels.h`` and ``ife_support.c``;
    pass both results to ``build.build_library``.
    """
    sources = {COMMON_HEADER: render_common(), SUPPORT_SOURCE: render_support(target)}
    for spec in dict.fromkeys(specs):
        if spec.isa != target.name:
            raise UnsupportedError(f"kernel {spec.symbol} is for ISA {spec.isa}, the library for {target.name}")
        sources[f"{spec.symbol}.c"] = render_kernel(spec)
    return sources, {SUPPORT_SOURCE}


def cdef(specs: list[KernelSpec]) -> str:
    """Declarations for ``cffi.FFI.cdef``: the pool API and every kernel of ``specs``."""
    lines = [
        "typedef struct ife_pool ife_pool;",
        "ife_pool *ife_pool_create(int n_threads);",
        "void ife_pool_destroy(ife_pool *pool);",
        "int ife_pool_threads(const ife_pool *pool);",
        "int ife_default_threads(void);",
        "int ife_cpu_check(char *missing, int len);",
        "const char *ife_target_name(void);",
    ]
    lines += [kernel_prototype(s) + ";" for s in dict.fromkeys(specs)]
    return "\n".join(lines) + "\n"
