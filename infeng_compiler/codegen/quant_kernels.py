"""Kernels of the quantized path, registered in the kernel table (``kernels.OPS``) on import.

| op | what | templates |
| --- | --- | --- |
| ``quantize_act`` | f32 rows -> int8 blocks of 32 (scales, sums) or int16 rows (one scale) | scalar, vec (every SIMD target) |
| ``dequantize_act`` | those rows -> the f32 values they stand for (LoRA deltas read them) | scalar |
| ``linear_q4`` | int4 weights (q4gG, q4gGa) x int8 activations (``vpdpbusd``, ``tdpbsud``) | scalar, vec, amx |
| ``linear_q8`` | int8 weights (q8r, q8gG) x int16 activations (``vpdpwssd``, ``tdpbssd``) | scalar, vec, amx |
| ``linear_qf32`` | int4 and int8 weights x f32 activations (weight codes widened in registers, FMA) | scalar, vec |
| ``linear_f8`` | fp8 e4m3 weights x f32 activations (widened through f16 in registers) | scalar, vec |
| ``embedding_q`` | rows of a quantized table, dequantized | scalar |
| ``linear_mxfp4`` | MXFP4 weights (GPT-OSS's bytes) x f32 or int8 activations (``act``), e2m1 by ``vpshufb`` | scalar, vec |

``vec``: written once over the ISA vocabulary (``templates/kernels/isa/*.h.j2``), whose integer dot
steps are VNNI where the target has it (``avx512-vnni`` and above; AVX-VNNI on ``avx2-vnni``) and
the multiply-add pairs otherwise. The amx templates run the vec code (AVX-512 vocabulary) below
``AMX_MIN_T_*`` token rows and AMX tiles from there on (docs/codegen.md). Weight and
activation byte layouts: ``quant/formats.py`` and ``quant/act.py`` (docs/quantization.md).
"""
from __future__ import annotations

from typing import Any

from ..quant.act import ACT_FORMS, act_row_layout
from ..quant.formats import ROWS_PER_BLOCK, get_format, is_quantized
from .kernels import OPS, KernelSpec, _all, _expect, _OpKernel, _positive

