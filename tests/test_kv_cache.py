"""KV cache formats, the ``kv-format`` / ``fht-kv`` passes and the ``attention_kvq`` kernels
(docs/kv-cache.md).

Tolerances, and why:
- ``fht-kv`` at f32: the fold is the identity in exact arithmetic; what is left is float32 rounding
  of the rotated weights: <= 1e-5 of max |logit| (the issue's bound).
- kernels against the op's reference on the same inputs: 1e-5 of max |out|. The reference stores
  the values the kernels store bit for bit (same FHT butterflies, f16 rounding, rint of x / scale),
  so only the order of accumulation differs.
- compiled model against the interpreter of the same graph: <= 1e-2 of max |logit|. The compiled
  K/V rows differ from numpy's in the last bits (matmul order), and a value sitting on a rounding
  boundary then rounds to the neighbouring int8/int4 code or f16 value. The std-0.2 test model is
  that sensitive by itself: the interpreter moves by up to 6.8e-3 (int4), 1.9e-3 (int8), 2.4e-4
  (f16) when its weights are perturbed by 2^-22 relative; the compiled runs measured up to 3.1e-3.
  The step-0 error must also be 10x below the format's own effect (against the f32 cache), so a
  library that did not quantize fails.
- perplexity: the issue's targets (drift, KL divergence, top-1 agreement) on stories260K.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import cffi
import numpy as np
import pytest
from typer.testing import CliRunner

from infeng_common.errors import InfengError
from infeng_cli.main import app
from infeng_compiler.codegen.build import build_library
from infeng_compiler.codegen.kernels import KernelSpec, cdef, library_sources, template_isa
from infeng_compiler.codegen.target import TARGETS, runnable_targets
from infeng_compiler.compile import CompileOptions, compile_model
from infeng_compiler.frontends.hf import import_hf
from infeng_compiler.interp import Interpreter, KVStore, Step
from infeng_compiler.ir import parse, print_graph
from infeng_compiler.ir.ops import REGISTRY
from infeng_compiler.passes.kv_cache import kv_entries
from infeng_compiler.passes.manager import PassContext, PassManager, parse_pipeline
from infeng_compiler.quant import kv as kvq
from infeng_runtime.engine import Engine
from _isa import isa_params

RUNNABLE = runnable_targets()
KERNEL_TOL = 1e-5
FOLD_TOL = 1e-5
COMPILED_TOL = 1e-2


def run_pipeline(graph, pipeline: str):
    PassManager(parse_pipeline(pipeline)).run(graph)
    return graph


def rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


# ---------------------------------------------------------------------------------------------
# numerics of the formats
def test_fht_is_the_normalised_hadamard_matrix_and_its_own_inverse():
    x = np.random.default_rng(0).standard_normal((5, 3, 64)).astype(np.float32)
    y = kvq.fht(x)
    np.testing.assert_allclose(y, x @ kvq.hadamard(64), rtol=0, atol=1e-5)
    np.testing.assert_allclose(kvq.fht(y), x, rtol=0, atol=1e-5)
    H = kvq.hadamard(8)
    np.testing.assert_allclose(H @ H, np.eye(8), atol=1e-12)
    with pytest.raises(InfengError, match="power-of-two"):
        kvq.fht(np.zeros((2, 24), np.float32))


@pytest.mark.parametrize("fmt, group", [("int8", None), ("int4", 8), ("int4", 32)])
def test_quantized_rows_round_to_half_a_step(fmt, group):
    x = np.random.default_rng(1).standard_normal((50, 64)).astype(np.float32) * 3
    x[7] = 0.0                                     # an all-zero row: scale 0, codes 0
    codes, scales = kvq.quantize(x, fmt, group)
    qmax = kvq.QMAX[fmt]
    assert codes.dtype == np.int8 and np.abs(codes).max() <= qmax
    assert np.array_equal(scales, scales.astype(np.float16).astype(np.float32))     # f16 scales
    back = kvq.store_rows(x, fmt, group)
    step = np.repeat(scales, 64 // scales.shape[-1], axis=-1)
    assert np.all(np.abs(back - x) <= step / 2 + 1e-6 * np.abs(x))
    assert not back[7].any()
    scale_bytes = 16 * 2 * (64 // (group or 64))                  # a block of 16 rows, one head
    assert kvq.block_bytes(fmt, 16, 1, 64, group) == -(-(16 * {"int8": 64, "int4": 32}[fmt] + scale_bytes) // 64) * 64
    # int8 V codes are kept 4 rows to a dim: a block of 6 rows holds 8 rows of codes
    assert kvq.codes_bytes(fmt, 6, 2, 64, value=True) == (8 * 2 * 64 if fmt == "int8" else 6 * 2 * 32)


def attention_ref(q, k, v, attrs, k_mean=None):
    T = len(q)
    pos = np.arange(T, dtype=np.int32)
    step = Step(np.zeros(T, np.int32), np.arange(T))
    return REGISTRY["attention"].reference([q, k, v, pos], [] if k_mean is None else [k_mean], attrs, step)[0]


def test_k_centring_is_exact_and_shrinks_the_k_step():
    """q·(k - mu) = q·k - q·mu: every score of a query moves by one constant, which softmax drops.
    With channel means 4x the spread, centring cuts int8 K's error several times."""
    rng = np.random.default_rng(2)
    h, kvh, hd, T = 4, 2, 16, 40
    q = rng.standard_normal((T, h * hd)).astype(np.float32)
    means = (4 * rng.standard_normal(kvh * hd)).astype(np.float32)
    k = (rng.standard_normal((T, kvh * hd)) + means).astype(np.float32)
    v = rng.standard_normal((T, kvh * hd)).astype(np.float32)
    attrs = {"layer": 0, "n_heads": h, "n_kv_heads": kvh, "head_dim": hd, "scale": 1 / math.sqrt(hd)}
    exact = attention_ref(q, k, v, attrs)
    mu = k.mean(axis=0)
    assert rel(attention_ref(q, k, v, {**attrs, "k_format": "f32"}, mu), exact) <= 1e-6
    int8_k = {**attrs, "k_format": "int8", "v_format": "f32"}
    plain, centred = rel(attention_ref(q, k, v, int8_k), exact), rel(attention_ref(q, k, v, int8_k, mu), exact)
    assert centred * 3 < plain, (plain, centred)


