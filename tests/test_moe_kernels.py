"""The mixture-of-experts kernels (router, experts, head_rms_norm, sigmoid_gate, attention_sinks), for
every ISA this host runs, against the numpy references of the op registry (``ir/moe_ops.py``).

The experts driver calls the target's linear kernels, so each ISA exercises its own; weights in
f16/bf16 are compared with the reference fed the same rounded weights (f32 tolerance: only the
accumulation order differs), except bf16 weights on avx512-bf16, whose linear kernels also round
activations to bf16 (2e-2, as tests/test_kernels.py).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from _isa import isa_params
from _kernel_lib import KernelLib, attention_step, paged_cache, rel_err, run_attention

from infeng_compiler.codegen.kernels import KernelSpec, template_isa
from infeng_compiler.codegen.moe_kernels import expert_linears, quantized_row_floats
from infeng_compiler.codegen.target import host_features, runnable_targets
from infeng_compiler.interp import KVStore, Step
from infeng_compiler.ir.moe_ops import route
from infeng_compiler.ir.ops import REGISTRY
from infeng_compiler.ir.types import bf16_to_f32, f32_to_bf16
from infeng_compiler.quant.formats import get_format, is_quantized, mxfp4_tensor
from infeng_compiler.quant.search import quantize

HOST = host_features()
RUNNABLE = runnable_targets(HOST)
F32_TOL = 1e-5            # max abs error / max |reference|
BF16_DOT_TOL = 2e-2
TOKENS = [1, 2, 5, 17, 70]          # decode, batched decode, the packed GEMM path of the linear kernels

#: (E, H, I, top_k, activation, gate_up layout, biases)
EXPERT_CASES = [
    (4, 64, 48, 2, "silu", "concat", False),
    (5, 40, 24, 3, "swiglu_clamp", "interleaved", True),
    (8, 96, 40, 1, "silu", "concat", True),
]
WDTYPES = ["f32", "f16", "bf16"]
#: (case, weight dtype) pairs: every dtype and every case, not every product (kernel builds are slow)
EXPERT_GRID = [(EXPERT_CASES[0], "f32"), (EXPERT_CASES[0], "f16"), (EXPERT_CASES[0], "bf16"),
               (EXPERT_CASES[1], "f32"), (EXPERT_CASES[1], "bf16"), (EXPERT_CASES[2], "f16"),
               (EXPERT_CASES[0], "q4g32"), (EXPERT_CASES[2], "q8r"), (EXPERT_CASES[2], "f8e4m3")]
#: integer formats: the reference rounds the rows each matrix reads as the driver's quantize_act does
#: (act_quant), so only the integer kernels' accumulation order differs
ACT_QUANT = {"q4g32": [8, 32], "q8r": [16, 0]}
#: ... except where a row's float value sits on a rounding boundary of its integer code (the kernel's
#: f32 sums against the reference's): one code step, as tests/test_quant_compiled.py bounds it
QUANT_TOL = {"q4g32": 1e-2, "q8r": 1e-3}
ROUTER_CASES = [(4, 2, "softmax", True), (8, 3, "softmax", False), (5, 2, "topk_softmax", False),
                (32, 4, "softmax", True)]
SWIGLU = {"alpha": 1.702, "limit": 7.0}
SINK_CASES = [(4, 2, 16, 16, 0), (6, 2, 24, 8, 5), (2, 1, 64, 4, 3)]   # (heads, KV heads, head_dim, block, window)


MXFP4_ACTS = ("f32", "q8")       # MXFP4 experts on f32 rows, or int8 rows (experts-act(q8))


def mxfp4_experts_spec(isa: str, act: str) -> KernelSpec:
    return KernelSpec.make("experts", isa, E=4, H=64, I=64, top_k=2, activation="swiglu_clamp", gate_up="interleaved",
                           wformat="mxfp4", bdtype="f32", act=act, target=isa, **SWIGLU)


def sinks_of(n_heads: int) -> tuple[float, ...]:
    """Sinks from well below to well above the scores, so both ends of the softmax are exercised."""
    return tuple(float(v) for v in np.linspace(-4.0, 6.0, n_heads, dtype=np.float32))


def sinks_spec(isa: str, case: tuple) -> KernelSpec:
    h, kvh, hd, block, window = case
    return KernelSpec.make("attention_sinks", isa, n_heads=h, n_kv_heads=kvh, head_dim=hd, block_size=block,
                           scale=float(hd) ** -0.5, window=window, sinks=sinks_of(h))


def experts_spec(isa: str, case: tuple, wdtype: str, bdtype: str) -> KernelSpec:
    E, H, I, k, activation, layout, _ = case
    extra = SWIGLU if activation == "swiglu_clamp" else {"alpha": 0.0, "limit": 0.0}
    return KernelSpec.make("experts", isa, E=E, H=H, I=I, top_k=k, activation=activation, gate_up=layout,
                           wformat=wdtype, bdtype=bdtype, act="f32", target=isa, **extra)


def grid_specs(isa: str) -> list[KernelSpec]:
    specs = []
    for case, wdtype in EXPERT_GRID:
        spec = experts_spec(isa, case, wdtype, bias_dtype(case, wdtype))
        called = expert_linears(dict(spec.params))
        specs += [spec] + [s for s in called.values() if isinstance(s, KernelSpec)]
    for E, k, scoring, renorm in ROUTER_CASES:
        specs.append(KernelSpec.make("router", isa, E=E, top_k=k, scoring=scoring, renormalize=renorm))
    specs.append(KernelSpec.make("head_rms_norm", isa, H=96, head_dim=24, eps=1e-6))
    specs += [sinks_spec(isa, case) for case in SINK_CASES]
    for act in MXFP4_ACTS:
        spec = mxfp4_experts_spec(isa, act)
        specs += [spec] + [s for s in expert_linears(dict(spec.params)).values() if isinstance(s, KernelSpec)]
    for wdtype in WDTYPES:
        specs.append(KernelSpec.make("sigmoid_gate", isa, N=40, K=64, wdtype=wdtype))
    return list(dict.fromkeys(specs))


@functools.cache
def kernel_lib(isa: str) -> KernelLib:
    return KernelLib(isa, grid_specs(isa))


@pytest.fixture(scope="session", params=isa_params(RUNNABLE))
def klib(request) -> KernelLib:
    return kernel_lib(request.param)


def bias_dtype(case: tuple, wdtype: str) -> str:
    """Biases in the weights' float format (f32 next to quantized weights); "none" without biases."""
    return ("f32" if is_quantized(wdtype) else wdtype) if case[-1] else "none"


