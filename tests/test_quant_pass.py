"""The quantize pass: IR text in / expected text out, numerics within the declared tolerance, the
policy (presets, files, fallbacks, errors), calibration (AWQ folding is exact), CLI eval."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from infeng_common.errors import InfengError
from infeng_compiler.frontends.hf import import_hf
from infeng_compiler.interp import Interpreter
from infeng_compiler.ir import parse, print_graph
from infeng_compiler.options import CompileOptions
from infeng_compiler.passes.manager import PassContext, PassManager, parse_pipeline
from infeng_compiler.passes.quantize import Quantize
from infeng_compiler.quant.awq import apply_awq
from infeng_compiler.quant.calibrate import MATMUL_OPS, calibration_ids, collect, spread_chunks
from infeng_compiler.quant.formats import get_format

TOKENS = np.array([1, 17, 3, 99, 42, 7, 250, 5, 61, 2, 33, 8], np.int32)

SMALL = """
graph @small(%tokens: i32[T], %positions: i32[T]) {
  weight @emb : f32[32,64] {inline=true}
  weight @norm : f32[64] {inline=true}
  weight @gate : f32[96,64] {inline=true}
  weight @up : f32[96,64] {inline=true}
  weight @down : f32[40,96] {inline=true}
  weight @proj : f32[64,40] {inline=true}
  weight @fnorm : f32[64] {inline=true}
  %h = embedding(%tokens, @emb) : f32[T,64]
  %n = rms_norm(%h, @norm) : f32[T,64] {eps=1e-05}
  %gate = linear(%n, @gate) : f32[T,96]
  %up = linear(%n, @up) : f32[T,96]
  %act = silu_mul(%gate, %up) : f32[T,96]
  %down = linear(%act, @down) : f32[T,40]
  %proj = linear(%down, @proj) : f32[T,64]
  %r = add(%h, %proj) : f32[T,64]
  %fn = rms_norm(%r, @fnorm) : f32[T,64] {eps=1e-05}
  %logits = logits(%fn, @emb) : f32[R,32]
  return %logits
}
"""


def small_graph(seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = {"emb": (32, 64), "norm": (64,), "gate": (96, 64), "up": (96, 64), "down": (40, 96),
              "proj": (64, 40), "fnorm": (64,)}
    arrays = {k: ((1 + 0.1 * rng.standard_normal(s)) if len(s) == 1 else 0.2 * rng.standard_normal(s)).astype(np.float32)
              for k, s in shapes.items()}
    return parse(SMALL, arrays)


def assert_checks(text: str, checks: str) -> None:
    """FileCheck-style: every ``CHECK:`` line occurs, in order, as a substring of a line of ``text``."""
    lines = text.splitlines()
    i = 0
    for check in [c.split("CHECK:", 1)[1].strip() for c in checks.strip().splitlines() if "CHECK:" in c]:
        while i < len(lines) and check not in lines[i]:
            i += 1
        assert i < len(lines), f"not found (in order): {check}\n{text}"
        i += 1


def run(graph, pipeline: str, ctx: PassContext | None = None):
    PassManager(parse_pipeline(pipeline)).run(graph, ctx)
    return graph


def logits(graph, tokens=TOKENS) -> np.ndarray:
    n = len(tokens)
    vocab = graph.meta.get("vocab_size", 32) if graph.meta else 32
    return Interpreter(graph).step(tokens % vocab, np.arange(n, dtype=np.int32), np.zeros(n, np.int32))


def rel_change(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(a).max())


# ---------------------------------------------------------------------------------------------
# IR text in, expected text out
def test_int4_formats_and_activation_quantization_in_the_ir() -> None:
    g = run(small_graph(), "quantize(int4)")
    assert_checks(print_graph(g), """
      CHECK: weight @emb : q8r[32,64] {source="f32", inline=true}
      CHECK: weight @norm : f32[64] {inline=true}
      CHECK: weight @gate : q4g32[96,64] {source="f32", inline=true}
      CHECK: weight @up : q4g32[96,64] {source="f32", inline=true}
      CHECK: weight @down : q4g32[40,96] {source="f32", inline=true}
      CHECK: weight @proj : q8r[64,40] {source="f32", inline=true, fallback_from="q4g32"}
      CHECK: %n.q8 = quantize_act(%n) : f32[T,64] {bits=8, block=32}
      CHECK: %gate = linear(%n.q8, @gate) : f32[T,96]
      CHECK: %up = linear(%n.q8, @up) : f32[T,96]
      CHECK: %act.q8 = quantize_act(%act) : f32[T,96] {bits=8, block=32}
      CHECK: %down = linear(%act.q8, @down) : f32[T,40]
      CHECK: %down.q16 = quantize_act(%down) : f32[T,40] {bits=16, block=0}
      CHECK: %proj = linear(%down.q16, @proj) : f32[T,64]
      CHECK: %fn.q16 = quantize_act(%fn) : f32[T,64] {bits=16, block=0}
      CHECK: %logits = logits(%fn.q16, @emb) : f32[R,32]
    """)
    again = parse(print_graph(g), {w.name: w.array for w in g.weights.values()})
    assert again == g
    assert len(list(g.find("quantize_act"))) == 4


def test_fp8_keeps_float_activations_and_pad_policy(tmp_path: Path) -> None:
    g = run(small_graph(), "quantize(fp8)")
    text = print_graph(g)
    assert "quantize_act" not in text and text.count(': f8e4m3[') == 5
    policy = tmp_path / "pad.json"
    policy.write_text(json.dumps({"preset": "int4", "group": 64, "fallback": "pad",
                                  "tensors": {"gate": "f16", "up": "q8g32"}}))
    g = run(small_graph(), f"quantize(policy={policy})")
    assert_checks(print_graph(g), """
      CHECK: weight @gate : f16[96,64] {source="f32", inline=true}
      CHECK: weight @up : q8g32[96,64] {source="f32", inline=true}
      CHECK: weight @down : q4g64[40,96] {source="f32", inline=true}
      CHECK: weight @proj : q4g64[64,40] {source="f32", inline=true}
      CHECK: %gate = linear(%n, @gate)
      CHECK: %up = linear(%n.q16, @up)
    """)
    assert get_format("q4g64").padding((64, 40)) == {"N": 64, "K": 64}


def test_stored_bytes_and_interpreter_values_agree() -> None:
    g = run(small_graph(), "quantize(int4)")
    for w in g.weights.values():
        if w.format.startswith("q"):
            fmt = get_format(w.format)
            data = w.stored()
            assert data.dtype == np.uint8 and data.size == fmt.nbytes(w.type.shape)
            assert np.array_equal(fmt.unpack(data, w.type.shape).dequantize(), w.numpy_f32())


# ---------------------------------------------------------------------------------------------
# numerics: the interpreter before and after, within the pass's declared tolerance
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


@pytest.mark.parametrize("preset", ["int8", "int4", "fp8"])
def test_numerics_within_declared_tolerance(stories_dir, preset: str) -> None:
    """The pass's tolerance is stated for a real model on in-domain text (random-init models
    amplify any rounding chaotically)."""
    from infeng_common.tokenizer import Tokenizer

    ids = np.array(Tokenizer(stories_dir, 1, [2]).encode(STORY, add_bos=True), np.int32)
    before = logits(import_hf(stories_dir), ids)
    p = Quantize(preset)
    g = import_hf(stories_dir)
    PassManager([("quantize", [preset])]).run(g)
    after = logits(g, ids)
    assert 0 < rel_change(before, after) <= p.tolerance, (preset, rel_change(before, after))
    assert (after.argmax(axis=1) == before.argmax(axis=1)).mean() >= (0.9 if preset == "int4" else 0.97)


def test_awq_folding_is_exact(hf_checkpoint) -> None:
    """Scaling weight columns and dividing the producer (norm weight and bias, up rows, v rows with
    GQA) by the same s changes nothing but float32 rounding."""
    for name in ("llama", "gpt2"):
        g = import_hf(hf_checkpoint(name))
        before = logits(g)
        rng = np.random.default_rng(1)
        chunks = rng.integers(0, 256, size=(2, 24)).astype(np.int32)
        stats = collect(g, chunks)
        formats = {n.weights[0].name: "q4g32" for n in g.nodes if n.op == "linear"}
        done = apply_awq(g, stats, formats, alphas=(0.5,))
        kinds = {s.folded_into.rsplit(".", 2)[-2] for s in done}
        assert done, name
        if name == "llama":
            assert {"input_layernorm", "post_attention_layernorm", "up_proj", "v_proj"} <= kinds, kinds
        assert rel_change(before, logits(g)) < 2e-5, name


def reference_stats(graph, chunks: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(mean |x|, XᵀX) of every matmul input, each chunk a sequence through ``Interpreter.step``
    (the registry's references, float64 sums)."""
    watched = {n.inputs[0].name for n in graph.nodes if n.op in MATMUL_OPS}
    rows: dict[str, list[np.ndarray]] = {}

    def observe(node, ins, ws, outs) -> None:
        for value, array in zip(node.outputs, outs):
            if value.name in watched:
                rows.setdefault(value.name, []).append(np.asarray(array, np.float64).reshape(-1, array.shape[-1]))

    it = Interpreter(graph, observe)
    for seq, chunk in enumerate(chunks):
        it.step(chunk, np.arange(len(chunk), dtype=np.int32), np.full(len(chunk), seq, np.int32))
    return {name: (np.abs(np.concatenate(x)).mean(axis=0), np.concatenate(x).T @ np.concatenate(x))
            for name, x in rows.items()}


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
def test_calibration_statistics_match_the_reference(hf_checkpoint, family: str) -> None:
    """``collect``'s float32 batched causal attention (GQA; mistral's sliding window; gpt2's
    layer norms and biases) and float32 Gram products give the reference interpreter's statistics
    up to float32 rounding."""
    g = import_hf(hf_checkpoint(family))
    chunks = np.random.default_rng(2).integers(0, 256, size=(5, 24)).astype(np.int32)
    stats = collect(g, chunks, batch=2)
    expected = reference_stats(g, chunks)
    assert stats.keys() == expected.keys() and len(stats) > 3
    for name, (abs_mean, gram) in expected.items():
        assert stats[name].tokens == chunks.size
        assert np.abs(stats[name].abs_mean - abs_mean).max() <= 1e-5 * np.abs(abs_mean).max(), name
        assert np.abs(stats[name].gram - gram).max() <= 1e-5 * np.abs(gram).max(), name


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_calibration_by_segments_gives_the_one_pass_statistics(hf_checkpoint, family: str) -> None:
    """``collect`` runs the graph a segment (a layer's half) at a time over every chunk; the same
    steps and sums as one pass through the whole graph (``_run_chunks``), so the same bits."""
    from infeng_compiler.quant import calibrate

    g = import_hf(hf_checkpoint(family))
    chunks = np.random.default_rng(3).integers(0, 256, size=(5, 24)).astype(np.int32)
    nodes = [n for n in g.nodes if n.op != "logits"]
    assert len(calibrate._segments(g, nodes)) > 2 * g.meta["num_layers"]
    sums: dict[str, list] = {}
    watched = {n.inputs[0].name for n in g.nodes if n.op in MATMUL_OPS}

    def observe(node, ins, ws, outs) -> None:
        for value, array in zip(node.outputs, outs):
            if value.name in watched:
                calibrate._accumulate(sums, value.name, array)

    calibrate._run_chunks(g, nodes, chunks, 2, observe, None, {"attention": calibrate.causal_attention(24)})
    seen = []
    stats = collect(g, chunks, batch=2, finish=lambda name, st: seen.append(name) or st)
    assert seen == [v.name for n in g.nodes for v in n.outputs if v.name in watched]     # the graph's order
    for name, (count, absum, gram) in sums.items():
        assert stats[name].tokens == count
        np.testing.assert_array_equal(stats[name].abs_mean, absum / count)
        np.testing.assert_array_equal(stats[name].gram, gram)


