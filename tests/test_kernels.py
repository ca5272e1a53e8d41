"""Every kernel, for every ISA this host runs, against the numpy references of the op registry.

One library per ISA holds the whole grid of kernels below; it is built once per session (and
cached on disk across sessions by build.py). Weights in f16/bf16 are compared with the reference
fed the same rounded weights, so only the accumulation order differs and the f32 tolerance holds;
the avx512-bf16 linear kernels for bf16 weights also round activations to bf16 (vdpbf16ps) and
get a 2e-2 relative tolerance.
"""
from __future__ import annotations

import functools
import math
import subprocess
import sys

import numpy as np
import pytest
from _isa import isa_params
from _kernel_lib import KernelLib, attention_step, paged_cache, rel_err, run_attention

from infeng_compiler.codegen.build import build_library
from infeng_compiler.codegen.kernels import AMX_ATTENTION_MIN_T, AMX_MIN_T, KernelSpec, library_sources, template_isa
from infeng_compiler.codegen.target import TARGETS, host_features, runnable_targets
from infeng_compiler.interp import KVStore, Step
from infeng_compiler.ir.ops import REGISTRY, rope_inv_freq
from infeng_compiler.ir.types import bf16_to_f32, f32_to_bf16

HOST = host_features()
RUNNABLE = runnable_targets(HOST)
F32_TOL = 1e-5            # max abs error / max |reference|
BF16_DOT_TOL = 2e-2

