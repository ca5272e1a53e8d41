"""``infeng export``: a model as a GGUF file that llama.cpp and transformers load.

The model is imported as for compiling (a checkpoint directory, a GGUF file, a hub id; an artifact
exports the model it was compiled from, at its weight precision) and written the way llama.cpp's
``convert_hf_to_gguf.py`` writes it, with ``gguf.GGUFWriter`` (llama.cpp's own writer):

- architecture metadata (``{arch}.block_count``, ``.embedding_length``, ``.attention.head_count``,
  ``.rope.freq_base`` ...) from the model's config; llama-family tensors under llama.cpp's names
  (``token_embd``, ``blk.N.attn_q`` ...), Q and K rows of the llama architecture permuted for
  llama.cpp's rope kernel (the permutation the GGUF frontend undoes), a tied head left out
  (llama.cpp ties it back);
- matrices in the chosen type (``f32``, ``f16``, ``q8_0``, ``q4_0``: llama.cpp's reference quantizers
  in ``gguf.quants``; a matrix whose rows do not fit the blocks stays f32, as llama.cpp does),
  vectors in f32;
- the tokenizer from ``tokenizer.json``: byte-level BPE as ``gpt2`` (tokens, merges), BPE with
  byte fallback (SentencePiece-style vocabularies) as ``llama`` (tokens, scores from the merge
  ranks), special tokens as control tokens, BOS/EOS/UNK, ``add_bos_token``, and the chat template.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from infeng_common.errors import InfengError, UnsupportedError
from infeng_common.manifest import is_artifact, read_manifest

#: GGUF ``general.architecture`` of each family infeng imports.
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
TYPES = ("f32", "f16", "q8_0", "q4_0")
#: An artifact's matrix format -> the GGUF type that keeps its precision.
TYPE_OF_FORMAT = {"f32": "f32", "f16": "f16", "bf16": "f16", "q8r": "q8_0", "q8g32": "q8_0", "q8g64": "q8_0",
                  "q8g128": "q8_0", "f8e4m3": "q8_0"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name of a llama-family tensor (``model.layers.3.mlp.up_proj.weight`` ->
    ``blk.3.ffn_up.weight``)."""
    base, _, suffix = hf_name.rpartition(".")
    if base.startswith("model.layers."):
        _, _, layer, rest = base.split(".", 3)
        if rest in _BLOCK:
            return f"blk.{layer}.{_BLOCK[rest]}.{suffix}"
    elif base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}"
    raise UnsupportedError(f"tensor {hf_name} has no GGUF name (infeng exports the llama, mistral and qwen2 families)")


