"""GGUF files for the tests, laid out as llama.cpp's ``convert_hf_to_gguf.py`` lays them out.

``gguf_from_hf(model_dir, out, matrix_type=...)`` converts a small Hugging Face checkpoint (the
``hf_checkpoint`` fixtures, stories260K) with ``gguf.GGUFWriter``: llama.cpp's tensor names, Q and K
rows permuted for the llama family (``permute`` below, as the convert script does), GPT-2's Conv1D
weights transposed to [out, in], Llama-3 rope scaling as a ``rope_freqs`` tensor, matrices
quantized with ``gguf.quants.quantize`` (llama.cpp's reference quantizers). transformers reads these
files with its own GGUF loader, so a test comparing infeng's import against it checks the writer
and the reader independently.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

from infeng_compiler.export_gguf import add_vocab

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gpt2": "gpt2"}

_LLAMA_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GPT2_NAMES = {
    "wte": "token_embd", "wpe": "position_embd", "ln_f": "output_norm", "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's Q/K row permutation (convert_hf_to_gguf.py ``LlamaModel.permute``)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def gguf_name(hf_name: str, family: str) -> str | None:
    """The GGUF name of a Hugging Face tensor (None: llama.cpp drops it)."""
    base, _, suffix = hf_name.rpartition(".")
    if family == "gpt2":
        base = base.removeprefix("transformer.")
        if base.rpartition(".")[2] == "attn" and suffix in ("bias", "masked_bias"):     # causal mask buffers
            return None
        names = _GPT2_NAMES
        if base.startswith("h."):
            _, i, rest = base.split(".", 2)
            return f"blk.{i}.{names[rest]}.{suffix}"
        return f"{names[base]}.{suffix}" if base in names else None
    if base.startswith("model.layers."):
        _, _, i, rest = base.split(".", 3)
        return f"blk.{i}.{_LLAMA_NAMES[rest]}.{suffix}"
    return f"{_LLAMA_NAMES[base]}.{suffix}"


def _load_safetensors(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update({k: np.asarray(v, dtype=np.float32) for k, v in load_file(f).items()})
    return out


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) from ``rope_theta``/``rope_scaling`` or transformers 5's ``rope_parameters``."""
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or {}
    if params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return float(theta), scaling


def _llama3_rope_factors(config: dict[str, Any], head_dim: int) -> np.ndarray:
    """``rope_freqs`` as convert_hf_to_gguf.py computes it for rope_type llama3."""
    base, rs = _rope(config)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rs.get("factor", 8.0), rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old = rs.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def llama2c_scores(path: Path) -> list[float]:
    """The piece scores of a llama2.c ``tok*.bin`` (a float score and a length-prefixed piece each)."""
    data = path.read_bytes()
    off, scores = 4, []
    while off < len(data):
        score, n = struct.unpack_from("<fi", data, off)
        off += 8 + n
        scores.append(score)
    return scores


def spm_vocab(tokenizer_json: Path, scores: list[float]) -> dict[str, Any]:
    """A llama (SentencePiece) vocabulary as llama.cpp stores it, from a tokenizer.json and scores."""
    vocab = json.loads(tokenizer_json.read_text())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x") and len(t) == 6 else 1
             for t in tokens]
    return {"model": "llama", "tokens": tokens, "scores": scores, "types": types, "bos": 1, "eos": 2, "unk": 0,
            "add_bos": True}


