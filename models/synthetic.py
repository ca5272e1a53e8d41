"""Small synthetic Hugging Face checkpoints, built without torch.

Tests, ``infeng demo`` and the benchmark scripts need checkpoints in the exact layout transformers
writes (``config.json``, ``generation_config.json``, ``model.safetensors``, tokenizer files) but
with random weights and without network access or torch. This module writes them from numpy:

- ``build_tokenizer`` trains a small byte-level BPE (``tokenizers``) on ``tokenizer_corpus.txt``.
- ``build_checkpoint`` writes ``config.json`` key for key as transformers 5 ``save_pretrained``
  does for llama, mistral, qwen2 and gpt2, and random-init weights (normal, std ``init_std``, for
  embeddings and projections; norm weights near 1; small nonzero biases).
- ``build_preset`` builds a named preset (``PRESETS``): ``tiny-<family>`` for tests, ``demo``, and
  the benchmark shapes ``smollm135`` and ``llama1b``.

The safetensors file is written by this module (header then tensor data, streamed tensor by
tensor) rather than by ``safetensors.numpy.save_file``: numpy has no bfloat16, so bf16 tensors are
stored as their raw 16-bit patterns (float32 rounded to nearest even), and streaming keeps memory
flat for the 1B-parameter preset. The layout follows the safetensors spec: an 8-byte little-endian
header length, a JSON header padded with spaces to a multiple of 8 bytes, then the tensors
back to back in header order.

Command line (for bench scripts)::

    python -m infeng_models.synthetic PRESET OUT_DIR [--dtype f32|f16|bf16] [--seed N]
"""
from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import zlib
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import numpy as np

FAMILIES = ("llama", "mistral", "qwen2", "gpt2")
DTYPES = ("f32", "f16", "bf16")

#: The transformers release whose ``save_pretrained`` output config.json mirrors.
TRANSFORMERS_VERSION = "5.24.0"

#: Special tokens of the small tokenizer, ids 0, 1, 2 (the SmolLM tokenizer uses the same ids).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: Where the shared test assets live for a source checkout: <repo>/../shared/assets.
SHARED_ASSETS = Path(__file__).resolve().parents[1].parent / "shared" / "assets"
SMOLLM_TOKENIZER_DIR = SHARED_ASSETS / "adapters" / "smollm-135m-instruct-medflashcards-5epochs"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_TORCH_DTYPE = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
_SAFETENSORS_DTYPE = {"f32": "F32", "f16": "F16", "bf16": "BF16"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}
_CHUNK = 1 << 22  # elements generated per block when streaming a large tensor


# ---------------------------------------------------------------------------------------------
# tokenizer
def corpus_text() -> str:
    """The built-in English text the small tokenizer is trained on (about 5 KB)."""
    return resources.files(__package__ or "infeng_models").joinpath("tokenizer_corpus.txt").read_text("utf-8")