def permute_qk(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order (``LlamaModel.permute`` of convert_hf_to_gguf.py): per head, the
    rotary pairs' halves interleaved."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def export_gguf(model: str | Path, out: str | Path, gguf_type: str | None = None) -> dict[str, Any]:
    """Write ``model`` (or the model of an artifact) to ``out`` as GGUF; returns a summary."""
    import gguf

    from .frontends import import_model, model_source

    model, out = Path(model), Path(out)
    if is_artifact(model):
        manifest = read_manifest(model)
        gguf_type = gguf_type or _artifact_type(manifest)
        model = Path(manifest["source"]["model_dir"])
    gguf_type = gguf_type or "f32"
    if gguf_type not in TYPES:
        raise InfengError(f"--type {gguf_type}: choose one of {', '.join(TYPES)}")
    source = model_source(model)
    config = source.config
    family = config.get("model_type")
    if family not in ARCHITECTURES:
        raise UnsupportedError(f"{model}: infeng exports the llama, mistral and qwen2 families to GGUF, "
                               f"not {family!r}")
    arch = ARCHITECTURES[family]
    graph = import_model(model)
    meta = graph.meta
    heads, kv_heads, head_dim = meta["num_heads"], meta["num_kv_heads"], meta["head_dim"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(graph.name)
    writer.add_context_length(int(meta["max_position_embeddings"]))
    writer.add_embedding_length(int(meta["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_block_count(int(meta["num_layers"]))
    writer.add_head_count(int(heads))
    writer.add_head_count_kv(int(kv_heads))
    writer.add_rope_dimension_count(int(head_dim))
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(meta["vocab_size"]))
    if head_dim * heads != meta["hidden_size"]:
        writer.add_key_length(int(head_dim))
        writer.add_value_length(int(head_dim))
    if family == "mistral" and config.get("sliding_window"):
        writer.add_sliding_window(int(config["sliding_window"]))
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[gguf_type])
    vocab = tokenizer_vocab(Path(source.tokenizer_dir)) if source.tokenizer_dir else None
    if vocab:
        add_vocab(writer, vocab)
    tied = "lm_head.weight" not in graph.weights
    counts: dict[str, int] = {}
    for name, weight in graph.weights.items():
        values = weight.numpy_f32()
        if arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            values = permute_qk(values, heads)
        elif arch == "llama" and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            values = permute_qk(values, kv_heads)
        qtype = _tensor_type(gguf, values, gguf_type)
        data = values if qtype == gguf.GGMLQuantizationType.F32 else \
            values.astype(np.float16) if qtype == gguf.GGMLQuantizationType.F16 else gguf.quants.quantize(values, qtype)
        writer.add_tensor(gguf_tensor_name(name), np.ascontiguousarray(data),
                          raw_dtype=qtype if qtype not in (gguf.GGMLQuantizationType.F32,
                                                          gguf.GGMLQuantizationType.F16) else None)
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"out": str(out), "architecture": arch, "type": gguf_type, "tensors": counts, "tied_output": tied,
            "vocab": vocab["model"] if vocab else None, "bytes": out.stat().st_size}


def _artifact_type(manifest: dict[str, Any]) -> str:
    """The GGUF type that keeps an artifact's matrix precision (its widest matrix format)."""
    formats = {t["format"] for t in manifest.get("tensors", []) if len(t.get("shape", [])) == 2}
    types = {TYPE_OF_FORMAT.get(f, "q4_0") for f in formats}
    for wide in ("f32", "f16", "q8_0", "q4_0"):
        if wide in types:
            return wide
    return "f32"


def _tensor_type(gguf, values: np.ndarray, gguf_type: str):
    """Matrices in ``gguf_type`` when their rows hold whole blocks, everything else f32."""
    if values.ndim != 2 or gguf_type == "f32":
        return gguf.GGMLQuantizationType.F32
    qtype = gguf.GGMLQuantizationType[gguf_type.upper()]
    if values.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return gguf.GGMLQuantizationType.F32
    return qtype


def tokenizer_vocab(tokenizer_dir: Path) -> dict[str, Any] | None:
    """The GGUF vocabulary of a ``tokenizer.json`` BPE model (None when there is none)."""
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        return None
    spec = json.loads(path.read_text())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise UnsupportedError(f"{path}: a {model.get('type')} tokenizer cannot be written to GGUF (BPE only)")
    config_path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    size = max(list(model["vocab"].values()) + [t["id"] for t in spec.get("added_tokens", [])]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    for token, i in model["vocab"].items():
        tokens[i] = token
    types = [1] * size                                            # NORMAL
    for added in spec.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added.get("special") else 4     # CONTROL, USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    ids = {t: i for i, t in enumerate(tokens)}

    def special(key: str) -> int | None:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return ids.get(value) if isinstance(value, str) else None

    vocab: dict[str, Any] = {"tokens": tokens, "types": types, "bos": special("bos_token"),
                             "eos": special("eos_token"), "unk": special("unk_token"),
                             "chat_template": _chat_template(tokenizer_dir, config)}
    if model.get("byte_fallback"):                                # SentencePiece-style: llama.cpp's "llama"
        rank = {m.replace(" ", ""): -float(i) for i, m in enumerate(merges)}
        for i, token in enumerate(tokens):
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                types[i] = 6                                      # BYTE
        vocab.update(model="llama", scores=[rank.get(t, 0.0) for t in tokens],
                     add_bos=bool(config.get("add_bos_token", True)))
    else:                                                         # byte-level BPE: llama.cpp's "gpt2"
        vocab.update(model="gpt2", merges=merges, pre="default", add_bos=bool(config.get("add_bos_token", False)))
    return vocab


def _chat_template(tokenizer_dir: Path, config: dict[str, Any]) -> str | None:
    jinja = tokenizer_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def add_vocab(writer, vocab: dict[str, Any]) -> None:
    """Write a vocabulary (``tokenizer_vocab``'s form) into a ``gguf.GGUFWriter``."""
    writer.add_tokenizer_model(vocab["model"])
    if vocab.get("pre"):
        writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    if vocab.get("scores") is not None:
        writer.add_token_scores(vocab["scores"])
    writer.add_token_types(vocab["types"])
    if vocab.get("merges"):
        writer.add_token_merges(vocab["merges"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unk", writer.add_unk_token_id)):
        if vocab.get(key) is not None:
            add(vocab[key])
    writer.add_add_bos_token(vocab["add_bos"])
    if vocab.get("chat_template"):
        writer.add_chat_template(vocab["chat_template"])
