"""The amx linear (bf16 and f16 weights on AMX-BF16 tiles) against the references.

Every case runs on ``amx-emu`` (the same kernels with each tile instruction emulated in C, so the
layouts, blocking and epilogues are tested on any AVX-512 BF16 host) and on ``amx`` where this host
can use AMX; the native library is built on every host. The weights reach the tiles exactly (bf16,
or f16 as a hi + lo bf16 pair). With bf16 weights x is rounded to bf16, on the tiles as on
avx512-bf16 below AMX_MIN_T rows: the result equals the f32 reference fed the bf16-rounded x up to
the accumulation order (F32_TOL) and the plain reference to BF16_TOL. With f16 weights x keeps 16
significant bits (xh + xl) on the tiles, about 3e-6 of max |y| here, and f32 below AMX_MIN_T
(avx512): F32_TOL against the plain reference at every T.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from _kernel_lib import KernelLib, rel_err

from infeng_compiler.codegen import kernels
from infeng_compiler.codegen.build import build_library
from infeng_compiler.codegen.kernels import AMX_MIN_T, KernelSpec, library_sources, template_isa
from infeng_compiler.codegen.target import TARGETS
from infeng_compiler.compile import CompileOptions, compile_model, run_pipeline
from infeng_compiler.interp import Interpreter
from infeng_compiler.ir.ops import REGISTRY
from infeng_compiler.ir.types import bf16_to_f32, f32_to_bf16
from infeng_runtime.engine import Engine

F32_TOL = 1e-5            # max abs error / max |reference|, as tests/test_kernels.py
BF16_TOL = 2e-2
# (K, N): K not a multiple of a tile's 32 (bf16) or 16 (f16) k, N not of 16 columns; K = 600 spans
# several packed k blocks (512 k for bf16, 128 for f16), N = 72 several work items
SHAPES = [(72, 40), (172, 49), (600, 72), (8200, 21)]      # 8200: the T = 1 path of GEMV_ROWS rows
TOKENS = [1, AMX_MIN_T - 1, AMX_MIN_T, 17, 33]
WDTYPES = ["bf16", "f16"]
ISAS = [
    pytest.param("amx-emu", marks=[pytest.mark.slow, pytest.mark.skipif(
        bool(TARGETS["amx-emu"].missing_features()),
        reason=f"this host lacks {', '.join(TARGETS['amx-emu'].missing_features())} (amx-emu runs on avx512-bf16)")]),
    pytest.param("amx", marks=pytest.mark.skipif(
        bool(TARGETS["amx"].missing_features()),
        reason=f"this host has no usable AMX (lacks {', '.join(TARGETS['amx'].missing_features())})")),
]


def specs(isa: str) -> list[KernelSpec]:
    return [KernelSpec.make("linear", isa, K=K, N=N, wdtype=wd) for K, N in SHAPES for wd in WDTYPES]


@functools.cache
def library(isa: str) -> KernelLib:
    return KernelLib(isa, specs(isa))


def weights(rng: np.random.Generator, shape: tuple[int, int], wdtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(stored weights, the same values as f32)."""
    w = rng.standard_normal(shape, dtype=np.float32)
    if wdtype == "f16":
        stored = w.astype(np.float16)
        return stored.view(np.uint16), stored.astype(np.float32)
    stored = f32_to_bf16(w)
    return stored, bf16_to_f32(stored)


