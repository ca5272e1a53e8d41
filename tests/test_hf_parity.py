"""The HF frontend + numpy interpreter against transformers on the same checkpoints.

For every family (and the real stories260K): two sequences of different lengths prefilled in one
step, then 16 decode steps carrying a token of each sequence, logits within 1e-4 x max|logit| of
transformers at every step; and greedy 32-token continuations identical to ``generate``.
Reduced-precision checkpoints are compared against transformers run in float32 on the same
(widened) weights.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import HF_VARIANTS, VOCAB  # noqa: E402
from infeng_compiler.frontends.hf import import_hf  # noqa: E402
from infeng_compiler.interp import Interpreter  # noqa: E402

RTOL = 1e-4          # max abs error <= RTOL * max |logit|, per step
PROMPT_LENGTHS = (7, 12)
DECODE_STEPS = 16
GREEDY_TOKENS = 32


def load_reference(model_dir: Path):
    """transformers in float32 (reduced-precision weights are widened exactly), eval mode."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def reference_logits(model, prompt: np.ndarray, decode: np.ndarray) -> list[np.ndarray]:
    """transformers' logits for ``prompt`` (one row per token), then for each decode token in turn."""
    # transformers 5 renamed past_key_values to cache (the old name warns until 5.40).
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    steps = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor(prompt[None], dtype=torch.long), use_cache=True)
        steps.append(out.logits[0].numpy())
        for token in decode:
            out = model(input_ids=torch.tensor([[token]], dtype=torch.long), use_cache=True,
                        **{cache_arg: out[cache_arg]})
            steps.append(out.logits[0].numpy())
    return steps


def reference_greedy(model, prompt: np.ndarray, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor(prompt[None], dtype=torch.long), do_sample=False, max_new_tokens=n,
                             min_new_tokens=0, eos_token_id=None, pad_token_id=0)
    generated = out[0, len(prompt):].tolist()
    assert len(generated) == n, "transformers stopped early; the comparison needs all tokens"
    return generated


def batched_prefill(interp: Interpreter, prompts: list[np.ndarray]) -> np.ndarray:
    """One step holding every prompt: positions from 0, sequence id = prompt index."""
    tokens = np.concatenate(prompts)
    positions = np.concatenate([np.arange(len(p)) for p in prompts])
    seq_ids = np.concatenate([np.full(len(p), i) for i, p in enumerate(prompts)])
    return interp.step(tokens, positions, seq_ids)


def assert_close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    err = float(np.max(np.abs(actual - expected)))
    bound = RTOL * float(np.max(np.abs(expected)))
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g} (1e-4 x max|logit|)"


def interpreter(model_dir: Path) -> Interpreter:
    return Interpreter(import_hf(model_dir))


def check_parity(model_dir: Path, prompts: list[np.ndarray], vocab: int, seed: int = 1,
                 backend: Callable[[Path], Any] = interpreter) -> None:
    """``backend(model_dir)`` (the interpreter, or a compiled Engine: the same ``step``) against transformers."""
    reference = load_reference(model_dir)
    rng = np.random.default_rng(seed)
    decode = [rng.integers(3, vocab, DECODE_STEPS) for _ in prompts]
    expected = [reference_logits(reference, p, d) for p, d in zip(prompts, decode)]

    interp = backend(model_dir)
    logits = batched_prefill(interp, prompts)
    cuts = np.cumsum([len(p) for p in prompts])[:-1]
    for i, rows in enumerate(np.split(logits, cuts)):
        assert_close(rows, expected[i][0], f"prefill, sequence {i}")
    for t in range(DECODE_STEPS):
        logits = interp.step([d[t] for d in decode], [len(p) + t for p in prompts], np.arange(len(prompts)))
        for i in range(len(prompts)):
            assert_close(logits[i:i + 1], expected[i][1 + t], f"decode step {t}, sequence {i}")


def check_greedy(model_dir: Path, prompts: list[np.ndarray], backend: Callable[[Path], Any] = interpreter) -> None:
    reference = load_reference(model_dir)
    expected = [reference_greedy(reference, p, GREEDY_TOKENS) for p in prompts]

    interp = backend(model_dir)
    logits = batched_prefill(interp, prompts)
    last_rows = np.cumsum([len(p) for p in prompts]) - 1
    generated = [[int(t)] for t in logits[last_rows].argmax(-1)]
    for t in range(GREEDY_TOKENS - 1):
        logits = interp.step([g[-1] for g in generated], [len(p) + t for p in prompts], np.arange(len(prompts)))
        for g, row in zip(generated, logits):
            g.append(int(row.argmax()))
    for i, (got, want) in enumerate(zip(generated, expected)):
        assert got == want, f"sequence {i}: greedy continuation differs at token {_first_diff(got, want)}"


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def random_prompts(vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n) for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def stories_prompts(stories_dir: Path) -> list[np.ndarray]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(stories_dir)
    texts = ["Once upon a time, there was a little girl", "The dog ran"]
    prompts = [np.array(tokenizer(t)["input_ids"]) for t in texts]
    assert len({len(p) for p in prompts}) == 2 and all(p[0] == tokenizer.bos_token_id for p in prompts)
    return prompts


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_logits_match_transformers(hf_checkpoint, variant: str) -> None:
    check_parity(hf_checkpoint(variant), random_prompts(VOCAB), VOCAB)


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_greedy_matches_generate(hf_checkpoint, variant: str) -> None:
    check_greedy(hf_checkpoint(variant), random_prompts(VOCAB, seed=2))