def test_exp_kernel_is_expf():
    x = np.concatenate([np.linspace(-110, 0, 20001), np.linspace(0, 88, 2001)]).astype(np.float32)
    got, want = kvq.exp_kernel(x).astype(np.float64), np.exp(x.astype(np.float64))
    assert np.all(np.abs(got - want) <= 4e-7 * want + 1e-38)


def test_integer_pv_rounds_probabilities_to_uint8_per_group():
    """int8 V against int8 K: probabilities (times V scales) become uint8 codes per 16 positions;
    the output stays within a few 1/255 steps of the float P·V over the same cached values."""
    rng = np.random.default_rng(3)
    h, kvh, hd, T = 4, 2, 32, 70
    q, k, v = ((rng.standard_normal((T, n * hd)) * 2).astype(np.float32) for n in (h, kvh, kvh))
    attrs = {"layer": 0, "n_heads": h, "n_kv_heads": kvh, "head_dim": hd, "scale": 1 / math.sqrt(hd),
             "k_format": "int8", "v_format": "int8"}
    integer = attention_ref(q, k, v, attrs)
    # the same cached K/V with float P·V: dequantize V and keep the f32 path
    v_stored = kvq.store_rows(v.reshape(T, kvh, hd), "int8").reshape(T, -1)
    floating = attention_ref(q, k, v_stored, {**attrs, "v_format": "f32"})
    assert 0 < rel(integer, floating) < 4 / 255


# ---------------------------------------------------------------------------------------------
# the passes, as text in / text out
ONE_LAYER = """
graph @one(%tokens: i32[T], %positions: i32[T]) {
  meta {"family": "llama", "hidden_size": 16, "num_layers": 1, "vocab_size": 32}
  weight @emb : f32[32,16] {inline=true}
  weight @q : f32[16,16] {inline=true}
  weight @k : f32[8,16] {inline=true}
  weight @v : f32[8,16] {inline=true}
  weight @vb : f32[8] {inline=true}
  weight @o : f32[16,16] {inline=true}
  %x = embedding(%tokens, @emb) : f32[T,16]
  %q = linear(%x, @q) : f32[T,16]
  %k = linear(%x, @k) : f32[T,8]
  %v = linear(%x, @v, @vb) : f32[T,8]
  %qr = rope(%q, %positions) : f32[T,16] {n_heads=4, head_dim=4, theta=10000.0}
  %kr = rope(%k, %positions) : f32[T,8] {n_heads=2, head_dim=4, theta=10000.0}
  %a = attention(%qr, %kr, %v, %positions) : f32[T,16] {layer=0, n_heads=4, n_kv_heads=2, head_dim=4, scale=0.5}
  %y = linear(%a, @o) : f32[T,16]
  %logits = logits(%y, @emb) : f32[R,32]
  return %logits
}
"""


def one_layer(text: str = ONE_LAYER):
    rng = np.random.default_rng(3)
    shapes = {"emb": (32, 16), "q": (16, 16), "k": (8, 16), "v": (8, 16), "vb": (8,), "o": (16, 16)}
    return parse(text, {n: (rng.standard_normal(s) * 0.7).astype(np.float32) for n, s in shapes.items()})


def logits_of(graph, n: int = 12) -> np.ndarray:
    ids = np.random.default_rng(4).integers(0, 32, n)
    return Interpreter(graph).step(ids, np.arange(n), np.zeros(n))


def attention_line(graph) -> str:
    return next(line for line in print_graph(graph).splitlines() if "= attention(" in line).strip()


