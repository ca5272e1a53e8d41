"""AMX: the tile instructions of ife_kernels.h (emulated in C on every host, native where AMX is
usable) against numpy's reading of the SDM; the AMX int4/int8 linears against the dequantized
reference and bit-identical to the avx512-bf16 kernels at every token count (a row's result must
not depend on the step's row count: greedy speculative decoding); stories260K compiled for amx-emu
(and amx) against the interpreter, with the avx512-bf16 build's greedy tokens.

``amx`` runs only where the host has AMX (CPUID, XCR0 and the kernel's permission); elsewhere its
tests are skipped with that reason and its sources are still compiled with the -mamx-* flags."""
from __future__ import annotations

import functools
import signal
import subprocess
import sys
from pathlib import Path

import cffi
import numpy as np
import pytest
from _kernel_lib import KernelLib, rel_err
from test_quant_compiled import STORY, TOLERANCE

from infeng_compiler.codegen import quant_kernels
from infeng_compiler.codegen.build import build_library
from infeng_compiler.codegen.kernels import (
    COMMON_HEADER,
    SUPPORT_SOURCE,
    KernelSpec,
    library_sources,
    render_common,
    render_kernel,
    render_support,
)
from infeng_compiler.codegen.quant_kernels import linear_op
from infeng_compiler.codegen.target import TARGETS, host_features
from infeng_compiler.compile import CompileOptions, compile_model
from infeng_compiler.frontends.hf import import_hf
from infeng_compiler.interp import Interpreter
from infeng_compiler.ir.types import f32_to_bf16
from infeng_compiler.passes.manager import PassManager
from infeng_compiler.quant.act import fake_quant, pack_act_rows
from infeng_compiler.quant.formats import get_format
from infeng_compiler.quant.search import quantize
from infeng_runtime.engine import Engine
from infeng_common.tokenizer import Tokenizer

HOST = host_features()
AMX_MISSING = ", ".join(TARGETS["amx"].missing_features(HOST))
#: amx-emu wherever avx512-bf16 runs (the slow set: tests/_isa.py); amx where the host has AMX (skipped with the
#: reason elsewhere)
AMX_ISAS = [
    pytest.param("amx-emu", marks=[pytest.mark.slow,
                                   pytest.mark.skipif(bool(TARGETS["amx-emu"].missing_features(HOST)),
                                                      reason="this host has no AVX-512 BF16 (amx-emu's base)")]),
    pytest.param("amx", marks=pytest.mark.skipif(bool(AMX_MISSING),
                                                  reason=f"this host has no usable AMX (lacks {AMX_MISSING})")),
]
F32_TOL = 1e-5                 # max abs error / max |reference|, as tests/test_quant_kernels.py

# ---------------------------------------------------------------------------------------------
# (a) the tile instructions
TILE_OPS = {"dpbssd": (0, True, True), "dpbsud": (1, True, False), "dpbusd": (2, False, True),
            "dpbuud": (3, False, False), "dpbf16ps": (4, None, None)}
TILE_PROGRAM = """#include "ife_kernels.h"
/* C (tile 0) = op(C, A (tile 1), B (tile 2)) under the configuration cfg: load, multiply, store. */
void tile_op(const void *cfg, int op, void *c, int ldc, const void *a, int lda, const void *b, int ldb) {
    ife_amx_loaded_cfg = NULL;          /* cfg is the caller's buffer: its address may come back with other contents */
    ife_amx_configure((const ife_tilecfg *)cfg);
    IFE_TILE_LOAD(0, c, ldc);
    IFE_TILE_LOAD(1, a, lda);
    IFE_TILE_LOAD(2, b, ldb);
    switch (op) {
    case 0: IFE_TILE_DPBSSD(0, 1, 2); break;
    case 1: IFE_TILE_DPBSUD(0, 1, 2); break;
    case 2: IFE_TILE_DPBUSD(0, 1, 2); break;
    case 3: IFE_TILE_DPBUUD(0, 1, 2); break;
    default: IFE_TILE_DPBF16PS(0, 1, 2); break;
    }
    IFE_TILE_STORE(0, c, ldc);
}

static void no_work(void *ctx, int begin, int end) { (void)ctx, (void)begin, (void)end; }

/* Whether the caller's cached tile configuration is forgotten when it runs a job (another
 * library's kernels may have loaded theirs on this thread since). */
int job_forgets_loaded_config(void) {
    static const ife_tilecfg cfg = {.palette = 1};
    ife_amx_loaded_cfg = &cfg;
    ife_pool *pool = ife_pool_create(2);
    ife_parallel_for(pool, 4, no_work, NULL);
    ife_pool_destroy(pool);
    return ife_amx_loaded_cfg == NULL;
}
"""