def run(lib: KernelLib, spec: KernelSpec, x: np.ndarray, stored: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    x = np.ascontiguousarray(x)
    y = np.full((len(x), spec["N"]), np.nan, dtype=np.float32)
    lib.fn(spec)(lib.pool, lib.ptr(x), len(x), lib.ptr(stored, "uint16_t *"), lib.ptr(bias), lib.ptr(y))
    return y


def reference(x: np.ndarray, w32: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    ws = [w32.astype(np.float64)] + ([bias] if bias is not None else [])
    return REGISTRY["linear"].reference([x.astype(np.float64)], ws, {}, None)[0]


def test_the_amx_native_library_builds():
    """The tile instructions themselves (-mamx-*), compiled on every host, AMX or not."""
    target = TARGETS["amx"]
    sources, baseline = library_sources(specs("amx"), target)
    assert build_library(sources, target, baseline_sources=baseline).path.is_file()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wdtype", WDTYPES)
@pytest.mark.parametrize("K,N", SHAPES)
def test_amx_linear(isa: str, K: int, N: int, wdtype: str):
    lib = library(isa)
    spec = KernelSpec.make("linear", isa, K=K, N=N, wdtype=wdtype)
    assert template_isa(spec) == "amx"
    rng = np.random.default_rng(K * N)
    stored, w32 = weights(rng, (N, K), wdtype)
    bias = rng.standard_normal(N, dtype=np.float32)
    for T in TOKENS:
        x = rng.standard_normal((T, K), dtype=np.float32)
        x_bf16 = bf16_to_f32(f32_to_bf16(x))
        for b in (None, bias):
            y = run(lib, spec, x, stored, b)
            where = f"T={T} bias={b is not None}"
            if wdtype == "bf16":       # x rounded to bf16: the tiles, and avx512-bf16 below them
                assert rel_err(y, reference(x_bf16, w32, b)) <= F32_TOL, where
                assert rel_err(y, reference(x, w32, b)) <= BF16_TOL, where
            else:                      # f16: x as xh + xl on the tiles, avx512's f32 FMAs below them
                assert rel_err(y, reference(x, w32, b)) <= F32_TOL, where


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wdtype", WDTYPES)
def test_amx_tile_rows_do_not_depend_on_the_row_count(isa: str, wdtype: str):
    """From AMX_MIN_T rows on, a token row's outputs are the same bits whatever the step's row count
    (prefill chunks, batched decode and verification steps of any size agree)."""
    K, N = 600, 72
    lib = library(isa)
    spec = KernelSpec.make("linear", isa, K=K, N=N, wdtype=wdtype)
    rng = np.random.default_rng(3)
    stored, _ = weights(rng, (N, K), wdtype)
    bias = rng.standard_normal(N, dtype=np.float32)
    x = rng.standard_normal((AMX_MIN_T + 24, K), dtype=np.float32)
    together = run(lib, spec, x, stored, bias)
    for t0, t1 in [(0, AMX_MIN_T), (3, 3 + AMX_MIN_T + 1), (5, AMX_MIN_T + 24)]:
        assert np.array_equal(run(lib, spec, x[t0:t1], stored, bias), together[t0:t1]), (t0, t1)


# ---------------------------------------------------------------------------------------------
PROMPTS = [[1, 17, 33, 5, 90, 11, 7, 64, 3, 2, 100], [1, 42, 8, 19, 77]]
# max abs logit error / max |logit|, tests/test_compiled.py's bounds: bf16 weights round x to bf16 (as
# avx512-bf16); f16 keeps x to 16 significant bits, within the bound of f32 weights
KERNEL_TOL = {"bf16": 2e-2, "f16": 1e-4}


def run_batch(backend, decode_steps: int) -> list[np.ndarray]:
    """Both prompts prefilled in one step, then decoded together (greedy): each step's logits."""
    lens = [len(p) for p in PROMPTS]
    out = [backend.step(np.concatenate(PROMPTS), np.concatenate([np.arange(n) for n in lens]),
                        np.repeat(np.arange(len(PROMPTS)), lens), np.cumsum(lens) - 1)]
    pos = np.array(lens)
    for _ in range(decode_steps):
        out.append(backend.step(out[-1].argmax(axis=1), pos, np.arange(len(PROMPTS))))
        pos = pos + 1
    for s in range(len(PROMPTS)):
        backend.free(s)
    return out


@pytest.mark.skipif(bool(TARGETS["amx-emu"].missing_features()), reason="this host lacks avx512_bf16 (amx-emu)")
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_stories260k_on_amx_emu_matches_interpreter(tmp_path, stories_dir, monkeypatch, dtype):
    """Every linear of the step on the tiles (AMX_MIN_T = 2: the 16-row prefill and the 2-row decode
    steps; the logits of the 2 gathered rows) against the interpreter of the same cast graph."""
    monkeypatch.setattr(kernels, "AMX_MIN_T", 2)
    options = CompileOptions(target="amx-emu", dtype=dtype)
    compile_model(stories_dir, tmp_path / "model.infeng", options, reuse=False)   # AMX_MIN_T is not in its key
    engine = Engine(tmp_path / "model.infeng", threads=2)
    want = run_batch(Interpreter(run_pipeline(stories_dir, options).graph), 3)
    for step, (g, w) in enumerate(zip(run_batch(engine, 3), want)):
        err, bound = np.abs(g - w).max(), KERNEL_TOL[dtype] * np.abs(w).max()
        assert err <= bound, f"step {step}: max abs error {err:.3g} > {bound:.3g}"
    linears = [p.read_text() for p in (tmp_path / "model.infeng" / "src").glob("ife_linear_*.c")]
    assert linears and all("kernels/linear/amx.c.j2" in c and "GEMM_MIN_T = 2," in c for c in linears)