def test_kv_format_pass_sets_the_attributes():
    before = one_layer()
    after = run_pipeline(one_layer(), "kv-format(int4,int8,window=3,group=2)")
    assert attention_line(after) == (
        '%a = attention(%qr, %kr, %v, %positions) : f32[T,16] {layer=0, n_heads=4, n_kv_heads=2, head_dim=4, '
        'scale=0.5, k_format="int4", v_format="int8", kv_group=2, kv_window=3}')
    assert parse(print_graph(after), {n: w.raw() for n, w in after.weights.items()}) == after
    # the interpreter now rounds K through int4 and V through int8, except the last 3 positions
    assert 0 < rel(logits_of(after), logits_of(before)) < 0.5
    # f32 with no window is the original cache
    same = run_pipeline(one_layer(), "kv-format(f32)")
    assert rel(logits_of(same), logits_of(before)) == 0.0


def test_fht_kv_pass_folds_v_and_rotates_qk():
    before = one_layer()
    after = run_pipeline(one_layer(), "fht-kv")
    text = print_graph(after)
    assert "rotate_qk=true" in attention_line(after)
    for line in ("%v = linear(%x, @v+fht, @vb+fht) : f32[T,8]", "%y = linear(%a, @o+fht) : f32[T,16]",
                 "%q = linear(%x, @q) : f32[T,16]", "%k = linear(%x, @k) : f32[T,8]"):
        assert line in text
    assert "weight @v :" not in text and "weight @o :" not in text      # replaced, not kept
    H = kvq.hadamard(4)
    v, v_rot = before.weights["v"].raw(), after.weights["v+fht"].raw()
    np.testing.assert_allclose(v_rot[4:], H @ v[4:], atol=1e-6)            # head 1's rows: H @ W_v
    o, o_rot = before.weights["o"].raw(), after.weights["o+fht"].raw()
    np.testing.assert_allclose(o_rot[:, 8:12], o[:, 8:12] @ H, atol=1e-6)  # head 2's columns: W_o @ H
    assert rel(logits_of(after), logits_of(before)) <= FOLD_TOL
    assert text == print_graph(run_pipeline(after, "fht-kv"))               # idempotent: rotated once


class ByteTokenizer:
    """Enough of a tokenizer for calibration_ids: one id per byte, modulo the test vocabulary."""

    bos_token_id = 1

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return [1] * add_bos + [2 + b % 30 for b in text.encode()]


@pytest.mark.parametrize("rotation", ["", "fht-kv,"])
def test_calib_centres_k(tmp_path, rotation):
    """kv-format with calib=FILE (after fht-kv or not): the mean k row of the calibration text (after
    RoPE; rotated after fht-kv) becomes the attention node's k_mean, independently recomputed here."""
    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, " * 8)
    after = one_layer()
    PassManager(parse_pipeline(f"{rotation}kv-format(int8,calib={text},calib_ctx=16)")).run(
        after, PassContext(tokenizer=ByteTokenizer()))
    assert attention_line(after).startswith("%a = attention(%qr, %kr, %v, %positions, @a.k_mean) : f32[T,16]")
    assert "weight @a.k_mean : f32[8] {inline=true}" in print_graph(after)

    from infeng_compiler.quant.calibrate import calibration_ids

    chunks = calibration_ids(ByteTokenizer(), text, None, 16)
    g = one_layer()
    x = g.weights["emb"].raw()[chunks.reshape(-1)]
    k = x @ g.weights["k"].raw().T
    positions = np.tile(np.arange(16, dtype=np.int32), len(chunks))
    rope = {"n_heads": 2, "head_dim": 4, "theta": 10000.0}
    mean = REGISTRY["rope"].reference([k.astype(np.float32), positions], [], rope, None)[0].mean(axis=0)
    if rotation:
        mean = (mean.reshape(2, 4) @ kvq.hadamard(4)).reshape(-1)
    np.testing.assert_allclose(after.weights["a.k_mean"].raw(), mean, rtol=0, atol=1e-5)
    # without calib nothing is centred; calib with an unquantized K has nothing to gain
    assert "k_mean" not in print_graph(run_pipeline(one_layer(), f"{rotation}kv-format(int8)"))
    with pytest.raises(InfengError, match="centres an int8/int4 K"):
        run_pipeline(one_layer(), f"{rotation}kv-format(f16,calib={text})")


def test_fht_kv_fold_is_exact_on_stories260k(stories_dir):
    """The issue's bound: folding the rotation changes f32 outputs by <= 1e-5 relative."""
    ids = np.random.default_rng(0).integers(3, 512, 96)
    ids[0] = 1
    want = Interpreter(import_hf(stories_dir)).step(ids, np.arange(96), np.zeros(96))
    got = Interpreter(run_pipeline(import_hf(stories_dir), "fht-kv")).step(ids, np.arange(96), np.zeros(96))
    assert rel(got, want) <= FOLD_TOL


HEAD_DIM_6 = """
graph @six(%tokens: i32[T], %positions: i32[T]) {
  weight @emb : f32[32,12] {inline=true}
  weight @qkv : f32[24,12] {inline=true}
  weight @o : f32[12,12] {inline=true}
  %x = embedding(%tokens, @emb) : f32[T,12]
  %qkv = linear(%x, @qkv) : f32[T,24]
  %q, %k, %v = split(%qkv) : f32[T,12], f32[T,6], f32[T,6] {sizes=[12, 6, 6]}
  %a = attention(%q, %k, %v, %positions) : f32[T,12] {layer=0, n_heads=2, n_kv_heads=1, head_dim=6, scale=0.4}
  %y = linear(%a, @o) : f32[T,12]
  %logits = logits(%y, @emb) : f32[R,32]
  return %logits
}
"""