@functools.cache
def tile_program(isa: str):
    target = TARGETS[isa]
    sources = {COMMON_HEADER: render_common(), SUPPORT_SOURCE: render_support(target), "tile_op.c": TILE_PROGRAM}
    build = build_library(sources, target, baseline_sources={SUPPORT_SOURCE})
    ffi = cffi.FFI()
    ffi.cdef("void tile_op(const void *cfg, int op, void *c, int ldc, const void *a, int lda, const void *b, int ldb);"
             "int ife_cpu_check(char *missing, int len); int job_forgets_loaded_config(void);")
    return ffi, ffi.dlopen(str(build.path))


def tile_config(m: int, k_bytes: int, n: int) -> np.ndarray:
    """The 64-byte LDTILECFG operand: C m x 4n bytes, A m x k_bytes, B k_bytes/4 x 4n."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1                                                   # palette 1
    colsb, rows = cfg[16:48].view(np.uint16), cfg[48:64]
    colsb[:3] = (4 * n, k_bytes, 4 * n)
    rows[:3] = (m, m, k_bytes // 4)
    return cfg


def run_tile_op(isa: str, op: str, cfg: np.ndarray, c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ffi, lib = tile_program(isa)
    assert lib.ife_cpu_check(ffi.NULL, 0) == 0          # asks for the tile permission where AMX is native
    out = c.copy()
    ptr = lambda arr: ffi.cast("void *", ffi.from_buffer(arr))    # noqa: E731
    lib.tile_op(ptr(cfg), TILE_OPS[op][0], ptr(out), out.strides[0], ptr(a), a.strides[0], ptr(b), b.strides[0])
    return out


def wrap_i32(x: np.ndarray) -> np.ndarray:
    return ((x.astype(np.int64) + 2**31) % 2**32 - 2**31).astype(np.int32)


@pytest.mark.parametrize("isa", AMX_ISAS)
@pytest.mark.parametrize("op", ["dpbssd", "dpbsud", "dpbusd", "dpbuud"])
@pytest.mark.parametrize("m,k_bytes,n", [(16, 64, 16), (5, 20, 9), (1, 4, 1), (16, 32, 16)])
def test_int8_tile_products(isa: str, op: str, m: int, k_bytes: int, n: int) -> None:
    """C.i32[i][j] += sum over k, q of A.x8[i][4k+q] * B.x8[k][4j+q], signed or unsigned bytes as
    the op says, with int32 wrap-around; a configuration of fewer rows or bytes than the buffers
    touches only its part of C."""
    _, a_signed, b_signed = TILE_OPS[op]
    rng = np.random.default_rng(m * 1000 + k_bytes + n)
    a = rng.integers(0, 256, (16, 64), dtype=np.uint8)
    b = rng.integers(0, 256, (16, 64), dtype=np.uint8)
    c = rng.integers(-2**31, 2**31, (16, 16), dtype=np.int64).astype(np.int32)
    c[0, 0], c[-1, -1] = 2**31 - 1, -2**31                   # sums that wrap
    got = run_tile_op(isa, op, tile_config(m, k_bytes, n), c, a, b)
    kq = k_bytes // 4
    av = (a.view(np.int8) if a_signed else a)[:m, :k_bytes].astype(np.int64).reshape(m, kq, 4)
    bv = (b.view(np.int8) if b_signed else b)[:kq, :4 * n].astype(np.int64).reshape(kq, n, 4)
    want = c.copy()
    want[:m, :n] = wrap_i32(c[:m, :n].astype(np.int64) + np.einsum("ikq,kjq->ij", av, bv))
    np.testing.assert_array_equal(got, want)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return f32_to_bf16(np.asarray(x, np.float32))


def bf16_value(bits: np.ndarray) -> np.ndarray:
    """bf16 bits as float32, denormals as zero (the tile unit's DAZ)."""
    bits = bits.astype(np.uint32)
    bits = np.where(bits & 0x7F80 == 0, bits & 0x8000, bits)
    return (bits << 16).view(np.float32)


def ftz(x: np.ndarray) -> np.ndarray:
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0) * x, x).astype(np.float32)


