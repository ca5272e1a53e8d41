"""The amx attention (templates/kernels/attention/amx.c.j2) against the numpy reference.

Runs on ``amx-emu`` (the tile instructions emulated in C) on every host that runs avx512-bf16, and
on ``amx`` where the host has AMX; elsewhere the native library is still built (``-mamx-*``). Each
library is built with the default run threshold ``AMX_ATTENTION_MIN_T`` and with a low one
(``LOW_MIN_T``) so that short runs take the tiles too, and with one bf16 part per value as well as
the default two. Rows of a run below the threshold take the AVX-512 path and must meet the f32
tolerance; rows on the tiles meet ``TWO_PART_TOL`` (Q, K, P, V as hi + lo bf16 parts) or
``BF16_TOL`` (rounded to bf16).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from _kernel_lib import KernelLib

from infeng_compiler.codegen import kernels, moe_kernels
from infeng_compiler.codegen.build import build_library
from infeng_compiler.codegen.kernels import KernelSpec, library_sources, template_isa
from infeng_compiler.codegen.target import TARGETS, host_features
from infeng_compiler.interp import KVStore, Step
from infeng_compiler.ir.ops import REGISTRY

assert "attention_sinks" in moe_kernels.OPS       # registered by importing moe_kernels
HOST = host_features()
F32_TOL = 1e-5            # max abs error / max |reference|, as tests/test_kernels.py
#: Q, K, P and V rounded to bf16 (8 significant bits, 2^-9 relative each), fp32 sums: up to 7.4e-3 of
#: max |output| on these shapes (the scores' errors grow with |q||k|); 2e-2 as the bf16 linears.
BF16_TOL = 2e-2
#: Two bf16 parts, three products (about 2^-16 relative): below 2.5e-5 on these shapes.
TWO_PART_TOL = 1e-4
LOW_MIN_T = 4
CASES = [  # (n_heads, n_kv_heads, head_dim, block_size, window)
    (8, 4, 8, 16, 0),      # stories260K's heads
    (6, 2, 16, 8, 0),
    (9, 3, 64, 16, 0),     # smollm135's heads
    (4, 4, 40, 32, 21),    # head dims that are not whole tiles; a sliding window
]
SINKS = (4, 2, 16, 16, 0)
ISAS = [pytest.param("amx-emu", marks=pytest.mark.slow), "amx"]     # amx-emu: the slow set (tests/_isa.py)


def spec_of(isa: str, case: tuple, sinks: bool = False) -> KernelSpec:
    h, kvh, hd, block, window = case
    extra = {"sinks": tuple(np.linspace(-4.0, 6.0, h).tolist())} if sinks else {}
    return KernelSpec.make("attention_sinks" if sinks else "attention", isa, n_heads=h, n_kv_heads=kvh, head_dim=hd,
                           block_size=block, scale=1 / math.sqrt(hd), window=window, **extra)


def specs_of(isa: str) -> list[KernelSpec]:
    return [spec_of(isa, case) for case in CASES] + [spec_of(isa, SINKS, sinks=True)]


@functools.cache
def library(isa: str, min_t: int, parts: int) -> KernelLib:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "AMX_ATTENTION_MIN_T", min_t)
        mp.setattr(kernels, "AMX_ATTENTION_PARTS", parts)
        return KernelLib(isa, specs_of(isa))


def need(isa: str) -> None:
    missing = TARGETS[isa].missing_features(HOST)
    if missing:
        pytest.skip(f"this host lacks {', '.join(missing)} for {isa}")


def steps(min_t: int) -> list[list[tuple[int, range]]]:
    """(slot, positions) per step: runs of 1, min_t - 1, min_t, 17, 33 and 70 rows of one sequence
    (70: more keys than one chunk), mixed with other sequences' decode rows; contexts end anywhere in
    a block; the last step's 45 rows reach past the AVX-512 path's first key chunk (128 positions)."""
    return [
        [(0, range(33))],
        [(1, range(17)), (0, range(33, 34))],
        [(2, range(min_t - 1)), (0, range(34, 35)), (1, range(17, 18))],
        [(3, range(min_t)), (1, range(18, 19))],
        [(0, range(35, 105)), (2, range(min_t - 1, min_t)), (3, range(min_t, min_t + 1))],
        [(3, range(min_t + 1, 2 * min_t + 1)), (0, range(105, 150))],
    ]


def run_steps(klib: KernelLib, spec: KernelSpec, min_t: int, tile_tol: float) -> None:
    p = dict(spec.params)
    h, kvh, hd, block, window = p["n_heads"], p["n_kv_heads"], p["head_dim"], p["block_size"], p["window"]
    sinks = np.array(p["sinks"], np.float32) if spec.op == "attention_sinks" else None
    attrs = {"layer": 0, "n_heads": h, "n_kv_heads": kvh, "head_dim": hd, "scale": p["scale"], "window": window,
             **({"sinks": True} if sinks is not None else {})}
    rng = np.random.default_rng(hd * block + window)
    slots, max_blocks = 4, max(150, 2 * min_t + 1) // block + 1
    n_blocks = slots * max_blocks + 3
    block_table = rng.permutation(n_blocks)[: slots * max_blocks].astype(np.int32).reshape(slots, max_blocks)
    k_cache = np.zeros((n_blocks, block, kvh, hd), np.float32)
    v_cache = np.zeros_like(k_cache)
    store = KVStore()
    for step in steps(min_t):
        seq = np.array([s for s, ps in step for _ in ps], dtype=np.int32)
        pos = np.array([q for _, ps in step for q in ps], dtype=np.int32)
        tiled = np.array([len(ps) >= min_t for _, ps in step for _ in ps])
        T = len(pos)
        q = rng.standard_normal((T, h * hd), dtype=np.float32) * 2.0
        k, v = (rng.standard_normal((T, kvh * hd), dtype=np.float32) for _ in range(2))
        ctx = Step(seq_ids=seq, logits_rows=np.arange(T), kv=store)
        ref = REGISTRY["attention"].reference([q, k, v, pos], [] if sinks is None else [sinks], attrs, ctx)[0]
        out = np.full_like(q, np.nan)
        klib.fn(spec)(klib.pool, klib.ptr(q), klib.ptr(k), klib.ptr(v), T, klib.ptr(pos, "int32_t *"),
                      klib.ptr(seq, "int32_t *"), klib.ptr(block_table, "int32_t *"), max_blocks,
                      klib.ptr(k_cache), klib.ptr(v_cache), klib.ptr(out))
        scale = float(np.max(np.abs(ref)))
        err = np.max(np.abs(out.astype(np.float64) - ref), axis=1) / scale
        assert np.all(np.isfinite(out)), f"step {step}: non-finite outputs"
        if tiled.any():
            assert err[tiled].max() <= tile_tol, f"step {step}: tile rows' error {err[tiled].max():.3g}"
        if (~tiled).any():
            assert err[~tiled].max() <= F32_TOL, f"step {step}: AVX-512 rows' error {err[~tiled].max():.3g}"
        if tiled.any():     # rows off the tiles in a tiled step: the bits a step of that row alone gives
            for t in np.flatnonzero(~tiled)[[0, -1]] if (~tiled).any() else ():
                alone = np.full_like(q[:1], np.nan)
                klib.fn(spec)(klib.pool, klib.ptr(q[t:t + 1]), klib.ptr(k[t:t + 1]), klib.ptr(v[t:t + 1]), 1,
                              klib.ptr(pos[t:t + 1], "int32_t *"), klib.ptr(seq[t:t + 1], "int32_t *"),
                              klib.ptr(block_table, "int32_t *"), max_blocks, klib.ptr(k_cache), klib.ptr(v_cache),
                              klib.ptr(alone))
                np.testing.assert_array_equal(alone[0], out[t], err_msg=f"step {step}: row {t} alone")


@pytest.mark.parametrize("min_t,parts", [(LOW_MIN_T, 2), (kernels.AMX_ATTENTION_MIN_T, 2), (LOW_MIN_T, 1)],
                         ids=["low-threshold", "default", "one-part"])
@pytest.mark.parametrize("case", CASES + [SINKS], ids=lambda c: "h{}kv{}d{}b{}w{}".format(*c))
@pytest.mark.parametrize("isa", ISAS)
def test_amx_attention(isa: str, case: tuple, min_t: int, parts: int):
    """Prefill runs of every length around the threshold, decode rows and mixed steps over a paged
    cache with scattered blocks; attention_sinks (the same template with SINKS) in the last case."""
    need(isa)
    spec = spec_of(isa, case, sinks=case is SINKS)
    assert template_isa(spec) == "amx"
    run_steps(library(isa, min_t, parts), spec, min_t, TWO_PART_TOL if parts == 2 else BF16_TOL)


@pytest.mark.parametrize("parts", [2, 1])
def test_amx_attention_compiles_natively(parts: int):
    """The native amx attention (tile intrinsics, -mamx-*) builds on every host, AMX or not."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "AMX_ATTENTION_PARTS", parts)
        sources, baseline = library_sources(specs_of("amx"), TARGETS["amx"])
    assert any("IFE_TILE_DPBF16PS" in text for text in sources.values())
    build_library(sources, TARGETS["amx"], baseline_sources=baseline)