def test_fht_kv_refuses_a_head_dim_that_is_not_a_power_of_two():
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal(s).astype(np.float32) for n, s in
              {"emb": (32, 12), "qkv": (24, 12), "o": (12, 12)}.items()}
    with pytest.raises(InfengError, match="head_dim 6, not a power of two.*does not pad"):
        run_pipeline(parse(HEAD_DIM_6, arrays), "fht-kv,kv-format(int8)")
    run_pipeline(parse(HEAD_DIM_6, arrays), "kv-format(int8)")      # without the rotation any head_dim works


def test_fht_kv_folds_into_a_fused_qkv():
    """GPT-2 style: V is a slice of one projection; only its rows rotate."""
    text = HEAD_DIM_6.replace("24,12", "32,16").replace("f32[32,12]", "f32[32,16]").replace("@o : f32[12,12]", "@o : f32[16,16]")
    text = (text.replace("f32[T,12]", "f32[T,16]").replace("f32[T,24]", "f32[T,32]").replace("f32[T,6]", "f32[T,8]")
            .replace("sizes=[12, 6, 6]", "sizes=[16, 8, 8]").replace("head_dim=6", "head_dim=8"))
    rng = np.random.default_rng(1)
    arrays = {n: rng.standard_normal(s).astype(np.float32) for n, s in
              {"emb": (32, 16), "qkv": (32, 16), "o": (16, 16)}.items()}
    before = parse(text, arrays)
    after = run_pipeline(parse(text, arrays), "fht-kv")
    w, w_rot = before.weights["qkv"].raw(), after.weights["qkv+fht"].raw()
    np.testing.assert_array_equal(w_rot[:24], w[:24])
    np.testing.assert_allclose(w_rot[24:], kvq.hadamard(8) @ w[24:], atol=1e-6)
    assert rel(logits_of(after), logits_of(before)) <= FOLD_TOL


def test_fht_kv_refuses_lora_slots():
    g = run_pipeline(one_layer(), "lora-slots(2,4)")
    with pytest.raises(InfengError, match="comes from a lora_linear.*adapters are not rotated"):
        run_pipeline(g, "fht-kv")


@pytest.mark.parametrize("scheme, window, message", [
    ("int3", 0, "expected one of"),
    ("f16", 8, "has nothing to keep"),
    ("fht-int8", -1, "must be >= 0"),
])
def test_kv_option_errors(scheme, window, message):
    with pytest.raises(InfengError, match=message):
        kv_entries(scheme, window)


def test_kv_entries(tmp_path):
    assert kv_entries("f32") == []
    assert kv_entries("int4") == [("kv-format", ["int4"])]
    assert kv_entries("fht-int8", 32) == [("fht-kv", []), ("kv-format", ["int8", "window=32"])]
    calib = tmp_path / "calib.txt"
    calib.write_text("text")
    assert kv_entries("fht-int8", 0, calib, 1000) == [
        ("fht-kv", []), ("kv-format", ["int8", f"calib={calib.resolve()}", "calib_max_bytes=1000"])]
    assert kv_entries("f16", 0, calib) == [("kv-format", ["f16"])]      # --calib may serve --quant instead
    with pytest.raises(InfengError, match="--calib needs --quant .* or an int8/int4 --kv"):
        CompileOptions(kv="f16", calib=calib).pipeline()
    assert CompileOptions(kv="int8", calib=calib).pipeline()[0][1][-1] == f"calib={calib.resolve()}"
    with pytest.raises(InfengError, match="unknown KV format 'int2'"):
        run_pipeline(one_layer(), "kv-format(int2)")
    with pytest.raises(InfengError, match="int4 group 3 must be even and divide head_dim 4"):
        run_pipeline(one_layer(), "kv-format(int4,group=3)")


def test_fht_kv_takes_no_formats():
    """No pass runs another: the formats belong to the kv-format entry after fht-kv."""
    with pytest.raises(InfengError, match=r"fht-kv takes no arguments.*fht-kv,kv-format\(int8,window=8\)"):
        run_pipeline(one_layer(), "fht-kv(int8,window=8)")