@pytest.mark.parametrize("isa", AMX_ISAS)
@pytest.mark.parametrize("m,k_bytes,n", [(16, 64, 16), (3, 12, 5)])
def test_bf16_tile_product(isa: str, m: int, k_bytes: int, n: int) -> None:
    """TDPBF16PS as the SDM's pseudo-code: per element an even and an odd fp32 sum from zero, each
    k adding its product with one rounding (FMA), then C += even + odd; round to nearest even,
    denormal inputs read as zero, denormal results flushed to zero. The emulation follows it
    exactly; the hardware is held to the same values within fp32 rounding, and exactly on the
    denormal cases."""
    rng = np.random.default_rng(m + n)
    kq = k_bytes // 4
    a = bf16_bits(rng.standard_normal((16, 32)))
    b = bf16_bits(rng.standard_normal((16, 32)))
    c = rng.standard_normal((16, 16)).astype(np.float32)
    a[0:3], c[0:2] = 0, 0.0                 # rows 0 and 1: one product each, from zero
    a[0, 0], b[0, 0] = 0x0001, 0x7180       # a denormal input x 2^100: 1e-10 unless read as zero (DAZ)
    a[1, 0], b[0, 2] = 0x1C80, 0x1C80       # 2^-70 x 2^-70: a denormal result, 2^-140 unless flushed (FTZ)
    a[2, 0:2 * kq:2], b[:, 4], b[:, 5], c[2, 2] = 0x3900, 0x3980, 0, 1.0    # 1 + kq x 2^-25: the sums first
    got = run_tile_op(isa, "dpbf16ps", tile_config(m, k_bytes, n), c, a, b)
    want = c.copy()
    av, bv = bf16_value(a[:m, :2 * kq]).astype(np.float64), bf16_value(b[:kq, :2 * n]).astype(np.float64)
    for i in range(m):
        sums = np.zeros((2, n), np.float32)                     # even, odd
        for k in range(kq):
            for q in range(2):                                  # the product is exact in float64: one rounding
                sums[q] = ftz((av[i, 2 * k + q] * bv[k, q::2] + sums[q]).astype(np.float32))
        want[i, :n] = ftz(ftz(c[i, :n]) + ftz(sums[0] + sums[1]))
    assert not want[0, :n].any() and want[1, 1] == 0.0 and want[1, 0] != 0.0 and want[2, 2] > 1.0
    if isa == "amx-emu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert not got[0, :n].any() and got[1, 1] == 0.0


@pytest.mark.skipif(bool(TARGETS["amx-emu"].missing_features(HOST)), reason="this host has no AVX-512 BF16")
@pytest.mark.parametrize("case", ["17 rows", "B rows != A dwords", "unconfigured"])
def test_emulation_refuses_what_the_hardware_faults_on(case: str) -> None:
    """A configuration LDTILECFG refuses (#GP) or a tile product whose shapes do not fit (#UD) stops
    the emulated program too, so that amx-emu's tests fail where an AMX CPU would fault."""
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import numpy as np
from test_amx import run_tile_op, tile_config
cfg = tile_config(16, 64, 16)
if {case!r} == "17 rows":
    cfg[48] = 17
elif {case!r} == "B rows != A dwords":
    cfg[48 + 2] = 8
else:
    cfg[0] = 0
