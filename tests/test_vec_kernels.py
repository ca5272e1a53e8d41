"""The ISA vocabulary (templates/kernels/isa/*.h.j2): the op x target matrix, and the kernels written
over it that no other test file runs against a reference (lora_apply), on every ISA this host runs.

The other vocabulary kernels are checked where their ops are: attention_kvq in test_kv_cache.py,
experts in test_moe_kernels.py, the elementwise ops, norms, rope and embedding in test_kernels.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _isa import isa_params
from _kernel_lib import KernelLib, rel_err

from infeng_compiler.codegen import moe_kernels, quant_kernels  # noqa: F401  (they register their ops)
from infeng_compiler.codegen.kernels import (OPS, KernelSpec, op_template, simd_targets, template_isa,
                                             template_matrix_markdown)
from infeng_compiler.codegen.target import runnable_targets

RUNNABLE = runnable_targets()
F32_TOL = 1e-5            # max abs error / max |reference|
CODEGEN_DOC = Path(__file__).resolve().parents[1] / "docs" / "codegen.md"


def test_every_op_is_vectorised_on_every_simd_target_or_says_why_not():
    unexplained = [(op, target) for op in OPS for target in simd_targets()
                   if op_template(op, target) == "scalar" and not OPS[op].scalar_reason]
    assert not unexplained, f"SIMD targets rendering a scalar template with no reason recorded: {unexplained}"


def test_a_reason_is_recorded_only_where_an_op_stays_scalar():
    stale = [op for op, kernel in OPS.items() if kernel.scalar_reason
             and any(op_template(op, target) != "scalar" for target in simd_targets())]
    assert not stale, f"vectorised ops that still carry a scalar reason: {stale}"


def test_docs_print_the_current_matrix():
    assert template_matrix_markdown() in CODEGEN_DOC.read_text(), \
        "docs/codegen.md's op x target matrix is stale: paste template_matrix_markdown()'s table"


# ---------------------------------------------------------------------------------------------
# lora_apply: y += scale[s] * (x A_s^T) B_s for each token's slot s
LORA_CASES = [(576, 96, 8, 3), (37, 19, 4, 2), (16, 16, 1, 1)]      # (K, N, R, slots): tails, one lane group


def lora_specs(isa: str) -> list[KernelSpec]:
    return [KernelSpec.make("lora_apply", isa, K=K, N=N, R=R, slots=S) for K, N, R, S in LORA_CASES]


@pytest.fixture(scope="module", params=isa_params(RUNNABLE))
def lora_lib(request) -> KernelLib:
    return KernelLib(request.param, lora_specs(request.param))


@pytest.mark.parametrize("case", LORA_CASES, ids=lambda c: "k{}n{}r{}s{}".format(*c))
def test_lora_apply(lora_lib: KernelLib, case):
    K, N, R, S = case
    spec = KernelSpec.make("lora_apply", lora_lib.isa, K=K, N=N, R=R, slots=S)
    if lora_lib.isa != "scalar":
        assert template_isa(spec) != "scalar", "a SIMD target fell back to the scalar lora_apply"
    rng = np.random.default_rng(K * N + R)
    T = 23                                  # 5-11 tokens per slot: tiles of 1 to 4 rows of one adapter
    x = rng.standard_normal((T, K), dtype=np.float32)
    a = rng.standard_normal((S, R, K), dtype=np.float32)
    bt = rng.standard_normal((S, R, N), dtype=np.float32)
    rank = np.array([R - i % R for i in range(S)], np.int32)               # padded slots: lower ranks
    scale = rng.uniform(0.5, 2.0, S).astype(np.float32)
    slots = np.array([t % (S + 1) - 1 for t in range(T)], np.int32)        # -1: no adapter
    y0 = rng.standard_normal((T, N), dtype=np.float32)
    want = y0.astype(np.float64)
    for t, s in enumerate(slots):
        if s >= 0:
            r = rank[s]
            h = a[s, :r].astype(np.float64) @ x[t] * scale[s]
            want[t] += h @ bt[s, :r]
    y = y0.copy()
    lora_lib.fn(spec)(lora_lib.ptr(x), T, lora_lib.ptr(slots), lora_lib.ptr(rank), lora_lib.ptr(scale),
                      lora_lib.ptr(a), lora_lib.ptr(bt), lora_lib.ptr(y))
    assert rel_err(y - y0, want - y0) <= F32_TOL
    untouched = slots < 0
    np.testing.assert_array_equal(y[untouched], y0[untouched])
    y_null = y0.copy()                                                       # no slots table: no deltas
    lora_lib.fn(spec)(lora_lib.ptr(x), T, lora_lib.ffi.NULL, lora_lib.ptr(rank), lora_lib.ptr(scale),
                      lora_lib.ptr(a), lora_lib.ptr(bt), lora_lib.ptr(y_null))
    np.testing.assert_array_equal(y_null, y0)