# ---------------------------------------------------------------------------------------------
# kernels, every ISA of this host, against the reference
KERNEL_CASES = [  # heads, kv heads, head_dim, block, sliding window, K, V, int4 group, rotate, f16 window, k_mean
    (4, 2, 64, 16, 0, "int8", "int8", 0, True, 0, False),
    (4, 2, 64, 16, 0, "int8", "int8", 0, True, 0, True),
    (4, 2, 64, 16, 0, "int4", "int4", 32, True, 8, False),
    (9, 3, 64, 16, 0, "f16", "f16", 0, False, 0, False),
    (6, 2, 32, 32, 0, "int4", "f16", 16, True, 6, True),
    (8, 4, 8, 16, 0, "int4", "int4", 8, True, 4, False),
    (8, 4, 8, 16, 0, "int8", "int8", 0, True, 0, True),
    (4, 2, 16, 8, 0, "int4", "int4", 8, True, 3, False),
    (3, 3, 40, 4, 0, "f32", "int8", 0, False, 0, False),
    (6, 2, 24, 8, 5, "int8", "f16", 0, False, 4, True),
    (4, 4, 16, 6, 0, "int8", "int4", 16, False, 5, False),
    # int8 V in blocks that are not a multiple of its 4 rows per dim (padded)
    (4, 2, 16, 6, 0, "f16", "int8", 0, False, 0, False),
    (2, 1, 16, 2, 0, "f16", "int8", 0, False, 0, False),
    # int8 V against an int8/int4 K: probability codes (uint8, per 16 positions), integer P.V
    (4, 2, 64, 16, 0, "int8", "int8", 0, True, 8, True),
    (6, 2, 128, 32, 0, "int4", "int8", 32, False, 0, False),
    (4, 2, 32, 8, 0, "int8", "int8", 0, True, 5, False),
    (6, 2, 24, 16, 5, "int8", "int8", 0, False, 0, False),
]
STEPS = [  # (slot, positions) per step: prefill, decode, mixed batches, a long chunk
    [(0, range(0, 13))],
    [(0, range(13, 14)), (1, range(0, 9))],
    [(1, range(9, 10)), (0, range(14, 15)), (2, range(0, 1))],
    [(2, range(1, 20)), (0, range(15, 16))],
    [(0, range(16, 17)), (1, range(10, 11)), (2, range(20, 21))],
    [(0, range(17, 18))],
    # a long context in chunks of <= MAX_STEP_TOKENS, then decode: a token's keys split across threads
    *[[(1, range(p, p + 32))] for p in range(11, 139, 32)],
    [(1, range(139, 140)), (0, range(18, 19))],
]
MAX_STEP_TOKENS = 32
MAX_POSITIONS = 140


def kernel_spec(isa: str, case) -> KernelSpec:
    h, kvh, hd, block, window, k, v, group, rotate, kv_window, _ = case
    ring = -(-(kv_window + MAX_STEP_TOKENS) // 16) * 16 if kv_window else 0
    return KernelSpec.make("attention_kvq", isa, n_heads=h, n_kv_heads=kvh, head_dim=hd, block_size=block,
                           scale=1 / math.sqrt(hd), window=window, k_format=k, v_format=v, group=group,
                           rotate=rotate, kv_window=kv_window, ring_rows=ring)


@pytest.fixture(scope="module", params=isa_params(RUNNABLE))
def kvq_lib(request):
    isa = request.param
    specs = [kernel_spec(isa, c) for c in KERNEL_CASES]
    sources, baseline = library_sources(specs, TARGETS[isa])
    build = build_library(sources, TARGETS[isa], baseline_sources=baseline)
    ffi = cffi.FFI()
    ffi.cdef(cdef(specs))
    lib = ffi.dlopen(str(build.path))
    pool = ffi.gc(lib.ife_pool_create(3), lib.ife_pool_destroy)   # 3 > 2 cores: uneven, preempted ranges
    return isa, ffi, lib, pool


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "h{}kv{}d{}b{}w{}-{}-{}-g{}{}-kw{}{}".format(
    *c[:8], "-fht" if c[8] else "", c[9], "-centred" if c[10] else ""))
