"""Mixture-of-experts families against transformers: tiny random-init checkpoints of mixtral,
qwen2_moe, qwen3_moe, olmoe and gpt_oss built with transformers and saved with save_pretrained,
imported by the HF frontend; the interpreter's and the compiled artifact's logits within
1e-4 x max|logit| of transformers (prefill of two sequences in one step, then 16 decode steps) and
greedy 32 tokens identical. Compiled f16/bf16 experts against the interpreter of the same graph.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import Variant, build_hf_checkpoint
from test_hf_parity import check_greedy, check_parity, random_prompts

from infeng_compiler.compile import CompileOptions, compile_model
from infeng_compiler.frontends.hf import import_hf
from infeng_compiler.interp import Interpreter
from infeng_compiler.ir import parse, print_graph, verify
from infeng_compiler.ir.moe_ops import route
from infeng_compiler.ir.ops import REGISTRY
from infeng_compiler.passes.manager import PassManager, parse_pipeline
from infeng_runtime.engine import Engine

VOCAB = 256
_BASE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": VOCAB, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
             "bos_token_id": 1, "eos_token_id": 2}

MOE_VARIANTS: dict[str, Variant] = {
    "mixtral": Variant("MixtralConfig", dict(_BASE, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                                             sliding_window=5),
                       notes="softmax, top 2 of 4, renormalised; sliding window 5"),
    "qwen2_moe": Variant("Qwen2MoeConfig", dict(_BASE, num_hidden_layers=3, intermediate_size=96,
                                                moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                                num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                                mlp_only_layers=[1]),
                         notes="no renormalisation, sigmoid-gated shared expert, a dense layer (1), q/k/v biases"),
    "qwen3_moe": Variant("Qwen3MoeConfig", dict(_BASE, intermediate_size=96, moe_intermediate_size=48, num_experts=8,
                                                num_experts_per_tok=3, norm_topk_prob=True, head_dim=24),
                         notes="per-head q/k RMS norm, top 3 of 8 renormalised, head_dim 24 != hidden/heads"),
    "olmoe": Variant("OlmoeConfig", dict(_BASE, intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                         norm_topk_prob=False),
                     notes="q/k RMS norm over the whole row"),
    "gpt_oss": Variant("GptOssConfig", dict(_BASE, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                            head_dim=16, sliding_window=5,
                                            rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                             "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                             "original_max_position_embeddings": 16}),
                       notes="attention sinks, sliding window 5 on even layers, YaRN, clamped SwiGLU, biases"),
    "qwen3_moe-bf16": Variant("Qwen3MoeConfig", dict(_BASE, intermediate_size=96, moe_intermediate_size=48,
                                                     num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
                              dtype="bfloat16"),
}


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``moe_checkpoint(name)``: the tiny checkpoint of MOE_VARIANTS[name], built once per session."""
    root = tmp_path_factory.mktemp("moe")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_hf_checkpoint(MOE_VARIANTS[name], root / name)
        return built[name]

    return get


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_logits_match_transformers(moe_checkpoint, variant: str) -> None:
    check_parity(moe_checkpoint(variant), random_prompts(VOCAB), VOCAB)


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"])
def test_greedy_matches_generate(moe_checkpoint, variant: str) -> None:
    check_greedy(moe_checkpoint(variant), random_prompts(VOCAB, seed=2))


def test_variants_are_what_they_claim(moe_checkpoint) -> None:
    """The graphs hold what each family is meant to exercise."""
    oss = import_hf(moe_checkpoint("gpt_oss"))
    attn = list(oss.find("attention"))
    assert [a.attrs.get("window") for a in attn] == [5, None] and all(a.attrs.get("sinks") for a in attn)
    assert next(oss.find("rope")).attrs["scaling"]["rope_type"] == "yarn"
    experts = next(oss.find("experts"))
    assert experts.attrs["activation"] == "swiglu_clamp" and len(experts.weights) == 4
    qwen2 = import_hf(moe_checkpoint("qwen2_moe"))
    assert len(list(qwen2.find("experts"))) == 2 and len(list(qwen2.find("sigmoid_gate"))) == 2
    assert not next(qwen2.find("router")).attrs["renormalize"]
    qwen3 = import_hf(moe_checkpoint("qwen3_moe"))
    assert len(list(qwen3.find("head_rms_norm"))) == 4 and next(qwen3.find("router")).attrs["top_k"] == 3
    mixtral = import_hf(moe_checkpoint("mixtral"))
    assert next(mixtral.find("router")).attrs == {"top_k": 2, "scoring": "softmax", "renormalize": True}
    assert {w.type.dtype for w in import_hf(moe_checkpoint("qwen3_moe-bf16")).weights.values()} == {"bf16"}


@pytest.mark.parametrize("variant", ["mixtral", "gpt_oss"])
def test_text_form_round_trips(moe_checkpoint, variant: str) -> None:
    g = import_hf(moe_checkpoint(variant))
    verify(g)
    text = print_graph(g)
    assert "= router(" in text and "= experts(" in text
    assert print_graph(parse(text)) == text