c, a, b = np.zeros((16, 16), np.int32), np.zeros((16, 64), np.int8), np.zeros((16, 64), np.int8)
run_tile_op("amx-emu", "dpbssd", cfg, c, a, b)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGABRT, done.stderr[-2000:]
    assert "infeng: AMX emulation:" in done.stderr


def test_a_job_reloads_the_callers_tile_config() -> None:
    """Each library caches the tile configuration a thread loaded; the caller's is dropped at every
    job, since it may have run another library's tile kernels in between (natively a stale belief
    faults or multiplies with another kernel's shapes; the check itself runs on any host)."""
    _, lib = tile_program("amx-emu")
    assert lib.job_forgets_loaded_config() == 1


# ---------------------------------------------------------------------------------------------
# (b) the AMX linears
INT_FORMATS = ["q4g32", "q4g64", "q4g128", "q4g32a", "q4g64a", "q4g128a", "q4g32m", "q4g64m", "q4g128m",
               "q8r", "q8g32", "q8g64", "q8g128"]
# (K, N): K a multiple of 32 but not of 64; K not a multiple of 32 (padded formats; q8r: KP % 4 == 0);
# K = 1102 (q8r: five chunks of 256, the last of 78 k, KP % 4 == 2); N not a multiple of 16
AMX_SHAPES = [(96, 33), (172, 20), (1102, 40)]


def amx_min_t(op: str) -> int:
    return quant_kernels.AMX_MIN_T_Q4 if op == "linear_q4" else quant_kernels.AMX_MIN_T_Q8


def token_counts(op: str) -> list[int]:
    """One row (VNNI), either side of the switch to tiles, 17 and 33 (a last tile of 1 row)."""
    return sorted({1, amx_min_t(op) - 1, amx_min_t(op), 17, 33})


def fits(name: str, K: int) -> bool:
    return get_format(name).group <= max(K, 32)


def amx_grid(isa: str) -> list[KernelSpec]:
    return [KernelSpec.make(linear_op(name), isa, K=K, N=N, wformat=name)
            for name in INT_FORMATS for K, N in AMX_SHAPES if fits(name, K)]


@functools.cache
def amx_lib(isa: str) -> KernelLib:
    return KernelLib(isa, amx_grid(isa))


@pytest.mark.slow       # compile-only: a whole kernel grid built for a target it does not run
def test_amx_kernels_compile_natively() -> None:
    """The amx grid and the tile program build with the -mamx-* flags (native tile instructions) on
    any host; loading them runs no instruction."""
    tile_program("amx")
    specs = amx_grid("amx")
    sources, baseline = library_sources(specs, TARGETS["amx"])
    assert all("IFE_TILE_DPB" in sources[f"{spec.symbol}.c"] for spec in specs)     # the tile kernels
    assert build_library(sources, TARGETS["amx"], baseline_sources=baseline).path.is_file()


@pytest.mark.parametrize("isa", AMX_ISAS)
@pytest.mark.parametrize("name", INT_FORMATS)
def test_amx_linear_bit_identical_to_vnni(isa: str, name: str) -> None:
    if TARGETS["avx512-bf16"].missing_features(HOST):
        pytest.skip("this host has no AVX-512 BF16 (the kernels compared against)")
    lib, vnni = amx_lib(isa), amx_lib("avx512-bf16")
    assert lib.ffi.string(lib.lib.ife_target_name()).decode() == isa
    fmt = get_format(name)
    bits = 8 if fmt.bits == 4 else 16
    for K, N in AMX_SHAPES:
        if not fits(name, K):
            continue
        rng = np.random.default_rng(K + N)
        w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
        w[:, 3] *= 6                                                     # an outlier column
        qt = quantize(w, name, search=False)
        packed, wdeq = qt.pack(), qt.dequantize().astype(np.float64)
        op = linear_op(name)
        for bias in (None, rng.standard_normal(N).astype(np.float32)):
            for T in token_counts(op):
                x = (rng.standard_normal((T, K)) * 2).astype(np.float32)
                xin, xref = pack_act_rows(x, bits), fake_quant(x, 32 if bits == 8 else 0, bits)
                ys = []
                for klib in (lib, vnni):
                    y = np.full((T, N), np.nan, np.float32)
                    spec = KernelSpec.make(op, klib.isa, K=K, N=N, wformat=name)
                    klib.fn(spec)(klib.pool, klib.ptr(xin), T, klib.ptr(packed), klib.ptr(bias), klib.ptr(y))
                    ys.append(y)
                ref = xref.astype(np.float64) @ wdeq.T + (0 if bias is None else bias)
                assert rel_err(ys[0], ref) <= F32_TOL, (isa, name, K, N, T, rel_err(ys[0], ref))
                np.testing.assert_array_equal(ys[0].view(np.uint32), ys[1].view(np.uint32),
                                              err_msg=f"{isa} {name} K={K} N={N} T={T}")