def test_attention_kvq_kernel(kvq_lib, case):
    """Prefill chunks, decode steps (the split-keys path) and mixed batches over a scattered paged cache;
    with k_mean, K rows carry large channel means that the kernel subtracts before storing."""
    isa, ffi, lib, pool = kvq_lib
    h, kvh, hd, block, window, k_format, v_format, group, rotate, kv_window, centred = case
    spec = kernel_spec(isa, case)
    plan = dict(spec.params)
    attrs = {"layer": 0, "n_heads": h, "n_kv_heads": kvh, "head_dim": hd, "scale": 1 / math.sqrt(hd),
             "window": window, "k_format": k_format, "v_format": v_format, "rotate_qk": rotate}
    if group:
        attrs["kv_group"] = group
    if kv_window:
        attrs["kv_window"] = kv_window
    k_bytes = kvq.block_bytes(k_format, block, kvh, hd, group or None)
    v_bytes = kvq.block_bytes(v_format, block, kvh, hd, group or None, value=True)
    rng = np.random.default_rng(hd * block + kv_window)
    seq_ids = {0: 11, 1: 22, 2: 33}                   # slot -> interpreter sequence
    max_blocks = MAX_POSITIONS // block + 1
    n_blocks = len(seq_ids) * max_blocks + 3
    table = rng.permutation(n_blocks)[: len(seq_ids) * max_blocks].astype(np.int32).reshape(len(seq_ids), -1)
    k_cache = rng.integers(0, 256, n_blocks * k_bytes).astype(np.uint8)       # stale bytes, never read
    v_cache = rng.integers(0, 256, n_blocks * v_bytes).astype(np.uint8)
    ring = plan["ring_rows"]
    k_ring = np.zeros(len(seq_ids) * kvh * hd * ring, np.uint16) if kv_window and k_format in kvq.QUANTIZED else None
    v_ring = np.zeros(len(seq_ids) * kvh * hd * ring, np.uint16) if kv_window and v_format in kvq.QUANTIZED else None
    store = KVStore()
    channel_means = (rng.standard_normal(kvh * hd) * 6).astype(np.float32)
    k_mean = (channel_means + rng.standard_normal(kvh * hd)).astype(np.float32) if centred else None

    def ptr(a, ctype="float *"):
        return ffi.NULL if a is None else ffi.cast(ctype, ffi.from_buffer(a))

    def run(slots, pos, q, k, v, pool=pool):
        out = np.full_like(q, np.nan)
        ring_lo = np.zeros(len(pos), np.int32)        # every slot's ring holds its sequence from 0
        getattr(lib, spec.symbol)(pool, ptr(q), ptr(k), ptr(v), ptr(k_mean), len(pos), ptr(pos, "int32_t *"),
                                  ptr(slots, "int32_t *"),
                                  ptr(table, "int32_t *"), max_blocks, ptr(k_cache, "uint8_t *"),
                                  ptr(v_cache, "uint8_t *"), ptr(k_ring, "uint16_t *"), ptr(v_ring, "uint16_t *"),
                                  ptr(ring_lo, "int32_t *") if kv_window else ffi.NULL, ptr(out))
        return out

    for step in STEPS:
        slots = np.array([s for s, ps in step for _ in ps], np.int32)
        pos = np.array([p for _, ps in step for p in ps], np.int32)
        T = len(pos)
        q = rng.standard_normal((T, h * hd), dtype=np.float32) * 2
        k = rng.standard_normal((T, kvh * hd), dtype=np.float32) * 2
        v = rng.standard_normal((T, kvh * hd), dtype=np.float32)
        k[:, 1] *= 8                                   # an outlier channel
        if centred:
            k += channel_means                         # means the rotation alone would spread, not remove
        ctx = Step(seq_ids=np.array([seq_ids[s] for s in slots], np.int32), logits_rows=np.arange(T), kv=store)
        want = REGISTRY["attention"].reference([q, k, v, pos], [k_mean] if centred else [], attrs, ctx)[0]
        out = run(slots, pos, q, k, v)
        assert rel(out, want) <= KERNEL_TOL, f"{template_isa(spec)} step {step}: error {rel(out, want):.3g}"
        if T == MAX_STEP_TOKENS:
            chunk = (slots, pos, q, k, v, out)
    # a long chunk's rows again (keys past one chunk of work), on one thread (whole groups of rows
    # rather than split keys) and one at a time: the same bits, since a row's output must depend
    # neither on the other rows of its step nor on the threads
    slots, pos, q, k, v, out = chunk
    one_thread = ffi.gc(lib.ife_pool_create(1), lib.ife_pool_destroy)
    np.testing.assert_array_equal(run(slots, pos, q, k, v, one_thread), out, err_msg="on one thread")
    for t in (0, 20, MAX_STEP_TOKENS - 1):
        alone = run(slots[t:t + 1], pos[t:t + 1], q[t:t + 1], k[t:t + 1], v[t:t + 1])
        np.testing.assert_array_equal(alone[0], out[t], err_msg=f"row {t} (position {pos[t]}) alone")


def test_rotation_is_what_the_kernels_compute(kvq_lib):
    """The kernels really rotate: the reference without rotate_qk disagrees with them (int4 K)."""
    isa, ffi, lib, pool = kvq_lib
    case = KERNEL_CASES[2]
    spec = kernel_spec(isa, case)
    h, kvh, hd, block = case[:4]
    attrs = {"layer": 0, "n_heads": h, "n_kv_heads": kvh, "head_dim": hd, "scale": 1 / math.sqrt(hd),
             "k_format": "int4", "v_format": "int4", "kv_group": 32}
    rng = np.random.default_rng(5)
    T = 12
    q, k, v = (rng.standard_normal((T, n * hd), dtype=np.float32) for n in (h, kvh, kvh))
    k[:, 1] *= 8
    table = np.arange(2, dtype=np.int32).reshape(1, 2)
    k_cache = np.zeros(2 * kvq.block_bytes("int4", block, kvh, hd, 32), np.uint8)
    v_cache = np.zeros_like(k_cache)
    k_ring = np.zeros(kvh * hd * dict(spec.params)["ring_rows"], np.uint16)
    v_ring = np.zeros_like(k_ring)
    out = np.empty_like(q)
    pos, slots, lo = np.arange(T, dtype=np.int32), np.zeros(T, np.int32), np.zeros(T, np.int32)
    c = ffi.cast
    getattr(lib, spec.symbol)(pool, c("float *", ffi.from_buffer(q)), c("float *", ffi.from_buffer(k)),
                              c("float *", ffi.from_buffer(v)), ffi.NULL, T, c("int32_t *", ffi.from_buffer(pos)),
                              c("int32_t *", ffi.from_buffer(slots)), c("int32_t *", ffi.from_buffer(table)), 2,
                              c("uint8_t *", ffi.from_buffer(k_cache)), c("uint8_t *", ffi.from_buffer(v_cache)),
                              c("uint16_t *", ffi.from_buffer(k_ring)), c("uint16_t *", ffi.from_buffer(v_ring)),
                              c("int32_t *", ffi.from_buffer(lo)), c("float *", ffi.from_buffer(out)))
    unrotated = REGISTRY["attention"].reference([q, k, v, pos], [], attrs, Step(slots, np.arange(T)))[0]
    rotated = REGISTRY["attention"].reference([q, k, v, pos], [], {**attrs, "rotate_qk": True, "kv_window": 8},
                                              Step(slots, np.arange(T)))[0]
    assert rel(out, rotated) <= KERNEL_TOL < rel(out, unrotated)