def _quantize(array: np.ndarray, qtype) -> tuple[np.ndarray, Any]:
    import gguf

    if array.dtype == np.uint8 and qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return array, qtype                                    # blocks already encoded (``random_blocks``)
    if qtype == gguf.GGMLQuantizationType.F32:
        return array.astype(np.float32), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def write_gguf(out: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, tuple[np.ndarray, str]],
               vocab: dict[str, Any] | None = None) -> Path:
    """A GGUF file: ``metadata`` keys under ``{arch}.`` (int -> u32, float -> f32, str, bool), tensors
    by GGUF name as (float32 array in numpy order, GGML type name), an optional vocabulary."""
    import gguf

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(out.stem)
    for key, value in metadata.items():
        key = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    if vocab:
        add_vocab(writer, {"add_bos": False, **vocab})
    for name, (array, type_name) in tensors.items():
        data, raw_dtype = _quantize(np.ascontiguousarray(array), gguf.GGMLQuantizationType[type_name])
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def gguf_from_hf(model_dir: Path, out: Path, matrix_type: str = "F32", embed_type: str | None = None,
                 types: dict[str, str] | None = None, vocab: dict[str, Any] | None = None,
                 replace: dict[str, tuple[np.ndarray, str] | None] | None = None) -> Path:
    """Convert a Hugging Face checkpoint as llama.cpp does: matrices in ``matrix_type`` (the token
    embedding in ``embed_type``, any GGUF name in ``types``), vectors F32. A matrix whose rows do not
    fit the type's blocks stays F32 (llama.cpp falls back the same way). ``replace`` swaps tensors
    by GGUF name for (data, type), or drops them (None): broken files for the error tests."""
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    family = config["model_type"]
    arch = ARCH[family]
    hf = _load_safetensors(model_dir)
    if family == "gpt2":
        heads = config["n_head"]
        metadata: dict[str, Any] = {
            "context_length": config["n_positions"], "embedding_length": config["n_embd"],
            "feed_forward_length": config.get("n_inner") or 4 * config["n_embd"], "block_count": config["n_layer"],
            "attention.head_count": heads, "attention.layer_norm_epsilon": float(config["layer_norm_epsilon"])}
    else:
        heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        metadata = {
            "context_length": config["max_position_embeddings"], "embedding_length": config["hidden_size"],
            "feed_forward_length": config["intermediate_size"], "block_count": config["num_hidden_layers"],
            "attention.head_count": heads, "attention.head_count_kv": kv,
            "rope.freq_base": _rope(config)[0], "rope.dimension_count": head_dim,
            "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]), "vocab_size": config["vocab_size"]}
        if config.get("head_dim"):
            metadata.update({"attention.key_length": head_dim, "attention.value_length": head_dim})
        if family == "mistral" and config.get("sliding_window"):
            metadata["attention.sliding_window"] = config["sliding_window"]
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    for name, array in hf.items():
        g = gguf_name(name, family)
        if g is None:
            continue
        if family == "gpt2" and name.endswith(_CONV1D):
            array = array.T
        if family in ("llama", "mistral") and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = permute(array, heads, heads)
        if family in ("llama", "mistral") and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = permute(array, heads, kv)
        qtype = "F32"
        if array.ndim == 2:
            qtype = (types or {}).get(g) or (embed_type if g == "token_embd.weight" and embed_type else matrix_type)
            block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
            if array.shape[1] % block:
                qtype = "F32"
        tensors[g] = (np.ascontiguousarray(array), qtype)
    if family == "gpt2" and "output.weight" not in tensors:
        tensors["output.weight"] = tensors["token_embd.weight"]          # llama.cpp writes the tied head out
    rs = _rope(config)[1]
    if rs.get("rope_type", rs.get("type")) == "llama3":
        tensors["rope_freqs.weight"] = (_llama3_rope_factors(config, metadata["rope.dimension_count"]), "F32")
    for name, new in (replace or {}).items():
        if new is None:
            tensors.pop(name)
        else:
            tensors[name] = new
    return write_gguf(out, arch, metadata, tensors, vocab)


#: Byte offsets of the fp16 scale fields in a block of each k-quant (ggml-common.h's block_q*_K).
_KQUANT_F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Encoded blocks of a k-quant matrix [rows, cols] (gguf-py quantizes none of them): random
    codes and sub-block scales, fp16 super-block scales set to small finite values."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in _KQUANT_F16_FIELDS[type_name]:
        d = rng.uniform(1e-4, 2e-3, blocks.shape[:2]).astype(np.float16)
        blocks[..., at:at + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)