def test_stacked_expert_weights_are_the_checkpoint_tensors(moe_checkpoint) -> None:
    """gate_up [E, 2I, H] holds each expert's gate rows then its up rows; GPT-OSS's [in, out] tensors transposed."""
    from safetensors.numpy import load_file

    mixtral = moe_checkpoint("mixtral")
    tensors = load_file(mixtral / "model.safetensors")
    g = import_hf(mixtral)
    gate_up = g.weights["model.layers.1.block_sparse_moe.experts.gate_up"].numpy_f32()
    p = "model.layers.1.block_sparse_moe.experts.2."
    np.testing.assert_array_equal(gate_up[2], np.concatenate([tensors[p + "w1.weight"], tensors[p + "w3.weight"]]))
    down = g.weights["model.layers.1.block_sparse_moe.experts.down"].numpy_f32()
    np.testing.assert_array_equal(down[2], tensors[p + "w2.weight"])
    oss = moe_checkpoint("gpt_oss")
    tensors = load_file(oss / "model.safetensors")
    g = import_hf(oss)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    np.testing.assert_array_equal(g.weights[name].numpy_f32(), tensors[name].transpose(0, 2, 1))


def test_router_scoring() -> None:
    """Both scorings on hand-made logits: Mixtral's softmax-top-k-renormalise, GPT-OSS's top-k-softmax."""
    logits = np.array([[1.0, 3.0, 2.0, 0.0]], dtype=np.float32)
    w, ids = route(logits, 2, "softmax", renormalize=False)
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    assert ids.tolist() == [[1, 2]]
    np.testing.assert_allclose(w[0], [p[1], p[2]], rtol=1e-6)
    w, ids = route(logits, 2, "softmax", renormalize=True)
    np.testing.assert_allclose(w[0], [p[1] / (p[1] + p[2]), p[2] / (p[1] + p[2])], rtol=1e-6)
    w, ids = route(logits, 2, "topk_softmax", renormalize=False)
    np.testing.assert_allclose(w[0], [1 / (1 + np.exp(-1.0)), np.exp(-1.0) / (1 + np.exp(-1.0))], rtol=1e-6)


def test_experts_reference_is_a_sum_of_dense_ffns() -> None:
    """experts = sum over the chosen k of weight * down(act(gate_up(x))), each token on its own."""
    rng = np.random.default_rng(0)
    E, H, I, T, k = 4, 8, 6, 5, 2
    x = rng.standard_normal((T, H)).astype(np.float32)
    gu, down = rng.standard_normal((E, 2 * I, H)).astype(np.float32), rng.standard_normal((E, H, I)).astype(np.float32)
    ids = np.array([[0, 1], [3, 1], [2, 0], [1, 3], [3, 2]], dtype=np.int32)
    rw = rng.random((T, k)).astype(np.float32)
    attrs = {"activation": "silu", "gate_up": "concat"}
    got = REGISTRY["experts"].reference([x, rw, ids], [gu, down], attrs, None)[0]
    for t in range(T):
        want = np.zeros(H)
        for j in range(k):
            e = ids[t, j]
            gate, up = gu[e, :I] @ x[t], gu[e, I:] @ x[t]
            want += rw[t, j] * (down[e] @ (gate / (1 + np.exp(-gate)) * up))
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-5)


COMPILED_VARIANTS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"]


@pytest.fixture(scope="session")
def moe_artifact(tmp_path_factory: pytest.TempPathFactory, moe_checkpoint) -> Callable[..., Path]:
    """``moe_artifact(variant, dtype)``: the compiled artifact (native target), built once per session."""
    root = tmp_path_factory.mktemp("moe-artifacts")
    built: dict[tuple[str, str], Path] = {}

    def get(variant: str, dtype: str = "f32") -> Path:
        if (variant, dtype) not in built:
            out = root / f"{variant}-{dtype}.infeng"
            compile_model(moe_checkpoint(variant), out, CompileOptions(target="native", dtype=dtype))
            built[variant, dtype] = out
        return built[variant, dtype]

    return get


@pytest.mark.parametrize("variant", COMPILED_VARIANTS)
def test_compiled_logits_match_transformers(moe_checkpoint, moe_artifact, variant: str) -> None:
    artifact = moe_artifact(variant)
    check_parity(moe_checkpoint(variant), random_prompts(VOCAB), VOCAB, backend=lambda _: Engine(artifact))