def test_verification_rows_stay_on_the_vector_path():
    """A verification step (1 + at most 32 drafted tokens, runtime/spec/config.py) is below the
    threshold, so its rows get the bits one-row decode steps get (greedy speculation stays exact)."""
    from infeng_runtime.spec import SpeculativeConfig, SpeculativeError

    with pytest.raises(SpeculativeError):
        SpeculativeConfig(max_draft=kernels.AMX_ATTENTION_MIN_T - 1)


@pytest.mark.slow
def test_stories260k_on_amx_emu_matches_interpreter(tmp_path, stories_dir):
    """stories260K compiled for amx-emu with a threshold low enough that both prompts' prefill runs
    on the tiles (70 rows: more keys than one chunk), then decode steps on the AVX-512 path, against
    the interpreter's logits with test_compiled's f32 tolerance (seen: 8.7e-6)."""
    from test_compiled import assert_close, run_batch

    from infeng_compiler.compile import CompileOptions, compile_model
    from infeng_compiler.frontends.hf import import_hf
    from infeng_compiler.interp import Interpreter
    from infeng_runtime.engine import Engine

    need("amx-emu")
    artifact = tmp_path / "stories-amx-emu.infeng"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "AMX_ATTENTION_MIN_T", LOW_MIN_T)
        compile_model(stories_dir, artifact, CompileOptions(target="amx-emu"))
    assert "AMX_MIN_T = 4," in "".join(p.read_text() for p in (artifact / "src").glob("ife_attention_*.c"))
    rng = np.random.default_rng(0)
    prompts = [[1, *rng.integers(3, 500, size=69).tolist()], [1, 42, 8, 19, 77, 5, 90, 11, 7]]
    want = run_batch(Interpreter(import_hf(stories_dir)), prompts, 4)
    assert_close(run_batch(Engine(artifact), prompts, 4), want, 1e-4)
