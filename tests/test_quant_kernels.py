"""Quantized kernels, every format x every ISA this host runs, against the dequantize-then-f32
numpy reference: activation quantization bit-exact with quant/act.py; the integer and fp8 linear
kernels within F32_TOL of fake_quant(x) @ dequantize(W)^T (the integer dot products are exact,
only the float accumulation order differs); quantized embedding rows exactly equal to the
dequantized table rows. One library per ISA, built once per session (cached on disk by build.py).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from _isa import isa_params
from _kernel_lib import KernelLib, rel_err

import infeng_compiler.codegen.quant_kernels  # noqa: F401  (registers the kernels)
from infeng_compiler.codegen.build import build_library
from infeng_compiler.codegen.kernels import KernelSpec, library_sources, template_isa
from infeng_compiler.codegen.quant_kernels import linear_op
from infeng_compiler.codegen.target import TARGETS, host_features, runnable_targets
from infeng_compiler.quant.act import act_row_layout, fake_quant, pack_act_rows
from infeng_compiler.quant.formats import QUANT_FORMATS, get_format
from infeng_compiler.quant.search import quantize

HOST = host_features()
RUNNABLE = runnable_targets(HOST)
COMPILE_ONLY = [name for name, t in TARGETS.items() if t.missing_features(HOST)]
F32_TOL = 1e-5                 # max abs error / max |reference|
AMX_OPS = ("linear_q4", "linear_q8")       # the ops with AMX templates (tests/test_amx.py)

# (K, N): K below, at and above a group; K not a multiple of 32 (padded formats) and N not of 16
# rows; N large enough for work items of 4 blocks (520: 33 blocks, a tail item of 1) and of 2 (272)
LINEAR_SHAPES = [(64, 40), (172, 33), (576, 96), (1100, 20), (64, 520), (96, 272)]
TOKENS = [1, 2, 3, 5, 17]
ACT_CASES = [(64, 8), (172, 8), (70, 16), (576, 16), (3, 8)]


def fits(fmt_name: str, K: int) -> bool:
    """Shapes a format takes in these tests (groups larger than K only where K is one group)."""
    fmt = get_format(fmt_name)
    return fmt.group <= max(K, 32) or fmt.group == 0


def grid_specs(isa: str) -> list[KernelSpec]:
    specs = [KernelSpec.make(op, isa, K=K, bits=b, block=32 if b == 8 else 0) for K, b in ACT_CASES
             for op in ("quantize_act", "dequantize_act")]
    for name in QUANT_FORMATS:
        for K, N in LINEAR_SHAPES:
            if fits(name, K):
                specs.append(KernelSpec.make(linear_op(name), isa, K=K, N=N, wformat=name))
                if get_format(name).kind == "int":
                    specs.append(KernelSpec.make("linear_qf32", isa, K=K, N=N, wformat=name))
        specs.append(KernelSpec.make("embedding_q", isa, V=37, H=64, wformat=name))
    return specs


@functools.cache
def quant_lib(isa: str) -> KernelLib:
    return KernelLib(isa, grid_specs(isa))


@pytest.fixture(scope="session", params=isa_params(RUNNABLE))
def qlib(request) -> KernelLib:
    return quant_lib(request.param)


def test_every_isa_has_a_template_path() -> None:
    for isa in TARGETS:
        for op in ("quantize_act", "linear_q4", "linear_q8", "linear_f8", "linear_qf32"):
            spec = KernelSpec.make(op, isa, **({"K": 64, "bits": 8, "block": 32} if op == "quantize_act" else
                                               {"K": 64, "N": 16, "wformat": {"linear_q4": "q4g32", "linear_q8": "q8r",
                                                                              "linear_f8": "f8e4m3",
                                                                              "linear_qf32": "q4g32m"}[op]}))
            expect = "scalar" if isa == "scalar" else ("avx2" if isa.startswith("avx2") else "avx512")
            if isa.startswith("amx") and op in AMX_OPS:
                expect = "amx"
            assert template_isa(spec) == expect, (op, isa)


@pytest.mark.parametrize("K,bits", ACT_CASES)
def test_quantize_act_bit_exact(qlib: KernelLib, K: int, bits: int) -> None:
    spec = KernelSpec.make("quantize_act", qlib.isa, K=K, bits=bits, block=32 if bits == 8 else 0)
    rng = np.random.default_rng(K + bits)
    for T in TOKENS:
        x = (rng.standard_normal((T, K)) * rng.uniform(0.01, 30, size=(T, 1))).astype(np.float32)
        x[0, :] = 0.0 if T > 2 else x[0, :]                                      # an all-zero row
        x[-1, K // 2] = 300.0                                                     # an outlier
        out = np.zeros((T, act_row_layout(K, bits)["row_bytes"]), np.uint8)
        qlib.fn(spec)(qlib.ptr(x, "float *"), T, qlib.ptr(out, "uint8_t *"))
        assert np.array_equal(out, pack_act_rows(x, bits)), (qlib.isa, K, bits, T)
        back = np.full((T, K), np.nan, np.float32)
        deq = KernelSpec.make("dequantize_act", qlib.isa, K=K, bits=bits, block=32 if bits == 8 else 0)
        qlib.fn(deq)(qlib.ptr(out, "uint8_t *"), T, qlib.ptr(back, "float *"))
        assert np.array_equal(back, fake_quant(x, 32 if bits == 8 else 0, bits))


def _linear_case(name: str, K: int, N: int, seed: int):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    w[:, 3] *= 6                                                                  # an outlier column
    qt = quantize(w, name, search=False)
    bias = rng.standard_normal(N).astype(np.float32) if seed % 2 else None
    return qt, bias


@pytest.mark.parametrize("name", QUANT_FORMATS)
def test_linear_matches_dequantized_reference(qlib: KernelLib, name: str) -> None:
    fmt = get_format(name)
    for K, N in LINEAR_SHAPES:
        if not fits(name, K):
            continue
        spec = KernelSpec.make(linear_op(name), qlib.isa, K=K, N=N, wformat=name)
        qt, bias = _linear_case(name, K, N, K + N)
        packed = qt.pack()
        wdeq = qt.dequantize().astype(np.float64)
        rng = np.random.default_rng(K * N)
        for T in TOKENS:
            x = (rng.standard_normal((T, K)) * 2).astype(np.float32)
            if fmt.kind == "int":
                bits = 8 if fmt.bits == 4 else 16
                xin, xref = pack_act_rows(x, bits), fake_quant(x, 32 if bits == 8 else 0, bits)
                xptr = qlib.ptr(xin, "void *")
            else:
                xref = x
                xptr = qlib.ptr(x, "float *")
            ref = xref.astype(np.float64) @ wdeq.T + (0 if bias is None else bias)
            y = np.full((T, N), np.nan, np.float32)
            qlib.fn(spec)(qlib.pool, xptr, T, qlib.ptr(packed, "uint8_t *"), qlib.ptr(bias, "float *"),
                          qlib.ptr(y, "float *"))
            assert rel_err(y, ref) <= F32_TOL, (qlib.isa, name, K, N, T, rel_err(y, ref))


INT_FORMATS = [name for name in QUANT_FORMATS if get_format(name).kind == "int"]


@pytest.mark.parametrize("name", INT_FORMATS)
def test_f32_activation_linear_matches_dequantized_reference(qlib: KernelLib, name: str) -> None:
    """linear_qf32 (integer weights, f32 activations: --act-precision f32) within F32_TOL of
    x @ dequantize(W)^T, with no rounding of x at all."""
    for K, N in LINEAR_SHAPES:
        if not fits(name, K):
            continue
        spec = KernelSpec.make("linear_qf32", qlib.isa, K=K, N=N, wformat=name)
        qt, bias = _linear_case(name, K, N, K + N)
        packed = qt.pack()
        wdeq = qt.dequantize().astype(np.float64)
        rng = np.random.default_rng(K * N + 1)
        for T in TOKENS:
            x = (rng.standard_normal((T, K)) * 2).astype(np.float32)
            ref = x.astype(np.float64) @ wdeq.T + (0 if bias is None else bias)
            y = _run_linear(qlib, spec, x, packed, bias, N)
            assert rel_err(y, ref) <= F32_TOL, (qlib.isa, name, K, N, T, rel_err(y, ref))


@pytest.mark.parametrize("name", QUANT_FORMATS)
def test_embedding_rows_exact(qlib: KernelLib, name: str) -> None:
    spec = KernelSpec.make("embedding_q", qlib.isa, V=37, H=64, wformat=name)
    qt = quantize(np.random.default_rng(9).standard_normal((37, 64)).astype(np.float32), name, search=False)
    ids = np.array([0, 36, 17, 16, 15, -1, 40], np.int32)
    out = np.full((len(ids), 64), np.nan, np.float32)
    packed = qt.pack()                                  # kept alive across the call
    qlib.fn(spec)(qlib.ptr(ids, "int32_t *"), len(ids), qlib.ptr(packed, "uint8_t *"), qlib.ptr(out, "float *"))
    table = qt.dequantize()
    assert np.array_equal(out[:5], table[ids[:5]]) and not out[5:].any()


@pytest.mark.slow       # compile-only: a whole kernel grid built for a target it does not run
@pytest.mark.parametrize("isa", COMPILE_ONLY)
def test_compile_only_targets_build(isa: str) -> None:
    """Targets this host cannot run (AVX-VNNI, AMX) still compile every quantized kernel."""
    specs = grid_specs(isa)
    sources, baseline = library_sources(specs, TARGETS[isa])
    assert build_library(sources, TARGETS[isa], baseline_sources=baseline).path.is_file()


def test_avx_vnni_is_chosen_where_the_cpu_has_it(monkeypatch) -> None:
    from infeng_compiler.codegen.target import native_target

    if not {"avx2", "fma", "f16c", "avx_vnni"} <= HOST:
        pytest.skip("this host has no AVX-VNNI (INFENG_CPU_FEATURES only removes features)")
    monkeypatch.setenv("INFENG_CPU_FEATURES", "avx2,fma,f16c,avx_vnni")
    assert native_target().name == "avx2-vnni"
    monkeypatch.setenv("INFENG_CPU_FEATURES", "avx2,fma,f16c")
    assert native_target().name == "avx2"



def _run_linear(qlib: KernelLib, spec: KernelSpec, rows: np.ndarray, packed: np.ndarray, bias: np.ndarray | None,
                N: int) -> np.ndarray:
    y = np.full((len(rows), N), np.nan, np.float32)
    rows = np.ascontiguousarray(rows)
    qlib.fn(spec)(qlib.pool, qlib.ptr(rows, "void *"), len(rows), qlib.ptr(packed, "uint8_t *"),
                  qlib.ptr(bias, "float *"), qlib.ptr(y, "float *"))
    return y


@pytest.mark.parametrize("name", QUANT_FORMATS)
def test_linear_rows_do_not_depend_on_the_row_count(qlib: KernelLib, name: str) -> None:
    """A token row's outputs are the same bits whether the step has 1 row or many (greedy
    speculative decoding verifies drafted tokens in one step and must reproduce one-row decode)."""
    fmt = get_format(name)
    T = max(TOKENS)
    for K, N in LINEAR_SHAPES:
        if not fits(name, K):
            continue
        spec = KernelSpec.make(linear_op(name), qlib.isa, K=K, N=N, wformat=name)
        qt, bias = _linear_case(name, K, N, K + N)
        packed = qt.pack()
        x = (np.random.default_rng(K + 3 * N).standard_normal((T, K)) * 2).astype(np.float32)
        xin = pack_act_rows(x, 8 if fmt.bits == 4 else 16) if fmt.kind == "int" else x
        together = _run_linear(qlib, spec, xin, packed, bias, N)
        # streamed up to STREAM_T rows, in passes of at most 8 rows and of even size (9 = 5 + 4)
        slices = [(0, 2), (1, 4), (3, 8), (2, 7), (0, 8), (0, 9), (4, 8), (9, 16), (0, 12), (2, 15), (0, 16), (1, 17)]
        for t0, t1 in [(t, t + 1) for t in range(T)] + slices:
            part = _run_linear(qlib, spec, xin[t0:t1], packed, bias, N)
            assert np.array_equal(part, together[t0:t1]), (qlib.isa, name, K, N, t0, t1)
        if fmt.kind == "int":                          # the f32-activation kernel too
            f32 = KernelSpec.make("linear_qf32", qlib.isa, K=K, N=N, wformat=name)
            together = _run_linear(qlib, f32, x, packed, bias, N)
            for t0, t1 in [(t, t + 1) for t in range(T)] + slices:
                assert np.array_equal(_run_linear(qlib, f32, x[t0:t1], packed, bias, N), together[t0:t1]), \
                    (qlib.isa, name, K, N, t0, t1, "f32 activations")