@pytest.mark.parametrize("variant", COMPILED_VARIANTS)
def test_compiled_greedy_matches_generate(moe_checkpoint, moe_artifact, variant: str) -> None:
    artifact = moe_artifact(variant)
    check_greedy(moe_checkpoint(variant), random_prompts(VOCAB, seed=2), backend=lambda _: Engine(artifact))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_compiled_reduced_precision_experts(moe_checkpoint, moe_artifact, dtype: str) -> None:
    """Experts stored in f16/bf16 (cast-weights casts the stacked [E, out, in] weights too), against
    the interpreter of the same cast graph: 1e-4 x max|logit| where only accumulation order differs,
    2e-2 where avx512-bf16 kernels round activations to bf16 (tests/test_compiled.py's bound)."""
    from infeng_compiler.codegen.target import get_target

    graph = import_hf(moe_checkpoint("qwen2_moe"))
    PassManager(parse_pipeline(f"cast-weights({dtype})")).run(graph)
    assert next(graph.find("experts")).weights[0].format == dtype
    engine, interp = Engine(moe_artifact("qwen2_moe", dtype)), Interpreter(graph)
    bound = 2e-2 if dtype == "bf16" and get_target("native").name in ("avx512-bf16", "amx") else 1e-4
    prompts = random_prompts(VOCAB)
    tokens = np.concatenate(prompts)
    positions = np.concatenate([np.arange(len(p)) for p in prompts])
    seq_ids = np.repeat(np.arange(len(prompts)), [len(p) for p in prompts])
    want, got = interp.step(tokens, positions, seq_ids), engine.step(tokens, positions, seq_ids)
    assert np.abs(got - want).max() <= bound * np.abs(want).max()


#: compiled vs the interpreter of the same quantized graph: the integer kernels against the reference's
#: float64 dot products of the same codes (tests/test_quant_compiled.py's bounds and reasons)
QUANT_TOLERANCE = {"int4": 1e-2, "int8": 1e-3}


@pytest.mark.parametrize("preset", ["int8", "int4"])
def test_compiled_quantized_experts(moe_checkpoint, tmp_path: Path, preset: str) -> None:
    """--quant quantizes the stacked experts too (expert by expert, in the preset's format; int4 pads
    I = 48 to whole groups), and the driver's integer kernels match the interpreter, which rounds the
    rows each expert matrix reads as the driver's quantize_act does (``act_quant``)."""
    model = moe_checkpoint("qwen2_moe")
    out = tmp_path / f"{preset}.infeng"
    compile_model(model, out, CompileOptions(target="native", quant=preset, act_precision="int8"))
    graph = import_hf(model)
    PassManager([("quantize", [preset])]).run(graph)
    experts = next(graph.find("experts"))
    assert experts.weights[0].format == ("q8r" if preset == "int8" else "q4g32") == experts.weights[1].format
    assert experts.attrs["act_quant"] == ([16, 0] if preset == "int8" else [8, 32])
    prompts = random_prompts(VOCAB)
    tokens = np.concatenate(prompts)
    positions = np.concatenate([np.arange(len(p)) for p in prompts])
    seq_ids = np.repeat(np.arange(len(prompts)), [len(p) for p in prompts])
    want, got = Interpreter(graph).step(tokens, positions, seq_ids), Engine(out).step(tokens, positions, seq_ids)
    assert np.abs(got - want).max() <= QUANT_TOLERANCE[preset] * np.abs(want).max()
    assert (got.argmax(axis=1) == want.argmax(axis=1)).mean() >= 0.9


def test_mxfp4_experts_on_int8_rows(tmp_path_factory: pytest.TempPathFactory) -> None:
    """GPT-OSS with MXFP4 experts (infeng_models.gpt_oss_shape, tiny) compiled with ``experts-act(q8)``:
    the driver quantizes each expert's rows to int8 for linear_mxfp4's integer path, and matches the
    interpreter of the same graph, which rounds those rows alike (``act_quant``)."""
    from infeng_models.gpt_oss_shape import TINY, write_checkpoint

    root = tmp_path_factory.mktemp("oss-mxfp4")
    model = write_checkpoint(root / "model", TINY, seed=3)
    options = CompileOptions(target="native", passes="cast-weights(f32),experts-act(q8)")
    compile_model(model, root / "q8.infeng", options)
    graph = import_hf(model)
    PassManager(parse_pipeline("cast-weights(f32),experts-act(q8)")).run(graph)
    assert all(n.attrs["act_quant"] == [8, 32] for n in graph.find("experts"))
    ids = np.array([1, 45, 300, 12, 7, 99, 250, 3, 60, 411, 5, 17], np.int32)
    step = (ids, np.arange(len(ids), dtype=np.int32), np.zeros(len(ids), np.int32))
    want, got = Interpreter(graph).step(*step), Engine(root / "q8.infeng").step(*step)
    assert np.abs(got - want).max() <= QUANT_TOLERANCE["int8"] * np.abs(want).max()


@pytest.mark.parametrize(("variant", "edit", "message"), [
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds the 4 experts"),
    ("mixtral", {"num_local_experts": 5}, "gate.weight has shape [4, 64] but config.json implies [5, 64]"),
    ("qwen2_moe", {"mlp_only_layers": 1}, "mlp_only_layers must be a list"),
    ("gpt_oss", {"swiglu_limit": "seven"}, "swiglu_limit must be a number"),
    ("gpt_oss", {"layer_types": ["full_attention"]}, "layer_types must list the 2 layers"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv is not supported"),
])
def test_malformed_moe_config_is_one_line(moe_checkpoint, tmp_path: Path, variant: str, edit: dict,
                                          message: str) -> None:
    import json
    import shutil

    from infeng_common.errors import InfengError

    model = tmp_path / variant
    shutil.copytree(moe_checkpoint(variant), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(InfengError) as err:
        import_hf(model)
    text = str(err.value)
    assert message in text and "\n" not in text and str(model) in text