# ---------------------------------------------------------------------------------------------
# compiled models against the interpreter
PROMPTS = [[1, 17, 33, 5, 90, 11, 7, 64, 3, 2, 100] * 3, [1, 42, 8, 19, 77] * 4]
DECODE = [[5, 9], [77, 3], [12, 200], [41, 41], [8, 130], [66, 1]]     # fed tokens, not argmax: runs stay aligned


def run_batch(backend) -> list[np.ndarray]:
    lens = [len(p) for p in PROMPTS]
    out = [backend.step(np.concatenate(PROMPTS), np.concatenate([np.arange(n) for n in lens]),
                        np.repeat(np.arange(2), lens), np.cumsum(lens) - 1)]
    pos = np.array(lens)
    for tokens in DECODE:
        out.append(backend.step(np.array(tokens), pos, np.arange(2)))
        pos = pos + 1
    for s in range(2):
        backend.free(s)
    return out


COMPILED_CASES = [("f16", 0, "native"), ("int8", 0, "native"), ("int4", 0, "native"), ("fht-int8", 0, "native"),
                  ("fht-int4", 0, "native"), ("fht-int4", 8, "native"), ("int8", 8, "native"),
                  ("fht-int4", 8, "scalar"), ("int8", 0, "avx2")]


@pytest.fixture(scope="module")
def llama_f32(hf_checkpoint):
    return run_batch(Interpreter(import_hf(hf_checkpoint("llama"))))


@pytest.mark.parametrize("kv, window, target", [c for c in COMPILED_CASES if c[2] in RUNNABLE + ["native"]])
def test_compiled_matches_interpreter(tmp_path, hf_checkpoint, llama_f32, kv, window, target):
    model = hf_checkpoint("llama")
    options = CompileOptions(target=target, kv=kv, kv_window=window)
    artifact = tmp_path / f"llama-{kv}-{window}-{target}.infeng"      # one path per library (dlopen caches by path)
    compile_model(model, artifact, options)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["kv"]["scheme"] == kv and manifest["kv"]["window"] == window
    assert any(s.startswith("ife_attention_kvq_") for s in manifest["kernels"])
    graph = import_hf(model)
    PassManager(options.pipeline()).run(graph)
    want = run_batch(Interpreter(graph))
    got = run_batch(Engine(artifact))
    errors = [rel(g, w) for g, w in zip(got, want)]
    assert max(errors) <= COMPILED_TOL, errors
    assert rel(got[0], llama_f32[0]) > 10 * errors[0]      # the format's own effect, far above the kernels'


@pytest.mark.parametrize("kv, block_size", [("fht-int8", 8), ("fht-int8", 32), ("fht-int4", 8)])
def test_ring_with_other_block_sizes(tmp_path, hf_checkpoint, kv, block_size):
    """The f16 window with blocks of 8 and 32 positions, in a ring that wraps: max_tokens 16 makes a
    ring of 32 columns, which the 39 positions of run_batch go around."""
    model = hf_checkpoint("llama")
    options = CompileOptions(kv=kv, kv_window=8, block_size=block_size, max_tokens=16)
    artifact = tmp_path / f"llama-{kv}-b{block_size}.infeng"
    compile_model(model, artifact, options)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["kv"]["block_size"] == block_size and manifest["constants"]["kv_layers"][0]["ring_rows"] == 32
    graph = import_hf(model)
    PassManager(options.pipeline()).run(graph)
    errors = [rel(g, w) for g, w in zip(run_batch(Engine(artifact)), run_batch(Interpreter(graph)))]
    assert max(errors) <= COMPILED_TOL, errors


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_ring_restarts_when_a_slot_changes_hands(tmp_path, hf_checkpoint, block_size):
    """A slot reused by another sequence, or a sequence that starts after a shared prefix, must not
    read the f16 ring rows of the slot's previous owner."""
    artifact = tmp_path / f"llama-ring-b{block_size}.infeng"
    compile_model(hf_checkpoint("llama"), artifact, CompileOptions(kv="fht-int8", kv_window=16, block_size=block_size))
    rng = np.random.default_rng(9)
    a, b = (rng.integers(3, 250, 48).astype(np.int32) for _ in range(2))
    fresh = Engine(artifact, max_seqs=4)
    want = fresh.step(b, np.arange(48), np.zeros(48), np.array([47]))
    engine = Engine(artifact, max_seqs=4)
    engine.step(a, np.arange(48), np.zeros(48), np.array([47]))     # slot 0 held a, up to position 47
    engine.free(0)
    got = engine.step(b, np.arange(48), np.full(48, 7), np.array([47]))   # b gets slot 0
    np.testing.assert_array_equal(got, want)

    # b's first 32 tokens come from shared blocks (prefix cache): b computes only 32..47, in a slot
    # whose previous owner c ended exactly at position 31 (so only the block check tells them apart)
    engine = Engine(artifact, max_seqs=4)
    c = rng.integers(3, 250, 32).astype(np.int32)
    engine.step(b[:32], np.arange(32), np.zeros(32), np.array([31]))        # seq 0 (slot 0): the prefix
    engine.step(c, np.arange(32), np.ones(32), np.array([31]))              # seq 1 (slot 1): c, then freed
    engine.free(1)
    slot = engine.kv.slot(2)
    assert slot == 1
    engine.kv.ensure(2, 48)
    prefix_blocks = 32 // block_size                                        # b's first 32 positions
    engine.kv.block_table[slot, :prefix_blocks] = engine.kv.block_table[engine.kv.slot_of[0], :prefix_blocks]
    shared = engine.forward(b[32:], np.arange(32, 48, dtype=np.int32), np.full(16, slot, np.int32),
                            np.array([15], np.int32))
    # positions 16..31 now come from the int8 store instead of the ring: close to the full run, and
    # far from what the stale ring of c would give
    assert rel(shared, want) < 0.02       # measured 2e-3; 0.23 when the stale ring of c is read