#: Micro-tiles of the integer linear kernels, by vocabulary: (TT token rows, RB blocks of 16 weight
#: rows per work item and per single-token tile, RB_MULTI blocks per tile of several token rows).
#: The accumulators, the unpacked weights and the broadcasts fit the 32 AVX-512 registers; on AVX2
#: each 16-lane vector takes two of the 16 ymm registers, and 4 token rows of one block still ran
#: fastest (some float accumulators spill, read once per 32 k): linear_q4 q4g32 576x1536 on Zen 4
#: running avx2, 1 thread, TT = 2 / 3 / 4: 119 / 104 / 93 M instructions at T = 512 (callgrind), 765 /
#: 682 / 646 us at T = 64; q8r 1092 / 937 / 882 us (`bench/kernels.py --tile-rows`, docs/performance.md).
_TILES = {"scalar": (1, 1, 1), "avx2": (4, 1, 1), "avx512": (4, 4, 2), "amx": (4, 4, 2)}
#: Software prefetch distance along a block of weight codes (0: none), bytes.
PREFETCH_BYTES = 0
#: Software prefetch distance of the int4 decode path (AVX-512), bytes: measured best of 256-2048
#: on the dev machine (Zen 4), `python bench/kernels.py --wdtypes q4g32 --tokens 1`.
GEMV_PREFETCH_BYTES = 512
#: The same for the int8 streamed path (linear_q8): 512 / 1024 / 2048 / 4096 bytes took 1234 / 837 /
#: 850 / 768 us for q8g32 576x49152 at T = 1 (2 threads, Zen 5, same run, loaded machine); q8r
#: within noise of one another.
GEMV_PREFETCH_BYTES_INT8 = 2048
#: The int8 streamed path's distance for one token row (decode), by vocabulary. AVX2 (Zen 4 running
#: the avx2 target, q8r 2048x2048 and 8192x2048 from DRAM, T = 1, two rounds): one thread streamed
#: 28-31 GB/s at 512 bytes, 21-25 at 1024 and 2048, 23-27 at 4096; two threads 31-35 at every
#: distance (two later holds: 512 and 2048 level). Several token rows consume a block more slowly
#: and keep GEMV_PREFETCH_BYTES_INT8: at 512 bytes T = 4 ran 0.74-0.83x as fast, at 2048 as main
#: (`bench/kernels.py --gemv-prefetch`, docs/performance.md).
GEMV_PREFETCH_BYTES_INT8_ONE_ROW = {"scalar": 2048, "avx2": 512, "avx512": 2048, "amx": 2048}
#: Token rows up to which the int4/int8 AVX-512 kernels stream each weight block once with that prefetch
#: (stream_block, in passes of at most 8 rows and of even size) instead of running micro-tiles. The
#: micro-tiles read without the prefetch, so a 9-row step cost 2-2.5x an 8-row one; streamed, 9-16
#: rows (drafted tokens in a verification, a batch of speculating sequences) took 0.58-0.75x the
#: micro-tiles' time for q8r and 0.70-0.93x for int4 on smollm135's shapes, 0.85-1.02x on 2048x8192
#: (Zen 5, 2 threads, `python bench/kernels.py --wdtypes q4g32,q4g32m,q8r --tokens 8,9,12,16
#: --threads 2 --rounds 5`). From 16 rows the AMX int4 kernel takes its tiles (AMX_MIN_T_Q4).
STREAM_T = 16
#: Token rows per pass over a streamed block: their sums stay in registers (two ymm per vector on AVX2).
STREAM_TILE = {"scalar": 1, "avx2": 4, "avx512": 8, "amx": 8}
#: Independent partial sums per output along K in the fp8 kernels, the same for every number of
#: token rows in a tile, so that a row's result does not depend on how many rows the step has.
F8_PHASES = 2
#: Token rows from which the AMX linears (amx.c.j2) take the tiles; fewer rows run their AVX-512
#: VNNI code. Not measured: this project's development hosts have no AMX, so these are the usual
#: switch points (llama.cpp's and oneDNN's AMX GEMMs take tiles from 16-32 rows) argued from the
#: kernels' shape. int4: a tile holds 16 token rows and costs as much with fewer; below 16 rows the
#: widening of each block (once per block per step) and one tile store plus epilogue per 32 k
#: gain little over vpdpbusd, whose registers then hold every row. int8: each k is multiplied
#: twice (the int16 activations' high and low bytes) and the activations are split into bytes
#: first, so the tiles pay from two tiles of rows on. To be measured on an AMX host
#: (`bench/kernels.py`, T from 1 to 64) before they are trusted.
AMX_MIN_T_Q4 = 16
AMX_MIN_T_Q8 = 32
_INT4 = ("q4g32", "q4g64", "q4g128", "q4g32a", "q4g64a", "q4g128a", "q4g32m", "q4g64m", "q4g128m")
_INT8 = ("q8r", "q8g32", "q8g64", "q8g128")


def _check_format(allowed: tuple[str, ...]):
    def check(p: dict[str, Any]) -> None:
        _expect(p["wformat"] in allowed, f"kernel for weight formats {', '.join(allowed)}, got {p['wformat']!r}")
    return check


