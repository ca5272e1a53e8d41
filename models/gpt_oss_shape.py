"""GPT-OSS-20B's shape with random weights: the speed checkpoint of the mixture-of-experts work.

``write_checkpoint`` writes a Hugging Face directory laid out as ``openai/gpt-oss-20b`` ships:
its ``config.json`` key for key (24 layers, hidden 2880, 64 query heads, 8 KV heads, head_dim 64,
32 experts, top-4, vocab 201,088, sliding window 128 on alternating layers, attention sinks, YaRN
rope factor 32, MXFP4 experts), the experts as MXFP4 (``*_blocks`` uint8 [E, out, in/32, 16], two
e2m1 codes a byte, and ``*_scales`` uint8 e8m0 [E, out, in/32]) and every other weight bf16, in
safetensors shards with ``model.safetensors.index.json``. Tensors are generated and written a
block at a time, straight into the shard: the experts are never a bf16 array (21B parameters
would not fit in 24 GiB), and peak memory stays around one chunk. Random values: uniform e2m1
codes with scales 2^-8..2^-6 (weights of rms ~0.02), bf16 normal with std 0.02, norms near 1.
The tokenizer is a small stand-in (``synthetic.build_tokenizer``: about 1,200 byte-level BPE
tokens; the embedding's other rows are never produced), enough for speed measurements.

``write_gguf`` transcodes such a checkpoint (or any GPT-OSS MXFP4 checkpoint) into the GGUF that
llama.cpp's ``convert_hf_to_gguf.py`` writes for it: architecture ``gpt-oss``, its tensor names and
metadata, the experts as GGML type MXFP4 with the codes moved into ``block_mxfp4`` order (not
re-rounded: the same weights), gate and up split from the interleaved ``gate_up_proj``, other
matrices bf16, vectors f32, the stand-in vocabulary padded to the model's vocab size.

Command line::

    python -m infeng_models.gpt_oss_shape OUT_DIR [--gguf FILE] [--tiny] [--seed N]
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .synthetic import _f32_to_bf16_bits, build_tokenizer

_CHUNK = 1 << 24            # elements generated per block
_INIT_STD = 0.02
#: e8m0 exponents of the random experts: 2^(s - 127) for s in [119, 121] (rms of e2m1 ~2.9)
_SCALE_RANGE = (119, 122)
MXFP4_BLOCK = 32


@dataclass(frozen=True)
class GptOssShape:
    """The sizes of a GPT-OSS model (defaults: gpt-oss-20b)."""

    layers: int = 24
    hidden: int = 2880
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 64
    experts: int = 32
    top_k: int = 4
    vocab: int = 201088
    intermediate: int = 2880
    sliding_window: int = 128
    eos_token_id: int = 200002
    pad_token_id: int = 199999
    layers_per_shard: int = 4


GPT_OSS_20B = GptOssShape()
#: A scaled-down shape for tests (the tokenizer's vocabulary fits its 512 rows).
TINY = GptOssShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2, vocab=512,
                   intermediate=64, sliding_window=4, eos_token_id=2, pad_token_id=0, layers_per_shard=1)


def config_json(shape: GptOssShape) -> dict[str, Any]:
    """``config.json`` exactly as openai/gpt-oss-20b ships it (its key order), sizes from ``shape``."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": shape.eos_token_id,
        "experts_per_token": shape.top_k,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape.layers)],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": shape.heads,
        "num_experts_per_tok": shape.top_k,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads,
        "num_local_experts": shape.experts,
        "output_router_logits": False,
        "pad_token_id": shape.pad_token_id,
        "quantization_config": {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": shape.sliding_window,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": shape.vocab,
    }


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: safetensors dtype (BF16 or U8) and what fills it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    init: str                # normal | norm | blocks | scales

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.numel * (2 if self.dtype == "BF16" else 1)


