"""The fuse-linears pass: IR text in / expected text out, exact numerics (float, quantized, biases),
LoRA slots left alone, and the compiled model still matching the interpreter."""
from __future__ import annotations

import numpy as np
import pytest

from infeng_compiler.frontends.hf import import_hf
from infeng_compiler.interp import Interpreter
from infeng_compiler.ir import parse, print_graph
from infeng_compiler.passes.fuse_linears import FuseLinears

from test_quant_pass import TOKENS, assert_checks, rel_change, run

ATTN = """
graph @attn(%tokens: i32[T], %positions: i32[T]) {
  weight @emb : f32[32,64] {inline=true}
  weight @norm : f32[64] {inline=true}
  weight @q : f32[64,64] {inline=true}
  weight @qb : f32[64] {inline=true}
  weight @k : f32[32,64] {inline=true}
  weight @kb : f32[32] {inline=true}
  weight @v : f32[32,64] {inline=true}
  weight @vb : f32[32] {inline=true}
  weight @o : f32[64,64] {inline=true}
  weight @gate : f32[96,64] {inline=true}
  weight @up : f32[96,64] {inline=true}
  weight @down : f32[64,96] {inline=true}
  %h = embedding(%tokens, @emb) : f32[T,64]
  %l0.n = rms_norm(%h, @norm) : f32[T,64] {eps=1e-05}
  %l0.q = linear(%l0.n, @q, @qb) : f32[T,64]
  %l0.k = linear(%l0.n, @k, @kb) : f32[T,32]
  %l0.v = linear(%l0.n, @v, @vb) : f32[T,32]
  %l0.qr = rope(%l0.q, %positions) : f32[T,64] {n_heads=4, head_dim=16, theta=10000.0}
  %l0.kr = rope(%l0.k, %positions) : f32[T,32] {n_heads=2, head_dim=16, theta=10000.0}
  %l0.a = attention(%l0.qr, %l0.kr, %l0.v, %positions) : f32[T,64] {layer=0, n_heads=4, n_kv_heads=2, head_dim=16, scale=0.25}
  %l0.o = linear(%l0.a, @o) : f32[T,64]
  %l0.r = add(%h, %l0.o) : f32[T,64]
  %l0.m = rms_norm(%l0.r, @norm) : f32[T,64] {eps=1e-05}
  %l0.gate = linear(%l0.m, @gate) : f32[T,96]
  %l0.up = linear(%l0.m, @up) : f32[T,96]
  %l0.act = silu_mul(%l0.gate, %l0.up) : f32[T,96]
  %l0.down = linear(%l0.act, @down) : f32[T,64]
  %out = add(%l0.r, %l0.down) : f32[T,64]
  %logits = logits(%out, @emb) : f32[R,32]
  return %logits
}
"""


