"""The integer linears (linear_q4, linear_q8) and the experts driver over them, rendered for avx2 with
micro-tiles of 1 to 4 token rows (``quant_kernels._TILES``, whatever the shipped value), against the
dequantize-then-f32 reference: a tile size must never change a result beyond the kernels' own
tolerance. Step sizes past the streamed path (STREAM_T rows) leave every remainder modulo every tile
size (17 to 20 rows), and the experts' routes give each expert such a row count. AVX2 runs on every
CI host; the AVX-512 vocabulary renders the same template (tests/test_quant_kernels.py covers its
shipped tiles).
"""
from __future__ import annotations

import functools
from unittest import mock

import numpy as np
import pytest
from _kernel_lib import KernelLib, rel_err
from test_moe_kernels import QUANT_TOL, experts_spec, run_experts, stored_and_f32

from infeng_compiler.codegen import quant_kernels
from infeng_compiler.codegen.kernels import KernelSpec
from infeng_compiler.codegen.moe_kernels import expert_linears, quantized_row_floats
from infeng_compiler.codegen.target import host_features, runnable_targets
from infeng_compiler.ir.ops import REGISTRY
from infeng_compiler.quant.act import fake_quant, pack_act_rows
from infeng_compiler.quant.formats import get_format
from infeng_compiler.quant.search import quantize

ISA = "avx2"
TILE_ROWS = (1, 2, 3, 4)
F32_TOL = 1e-5                             # as tests/test_quant_kernels.py
#: (format, K, N): groups of 32 and 64, asymmetric, GGUF minimums, per-row and grouped int8; N not a
#: multiple of 16 rows
LINEARS = [("q4g32", 96, 40), ("q4g64a", 128, 33), ("q4g32m", 64, 20), ("q8r", 96, 40), ("q8g32", 64, 33)]
STEPS = [1, 3, 17, 18, 19, 20, 23]         # decode, streamed, and every remainder of 1-4 row tiles
#: (E, H, I, top_k, activation, gate_up, biases) and weight format: tests/test_moe_kernels.py's cases
EXPERTS = [((4, 64, 48, 2, "silu", "concat", False), "q4g32"), ((4, 64, 48, 2, "silu", "concat", False), "q8r")]
EXPERT_ROWS = (17, 18, 19, 20)             # rows per expert: every remainder of 1-4 row tiles


def experts_of(wformat: str) -> KernelSpec:
    case = next(c for c, w in EXPERTS if w == wformat)
    return experts_spec(ISA, case, wformat, "none")


def tile_specs() -> list[KernelSpec]:
    specs = [KernelSpec.make(quant_kernels.linear_op(name), ISA, K=K, N=N, wformat=name) for name, K, N in LINEARS]
    for _, wformat in EXPERTS:
        spec = experts_of(wformat)
        specs += [spec] + [s for s in expert_linears(dict(spec.params)).values() if isinstance(s, KernelSpec)]
    return list(dict.fromkeys(specs))


@functools.cache
def tile_lib(rows: int) -> KernelLib:
    _, rb, rb_multi = quant_kernels._TILES[ISA]
    with mock.patch.dict(quant_kernels._TILES, {ISA: (rows, rb, rb_multi)}):
        return KernelLib(ISA, tile_specs())


#: each a library build (4-10 s on 2 cores): the slow set (`.ci/run` runs it); the default set keeps
#: the shipped tile's coverage through tests/test_quant_kernels.py and tests/test_moe_kernels.py (T = 70)
TILE_PARAMS = [pytest.param(r, id=f"tt{r}", marks=pytest.mark.slow) for r in TILE_ROWS]


@pytest.fixture(scope="session", params=TILE_PARAMS)
def tlib(request) -> KernelLib:
    if ISA not in runnable_targets(host_features()):
        pytest.skip(f"this host cannot run {ISA}")
    return tile_lib(request.param)


@pytest.mark.parametrize(("name", "K", "N"), LINEARS, ids=[f"{n}-k{k}n{m}" for n, k, m in LINEARS])
def test_linear_any_tile(tlib: KernelLib, name: str, K: int, N: int) -> None:
    spec = KernelSpec.make(quant_kernels.linear_op(name), ISA, K=K, N=N, wformat=name)
    rng = np.random.default_rng(K + N)
    qt = quantize((rng.standard_normal((N, K)) * 0.1).astype(np.float32), name, search=False)
    packed, wdeq = qt.pack(), qt.dequantize().astype(np.float64)
    bias = rng.standard_normal(N).astype(np.float32)
    bits = 8 if get_format(name).bits == 4 else 16
    for T in STEPS:
        x = (rng.standard_normal((T, K)) * 2).astype(np.float32)
        xin = pack_act_rows(x, bits)
        ref = fake_quant(x, 32 if bits == 8 else 0, bits).astype(np.float64) @ wdeq.T + bias
        y = np.full((T, N), np.nan, np.float32)
        tlib.fn(spec)(tlib.pool, tlib.ptr(xin), T, tlib.ptr(packed, "uint8_t *"), tlib.ptr(bias, "float *"),
                      tlib.ptr(y, "float *"))
        assert rel_err(y, ref) <= F32_TOL, (name, T, rel_err(y, ref))


def routes_with_counts(counts: tuple[int, ...], k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Routes of sum(counts) / k tokens to k distinct experts each, expert e chosen by counts[e]
    tokens: the experts listed counts[e] times each, token t taking entries t, t + T, ... (distinct
    while no count exceeds T)."""
    T = sum(counts) // k
    assert T * k == sum(counts) and max(counts) <= T
    entries = np.repeat(np.arange(len(counts)), counts)
    ids = np.stack([entries[j * T:(j + 1) * T] for j in range(k)], axis=1).astype(np.int32)
    return rng.random((T, k)).astype(np.float32), ids


@pytest.mark.parametrize("wformat", [w for _, w in EXPERTS])
def test_experts_any_tile(tlib: KernelLib, wformat: str) -> None:
    spec = experts_of(wformat)
    params = dict(spec.params)
    E, H, I, k = (params[p] for p in ("E", "H", "I", "top_k"))
    called = expert_linears(params)
    rng = np.random.default_rng(E * H + I)
    gu, gu32 = stored_and_f32(rng.standard_normal((E, 2 * I, H), dtype=np.float32) * 0.3, wformat)
    dn, dn32 = stored_and_f32(rng.standard_normal((E, H, I), dtype=np.float32) * 0.3, wformat)
    attrs = {"activation": "silu", "gate_up": "concat",
             "act_quant": [8, 32] if wformat.startswith("q4") else [16, 0]}
    row_floats = {name: quantized_row_floats(called[f"quant_{name}"], width) for name, width in (("x", H), ("act", I))}
    rw, ids = routes_with_counts(EXPERT_ROWS, k, rng)
    x = rng.standard_normal((len(ids), H), dtype=np.float32) * 2.0
    out = run_experts(tlib, spec, x, rw, ids, (gu, dn, None, None), row_floats, k, I)
    ref = REGISTRY["experts"].reference([x, rw, ids], [gu32, dn32], attrs, None)[0]
    assert rel_err(out, ref) <= QUANT_TOL[wformat], f"error {rel_err(out, ref):.3g}"