def layer_specs(shape: GptOssShape, i: int) -> list[TensorSpec]:
    """The tensors of layer ``i``, named as gpt-oss-20b's checkpoint names them."""
    H, I, E, hd = shape.hidden, shape.intermediate, shape.experts, shape.head_dim
    q, kv = shape.heads * hd, shape.kv_heads * hd
    p = f"model.layers.{i}."
    specs = [TensorSpec(p + "input_layernorm.weight", "BF16", (H,), "norm"),
             TensorSpec(p + "post_attention_layernorm.weight", "BF16", (H,), "norm")]
    for name, rows, cols in (("q_proj", q, H), ("k_proj", kv, H), ("v_proj", kv, H), ("o_proj", H, q)):
        specs += [TensorSpec(f"{p}self_attn.{name}.weight", "BF16", (rows, cols), "normal"),
                  TensorSpec(f"{p}self_attn.{name}.bias", "BF16", (rows,), "normal")]
    specs += [TensorSpec(p + "self_attn.sinks", "BF16", (shape.heads,), "normal"),
              TensorSpec(p + "mlp.router.weight", "BF16", (E, H), "normal"),
              TensorSpec(p + "mlp.router.bias", "BF16", (E,), "normal")]
    for name, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
        specs += [TensorSpec(f"{p}mlp.experts.{name}_blocks", "U8", (E, rows, cols // MXFP4_BLOCK, 16), "blocks"),
                  TensorSpec(f"{p}mlp.experts.{name}_scales", "U8", (E, rows, cols // MXFP4_BLOCK), "scales"),
                  TensorSpec(f"{p}mlp.experts.{name}_bias", "BF16", (E, rows), "normal")]
    return specs


def shard_specs(shape: GptOssShape) -> list[list[TensorSpec]]:
    """The tensors of each shard: ``layers_per_shard`` layers each, the embedding with the first,
    the final norm and lm_head with the last."""
    for size in (shape.hidden, shape.intermediate):
        if size % MXFP4_BLOCK:
            raise ValueError(f"MXFP4 experts need hidden and intermediate sizes divisible by {MXFP4_BLOCK}, got {size}")
    shards: list[list[TensorSpec]] = []
    for first in range(0, shape.layers, shape.layers_per_shard):
        shards.append([s for i in range(first, min(first + shape.layers_per_shard, shape.layers))
                       for s in layer_specs(shape, i)])
    shards[0].insert(0, TensorSpec("model.embed_tokens.weight", "BF16", (shape.vocab, shape.hidden), "normal"))
    shards[-1] += [TensorSpec("model.norm.weight", "BF16", (shape.hidden,), "norm"),
                   TensorSpec("lm_head.weight", "BF16", (shape.vocab, shape.hidden), "normal")]
    return shards


def _chunks(spec: TensorSpec, seed: int) -> Iterator[np.ndarray]:
    """The bytes of ``spec`` a block at a time; deterministic per (seed, name)."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    left = spec.numel
    while left:
        n = min(left, _CHUNK)
        if spec.init == "blocks":
            yield rng.integers(0, 256, n, dtype=np.uint8)
        elif spec.init == "scales":
            yield rng.integers(*_SCALE_RANGE, n, dtype=np.uint8)
        else:
            values = rng.standard_normal(n, dtype=np.float32) * np.float32(_INIT_STD)
            yield _f32_to_bf16_bits(values + np.float32(1.0) if spec.init == "norm" else values)
        left -= n


def write_safetensors(path: Path, specs: Sequence[TensorSpec], seed: int) -> int:
    """One safetensors file of ``specs`` (their order), streamed; returns the data bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for spec in specs:
            f.writelines(chunk.tobytes() for chunk in _chunks(spec, seed))
    return offset


def write_checkpoint(out_dir: str | Path, shape: GptOssShape = GPT_OSS_20B, seed: int = 0) -> Path:
    """Write the checkpoint of ``shape`` into ``out_dir`` (config, shards, index, tokenizer)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_json(shape), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": shape.eos_token_id, "pad_token_id": shape.pad_token_id}, indent=2) + "\n")
    shards = shard_specs(shape)
    weight_map, total = {}, 0
    for i, specs in enumerate(shards):
        name = f"model-{i:05d}-of-{len(shards) - 1:05d}.safetensors"
        total += write_safetensors(out / name, specs, seed)
        weight_map.update({s.name: name for s in specs})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    build_tokenizer(out, vocab_size=min(shape.vocab, 2048))
    return out


# ---------------------------------------------------------------------------------------------
# GGUF for llama.cpp
#: HF tensor name (after ``model.layers.N.``) -> GGUF name (after ``blk.N.``), for the plain tensors.
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
}
_GGUF_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}
#: GGML file type of convert_hf_to_gguf.py's output for an MXFP4 checkpoint (LlamaFileType.MOSTLY_MXFP4_MOE).
_FILE_TYPE_MXFP4_MOE = 38


@dataclass(frozen=True)
class _GGUFTensor:
    name: str
    kind: str                                   # bf16 (2-D, kept) | f32 (widened) | mxfp4
    shape: tuple[int, ...]                      # numpy order: bytes per row for mxfp4
    read: Any                                   # () -> the array to write


def write_gguf(model_dir: str | Path, out: str | Path) -> Path:
    """The GGUF llama.cpp reads for the GPT-OSS MXFP4 checkpoint in ``model_dir`` (streamed)."""
    import gguf

    from infeng_common.safetensors import read_safetensors_header
    from infeng_compiler.export_gguf import add_vocab, tokenizer_vocab
    from infeng_compiler.quant.formats import mxfp4_to_ggml

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    entries = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        entries.update(read_safetensors_header(path))

    def array(name: str) -> np.ndarray:
        e = entries[name]
        dtype = np.uint8 if e.dtype == "u8" else np.uint16
        return np.memmap(e.file, dtype=dtype, mode="r", offset=e.offset, shape=e.shape)

    def as_f32(bits: np.ndarray) -> np.ndarray:
        return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)

    def plain(hf: str, name: str) -> _GGUFTensor:
        shape = tuple(entries[hf].shape)
        if len(shape) == 2 and not name.endswith("ffn_gate_inp.weight"):         # the router stays f32
            return _GGUFTensor(name, "bf16", shape, lambda: np.ascontiguousarray(array(hf)))
        return _GGUFTensor(name, "f32", shape, lambda: np.ascontiguousarray(as_f32(array(hf))))

    def experts(prefix: str, bid: int) -> list[_GGUFTensor]:
        out = []
        for proj, parts in (("gate_up_proj", (("gate", slice(0, None, 2)), ("up", slice(1, None, 2)))),
                            ("down_proj", (("down", slice(None)),))):
            blocks, scales, bias = (prefix + f"mlp.experts.{proj}_{s}" for s in ("blocks", "scales", "bias"))
            E, rows, nb, _ = entries[blocks].shape
            for part, rows_of in parts:
                n = len(range(rows)[rows_of])
                out.append(_GGUFTensor(f"blk.{bid}.ffn_{part}_exps.weight", "mxfp4", (E, n, nb * 17),
                                       lambda b=blocks, s=scales, r=rows_of: mxfp4_to_ggml(array(b)[:, r], array(s)[:, r])))
                out.append(_GGUFTensor(f"blk.{bid}.ffn_{part}_exps.bias", "f32", (E, n),
                                       lambda b=bias, r=rows_of: np.ascontiguousarray(as_f32(array(b)[:, r]))))
        return out

    tensors = [plain("model.embed_tokens.weight", "token_embd.weight")]
    for bid in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{bid}."
        tensors += [plain(prefix + hf, f"blk.{bid}.{name}") for hf, name in _GGUF_LAYER_NAMES.items()]
        tensors += experts(prefix, bid)
    tensors += [plain(hf, name) for hf, name in _GGUF_TOP_NAMES.items() if hf != "model.embed_tokens.weight"]

    writer = gguf.GGUFWriter(str(out), "gpt-oss")
    _gguf_metadata(writer, config, model_dir.name)
    vocab = tokenizer_vocab(model_dir)
    if vocab is not None:
        pad = config["vocab_size"] - len(vocab["tokens"])
        vocab["tokens"] = vocab["tokens"] + [f"[PAD{i}]" for i in range(len(vocab["tokens"]), config["vocab_size"])]
        vocab["types"] = vocab["types"] + [1] * pad
        add_vocab(writer, vocab)
    raw = {"bf16": (np.uint16, gguf.GGMLQuantizationType.BF16), "f32": (np.float32, None),
           "mxfp4": (np.uint8, gguf.GGMLQuantizationType.MXFP4)}
    for t in tensors:
        dtype, raw_dtype = raw[t.kind]
        writer.add_tensor_info(t.name, t.shape, np.dtype(dtype), int(np.prod(t.shape)) * np.dtype(dtype).itemsize,
                               raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        writer.write_tensor_data(t.read())
    writer.close()
    return Path(out)


def _gguf_metadata(writer: Any, config: dict[str, Any], name: str) -> None:
    """The key-values convert_hf_to_gguf.py writes for a gpt-oss model."""
    rope = config["rope_scaling"]
    writer.add_name(name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_file_type(_FILE_TYPE_MXFP4_MOE)
    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infeng_models.gpt_oss_shape",
                                     description="Write a GPT-OSS-20B-shaped checkpoint with random MXFP4 experts.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--gguf", type=Path, default=None, help="also write the same weights as a GGUF here")
    parser.add_argument("--tiny", action="store_true", help="the scaled-down test shape instead of gpt-oss-20b")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_checkpoint(args.out_dir, TINY if args.tiny else GPT_OSS_20B, args.seed)
    if args.gguf is not None:
        write_gguf(args.out_dir, args.gguf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