def test_stories260k_logits(stories_dir: Path, stories_prompts) -> None:
    check_parity(stories_dir, stories_prompts, vocab=512)


def test_stories260k_greedy(stories_dir: Path, stories_prompts) -> None:
    check_greedy(stories_dir, stories_prompts)


def test_variants_are_what_they_claim(hf_checkpoint) -> None:
    """The fixtures exercise what they are meant to: shards, dtypes, biases, window, head_dim."""
    import json

    sharded = hf_checkpoint("llama-sharded")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()
    for name, dtype in (("llama-f16", "f16"), ("qwen2-bf16", "bf16")):
        g = import_hf(hf_checkpoint(name))
        assert {w.type.dtype for w in g.weights.values()} == {dtype}
    qwen = import_hf(hf_checkpoint("qwen2"))
    bias = qwen.weights["model.layers.0.self_attn.k_proj.bias"].numpy_f32()
    assert np.abs(bias).min() > 0
    mistral = import_hf(hf_checkpoint("mistral"))
    assert {n.attrs.get("window") for n in mistral.find("attention")} == {5}
    assert max(PROMPT_LENGTHS) > 5
    llama3 = import_hf(hf_checkpoint("llama3-rope"))
    rope = next(llama3.find("rope")).attrs
    assert rope["head_dim"] == 24 and rope["scaling"]["rope_type"] == "llama3"


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-gpt2"])
def test_synthetic_presets_match_transformers(synthetic_checkpoint, preset: str) -> None:
    """The torch-free synthetic builder writes checkpoints both implementations read alike."""
    from infeng_models.synthetic import PRESETS

    vocab = PRESETS[preset].vocab
    check_parity(synthetic_checkpoint(preset), random_prompts(vocab), vocab)


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2", "gpt2"])
def test_mixed_prefill_chunks_and_decode(hf_checkpoint, variant: str) -> None:
    """Steps mixing a prefill chunk of one sequence with decode tokens of another, as the scheduler does."""
    model_dir = hf_checkpoint(variant)
    rng = np.random.default_rng(3)
    a, b = rng.integers(3, VOCAB, 11), rng.integers(3, VOCAB, 8)
    reference = load_reference(model_dir)
    with torch.no_grad():
        full = [reference(input_ids=torch.tensor(s[None], dtype=torch.long)).logits[0].numpy() for s in (a, b)]
    # (sequence, start, stop) per step: a is prefilled in chunks of 5, 3, then decoded; b prefilled at once.
    schedule = [[(1, 0, 6)], [(0, 0, 5), (1, 6, 7)], [(1, 7, 8), (0, 5, 8)], [(0, 8, 9)], [(0, 9, 11)]]
    interp = Interpreter(import_hf(model_dir))
    for n, step in enumerate(schedule):
        seqs = (a, b)
        tokens = np.concatenate([seqs[s][lo:hi] for s, lo, hi in step])
        positions = np.concatenate([np.arange(lo, hi) for s, lo, hi in step])
        seq_ids = np.concatenate([np.full(hi - lo, s) for s, lo, hi in step])
        logits = interp.step(tokens, positions, seq_ids)
        expected = np.concatenate([full[s][lo:hi] for s, lo, hi in step])
        assert_close(logits, expected, f"step {n}")


def test_logits_rows_select_rows(hf_checkpoint) -> None:
    """Asking for the last row of each sequence returns exactly those rows (the ``R`` of the step)."""
    model_dir = hf_checkpoint("llama")
    prompts = random_prompts(VOCAB)
    every = batched_prefill(Interpreter(import_hf(model_dir)), prompts)
    last_rows = np.cumsum([len(p) for p in prompts]) - 1
    tokens = np.concatenate(prompts)
    positions = np.concatenate([np.arange(len(p)) for p in prompts])
    seq_ids = np.concatenate([np.full(len(p), i) for i, p in enumerate(prompts)])
    some = Interpreter(import_hf(model_dir)).step(tokens, positions, seq_ids, logits_rows=last_rows)
    assert some.shape == (2, VOCAB)
    # Not bit-equal: BLAS blocks a 2-row matmul differently from a 19-row one.
    np.testing.assert_allclose(some, every[last_rows], rtol=0, atol=1e-6 * np.abs(every).max())