def attn_graph(seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = {"emb": (32, 64), "norm": (64,), "q": (64, 64), "qb": (64,), "k": (32, 64), "kb": (32,),
              "v": (32, 64), "vb": (32,), "o": (64, 64), "gate": (96, 64), "up": (96, 64), "down": (64, 96)}
    arrays = {k: (0.3 * rng.standard_normal(s) + (1 if k == "norm" else 0)).astype(np.float32) for k, s in shapes.items()}
    return parse(ATTN, arrays)


def test_siblings_become_one_linear_and_a_split() -> None:
    g = run(attn_graph(), "fuse-linears")
    assert_checks(print_graph(g), """
    CHECK: weight @q+k+v : f32[128,64] {inline=true}
    CHECK: weight @qb+kb+vb : f32[128] {inline=true}
    CHECK: weight @gate+up : f32[192,64] {inline=true}
    CHECK: %l0.q_k_v = linear(%l0.n, @q+k+v, @qb+kb+vb) : f32[T,128]
    CHECK: %l0.q, %l0.k, %l0.v = split(%l0.q_k_v) : f32[T,64], f32[T,32], f32[T,32] {sizes=[64, 32, 32]}
    CHECK: %l0.o = linear(%l0.a, @o) : f32[T,64]
    CHECK: %l0.gate_up = linear(%l0.m, @gate+up) : f32[T,192]
    CHECK: %l0.gate, %l0.up = split(%l0.gate_up) : f32[T,96], f32[T,96] {sizes=[96, 96]}
    CHECK: %l0.down = linear(%l0.act, @down) : f32[T,64]
    """)
    assert "@q :" not in print_graph(g) and "@gate :" not in print_graph(g)    # the parts are gone


def test_fusion_is_exact() -> None:
    before, after = attn_graph(), run(attn_graph(), "fuse-linears")
    n = len(TOKENS)
    want = Interpreter(before).step(TOKENS % 32, np.arange(n, dtype=np.int32), np.zeros(n, np.int32))
    got = Interpreter(after).step(TOKENS % 32, np.arange(n, dtype=np.int32), np.zeros(n, np.int32))
    assert rel_change(want, got) <= FuseLinears.tolerance


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_quantized_weights_stack_code_for_code(quant: str) -> None:
    """The stacked matrix holds the parts' bytes one after another (whole blocks of 16 rows here),
    so the fused linear computes what the parts did. (Whole-model logits are not compared: a
    last-bit difference of float summation order can move an int8 activation code downstream.)"""
    before = run(attn_graph(), f"quantize({quant})")
    after = run(attn_graph(), f"quantize({quant}),fuse-linears")
    for fused, parts in (("q+k+v", "qkv"), ("gate+up", ("gate", "up"))):
        assert after.weights[fused].format == before.weights[parts[0]].format
        assert np.array_equal(after.weights[fused].stored(), np.concatenate([before.weights[p].stored() for p in parts]))


def test_only_weights_of_one_format_fuse() -> None:
    g = attn_graph()
    g.weights["k"].attrs["format"] = "f16"                 # k alone in f16: q and v still fuse
    run(g, "fuse-linears")
    text = print_graph(g)
    assert "%l0.q_v = linear(%l0.n, @q+v, @qb+vb)" in text and "%l0.k = linear(%l0.n, @k, @kb)" in text


def test_weights_of_one_format_fuse_whatever_their_source_dtype() -> None:
    """A V projection with a folded rotation is an f32 array while q and k come from bf16/f16 files:
    in one storage format they still fuse, stacked as stored."""
    from infeng_compiler.ir import Weight
    from infeng_compiler.ir.types import TensorType

    before = attn_graph()
    k = before.weights["k"]
    half = Weight("k", TensorType("f16", k.type.shape), array=k.raw().astype(np.float16))
    before.weights["k"] = half
    for node in before.nodes:
        node.weights = [half if w is k else w for w in node.weights]
    for name in ("q", "k", "v"):
        before.weights[name].attrs["format"] = "f16"
    after = run(before, "fuse-linears")
    fused = after.weights["q+k+v"]
    assert fused.type.dtype == "f16" and fused.format == "f16"
    parts = [attn_graph().weights[n].raw().astype(np.float16) for n in ("q", "k", "v")]
    assert np.array_equal(fused.stored(), np.concatenate(parts))


def test_compiled_model_with_fused_linears_matches_interpreter(tmp_path, hf_checkpoint) -> None:
    """The default pipeline ends with fuse-linears (test_compiled.py checks every family this way)."""
    from infeng_compiler.compile import CompileOptions, compile_model
    from infeng_runtime.engine import Engine
    from test_compiled import PROMPTS, assert_close, run_batch

    model = hf_checkpoint("qwen2")                           # q/k/v biases
    out = compile_model(model, tmp_path / "m.infeng", CompileOptions(target="native"))
    assert "fuse-linears" in out.pipeline
    assert " = split(" in (tmp_path / "m.infeng" / "ir.txt").read_text()
    assert_close(run_batch(Engine(tmp_path / "m.infeng", threads=1), PROMPTS, 3),
                 run_batch(Interpreter(import_hf(model)), PROMPTS, 3), rel=1e-4)