def build_tokenizer(out_dir: str | Path, vocab_size: int = 1024, model_max_length: int = 2048) -> Path:
    """Train a byte-level BPE on the built-in text and write the Hugging Face tokenizer files.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` (bos/eos tokens and a ChatML-style chat
    template) and ``special_tokens_map.json``. Special tokens take ids 0-2 (``SPECIAL_TOKENS``).
    The built-in text supports about 1200 tokens; a larger ``vocab_size`` gives that many (a model
    whose vocabulary is larger than its tokenizer's is valid, the extra rows are never produced).
    Training is deterministic. Returns ``out_dir``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE "
                         f"(at least {256 + len(SPECIAL_TOKENS)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus_text().splitlines(), trainer)
    tokenizer.save(str(out / "tokenizer.json"))

    def token(content: str) -> dict[str, Any]:
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}

    pad, bos, eos = (SPECIAL_TOKENS[i] for i in (PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID))
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): {**token(t), "special": True} for i, t in enumerate(SPECIAL_TOKENS)},
        "bos_token": bos,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "model_max_length": model_max_length,
        "pad_token": pad,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json",
                {"bos_token": token(bos), "eos_token": token(eos), "pad_token": token(pad)})
    return out


def copy_tokenizer(src_dir: str | Path, out_dir: str | Path) -> Path:
    """Copy the Hugging Face tokenizer files that exist in ``src_dir`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(src_dir) / name).is_file():
            shutil.copyfile(Path(src_dir) / name, out / name)
    return out


# ---------------------------------------------------------------------------------------------
# config.json
def make_config(family: str, *, hidden: int, layers: int, heads: int, kv_heads: int | None = None,
                intermediate: int | None = None, vocab: int, dtype: str = "f32", tie: bool = True,
                head_dim: int | None = None, max_position: int = 2048, rope_theta: float = 10000.0,
                rope_scaling: dict[str, Any] | None = None, sliding_window: int | None = None,
                norm_eps: float | None = None, init_std: float = 0.02,
                bos_token_id: int | None = BOS_TOKEN_ID, eos_token_id: int | None = EOS_TOKEN_ID) -> dict[str, Any]:
    """config.json as transformers 5 ``save_pretrained`` writes it for a model of this family."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if sliding_window is not None and family != "mistral":
        raise ValueError("sliding_window is only supported for mistral")
    kv_heads = kv_heads or heads
    common = {
        "architectures": [_ARCHITECTURES[family]],
        "bos_token_id": bos_token_id,
        "dtype": _TORCH_DTYPE[dtype],
        "eos_token_id": eos_token_id,
        "initializer_range": init_std,
        "model_type": family,
        "pad_token_id": None,
        "tie_word_embeddings": tie,
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": vocab,
    }
    if family == "gpt2":
        if kv_heads != heads or head_dim not in (None, hidden // heads) or rope_scaling:
            raise ValueError("gpt2 has no GQA, explicit head_dim or rope scaling")
        return dict(sorted({
            **common,
            "activation_function": "gelu_new", "add_cross_attention": False, "attn_pdrop": 0.1,
            "embd_pdrop": 0.1, "layer_norm_epsilon": 1e-5 if norm_eps is None else norm_eps,
            "n_embd": hidden, "n_head": heads,
            "n_inner": None if intermediate in (None, 4 * hidden) else intermediate,
            "n_layer": layers, "n_positions": max_position, "reorder_and_upcast_attn": False,
            "resid_pdrop": 0.1, "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True,
            "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
            "summary_type": "cls_index", "summary_use_proj": True,
        }.items()))
    if intermediate is None:
        raise ValueError(f"{family} needs intermediate")
    rope: dict[str, Any] = {"rope_theta": float(rope_theta), "rope_type": "default"}
    if rope_scaling:
        rope = {**{k: v for k, v in rope_scaling.items() if k != "type"}, "rope_theta": float(rope_theta)}
        rope["rope_type"] = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        rope = dict(sorted(rope.items()))
    config = {
        **common,
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": hidden,
        "intermediate_size": intermediate, "max_position_embeddings": max_position,
        "num_attention_heads": heads, "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6 if norm_eps is None else norm_eps, "rope_parameters": rope,
    }
    if family in ("llama", "mistral"):
        config["head_dim"] = head_dim or hidden // heads
    elif head_dim not in (None, hidden // heads):
        raise ValueError("qwen2 has no explicit head_dim")
    if family == "llama":
        config.update({"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1})
    elif family == "mistral":
        config["sliding_window"] = sliding_window
    else:
        config.update({"layer_types": ["full_attention"] * layers, "max_window_layers": 28,
                       "sliding_window": None, "use_sliding_window": False})
    return dict(sorted(config.items()))


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json as ``save_pretrained`` derives it from the model config."""
    gen: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            gen[key] = config[key]
    gen.update({"output_attentions": False, "output_hidden_states": False,
                "transformers_version": TRANSFORMERS_VERSION, "use_cache": True})
    return gen


# ---------------------------------------------------------------------------------------------
# weights
@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: name, shape, and how to initialise it."""

    name: str
    shape: tuple[int, ...]
    init: str            # "normal" (std), "norm" (1 + small noise), "bias" (small noise)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def tensor_specs(config: dict[str, Any]) -> list[TensorSpec]:
    """The tensors transformers expects for ``config``, with their Hugging Face names and shapes."""
    family = config["model_type"]
    specs: list[TensorSpec] = []
    add = lambda name, shape, init="normal": specs.append(TensorSpec(name, tuple(shape), init))  # noqa: E731
    if family == "gpt2":
        h, v, n_pos = config["n_embd"], config["vocab_size"], config["n_positions"]
        inner = config["n_inner"] or 4 * h
        add("transformer.wte.weight", (v, h))
        add("transformer.wpe.weight", (n_pos, h))
        for i in range(config["n_layer"]):
            p = f"transformer.h.{i}."
            for ln in ("ln_1", "ln_2"):
                add(p + ln + ".weight", (h,), "norm")
                add(p + ln + ".bias", (h,), "bias")
            # Conv1D stores weights as [in, out].
            for name, (n_in, n_out) in (("attn.c_attn", (h, 3 * h)), ("attn.c_proj", (h, h)),
                                        ("mlp.c_fc", (h, inner)), ("mlp.c_proj", (inner, h))):
                add(p + name + ".weight", (n_in, n_out))
                add(p + name + ".bias", (n_out,), "bias")
        add("transformer.ln_f.weight", (h,), "norm")
        add("transformer.ln_f.bias", (h,), "bias")
        if not config["tie_word_embeddings"]:
            add("lm_head.weight", (v, h))
        return specs
    h, v, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    add("model.embed_tokens.weight", (v, h))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", (h,), "norm")
        add(p + "post_attention_layernorm.weight", (h,), "norm")
        for name, out in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            add(p + f"self_attn.{name}.weight", (out, h))
            if family == "qwen2":
                add(p + f"self_attn.{name}.bias", (out,), "bias")
        add(p + "self_attn.o_proj.weight", (h, heads * hd))
        add(p + "mlp.gate_proj.weight", (inter, h))
        add(p + "mlp.up_proj.weight", (inter, h))
        add(p + "mlp.down_proj.weight", (h, inter))
    add("model.norm.weight", (h,), "norm")
    if not config["tie_word_embeddings"]:
        add("lm_head.weight", (v, h))
    return specs


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even, as torch does) and return the 16-bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bits += ((bits >> 16) & 1) + 0x7FFF
    return (bits >> 16).astype(np.uint16)


def _encode(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "f32":
        return values
    if dtype == "f16":
        return values.astype(np.float16)
    return _f32_to_bf16_bits(values)


def _blocks(spec: TensorSpec, seed: int, std: float) -> Any:
    """float32 values of ``spec`` in blocks of at most ``_CHUNK`` elements; deterministic per name."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    scale = {"normal": std, "norm": 0.02, "bias": 0.02}[spec.init]
    left = spec.numel
    while left:
        n = min(left, _CHUNK)
        block = rng.standard_normal(n, dtype=np.float32)
        block *= np.float32(scale)
        if spec.init == "norm":
            block += np.float32(1.0)
        yield block
        left -= n


def write_safetensors(path: str | Path, specs: Sequence[TensorSpec], dtype: str, seed: int, std: float,
                      progress: bool = False) -> Path:
    """Write random tensors for ``specs`` as one safetensors file, streaming (see module doc)."""
    itemsize = 4 if dtype == "f32" else 2
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    ordered = sorted(specs, key=lambda s: s.name)
    for spec in ordered:
        nbytes = spec.numel * itemsize
        header[spec.name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    path = Path(path)
    bar = _progress_bar(progress, f"{path.parent.name}/{path.name}", offset)
    with open(path, "wb") as f, bar as (advance):
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for spec in ordered:
            for block in _blocks(spec, seed, std):
                encoded = _encode(block, dtype)
                f.write(encoded.tobytes())
                advance(encoded.nbytes)
    return path


class _progress_bar:
    """A rich progress bar (on stderr, when it is a terminal) over bytes written, or a no-op."""

    def __init__(self, enabled: bool, label: str, total: int):
        self.enabled, self.label, self.total = enabled, label, total
        self._progress: Any = None

    def __enter__(self):
        from rich.console import Console

        console = Console(stderr=True)
        if not (self.enabled and console.is_terminal):
            return lambda n: None
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                  TimeRemainingColumn(), console=console, transient=True)
        self._progress.start()
        task = self._progress.add_task(self.label, total=self.total)
        return lambda n: self._progress.advance(task, n)

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()


def build_checkpoint(out_dir: str | Path, family: str, *, hidden: int, layers: int, heads: int,
                     kv_heads: int | None = None, intermediate: int | None = None, vocab: int,
                     dtype: str = "f32", seed: int = 0, tie: bool = True, head_dim: int | None = None,
                     max_position: int = 2048, rope_theta: float = 10000.0,
                     rope_scaling: dict[str, Any] | None = None, sliding_window: int | None = None,
                     norm_eps: float | None = None, init_std: float = 0.02,
                     bos_token_id: int | None = BOS_TOKEN_ID, eos_token_id: int | None = EOS_TOKEN_ID,
                     progress: bool = False) -> Path:
    """Write config.json, generation_config.json and model.safetensors of a random-init model.

    Embeddings and projections are normal(0, ``init_std``); norm weights are 1 + normal(0, 0.02);
    biases (qwen2 q/k/v, gpt2) are normal(0, 0.02). Every tensor is drawn from a generator seeded
    by (``seed``, its name), so a tensor does not change when others are added. No tokenizer is
    written (see ``build_tokenizer``). Returns ``out_dir``.
    """
    config = make_config(family, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                         intermediate=intermediate, vocab=vocab, dtype=dtype, tie=tie, head_dim=head_dim,
                         max_position=max_position, rope_theta=rope_theta, rope_scaling=rope_scaling,
                         sliding_window=sliding_window, norm_eps=norm_eps, init_std=init_std,
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(config))
    write_safetensors(out / "model.safetensors", tensor_specs(config), dtype, seed, init_std, progress)
    return out


# ---------------------------------------------------------------------------------------------
# presets
@dataclass(frozen=True)
class Preset:
    """A named checkpoint shape. ``tokenizer`` is "small" (built-in BPE) or "smollm" (shared assets)."""

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int | None
    vocab: int
    dtype: str = "f32"
    tie: bool = True
    max_position: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    norm_eps: float | None = None
    tokenizer: str = "small"
    extra: dict[str, Any] = field(default_factory=dict)

    def params(self) -> int:
        specs = tensor_specs(make_config(self.family, hidden=self.hidden, layers=self.layers, heads=self.heads,
                                         kv_heads=self.kv_heads, intermediate=self.intermediate,
                                         vocab=self.vocab, tie=self.tie, max_position=self.max_position))
        return sum(s.numel for s in specs)


_TINY = dict(hidden=64, layers=2, heads=4, vocab=512, max_position=256)
PRESETS: dict[str, Preset] = {
    "tiny-llama": Preset("llama", kv_heads=2, intermediate=128, **_TINY),
    "tiny-mistral": Preset("mistral", kv_heads=2, intermediate=128, tie=False, sliding_window=8, **_TINY),
    "tiny-qwen2": Preset("qwen2", kv_heads=2, intermediate=128, tie=False, **_TINY),
    "tiny-gpt2": Preset("gpt2", kv_heads=4, intermediate=None, **_TINY),
    # ~3.2M parameters: big enough to look like a model, small enough to compile in seconds.
    "demo": Preset("llama", hidden=256, layers=4, heads=8, kv_heads=4, intermediate=688, vocab=1024),
    # Benchmark shapes (BENCHMARKS.md): SmolLM-135M and a Llama-3.2-1B layout with SmolLM's vocab.
    "smollm135": Preset("llama", hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152,
                        dtype="bf16", norm_eps=1e-5, tokenizer="smollm"),
    "llama1b": Preset("llama", hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=49152,
                      dtype="bf16", norm_eps=1e-5, max_position=131072, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      tokenizer="smollm"),
}


def build_preset(name: str, out_dir: str | Path, *, dtype: str | None = None, seed: int = 0,
                 progress: bool = False, layers: int | None = None) -> Path:
    """Build preset ``name`` (checkpoint and tokenizer) into ``out_dir``; ``dtype`` overrides the preset's,
    ``layers`` its layer count (every matrix shape kept: a cheap stand-in for measuring per layer).

    "smollm" presets copy the real SmolLM tokenizer files from the shared assets when they are
    there, and fall back to the small built-in tokenizer otherwise.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    p = PRESETS[name]
    if dtype is not None:
        p = replace(p, dtype=dtype)
    if layers is not None:
        p = replace(p, layers=layers)
    out = build_checkpoint(out_dir, p.family, hidden=p.hidden, layers=p.layers, heads=p.heads,
                           kv_heads=p.kv_heads, intermediate=p.intermediate, vocab=p.vocab, dtype=p.dtype,
                           seed=seed, tie=p.tie, max_position=p.max_position, rope_theta=p.rope_theta,
                           rope_scaling=p.rope_scaling, sliding_window=p.sliding_window, norm_eps=p.norm_eps,
                           progress=progress, **p.extra)
    if p.tokenizer == "smollm" and (SMOLLM_TOKENIZER_DIR / "tokenizer.json").is_file():
        copy_tokenizer(SMOLLM_TOKENIZER_DIR, out)
    else:
        build_tokenizer(out, vocab_size=min(p.vocab, 1024), model_max_length=p.max_position)
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infeng_models.synthetic",
                                     description="Build a synthetic Hugging Face checkpoint with tokenizer.")
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="override the preset's weight dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    build_preset(args.preset, args.out_dir, dtype=args.dtype, seed=args.seed, progress=not args.quiet,
                 layers=args.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