def test_reduced_statistics_search_and_scale_as_the_full_gram() -> None:
    """What the clipping search reads of a Gram (its group blocks, zero-padded past K, or its
    diagonal) gives the same codes and scales as the full Gram, before and after an AWQ scaling."""
    from infeng_compiler.codegen.clip_search import clip_search
    from infeng_compiler.quant.calibrate import ActStats
    from infeng_compiler.quant.search import quantize

    rng = np.random.default_rng(4)
    K = 80                                                   # not a multiple of 32: a padded last block
    x = rng.standard_normal((300, K)) * rng.uniform(0.1, 3, K)
    full = ActStats(300, np.abs(x).mean(axis=0), x.T @ x)
    s = rng.uniform(0.5, 2, K)
    for scale in (None, s):
        st = full if scale is None else full.scaled(scale)
        reduced = full.reduced({0, 32, 64}) if scale is None else full.reduced({0, 32, 64}).scaled(scale)
        assert reduced.gram is None
        np.testing.assert_array_equal(reduced.abs_mean, st.abs_mean)
        w = (0.2 * rng.standard_normal((24, K))).astype(np.float32)
        for fmt in ("q4g32", "q4g64", "q8r"):
            group = get_format(fmt).group
            a = quantize(w, fmt, gram=st.gram / 300, symmetric_choice=clip_search)
            b = quantize(w, fmt, gram=reduced.error_weights(group), symmetric_choice=clip_search)
            np.testing.assert_array_equal(a.codes, b.codes)
            np.testing.assert_array_equal(a.scales, b.scales)