# ---------------------------------------------------------------------------------------------
# quality: stories260K by the BENCHMARKS protocol, through `infeng eval --json`
@pytest.fixture(scope="module")
def stories_artifacts(tmp_path_factory, stories_dir, assets):
    root = tmp_path_factory.mktemp("kv-stories")
    built = {}
    calib = root / "calib.txt"          # bytes 200,000-400,000: disjoint from the evaluated first 100,000
    calib.write_bytes((assets / "text/wikitext-2-raw-v1-test.txt").read_bytes()[200_000:400_000])

    def get(kv: str, window: int = 0, centred: bool = False) -> Path:
        if (kv, window, centred) not in built:
            out = root / f"stories-{kv}-{window}{'-centred' if centred else ''}.infeng"
            compile_model(stories_dir, out, CompileOptions(kv=kv, kv_window=window, calib=calib if centred else None))
            built[kv, window, centred] = out
        return built[kv, window, centred]

    return get


def eval_json(artifact: Path, base: Path, assets: Path) -> dict:
    result = CliRunner().invoke(app, ["eval", str(artifact), "--ppl", str(assets / "text/wikitext-2-raw-v1-test.txt"),
                                      "--max-bytes", "100000", "--ctx", "256", "--json", "--kld-base", str(base)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_stories260k_kv_quality(stories_artifacts, assets):
    """fht-int8 and fht-int4 with a 32-token f16 window meet the issue's drift bounds, and the rotation
    cuts int4's KL divergence by more than 3x (without a window see docs/kv-cache.md: head_dim 8)."""
    base = stories_artifacts("f32")
    fht8 = eval_json(stories_artifacts("fht-int8", 32), base, assets)
    fht4 = eval_json(stories_artifacts("fht-int4", 32), base, assets)
    int4 = eval_json(stories_artifacts("int4", 32), base, assets)
    assert abs(fht8["base_ppl"] - 143.13) / 143.13 <= 5e-4 and fht8["chunks"] == 247
    assert fht8["drift"] <= 0.001 and fht8["top1"] >= 0.99
    assert fht4["drift"] <= 0.01
    assert 3 * fht4["kld"] <= int4["kld"]
    # 5 layers x 4 KV heads x 8 dims: f32 1280 bytes/token; int8 rows of 8 codes + an f16 scale;
    # int4: 4 bytes of codes + one f16 scale per group of 8
    assert fht8["kv_bytes_per_token"] == 5 * 2 * 4 * (8 + 2)
    assert fht4["kv_bytes_per_token"] == 5 * 2 * 4 * (4 + 2)


@pytest.mark.slow
def test_stories260k_fht_int8_centred(stories_artifacts, assets):
    """The issue's fht-int8 bound without a window: K centred on calibration text (bytes 200,000-400,000)
    takes the drift from +0.10% to about +0.03% and the KL divergence from 0.0036 to about 0.0011
    (docs/kv-cache.md); the centring is a weight, so bytes per token do not change."""
    artifact = stories_artifacts("fht-int8", 0, centred=True)
    assert json.loads((artifact / "manifest.json").read_text())["kv"]["k_centred"] is True
    result = eval_json(artifact, stories_artifacts("f32"), assets)
    assert result["drift"] <= 0.001 and result["kld"] <= 0.002 and result["top1"] >= 0.97
    assert result["kv_bytes_per_token"] == 5 * 2 * 4 * (8 + 2)
