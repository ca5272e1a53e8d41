"""infeng_models.synthetic writes what transformers writes and reads, without torch."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from infeng_models import synthetic
from infeng_models.synthetic import PRESETS, build_checkpoint, build_preset, build_tokenizer, make_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-gpt2", "demo"]


@pytest.mark.parametrize("preset", TINY)
def test_transformers_loads_every_tensor(synthetic_checkpoint, preset: str) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(synthetic_checkpoint(preset),
                                                                    output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]


@pytest.mark.parametrize("preset", TINY)
def test_config_is_what_save_pretrained_writes(synthetic_checkpoint, preset: str, tmp_path: Path) -> None:
    """Loading our config.json and saving the model again gives the same config.json."""
    src = synthetic_checkpoint(preset)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    model.save_pretrained(tmp_path)
    ours, theirs = (json.loads((d / "config.json").read_text()) for d in (src, tmp_path))
    ours.pop("transformers_version"), theirs.pop("transformers_version")
    assert ours == theirs
    assert json.loads((src / "generation_config.json").read_text()).keys() == \
        json.loads((tmp_path / "generation_config.json").read_text()).keys()


@pytest.mark.parametrize("preset", ["smollm135", "llama1b"])
def test_benchmark_configs_are_what_save_pretrained_writes(preset: str, tmp_path: Path) -> None:
    """The big presets' config.json, checked without building their weights."""
    p = PRESETS[preset]
    ours = make_config(p.family, hidden=p.hidden, layers=p.layers, heads=p.heads, kv_heads=p.kv_heads,
                       intermediate=p.intermediate, vocab=p.vocab, dtype=p.dtype, tie=p.tie,
                       max_position=p.max_position, rope_theta=p.rope_theta, rope_scaling=p.rope_scaling,
                       norm_eps=p.norm_eps)
    (tmp_path / "config.json").write_text(json.dumps(ours))
    transformers.AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "again")
    theirs = json.loads((tmp_path / "again" / "config.json").read_text())
    ours.pop("transformers_version"), theirs.pop("transformers_version")
    assert ours == theirs
    assert p.params() == pytest.approx({"smollm135": 134.5e6, "llama1b": 1.07e9}[preset], rel=0.01)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_reduced_precision_weights_are_torch_rounding(synthetic_checkpoint, dtype: str) -> None:
    """f16/bf16 files hold exactly torch's rounding of the float32 draws."""
    from safetensors.torch import load_file

    f32 = load_file(synthetic_checkpoint("tiny-qwen2", "f32") / "model.safetensors")
    low = load_file(synthetic_checkpoint("tiny-qwen2", dtype) / "model.safetensors")
    torch_dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    assert f32.keys() == low.keys()
    for name, tensor in f32.items():
        assert low[name].dtype == torch_dtype
        assert torch.equal(low[name], tensor.to(torch_dtype)), name
    config = json.loads((synthetic_checkpoint("tiny-qwen2", dtype) / "config.json").read_text())
    assert config["dtype"] == {"f16": "float16", "bf16": "bfloat16"}[dtype]


def test_weight_scale(synthetic_checkpoint) -> None:
    from safetensors.numpy import load_file

    tensors = load_file(synthetic_checkpoint("demo") / "model.safetensors")
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.std() == pytest.approx(0.02, rel=0.05) and abs(q.mean()) < 1e-3
    assert tensors["model.norm.weight"].mean() == pytest.approx(1.0, abs=0.01)
    assert "lm_head.weight" not in tensors  # tied
    assert 1e6 <= sum(t.size for t in tensors.values()) <= 5e6


def test_deterministic_and_per_tensor_seeded(tmp_path: Path) -> None:
    dims = dict(hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=300)
    a = build_checkpoint(tmp_path / "a", "llama", layers=1, **dims)
    b = build_checkpoint(tmp_path / "b", "llama", layers=2, **dims)
    c = build_checkpoint(tmp_path / "c", "llama", layers=1, seed=1, **dims)
    from safetensors.numpy import load_file

    ta, tb, tc = (load_file(d / "model.safetensors") for d in (a, b, c))
    name = "model.layers.0.mlp.up_proj.weight"
    assert np.array_equal(ta[name], tb[name]) and not np.array_equal(ta[name], tc[name])


def test_tokenizer(tmp_path: Path) -> None:
    build_tokenizer(tmp_path / "a", vocab_size=512)
    build_tokenizer(tmp_path / "b", vocab_size=512)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "a")
    assert len(tok) == 512
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    text = "The model reads a sequence of tokens."
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError):
        build_tokenizer(tmp_path / "c", vocab_size=100)


def test_smollm_presets_copy_the_real_tokenizer(assets: Path, tmp_path: Path, monkeypatch) -> None:
    """smollm135/llama1b take the SmolLM tokenizer from the shared assets (shape shrunk here)."""
    monkeypatch.setitem(PRESETS, "smollm-mini", replace(PRESETS["smollm135"], hidden=16, layers=1, heads=2,
                                                        kv_heads=1, intermediate=32))
    out = build_preset("smollm-mini", tmp_path)
    src = assets / "adapters" / "smollm-135m-instruct-medflashcards-5epochs"
    assert synthetic.SMOLLM_TOKENIZER_DIR == src
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"


def test_cli_builds_without_torch(tmp_path: Path) -> None:
    """``python -m infeng_models.synthetic`` works and never imports torch (``infeng demo`` has none)."""
    code = ("import sys, runpy; sys.argv = ['synthetic', 'tiny-llama', sys.argv[1], '--dtype', 'bf16', '--quiet']\n"
            "try:\n    runpy.run_module('infeng_models.synthetic', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                                    "tokenizer.json", "tokenizer_config.json",
                                                    "special_tokens_map.json"}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