def test_calibration_folds_awq_and_reports(stories_dir, assets, tmp_path: Path) -> None:
    text = (assets / "text" / "wikitext-2-raw-v1-test.txt").read_bytes()[200_000:212_000]
    calib = tmp_path / "calib.txt"
    calib.write_bytes(text)
    ctx = PassContext(model_dir=stories_dir)
    g = run(import_hf(stories_dir), f"quantize(int4,calib={calib},calib_ctx=128)", ctx)
    report = ctx.quant_report
    assert report.calib_tokens >= 128 and report.awq
    assert all(a["loss_after"] < a["loss_before"] for a in report.awq)
    assert {r["format"] for r in report.by_format()} == {"q8r", "q4g32"}
    assert any(t.fallback_from == "q4g32" and "down_proj" in t.name for t in report.tensors)
    # a folded norm weight is an inline weight of the same name
    folded = [a["folded_into"] for a in report.awq if a["folded_into"].endswith("layernorm.weight")]
    assert folded and g.weights[folded[0]].array is not None


class _ByteTokenizer:
    """One id per byte; BOS 1."""

    bos_token_id = 1

    def encode(self, text: str, add_bos: bool) -> list[int]:
        return [1] * add_bos + list(text.encode())


def test_a_calibration_budget_keeps_whole_chunks_spread_over_the_text(tmp_path: Path) -> None:
    """``calib_tokens``: at most that many tokens, whole chunks (at least one) from all over the
    text in its order, the first included; 0 or None: every chunk."""
    chunks = np.arange(40).reshape(10, 4)
    np.testing.assert_array_equal(spread_chunks(chunks, 12)[:, 1], [1, 13, 25])          # chunks 0, 3, 6
    np.testing.assert_array_equal(spread_chunks(chunks, 20)[:, 1], [1, 9, 17, 25, 33])   # chunks 0, 2, 4, 6, 8
    assert spread_chunks(chunks, 3).shape == (1, 4)
    for everything in (None, 0, 40, 1000):
        assert spread_chunks(chunks, everything) is chunks
    text = tmp_path / "calib.txt"
    text.write_bytes(bytes(range(65, 91)) * 40)              # 1,040 bytes: 16 chunks of 64 (+ BOS)
    ids = calibration_ids(_ByteTokenizer(), text, None, 64, 256)
    every = calibration_ids(_ByteTokenizer(), text, None, 64)
    assert ids.shape == (4, 64) and every.shape == (16, 64)
    np.testing.assert_array_equal(ids, every[[0, 4, 8, 12]])


