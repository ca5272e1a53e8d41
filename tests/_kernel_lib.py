"""The kernel tests' library: a grid of KernelSpecs for one ISA, built once, loaded with cffi, with
a pool of POOL_THREADS threads; the error metric they share; one attention step's inputs and run."""
from __future__ import annotations

import cffi
import numpy as np

from infeng_compiler.codegen.build import build_library
from infeng_compiler.codegen.kernels import KernelSpec, cdef, library_sources
from infeng_compiler.codegen.target import TARGETS

POOL_THREADS = 3          # more than the 2 cores of the CI machine: uneven ranges, preempted workers


class KernelLib:
    """``specs`` built for ``isa`` into one library; ``extra_cdef``: declarations beyond the
    kernels' entry points (e.g. the per-expert ``_rows`` entries)."""

    def __init__(self, isa: str, specs: list[KernelSpec], extra_cdef: str = ""):
        self.isa = isa
        self.target = TARGETS[isa]
        sources, baseline = library_sources(specs, self.target)
        self.build = build_library(sources, self.target, baseline_sources=baseline)
        self.ffi = cffi.FFI()
        self.ffi.cdef(cdef(specs) + extra_cdef)
        self.lib = self.ffi.dlopen(str(self.build.path))
        self.pool = self.ffi.gc(self.lib.ife_pool_create(POOL_THREADS), self.lib.ife_pool_destroy)

    def pool_of(self, threads: int):
        """Another pool, of ``threads`` threads (the library's own has POOL_THREADS)."""
        return self.ffi.gc(self.lib.ife_pool_create(threads), self.lib.ife_pool_destroy)

    def fn(self, spec: KernelSpec):
        return getattr(self.lib, spec.symbol)

    def ptr(self, array: np.ndarray | None, ctype: str = "void *"):
        """A pointer to ``array``'s data (NULL for None); ``void *`` passes for any pointer argument."""
        if array is None:
            return self.ffi.NULL
        assert array.flags.c_contiguous
        return self.ffi.cast(ctype, self.ffi.from_buffer(array))


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| over max |ref| (in float64)."""
    scale = float(np.max(np.abs(ref))) or 1.0
    return float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64)))) / scale


def attention_step(rng: np.random.Generator, step, n_heads: int, n_kv_heads: int, head_dim: int):
    """(slots, positions, q, k, v) of an attention step given as [(slot, positions), ...]: random
    rows, q scaled by 2 so that the softmax is not flat."""
    slots = np.array([s for s, ps in step for _ in ps], dtype=np.int32)
    pos = np.array([p for _, ps in step for p in ps], dtype=np.int32)
    q = rng.standard_normal((len(pos), n_heads * head_dim), dtype=np.float32) * 2.0
    k, v = (rng.standard_normal((len(pos), n_kv_heads * head_dim), dtype=np.float32) for _ in range(2))
    return slots, pos, q, k, v


def run_attention(klib: KernelLib, spec: KernelSpec, step_inputs, cache, pool=None) -> np.ndarray:
    """One step of an attention (or attention_sinks) kernel of ``klib``: ``step_inputs`` as
    attention_step returns them, ``cache`` = (block_table, max_blocks, k_cache, v_cache)."""
    slots, pos, q, k, v = step_inputs
    block_table, max_blocks, k_cache, v_cache = cache
    out = np.full_like(q, np.nan)
    klib.fn(spec)(klib.pool if pool is None else pool, klib.ptr(q), klib.ptr(k), klib.ptr(v), len(pos),
                  klib.ptr(pos, "int32_t *"), klib.ptr(slots, "int32_t *"), klib.ptr(block_table, "int32_t *"),
                  max_blocks, klib.ptr(k_cache), klib.ptr(v_cache), klib.ptr(out))
    return out


def paged_cache(rng: np.random.Generator, slots: int, positions: int, block_size: int, n_kv_heads: int,
                head_dim: int):
    """(block_table, max_blocks, k_cache, v_cache): an f32 paged cache for ``slots`` sequences of up to
    ``positions`` positions, their blocks scattered over the pool (one spare)."""
    max_blocks = positions // block_size + 1
    n_blocks = slots * max_blocks + 1
    block_table = rng.permutation(n_blocks)[: slots * max_blocks].astype(np.int32).reshape(slots, max_blocks)
    k_cache = np.zeros((n_blocks, block_size, n_kv_heads, head_dim), np.float32)
    return block_table, max_blocks, k_cache, np.zeros_like(k_cache)