LINEAR_SHAPES = [(64, 40), (172, 49), (576, 96), (1100, 72), (8200, 21)]   # (K, N): remainders, K > one packed block, x rows long enough for GEMV_ROWS
LINEAR_TOKENS = [1, 2, 3, 5, 8, 17, 70]     # T=1 rows, dot tiles of 2..6 rows, packed GEMM
WDTYPES = ["f32", "f16", "bf16"]
NORM_SIZES = [576, 37]
ELTWISE_SIZES = [1536, 37]
ROPE_CASES = [  # (n_heads, head_dim, attrs beyond head_dim)
    (3, 64, {"theta": 10000.0}),
    (2, 24, {"theta": 500000.0, "scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
]
ATTENTION_CASES = [  # (n_heads, n_kv_heads, head_dim, block_size, window)
    (4, 2, 64, 16, 0),
    (3, 3, 40, 4, 0),
    (6, 2, 24, 8, 5),
    (2, 1, 32, 32, 0),      # MQA; a block holds two vectors of scores
    (4, 2, 16, 48, 150),    # blocks that do not divide a key chunk; a window longer than one
    (8, 1, 128, 16, 0),     # 8 query heads of 128 dims per KV head: the AVX-512 path's row groups of 1
]
COPY_CASES = [(1728, 576, 576), (10, 3, 5)]


def rope_attrs(n_heads: int, head_dim: int, extra: dict) -> dict:
    return {"n_heads": n_heads, "head_dim": head_dim, **extra}


def grid_specs(isa: str) -> list[KernelSpec]:
    specs = []
    for K, N in LINEAR_SHAPES:
        for wd in WDTYPES:
            specs.append(KernelSpec.make("linear", isa, K=K, N=N, wdtype=wd))
    for wd in WDTYPES:
        for H in (64, 37):
            specs.append(KernelSpec.make("embedding", isa, V=50, H=H, wdtype=wd))
    for H in NORM_SIZES:
        specs.append(KernelSpec.make("rms_norm", isa, H=H, eps=1e-5))
        specs.append(KernelSpec.make("layer_norm", isa, H=H, eps=1e-6))
    for h, d, extra in ROPE_CASES:
        specs.append(KernelSpec.make("rope", isa, n_heads=h, head_dim=d, inv_freq=rope_inv_freq(rope_attrs(h, d, extra))))
    for hq, hkv, d, bs, win in ATTENTION_CASES:
        specs.append(KernelSpec.make("attention", isa, n_heads=hq, n_kv_heads=hkv, head_dim=d, block_size=bs,
                                     scale=1 / math.sqrt(d), window=win))
    for N in ELTWISE_SIZES:
        specs.append(KernelSpec.make("silu_mul", isa, N=N))
        specs.append(KernelSpec.make("add", isa, N=N))
        for approx in ("tanh", "none"):
            specs.append(KernelSpec.make("gelu", isa, N=N, approximate=approx))
    for i, o, w in COPY_CASES:
        specs.append(KernelSpec.make("copy_cols", isa, IN=i, OFFSET=o, WIDTH=w))
    specs.append(KernelSpec.make("gather_rows", isa, H=576))
    specs.append(KernelSpec.make("gather_rows", isa, H=7))
    specs.append(KernelSpec.make("linear", isa, K=1100, N=300, wdtype="f16"))     # test_pool_threads
    return specs


@functools.cache
def kernel_lib(isa: str) -> KernelLib:
    return KernelLib(isa, grid_specs(isa))


@pytest.fixture(scope="session", params=isa_params(RUNNABLE))
def klib(request) -> KernelLib:
    return kernel_lib(request.param)


def weights(rng: np.random.Generator, shape: tuple[int, ...], wdtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(stored weights, the same values as f32) for ``wdtype``."""
    w = rng.standard_normal(shape, dtype=np.float32)
    if wdtype == "f32":
        return w, w
    if wdtype == "f16":
        stored = w.astype(np.float16)
        return stored.view(np.uint16), stored.astype(np.float32)
    stored = f32_to_bf16(w)
    return stored, bf16_to_f32(stored)


def reference(op: str, ins: list[np.ndarray], ws: list[np.ndarray], attrs: dict, step=None) -> np.ndarray:
    return REGISTRY[op].reference(ins, ws, attrs, step)[0]


def weight_ctype(wdtype: str) -> str:
    return "float *" if wdtype == "f32" else "uint16_t *"


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wdtype", WDTYPES)
@pytest.mark.parametrize("K,N", LINEAR_SHAPES)
def test_linear(klib: KernelLib, K: int, N: int, wdtype: str):
    spec = KernelSpec.make("linear", klib.isa, K=K, N=N, wdtype=wdtype)
    rng = np.random.default_rng(K * N)
    stored, w32 = weights(rng, (N, K), wdtype)
    bias = rng.standard_normal(N, dtype=np.float32)
    # vdpbf16ps and the amx tiles round x to bf16 for bf16 weights (amx keeps 16 bits of x for f16)
    dot_bf16 = template_isa(spec) in ("avx512-bf16", "amx") and wdtype == "bf16"
    for T in LINEAR_TOKENS:
        x = rng.standard_normal((T, K), dtype=np.float32)
        for b in (None, bias):
            y = np.full((T, N), np.nan, dtype=np.float32)
            klib.fn(spec)(klib.pool, klib.ptr(x), T, klib.ptr(stored, weight_ctype(wdtype)), klib.ptr(b), klib.ptr(y))
            ws_ref = [w32.astype(np.float64)] + ([b] if b is not None else [])
            if dot_bf16:   # vdpbf16ps: exact against the reference fed the same bf16-rounded x
                x_bf16 = bf16_to_f32(f32_to_bf16(x))
                assert rel_err(y, reference("linear", [x_bf16.astype(np.float64)], ws_ref, {})) <= F32_TOL
                assert rel_err(y, reference("linear", [x.astype(np.float64)], ws_ref, {})) <= BF16_DOT_TOL
            else:
                ref = reference("linear", [x.astype(np.float64)], ws_ref, {})
                assert rel_err(y, ref) <= F32_TOL, f"T={T} bias={b is not None}: error {rel_err(y, ref):.3g}"



@pytest.mark.parametrize("wdtype", WDTYPES)
@pytest.mark.parametrize("K,N", LINEAR_SHAPES)
def test_linear_dot_tile_rows_do_not_depend_on_the_row_count(klib: KernelLib, K: int, N: int, wdtype: str):
    """From 2 token rows up to the packed GEMM (2 <= T < GEMM_MIN_T: batched decode, speculative
    verification) a token row's outputs are the same bits whatever the step's row count. (T = 1
    sums in GEMV_UNROLL chains, or GEMV_ROWS rows at once, so its last bits may differ: docs/codegen.md.)"""
    spec = KernelSpec.make("linear", klib.isa, K=K, N=N, wdtype=wdtype)
    rng = np.random.default_rng(K + N)
    stored, _ = weights(rng, (N, K), wdtype)
    bias = rng.standard_normal(N, dtype=np.float32)
    n_rows = AMX_MIN_T - 1 if template_isa(spec) == "amx" else 17   # below the packed path (amx: the tiles)
    x = rng.standard_normal((n_rows, K), dtype=np.float32)

    def run(rows: np.ndarray, w: np.ndarray = stored, b: np.ndarray = bias) -> np.ndarray:
        rows = np.ascontiguousarray(rows)
        y = np.full((len(rows), N), np.nan, dtype=np.float32)
        klib.fn(spec)(klib.pool, klib.ptr(rows), len(rows), klib.ptr(w, weight_ctype(wdtype)), klib.ptr(b), klib.ptr(y))
        return y

    together = run(x)
    for t0, t1 in [(0, 2), (1, 4), (3, 8), (2, 7), (9, n_rows - 1), (n_rows - 2, n_rows), (4, n_rows)]:
        assert np.array_equal(run(x[t0:t1]), together[t0:t1]), (klib.isa, wdtype, K, N, t0, t1)

@pytest.mark.parametrize("wdtype", WDTYPES)
def test_linear_gemv_rows_do_not_depend_on_the_split(klib: KernelLib, wdtype: str):
    """T = 1 with a long x row reads GEMV_ROWS weight rows at once; a thread's range can end inside
    a group, and every row must still be summed the same way: the same bits for 1, 2 and 3 threads."""
    K, N = LINEAR_SHAPES[-1]
    spec = KernelSpec.make("linear", klib.isa, K=K, N=N, wdtype=wdtype)
    rng = np.random.default_rng(11)
    stored, _ = weights(rng, (N, K), wdtype)
    x = rng.standard_normal((1, K), dtype=np.float32)
    results = []
    for threads in (1, 2, 3):
        pool = klib.ffi.gc(klib.lib.ife_pool_create(threads), klib.lib.ife_pool_destroy)
        y = np.full((1, N), np.nan, dtype=np.float32)
        klib.fn(spec)(pool, klib.ptr(x), 1, klib.ptr(stored, weight_ctype(wdtype)), klib.ffi.NULL, klib.ptr(y))
        results.append(y)
    for y in results[1:]:
        np.testing.assert_array_equal(y, results[0])


def test_pool_threads(klib: KernelLib):
    """Work stealing gives every pool size the same bits: 1 thread, 2, and more threads than CPUs
    (workers preempted, ranges stolen), over many back-to-back jobs of 1..N items, some while
    another process keeps a core busy. Each must return: a lost chunk or wake-up would hang here."""
    K, N = 1100, 300                  # 38 work items of 8 rows: more than 2 x 8 chunks, fewer than 8 x 8
    spec = KernelSpec.make("linear", klib.isa, K=K, N=N, wdtype="f16")
    rng = np.random.default_rng(7)
    stored, _ = weights(rng, (N, K), "f16")
    xs = {T: rng.standard_normal((T, K), dtype=np.float32) for T in (1, 2, 9, 70)}
    pools = {n: klib.ffi.gc(klib.lib.ife_pool_create(n), klib.lib.ife_pool_destroy) for n in (1, 2, 3, 8)}
    expected = {}
    busy = None
    try:
        for rnd in range(2):
            if rnd:
                busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for n, pool in pools.items():
                for T, x in xs.items():
                    y = np.empty((T, N), dtype=np.float32)
                    for _ in range(50):
                        y.fill(np.nan)          # a chunk left out would leave NaNs
                        klib.fn(spec)(pool, klib.ptr(x), T, klib.ptr(stored, "uint16_t *"), klib.ffi.NULL, klib.ptr(y))
                        ref = expected.setdefault(T, y.copy())
                        np.testing.assert_array_equal(y, ref, err_msg=f"{n} threads, T={T}")
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


@pytest.mark.parametrize("wdtype", WDTYPES)
@pytest.mark.parametrize("H", [64, 37])
def test_embedding(klib: KernelLib, H: int, wdtype: str):
    spec = KernelSpec.make("embedding", klib.isa, V=50, H=H, wdtype=wdtype)
    rng = np.random.default_rng(H)
    stored, w32 = weights(rng, (50, H), wdtype)
    ids = np.array([0, 49, 7, 7, 23], dtype=np.int32)
    out = np.full((len(ids), H), np.nan, dtype=np.float32)
    klib.fn(spec)(klib.ptr(ids, "int32_t *"), len(ids), klib.ptr(stored, weight_ctype(wdtype)), klib.ptr(out))
    np.testing.assert_array_equal(out, reference("embedding", [ids], [w32], {}))


@pytest.mark.parametrize("H", NORM_SIZES)
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_norm(klib: KernelLib, op: str, H: int):
    eps = 1e-5 if op == "rms_norm" else 1e-6
    spec = KernelSpec.make(op, klib.isa, H=H, eps=eps)
    rng = np.random.default_rng(H)
    w, b = rng.standard_normal(H, dtype=np.float32), rng.standard_normal(H, dtype=np.float32)
    params = [w] if op == "rms_norm" else [w, b]
    for T in (1, 5):
        x = (rng.standard_normal((T, H), dtype=np.float32) * 3 + 1).astype(np.float32)
        ref = reference(op, [x], params, {"eps": eps})
        out = np.full_like(x, np.nan)
        klib.fn(spec)(klib.ptr(x), T, *map(klib.ptr, params), klib.ptr(out))
        assert rel_err(out, ref) <= F32_TOL
        klib.fn(spec)(klib.ptr(x), T, *map(klib.ptr, params), klib.ptr(x))      # in place
        assert rel_err(x, ref) <= F32_TOL


@pytest.mark.parametrize("n_heads,head_dim,extra", ROPE_CASES)
def test_rope(klib: KernelLib, n_heads: int, head_dim: int, extra: dict):
    attrs = rope_attrs(n_heads, head_dim, extra)
    spec = KernelSpec.make("rope", klib.isa, n_heads=n_heads, head_dim=head_dim, inv_freq=rope_inv_freq(attrs))
    rng = np.random.default_rng(head_dim)
    pos = np.array([0, 1, 17, 300, 4095], dtype=np.int32)
    x = rng.standard_normal((len(pos), n_heads * head_dim), dtype=np.float32)
    ref = reference("rope", [x, pos], [], attrs)
    klib.fn(spec)(klib.ptr(x), len(pos), klib.ptr(pos, "int32_t *"))
    assert rel_err(x, ref) <= F32_TOL


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim,block_size,window", ATTENTION_CASES)
def test_attention(klib: KernelLib, n_heads: int, n_kv_heads: int, head_dim: int, block_size: int, window: int):
    """Prefill chunks, decode steps and mixed batches over a paged cache with scattered blocks."""
    scale = 1 / math.sqrt(head_dim)
    spec = KernelSpec.make("attention", klib.isa, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                           block_size=block_size, scale=scale, window=window)
    attrs = {"layer": 0, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim, "scale": scale,
             "window": window}
    rng = np.random.default_rng(head_dim * block_size)
    seq_ids = {0: 11, 1: 22, 2: 33}                  # sequence slot -> interpreter sequence id
    max_blocks = 40 // block_size + 1
    n_blocks = len(seq_ids) * max_blocks + 3
    block_table = rng.permutation(n_blocks)[: len(seq_ids) * max_blocks].astype(np.int32).reshape(len(seq_ids), max_blocks)
    kv_shape = (n_blocks, block_size, n_kv_heads, head_dim)
    k_cache, v_cache = np.zeros(kv_shape, np.float32), np.zeros(kv_shape, np.float32)
    store = KVStore()
    steps = [  # (slot, positions) per step
        [(0, range(13))],                                   # prefill
        [(0, range(13, 14)), (1, range(9))],                # decode + prefill of another slot
        [(1, range(9, 10)), (0, range(14, 15)), (2, range(1))],
        [(2, range(1, 20)), (0, range(15, 16))],               # long prefill chunk + decode
        [(0, range(16, 17)), (1, range(10, 11)), (2, range(20, 21))],
    ]
    for step in steps:
        slots = np.array([s for s, ps in step for _ in ps], dtype=np.int32)
        pos = np.array([p for _, ps in step for p in ps], dtype=np.int32)
        T = len(pos)
        q = rng.standard_normal((T, n_heads * head_dim), dtype=np.float32)
        k = rng.standard_normal((T, n_kv_heads * head_dim), dtype=np.float32)
        v = rng.standard_normal((T, n_kv_heads * head_dim), dtype=np.float32)
        ctx = Step(seq_ids=np.array([seq_ids[s] for s in slots], dtype=np.int32), logits_rows=np.arange(T), kv=store)
        ref = reference("attention", [q, k, v, pos], [], attrs, ctx)
        out = np.full_like(q, np.nan)
        klib.fn(spec)(klib.pool, klib.ptr(q), klib.ptr(k), klib.ptr(v), T, klib.ptr(pos, "int32_t *"),
                      klib.ptr(slots, "int32_t *"), klib.ptr(block_table, "int32_t *"), max_blocks,
                      klib.ptr(k_cache), klib.ptr(v_cache), klib.ptr(out))
        assert rel_err(out, ref) <= F32_TOL, f"step {step}: error {rel_err(out, ref):.3g}"


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim,block_size,window", ATTENTION_CASES)
def test_attention_rows_alone_or_together(klib: KernelLib, n_heads: int, n_kv_heads: int, head_dim: int,
                                          block_size: int, window: int):
    """Contexts of several key chunks (the vector kernels' unit of work, 128 positions), prefill steps
    of many rows and a step of 9 consecutive rows of one sequence crossing a chunk boundary, as
    speculative verification runs them: against the reference, and rows bit for bit what a step of
    that row alone gives and what one thread gives (a row's output must depend neither on the other
    rows of its step nor on the threads). Runs stay below the AMX kernel's tile threshold, whose
    tiles round to bf16."""
    scale = 1 / math.sqrt(head_dim)
    spec = KernelSpec.make("attention", klib.isa, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                           block_size=block_size, scale=scale, window=window)
    attrs = {"layer": 0, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim, "scale": scale,
             "window": window}
    rng = np.random.default_rng(7 * head_dim + block_size)
    cache = paged_cache(rng, 2, 270, block_size, n_kv_heads, head_dim)
    store = KVStore()

    prefill = [[(s, range(p, min(p + AMX_ATTENTION_MIN_T - 1, end))) for s, end in ((0, 251), (1, 140)) if p < end]
               for p in range(0, 251, AMX_ATTENTION_MIN_T - 1)]
    done = []
    for step in [*prefill, [(0, range(251, 260)), (1, range(140, 141))]]:
        inputs = attention_step(rng, step, n_heads, n_kv_heads, head_dim)
        slots, pos, q, k, v = inputs
        ctx = Step(seq_ids=slots, logits_rows=np.arange(len(pos)), kv=store)
        ref = reference("attention", [q, k, v, pos], [], attrs, ctx)
        out = run_attention(klib, spec, inputs, cache)
        assert rel_err(out, ref) <= F32_TOL, f"step {step}: error {rel_err(out, ref):.3g}"
        done.append((inputs, out))
    inputs, out = done[-1]
    np.testing.assert_array_equal(run_attention(klib, spec, inputs, cache, klib.pool_of(1)), out,
                                  err_msg="the last step on one thread")
    wanted = {(0, 0), (0, 127), (0, 128), (0, 200), (0, 250), (1, 139)} | set(zip(inputs[0], inputs[1]))
    for inputs, out in done:
        slots, pos = inputs[:2]
        for t in (t for t in range(len(pos)) if (slots[t], pos[t]) in wanted):
            alone = run_attention(klib, spec, [x[t:t + 1] for x in inputs], cache)
            np.testing.assert_array_equal(alone[0], out[t], err_msg=f"slot {slots[t]} position {pos[t]} alone")


@pytest.mark.parametrize("N", ELTWISE_SIZES)
@pytest.mark.parametrize("op", ["silu_mul", "add", "gelu:tanh", "gelu:none"])
def test_elementwise(klib: KernelLib, op: str, N: int):
    op, _, approximate = op.partition(":")
    attrs = {"approximate": approximate} if approximate else {}
    spec = KernelSpec.make(op, klib.isa, N=N, **attrs)
    rng = np.random.default_rng(N)
    for T in (1, 5):
        ins = [(rng.standard_normal((T, N), dtype=np.float32) * 4).astype(np.float32) for _ in REGISTRY[op].inputs]
        ins[0][0, :4] = [-100.0, 100.0, 0.0, -1e-3]       # saturated and tiny arguments
        ref = reference(op, ins, [], attrs)
        out = np.full_like(ins[0], np.nan)
        klib.fn(spec)(*(klib.ptr(a) for a in ins), T, klib.ptr(out))
        assert rel_err(out, ref) <= F32_TOL
        klib.fn(spec)(*(klib.ptr(a) for a in ins), T, klib.ptr(ins[0]))    # in place
        assert rel_err(ins[0], ref) <= F32_TOL


@pytest.mark.parametrize("IN,OFFSET,WIDTH", COPY_CASES)
def test_copy_cols(klib: KernelLib, IN: int, OFFSET: int, WIDTH: int):
    spec = KernelSpec.make("copy_cols", klib.isa, IN=IN, OFFSET=OFFSET, WIDTH=WIDTH)
    x = np.random.default_rng(IN).standard_normal((3, IN), dtype=np.float32)
    out = np.full((3, WIDTH), np.nan, dtype=np.float32)
    klib.fn(spec)(klib.ptr(x), 3, klib.ptr(out))
    sizes = [OFFSET, WIDTH, IN - OFFSET - WIDTH]
    pieces = REGISTRY["split"].reference([x], [], {"sizes": [s for s in sizes if s]}, None)
    np.testing.assert_array_equal(out, pieces[1 if OFFSET else 0])


@pytest.mark.parametrize("H", [576, 7])
def test_gather_rows(klib: KernelLib, H: int):
    spec = KernelSpec.make("gather_rows", klib.isa, H=H)
    x = np.random.default_rng(H).standard_normal((6, H), dtype=np.float32)
    rows = np.array([5, 0, 5], dtype=np.int32)
    out = np.full((3, H), np.nan, dtype=np.float32)
    klib.fn(spec)(klib.ptr(x), klib.ptr(rows, "int32_t *"), 3, klib.ptr(out))
    np.testing.assert_array_equal(out, x[rows])


@pytest.mark.slow       # compile-only: a whole kernel grid built for a target it does not run
def test_amx_sources_compile():
    """The amx library (the -mamx-* flags, native tile instructions) builds on every host, AMX or not."""
    target = TARGETS["amx"]
    sources, baseline = library_sources(grid_specs("amx"), target)
    assert build_library(sources, target, baseline_sources=baseline).path.is_file()