# ---------------------------------------------------------------------------------------------
# (c) stories260K end to end
#: token rows from which the model test's linears take the tiles: its prefill (and a two-sequence
#: decode step) runs them, one-row decode the VNNI code
TEST_AMX_MIN_T = 2


@pytest.fixture(scope="module")
def artifacts(stories_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("amx")
    built: dict[tuple[str, str], Path] = {}

    def get(preset: str, target: str) -> Path:
        if (preset, target) not in built:
            out = root / f"{preset}-{target}.infeng"
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(quant_kernels, "AMX_MIN_T_Q4", TEST_AMX_MIN_T)
                mp.setattr(quant_kernels, "AMX_MIN_T_Q8", TEST_AMX_MIN_T)
                for op, wformat in (("linear_q4", "q4g32"), ("linear_q8", "q8r")):    # what the build renders
                    assert f"AMX_MIN_T = {TEST_AMX_MIN_T}," in render_kernel(
                        KernelSpec.make(op, "amx-emu", K=64, N=16, wformat=wformat))
                compile_model(stories_dir, out, CompileOptions(target=target, quant=preset, act_precision="int8"))
            built[(preset, target)] = out
        return built[(preset, target)]

    return get


def greedy(engine: Engine, ids: np.ndarray, steps: int) -> tuple[np.ndarray, list[int]]:
    """Prefill logits and the greedy continuation, one token per step."""
    n = len(ids)
    logits = engine.step(ids, np.arange(n, dtype=np.int32), np.zeros(n, np.int32))
    tokens = [int(logits[-1].argmax())]
    for pos in range(n, n + steps - 1):
        row = engine.step(np.array(tokens[-1:], np.int32), np.array([pos], np.int32), np.zeros(1, np.int32))
        tokens.append(int(row[-1].argmax()))
    return logits, tokens


@pytest.mark.parametrize("isa", AMX_ISAS)
@pytest.mark.parametrize("preset", ["int4", "int8"])
def test_stories_compiled_matches_interpreter(artifacts, stories_dir, isa: str, preset: str) -> None:
    if TARGETS["avx512-bf16"].missing_features(HOST):
        pytest.skip("this host has no AVX-512 BF16 (the build compared against)")
    artifact = artifacts(preset, isa)
    ids = np.array(Tokenizer(stories_dir, 1, [2]).encode(STORY, add_bos=True), np.int32)
    g = import_hf(stories_dir)
    PassManager([("quantize", [preset])]).run(g)
    ref = Interpreter(g).step(ids, np.arange(len(ids), dtype=np.int32), np.zeros(len(ids), np.int32))
    logits, tokens = greedy(Engine(artifact, max_seqs=2), ids, 8)
    assert np.abs(logits - ref).max() / np.abs(ref).max() <= TOLERANCE[preset]
    assert (logits.argmax(axis=1) == ref.argmax(axis=1)).mean() >= 0.97
    want_logits, want_tokens = greedy(Engine(artifacts(preset, "avx512-bf16"), max_seqs=2), ids, 8)
    np.testing.assert_array_equal(logits.argmax(axis=1), want_logits.argmax(axis=1))
    assert tokens == want_tokens