def test_the_calibration_budget_reaches_the_pass_and_the_cache(stories_dir, assets, tmp_path) -> None:
    """``--calib-tokens`` is written into the quantize entry (0 included); the pass calibrates on that
    many tokens; another budget is another calibration entry of the search cache (its key holds the
    chosen token ids), the same budget reads it back."""
    calib = assets / "text" / "wikitext-2-raw-v1-test.txt"
    entry = CompileOptions(quant="int4", calib=calib, calib_max_bytes=3000, calib_tokens=128).pipeline()
    assert ("quantize", ["int4", f"calib={calib.resolve()}", "calib_max_bytes=3000", "calib_tokens=128"]) in entry
    assert "calib_tokens=0" in dict(CompileOptions(quant="int4", calib=calib, calib_tokens=0).pipeline())["quantize"]
    with pytest.raises(InfengError, match="calib_tokens must be >= 0"):
        Quantize("int4", "calib_tokens=-1")
    for budget, stats_entries in ((128, 1), (0, 2), (128, 2)):
        ctx = PassContext(model_dir=stories_dir, search_cache=tmp_path)
        run(import_hf(stories_dir), f"quantize(int4,calib={calib},calib_max_bytes=3000,calib_ctx=64,"
                                    f"calib_tokens={budget},clip=0,awq=0)", ctx)      # calibration alone
        assert (ctx.quant_report.calib_tokens == 128) == (budget == 128) and ctx.quant_report.calib_tokens >= 128
        assert len(list(tmp_path.glob("calib-*.npz"))) == stats_entries