def _weight_plan(p: dict[str, Any], isa: str) -> dict[str, Any]:
    fmt = get_format(p["wformat"])
    K, N = p["K"], p["N"]
    kp, ng = fmt.padded_k(K), fmt.groups(K)
    codes = ROWS_PER_BLOCK * kp * fmt.bits // 8
    tt, rb, rb_multi = _TILES[isa]
    if isa in ("avx512", "amx") and fmt.kind == "int" and fmt.bits == 8:
        rb, rb_multi = 1, 1          # measured: int8 streams fastest one block at a time (27 vs 17 GB/s)
    n_blocks = -(-N // ROWS_PER_BLOCK)
    rb = _item_blocks(n_blocks, rb)
    rb_multi = min(rb_multi, rb)
    plan = {"kp": kp, "group": fmt.group, "ng": ng, "asym": fmt.asym, "mins": fmt.mins, "zero_bytes": fmt.zero_bytes,
            "zero": fmt.zero if fmt.kind == "int" else 0,
            "block_bytes": fmt.block_bytes(K), "codes_bytes": codes, "scales_offset": codes,
            "zeros_offset": codes + ROWS_PER_BLOCK * ng * fmt.scale_dtype.itemsize,
            "n_blocks": -(-N // ROWS_PER_BLOCK), "tt": tt, "rb": rb, "rb_multi": rb_multi, "prefetch": PREFETCH_BYTES,
            "gemv_prefetch": GEMV_PREFETCH_BYTES_INT8 if fmt.kind == "int" and fmt.bits == 8 else GEMV_PREFETCH_BYTES,
            "gemv_prefetch_one_row": GEMV_PREFETCH_BYTES_INT8_ONE_ROW[isa] if fmt.kind == "int" and fmt.bits == 8
            else GEMV_PREFETCH_BYTES,
            "stream_t": STREAM_T, "stream_tile": STREAM_TILE[isa], "f8_phases": F8_PHASES, "seg_groups": fmt.segment_groups, "seg_bytes": fmt.segment_bytes(fmt.segment_groups),
            "group_code_bytes": fmt.group_code_bytes}
    if fmt.kind == "int":
        bits = 8 if fmt.bits == 4 else 16
        lay = act_row_layout(K, bits)
        plan.update(act_bits=bits, act_kp=lay["kp"], act_row_bytes=lay["row_bytes"], act_d_offset=lay["d_offset"],
                    act_sum_offset=lay["sum_offset"],
                    # int8 x int16 products summed in int32: at most 256 k per partial sum
                    chunk=fmt.group or 256, amx_min_t=AMX_MIN_T_Q4 if fmt.bits == 4 else AMX_MIN_T_Q8)
        if fmt.bits == 8:
            # AMX: k per tile product (a tile row holds 64 bytes; a product never spans two chunks)
            # and K padded with zeros to whole products
            amx_k = min(plan["chunk"], 64)
            plan.update(amx_k=amx_k, amx_kp=-(-kp // amx_k) * amx_k)
    return plan


#: Micro-tiles of the fp8 linear over the vocabulary (TT, RB, RB_MULTI), by vocabulary. AVX2: 4 token
#: rows x PHASES partial sums take all 16 ymm (some spill) and still ran T = 4 and 512 faster than 2 or 3.
_F8_TILES = {"scalar": (1, 1, 1), "avx2": (4, 1, 1), "avx512": (4, 4, 2)}


def _f8_plan(p: dict[str, Any], isa: str) -> dict[str, Any]:
    plan = _weight_plan(p, isa)
    tt, rb, rb_multi = _F8_TILES[isa]
    rb = _item_blocks(plan["n_blocks"], rb)
    return {**plan, "tt": tt, "rb": rb, "rb_multi": min(rb_multi, rb)}


def _item_blocks(n_blocks: int, most: int) -> int:
    """Blocks per work item: the most (up to ``most``) that still give at least 8 items, an even
    number when possible, so that 2 threads get equal shares of a small matrix (k/v projections)."""
    options = [r for r in (4, 2, 1) if r <= most]
    for r in options:
        items = -(-n_blocks // r)
        if items >= 8 and items % 2 == 0:
            return r
    for r in options:
        if -(-n_blocks // r) >= 8:
            return r
    return 1


#: Independent partial sums per output of the f32-activation kernels (linear_qf32), the same for every
#: number of token rows, so that a row's result does not depend on the step's rows: 4 keep the FMA
#: dependency chains of a decode step (one token row) short; token rows go in tiles of QF32_TT. By
#: vocabulary: AVX2's 16 ymm registers hold TT x CHAINS partial sums of two ymm each and TT sums.
QF32_CHAINS = {"scalar": 1, "avx2": 2, "avx512": 4}
QF32_TT = {"scalar": 1, "avx2": 2, "avx512": 4}


def _qf32_plan(p: dict[str, Any], isa: str) -> dict[str, Any]:
    plan = _weight_plan(p, isa)
    fmt = get_format(p["wformat"])
    # int8 per-row formats: one "group" of the whole padded row, scaled once at the end
    return {**plan, "bits": fmt.bits, "chains": QF32_CHAINS[isa], "tt": QF32_TT[isa],
            "span": fmt.group or plan["kp"]}


def _quantize_act_plan(p: dict[str, Any], isa: str) -> dict[str, Any]:
    lay = act_row_layout(p["K"], p["bits"])
    return {"kp": lay["kp"], "blocks": lay["blocks"], "row_bytes": lay["row_bytes"], "d_offset": lay["d_offset"],
            "sum_offset": lay["sum_offset"], "qmax": (1 << (p["bits"] - 1)) - 1}


def _check_act(p: dict[str, Any]) -> None:
    _positive("K")(p)
    _expect(p["bits"] in ACT_FORMS and p["block"] == ACT_FORMS[p["bits"]],
            f"quantize_act: (bits, block) must be one of {sorted(ACT_FORMS.items())}, got ({p['bits']}, {p['block']})")


_LINEAR_PROTO = ("void {sym}(ife_pool *pool, const void *x /* [T, %s] */, int T, "
                 "const uint8_t *w /* packed [N/16 blocks] */, const float *bias /* [N] or NULL */, float *y /* [T, N] */)")

OPS.update({
    "quantize_act": _OpKernel(
        ("K", "bits", "block"),
        "void {sym}(const float *x /* [T, K] */, int T, uint8_t *out /* [T, row bytes] */)",
        ("scalar",),
        lambda p: [f"k{p['K']}", f"b{p['bits']}"], _check_act, _quantize_act_plan, vec=True),
    "dequantize_act": _OpKernel(
        ("K", "bits", "block"),
        "void {sym}(const uint8_t *x /* [T, row bytes] */, int T, float *out /* [T, K] */)",
        ("scalar",),
        lambda p: [f"k{p['K']}", f"b{p['bits']}"], _check_act, _quantize_act_plan,
        scalar_reason="a convert-and-scale loop per value, which -O3 vectorises under the target's flags "
                      "(only the LoRA input over a quantized base)"),
    "linear_q4": _OpKernel(
        ("K", "N", "wformat"), _LINEAR_PROTO % "int8 activation rows", ("scalar", "amx"),
        lambda p: [p["wformat"], f"k{p['K']}", f"n{p['N']}"],
        _all(_positive("K", "N"), _check_format(_INT4)), _weight_plan, vec=True),
    "linear_q8": _OpKernel(
        ("K", "N", "wformat"), _LINEAR_PROTO % "int16 activation rows", ("scalar", "amx"),
        lambda p: [p["wformat"], f"k{p['K']}", f"n{p['N']}"],
        _all(_positive("K", "N"), _check_format(_INT8)), _weight_plan, vec=True),
    "linear_qf32": _OpKernel(
        ("K", "N", "wformat"), _LINEAR_PROTO % "K f32",
        ("scalar",),
        lambda p: [p["wformat"], f"k{p['K']}", f"n{p['N']}"],
        _all(_positive("K", "N"), _check_format(_INT4 + _INT8)), _qf32_plan, vec=True),
    "linear_f8": _OpKernel(
        ("K", "N", "wformat"), (_LINEAR_PROTO % "K").replace("const void *x", "const float *x"),
        ("scalar",),
        lambda p: [p["wformat"], f"k{p['K']}", f"n{p['N']}"],
        _all(_positive("K", "N"), _check_format(("f8e4m3",))), _f8_plan, vec=True),
    "embedding_q": _OpKernel(
        ("V", "H", "wformat"),
        "void {sym}(const int32_t *ids /* [T] */, int T, const uint8_t *table /* packed [V/16 blocks] */, "
        "float *out /* [T, H] */)",
        ("scalar",),
        lambda p: [p["wformat"], f"v{p['V']}", f"h{p['H']}"],
        _all(_positive("V", "H"), _check_format(_INT4 + _INT8 + ("f8e4m3",))),
        lambda p, isa: _weight_plan({"K": p["H"], "N": p["V"], "wformat": p["wformat"]}, isa),
        scalar_reason="a token's row lies strided across its block of 16 interleaved rows (the linear "
                      "kernels' layout): gathers, one row per token and step"),
})


#: Weight rows per work item of the MXFP4 linear (threads split the rows), and token rows per tile
#: of its vector templates (f32 activations: one decoded row serves TT tokens; int8: MXFP4_TILE_ROWS
#: rows x TT tokens).
MXFP4_ROWS_PER_ITEM = 8
_MXFP4_TT = {"scalar": 1, "avx2": 2, "avx512": 4}
#: Weight rows the AVX-512 int8 kernel decodes together: one at a time for a single token row (one
#: stream per thread, every value in registers: 22 GB/s of MXFP4 from DRAM on one Zen 5 core against
#: 10 GB/s with 4 rows at a time), 2 for several token rows (the activation operands of a group serve
#: both: 210 GFLOP/s at T = 128 against 135 with 1 row; 3 rows and 6-8 tokens within noise).
#: Measured with CPU time (the dev machine was shared), K x N = 2880 x 5760.
MXFP4_GEMV_ROWS = 1
MXFP4_TILE_ROWS = 2
#: Software prefetch distance of the MXFP4 vector kernels along each weight row, bytes (0: none):
#: 256-1024 within noise of none on the shared dev machine (AVX-512); on the 2-core Zen 4 VM, T = 1
#: against 512: avx2 0.84x the time at 1 thread and 0.88x at 2 with 2048 (1024: 0.79x, 0.97x),
#: avx512-vnni 0.97-0.98x (docs/performance.md, the GPT-OSS-20B shape on the AVX2 class).
MXFP4_PREFETCH_BYTES = 2048
#: Activation forms of the MXFP4 linear: f32 (exact, the default) or int8 rows in blocks of 32.
MXFP4_ACTS = ("f32", "q8")


def _mxfp4_plan(p: dict[str, Any], isa: str) -> dict[str, Any]:
    lay = act_row_layout(p["K"], 8)
    return {"rows_per_item": MXFP4_ROWS_PER_ITEM, "tt": _MXFP4_TT[isa], "prefetch": MXFP4_PREFETCH_BYTES,
            "gemv_rows": MXFP4_GEMV_ROWS, "multi_rows": MXFP4_TILE_ROWS, "act_row_bytes": lay["row_bytes"],
            "act_d_offset": lay["d_offset"]}


def _check_mxfp4(p: dict[str, Any]) -> None:
    _positive("K", "N")(p)
    _expect(p["K"] % 32 == 0, f"linear_mxfp4: K = {p['K']} is not whole blocks of 32")
    _expect(p["act"] in MXFP4_ACTS, f"linear_mxfp4: act must be one of {', '.join(MXFP4_ACTS)}, got {p['act']!r}")


OPS["linear_mxfp4"] = _OpKernel(
    ("K", "N", "act"),
    "void {sym}(ife_pool *pool, const void *x /* [T, K] f32, or int8 activation rows (act q8) */, int T, "
    "const uint8_t *w /* blocks [N, K/32, 16], then e8m0 scales [N, K/32] */, const float *bias /* [N] or NULL */, "
    "float *y /* [T, N] */)",
    ("scalar",),
    lambda p: [f"k{p['K']}", f"n{p['N']}", p["act"]], _check_mxfp4, _mxfp4_plan, vec=True)


def mxfp4_rows_prototype(spec: KernelSpec) -> str:
    """The C declaration of ``<symbol>_rows``, which a ``linear_mxfp4`` library also defines: rows
    ``[n_begin, n_end)`` of one [N, K] matrix (``blocks``, ``scales``: one expert's) for T token
    rows, on the calling thread, into ``y`` with ``ldy`` floats per token row."""
    return (f"void {spec.symbol}_rows(const void *x, int T, const uint8_t *blocks /* [N, K/32, 16] */, "
            "const uint8_t *scales /* [N, K/32] */, const float *bias /* [N] or NULL */, int n_begin, int n_end, "
            "float *y /* [T, ldy] */, int ldy)")


def linear_op(weight_format: str) -> str | None:
    """The linear kernel op of a weight format (None for the float formats)."""
    if not is_quantized(weight_format):
        return None
    if weight_format == "mxfp4":
        return "linear_mxfp4"
    if weight_format in _INT4:
        return "linear_q4"
    if weight_format in _INT8:
        return "linear_q8"
    return "linear_f8"