def stored_and_f32(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``x`` in storage ``dtype`` (bf16 as uint16 bits; a quantized format packed expert by expert as
    one [E*N, K] matrix) and the float32 values it holds."""
    if is_quantized(dtype):
        q = quantize(x.reshape(-1, x.shape[-1]), get_format(dtype))
        return q.pack(), q.dequantize().reshape(x.shape)
    if dtype == "f16":
        s = x.astype(np.float16)
        return s, s.astype(np.float32)
    if dtype == "bf16":
        s = f32_to_bf16(x)
        return s, bf16_to_f32(s)
    return np.ascontiguousarray(x, dtype=np.float32), x.astype(np.float32)


def run_experts(klib: KernelLib, spec: KernelSpec, x: np.ndarray, rw: np.ndarray, ids: np.ndarray,
                weights: tuple, row_floats: dict[str, int], k: int, I: int) -> np.ndarray:
    """The experts kernel over ``x`` [T, H] routed by ``rw``/``ids``; ``weights``: gate_up, down and
    their biases (None for none), as the kernel reads them; work buffers sized as the driver's plan."""
    T, H = x.shape
    work = {name: np.zeros(T * width, dtype=np.float32) for name, width in
            (("pairs", k), ("xg", H), ("h", 2 * I), ("act", I), ("y", H),
             ("xq", row_floats["x"]), ("actq", row_floats["act"])) if width}
    out = np.full((T, H), np.nan, dtype=np.float32)
    klib.fn(spec)(klib.pool, klib.ptr(x, "float *"), T, klib.ptr(rw, "float *"), klib.ptr(ids, "int32_t *"),
                  *(klib.ptr(w) for w in weights),
                  klib.ptr(work["pairs"], "int32_t *"), klib.ptr(work["xg"], "float *"), klib.ptr(work.get("xq")),
                  klib.ptr(work["h"], "float *"), klib.ptr(work["act"], "float *"), klib.ptr(work.get("actq")),
                  klib.ptr(work["y"], "float *"), klib.ptr(out, "float *"))
    return out


def random_routes(rng: np.random.Generator, T: int, E: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct experts per token (some experts chosen by no token when T is small), weights in (0, 1)."""
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    return rng.random((T, k)).astype(np.float32), ids


@pytest.mark.parametrize(("case", "wdtype"), EXPERT_GRID,
                         ids=[f"e{c[0]}h{c[1]}i{c[2]}k{c[3]}{c[4]}-{w}" for c, w in EXPERT_GRID])
def test_experts(klib: KernelLib, case: tuple, wdtype: str) -> None:
    E, H, I, k, activation, layout, biases = case
    bdtype = bias_dtype(case, wdtype)
    spec = experts_spec(klib.isa, case, wdtype, bdtype)
    called = expert_linears(dict(spec.params))
    gate_up_spec = called["gate_up"]
    # vdpbf16ps and the amx bf16 tiles round x to bf16 (the amx f16 tiles keep 16 bits of x)
    dot_bf16 = template_isa(gate_up_spec) in ("avx512-bf16", "amx") and wdtype == "bf16"
    tol = BF16_DOT_TOL if dot_bf16 else QUANT_TOL.get(wdtype, F32_TOL)
    rng = np.random.default_rng(E * H + I)
    gu, gu32 = stored_and_f32(rng.standard_normal((E, 2 * I, H), dtype=np.float32) * 0.3, wdtype)
    dn, dn32 = stored_and_f32(rng.standard_normal((E, H, I), dtype=np.float32) * 0.3, wdtype)
    bias_pair = ([stored_and_f32(rng.standard_normal(shape, dtype=np.float32), bdtype)
                  for shape in ((E, 2 * I), (E, H))] if biases else [(None, None), (None, None)])
    attrs = {"activation": activation, "gate_up": layout, **(SWIGLU if activation == "swiglu_clamp" else {})}
    if wdtype in ACT_QUANT:
        attrs["act_quant"] = ACT_QUANT[wdtype]
    row_floats = {name: quantized_row_floats(called[f"quant_{name}"], width) for name, width in (("x", H), ("act", I))}
    for T in TOKENS:
        x = rng.standard_normal((T, H), dtype=np.float32) * 2.0
        rw, ids = random_routes(rng, T, E, k)
        out = run_experts(klib, spec, x, rw, ids, (gu, dn, bias_pair[0][0], bias_pair[1][0]), row_floats, k, I)
        ws = [gu32, dn32] + ([bias_pair[0][1], bias_pair[1][1]] if biases else [])
        ref = REGISTRY["experts"].reference([x, rw, ids], ws, attrs, None)[0]
        assert rel_err(out, ref) <= tol, f"T={T}: error {rel_err(out, ref):.3g}"


@pytest.mark.parametrize("case", ROUTER_CASES, ids=lambda c: f"e{c[0]}k{c[1]}{c[2]}{'-norm' if c[3] else ''}")
def test_router(klib: KernelLib, case: tuple) -> None:
    E, k, scoring, renorm = case
    spec = KernelSpec.make("router", klib.isa, E=E, top_k=k, scoring=scoring, renormalize=renorm)
    rng = np.random.default_rng(E + k)
    for T in TOKENS:
        logits = rng.standard_normal((T, E), dtype=np.float32) * 3.0
        weights = np.full((T, k), np.nan, dtype=np.float32)
        ids = np.full((T, k), -1, dtype=np.int32)
        klib.fn(spec)(klib.ptr(logits, "float *"), T, klib.ptr(weights, "float *"), klib.ptr(ids, "int32_t *"))
        want_w, want_ids = route(logits, k, scoring, renorm)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(weights, want_w, rtol=1e-6, atol=1e-7)


def test_router_ties_go_to_the_lower_expert(klib: KernelLib) -> None:
    spec = KernelSpec.make("router", klib.isa, E=4, top_k=2, scoring="softmax", renormalize=True)
    logits = np.array([[0.5, 2.0, 2.0, 2.0]], dtype=np.float32)
    weights, ids = np.zeros((1, 2), np.float32), np.zeros((1, 2), np.int32)
    klib.fn(spec)(klib.ptr(logits, "float *"), 1, klib.ptr(weights, "float *"), klib.ptr(ids, "int32_t *"))
    assert ids.tolist() == route(logits, 2, "softmax", True)[1].tolist() == [[1, 2]]


def test_head_rms_norm(klib: KernelLib) -> None:
    spec = KernelSpec.make("head_rms_norm", klib.isa, H=96, head_dim=24, eps=1e-6)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((9, 96), dtype=np.float32)
    w = rng.standard_normal(24, dtype=np.float32)
    out = np.full_like(x, np.nan)
    klib.fn(spec)(klib.ptr(x, "float *"), 9, klib.ptr(w, "float *"), klib.ptr(out, "float *"))
    ref = REGISTRY["head_rms_norm"].reference([x], [w], {"eps": 1e-6, "head_dim": 24}, None)[0]
    assert rel_err(out, ref) <= F32_TOL


@pytest.mark.parametrize("wdtype", WDTYPES)
def test_sigmoid_gate(klib: KernelLib, wdtype: str) -> None:
    spec = KernelSpec.make("sigmoid_gate", klib.isa, N=40, K=64, wdtype=wdtype)
    rng = np.random.default_rng(11)
    y, x = rng.standard_normal((6, 40), dtype=np.float32), rng.standard_normal((6, 64), dtype=np.float32)
    w, w32 = stored_and_f32(rng.standard_normal((1, 64), dtype=np.float32) * 0.3, wdtype)
    out = np.full_like(y, np.nan)
    klib.fn(spec)(klib.ptr(y, "float *"), klib.ptr(x, "float *"), 6, klib.ptr(w), klib.ptr(out, "float *"))
    ref = REGISTRY["sigmoid_gate"].reference([y, x], [w32], {}, None)[0]
    assert rel_err(out, ref) <= F32_TOL


@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: f"h{c[0]}kv{c[1]}d{c[2]}b{c[3]}w{c[4]}")
def test_attention_sinks(klib: KernelLib, case: tuple) -> None:
    """Prefill, decode and mixed steps over a paged cache, against the attention reference with sinks;
    contexts past the vector kernels' first key chunk (128 positions), where a row's chunks are folded
    from the sink: the last steps' rows bit for bit what a step of that row alone gives and what one
    thread gives. Runs stay below the AMX kernel's tile threshold, whose tiles round to bf16."""
    h, kvh, hd, block, window = case
    spec = sinks_spec(klib.isa, case)
    attrs = {"layer": 0, "n_heads": h, "n_kv_heads": kvh, "head_dim": hd, "scale": float(hd) ** -0.5,
             "window": window, "sinks": True}
    sinks = np.array(sinks_of(h), dtype=np.float32)
    rng = np.random.default_rng(hd * block)
    cache = paged_cache(rng, 2, 160, block, kvh, hd)
    store = KVStore()

    steps = ([(0, range(11))], [(0, range(11, 12)), (1, range(7))], [(1, range(7, 8)), (0, range(12, 13))],
             [(0, range(13, 70)), (1, range(8, 9))], [(0, range(70, 127))],
             [(0, range(127, 150)), (1, range(9, 10))], [(0, range(150, 153)), (1, range(10, 11))])
    for step in steps:
        inputs = attention_step(rng, step, h, kvh, hd)
        slots, pos, q, k, v = inputs
        ctx = Step(seq_ids=slots, logits_rows=np.arange(len(pos)), kv=store)
        ref = REGISTRY["attention"].reference([q, k, v, pos], [sinks], attrs, ctx)[0]
        out = run_attention(klib, spec, inputs, cache)
        assert rel_err(out, ref) <= F32_TOL, f"step {step}: error {rel_err(out, ref):.3g}"
    np.testing.assert_array_equal(run_attention(klib, spec, inputs, cache, klib.pool_of(1)), out,
                                  err_msg="the last step on one thread")
    for t in range(len(pos)):
        alone = run_attention(klib, spec, [x[t:t + 1] for x in inputs], cache)
        np.testing.assert_array_equal(alone[0], out[t], err_msg=f"slot {slots[t]} position {pos[t]} alone")


def random_mxfp4(shape: tuple[int, ...], rng: np.random.Generator):
    """Random e2m1 codes and e8m0 scales around 2^0 (as GPT-OSS's experts)."""
    *outer, K = shape
    return mxfp4_tensor(rng.integers(0, 256, size=(*outer, K // 32, 16), dtype=np.uint8),
                        rng.integers(120, 128, size=(*outer, K // 32), dtype=np.uint8))


@pytest.mark.parametrize("act", MXFP4_ACTS)
def test_experts_mxfp4(klib: KernelLib, act: str) -> None:
    """GPT-OSS's experts as it ships them: MXFP4 stacks (E matrices one after another) through
    linear_mxfp4, on f32 rows or on int8 rows (the reference rounds them alike: act_quant)."""
    spec = mxfp4_experts_spec(klib.isa, act)
    called = expert_linears(dict(spec.params))
    E, H, I, k = 4, 64, 64, 2
    rng = np.random.default_rng(5)
    gu, dn = random_mxfp4((E, 2 * I, H), rng), random_mxfp4((E, H, I), rng)
    biases = [rng.standard_normal(shape, dtype=np.float32) for shape in ((E, 2 * I), (E, H))]
    attrs = {"activation": "swiglu_clamp", "gate_up": "interleaved", **SWIGLU,
             **({"act_quant": [8, 32]} if act == "q8" else {})}
    ws = [gu.dequantize().reshape(E, 2 * I, H), dn.dequantize().reshape(E, H, I), *biases]
    packed = [gu.pack(), dn.pack()]             # held here: a pointer does not keep its array alive
    row_floats = {name: quantized_row_floats(called[f"quant_{name}"], width) for name, width in (("x", H), ("act", I))}
    for T in TOKENS:
        x = rng.standard_normal((T, H), dtype=np.float32)
        rw, ids = random_routes(rng, T, E, k)
        out = run_experts(klib, spec, x, rw, ids, (packed[0], packed[1], biases[0], biases[1]), row_floats, k, I)
        ref = REGISTRY["experts"].reference([x, rw, ids], ws, attrs, None)[0]
        assert rel_err(out, ref) <= QUANT_TOL["q8r"], f"T={T}: error {rel_err(out, ref):.3g}"