# ---------------------------------------------------------------------------------------------
# policy and argument errors name the file and tensor
def test_bad_policies(tmp_path: Path) -> None:
    def policy(spec) -> str:
        path = tmp_path / "p.json"
        path.write_text(spec if isinstance(spec, str) else json.dumps(spec))
        return str(path)

    cases = [
        ({"preset": "int4", "tensors": {"up": "q5g32"}}, r"p\.json: tensors\['up'\]: unknown format 'q5g32'"),
        ({"preset": "int4", "tensors": {"nothing*": "q8r"}}, r"p\.json: tensor pattern 'nothing\*' matches no"),
        ({"preset": "int4", "groups": 32}, r"p\.json: unknown keys \['groups'\]"),
        ({"preset": "int3"}, r"p\.json: unknown preset 'int3'"),
        ({"preset": "int4", "group": 48}, r"p\.json: group must be one of 32, 64, 128"),
        ({"preset": "fp8", "asym": True}, r"fp8 \(f8e4m3\) has one scale per row"),
        ("{not json", r"p\.json: malformed JSON"),
        ({"tensors": {}}, r"give \"preset\" or \"default\""),
    ]
    for spec, message in cases:
        with pytest.raises(InfengError, match=message):
            run(small_graph(), f"quantize(policy={policy(spec)})")
    with pytest.raises(InfengError, match="policy file not found"):
        Quantize("policy=/nonexistent/p.json")
    with pytest.raises(InfengError, match="bad argument 'int5'"):
        Quantize("int5")
    with pytest.raises(InfengError, match="group must be one of"):
        Quantize("int4", "group=16")
    with pytest.raises(InfengError, match="calibration needs the model's tokenizer"):
        run(small_graph(), f"quantize(int4,calib={policy('x')})")


def test_cli_eval_quant_and_kld(stories_dir, assets, tmp_path: Path) -> None:
    text = assets / "text" / "wikitext-2-raw-v1-test.txt"
    cmd = [sys.executable, "-m", "infeng_cli", "eval", str(stories_dir), "--ppl", str(text), "--ctx", "128",
           "--max-bytes", "6000", "--json", "--quant", "int8", "--kld-base", str(stories_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["pipeline"] == "quantize(int8)"
    assert 0 < result["kld"] < 0.01 and result["top1"] > 0.9 and abs(result["drift"]) < 0.01
    bad = subprocess.run(cmd[:-4] + ["--calib", str(tmp_path / "missing.txt"), "--quant", "int4"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and re.search(r"missing\.txt: calibration text file not found", bad.stderr)


def test_a_second_calibrated_quantize_reads_the_search_cache(stories_dir, assets, tmp_path) -> None:
    """With ``PassContext.search_cache``: the calibration (statistics reduced to group blocks, AWQ
    choices) and every tensor's search are kept by content hash, and a second run of the same pass
    on the same model reads them back to the same codes and scales and the same graph."""
    calib = assets / "text" / "wikitext-2-raw-v1-test.txt"
    entry = parse_pipeline(f"quantize(int4,calib={calib},calib_max_bytes=1000,calib_ctx=64)")
    graphs = []
    for _ in range(2):
        graph = import_hf(stories_dir)
        PassManager(entry).run(graph, PassContext(model_dir=stories_dir, search_cache=tmp_path))
        graphs.append(graph)
    kept = sorted(p.name for p in tmp_path.glob("*.npz"))
    assert sum(name.startswith("calib-") for name in kept) == 1
    quantized = [n for n, w in graphs[0].weights.items() if w.quant is not None]
    assert len(kept) == 1 + len(quantized)
    for name in quantized:
        first, again = graphs[0].weights[name].quant, graphs[1].weights[name].quant
        np.testing.assert_array_equal(again.codes, first.codes)
        np.testing.assert_array_equal(again.scales, first.scales)
    assert print_graph(graphs[1]) == print_graph(graphs[0])
