"""Shared fixtures: the shared assets and small checkpoints, built once per session.

``hf_checkpoint(name)`` builds (once) a tiny random-init model with **transformers** and saves it
with ``save_pretrained``, so the files are what transformers itself writes; ``HF_VARIANTS`` lists
the names. ``synthetic_checkpoint(preset)`` builds a preset of ``infeng_models.synthetic`` (no torch).

The suite writes under its own pytest temp folder: ``suite_cache`` points ``XDG_CACHE_HOME`` there
for the whole run, subprocesses included. The real GGUF's download cache (``$INFENG_ASSETS_CACHE``,
default ``~/.cache/infeng/assets``, not under ``XDG_CACHE_HOME``) is kept, so it works offline.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO.parent / "shared" / "assets"
STORIES = ASSETS / "models" / "stories260K"

VOCAB = 256
_GQA = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5)


@dataclass(frozen=True)
class Variant:
    """A tiny checkpoint: transformers config class name and kwargs, weight dtype, shard size."""

    config_class: str
    kwargs: dict[str, Any]
    dtype: str = "float32"
    max_shard_size: str | None = None
    notes: str = field(default="", compare=False)


HF_VARIANTS: dict[str, Variant] = {
    "llama": Variant("LlamaConfig", dict(_GQA, tie_word_embeddings=True), notes="GQA, tied embeddings"),
    "llama3-rope": Variant("LlamaConfig", dict(
        _GQA, head_dim=24, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}),
        notes="Llama-3 rope scaling (matters: wavelengths beyond 16 positions are rescaled), "
              "head_dim 24 != hidden/heads, untied lm_head"),
    "mistral": Variant("MistralConfig", dict(_GQA, sliding_window=5, tie_word_embeddings=False),
                       notes="sliding window 5, shorter than every test sequence"),
    "qwen2": Variant("Qwen2Config", dict(_GQA, tie_word_embeddings=False), notes="nonzero q/k/v biases"),
    "gpt2": Variant("GPT2Config", dict(n_embd=64, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=256,
                                       bos_token_id=1, eos_token_id=2)),
    "llama-f16": Variant("LlamaConfig", dict(_GQA, tie_word_embeddings=False), dtype="float16"),
    "qwen2-bf16": Variant("Qwen2Config", dict(_GQA, tie_word_embeddings=False), dtype="bfloat16"),
    "llama-sharded": Variant("LlamaConfig", dict(_GQA, tie_word_embeddings=False), max_shard_size="50KB"),
}

#: Families of the variants above, one per family (for per-family tests).
FAMILY_VARIANTS = ("llama", "mistral", "qwen2", "gpt2")


def build_hf_checkpoint(variant: Variant, out_dir: Path, seed: int = 0) -> Path:
    """Random-init a transformers model for ``variant`` and ``save_pretrained`` it into ``out_dir``.

    Weights are redrawn with a larger scale than transformers' init (std 0.2) so that logits are
    far from ties; norm weights are 1 + N(0, 0.1) and every bias N(0, 0.1), so that a frontend that
    ignored a norm weight or a bias would be caught.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, variant.config_class)(**variant.kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(1.0, 0.1)
    model.to(getattr(torch, variant.dtype))
    kwargs = {"max_shard_size": variant.max_shard_size} if variant.max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return out_dir


@pytest.fixture(scope="session", autouse=True)
def suite_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``XDG_CACHE_HOME`` for the run: ``<the run's temp folder>/cache``, for this process and the
    subprocesses it starts. infeng's caches (compiled libraries, artifacts, GGUF tokenizers) and any
    other tool's go there, not to the user's ``~/.cache``; every run starts cold, as a new user's
    does, and builds each library once (the build cache is content-addressed). An
    ``INFENG_CACHE_DIR`` set by the caller still holds the libraries, to reuse them across runs."""
    root = tmp_path_factory.mktemp("cache", numbered=False)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XDG_CACHE_HOME", str(root))
        yield root


@pytest.fixture(scope="session")
def assets() -> Path:
    """../shared/assets (real trained weights and text); never copied into the repository."""
    assert ASSETS.is_dir(), f"shared assets not found at {ASSETS}"
    return ASSETS


@pytest.fixture(scope="session")
def stories_dir(assets: Path) -> Path:
    return assets / "models" / "stories260K"


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``hf_checkpoint(name)``: the directory of variant ``name``, built on first use."""
    root = tmp_path_factory.mktemp("hf")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_hf_checkpoint(HF_VARIANTS[name], root / name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def synthetic_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``synthetic_checkpoint(preset, dtype=None)``: an ``infeng_models.synthetic`` preset, built once."""
    from infeng_models.synthetic import build_preset

    root = tmp_path_factory.mktemp("synthetic")
    built: dict[tuple[str, str | None], Path] = {}

    def get(preset: str, dtype: str | None = None) -> Path:
        key = (preset, dtype)
        if key not in built:
            built[key] = build_preset(preset, root / f"{preset}-{dtype or 'default'}", dtype=dtype)
        return built[key]

    return get


#: Session fixtures of real models: every test that uses one (directly or through another
#: fixture) is marked slow, so the default run leaves it to `.ci/run`'s `-m slow`.
SLOW_FIXTURES = frozenset({"smollm2_server"})


@pytest.hookimpl(tryfirst=True)          # before ``-m`` deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory):
    """The real SmolLM2-135M-Instruct (its GGUF from the package registry) served as "smollm2" with
    int4 weights, 4 sequences of up to 1,024 tokens: the server the tool-calling and Responses
    tests talk to through the official client. Started once per session; its tests are slow."""
    from _serving import running_server

    from infeng_models import registry

    gguf = registry.fetch(registry.SMOLLM2_135M_INSTRUCT)
    with running_server(gguf, "--quant", "int4", "--served-model-name", "smollm2", "--max-seqs", "4",
                        "--max-context", "1024", log=tmp_path_factory.mktemp("log") / "smollm2-serve.log",
                        startup_s=900) as url:
        yield url
