"""GGUF frontend: a llama.cpp model file -> the IR graph ``hf.py`` builds, read with the ``gguf``
package (llama.cpp's own reader and dequantizers).

A GGUF holds the weights of one model under llama.cpp's names, its hyperparameters as metadata
(``{arch}.embedding_length`` ...) and its tokenizer as metadata (``tokenizer.ggml.*``). The import
presents the file to ``hf._Builder`` as a Hugging Face checkpoint: an HF-style config built from the
metadata, and the tensors under their HF names (``docs/models.md`` has both tables), so there is one
graph builder for both sources. What differs from a safetensors checkpoint:

- GGUF writes dims innermost first (``ne``); the reader's numpy shape is already [out, in].
- llama.cpp's converter permutes the rows of Q and K of the llama family (``permute`` in
  ``convert_hf_to_gguf.py``) for its rope kernel; the import undoes it (``_unpermute_rows``), on
  codes and scales as well for the formats kept exact (it moves whole rows).
- Q8_0, Q4_0 and Q4_1 matrices are kept bit for bit as infeng's ``q8g32``, ``q4g32`` and ``q4g32m``
  (the same codes, the same fp16 scale, and minimum, per 32): the weight carries ``format`` and
  ``prequantized``, so ``cast-weights`` and ``quantize`` leave it as it is (an explicit ``--dtype``
  widens it: ``cast-weights(DTYPE,all)``). Every other quantized type is dequantized
  with ``gguf.quants.dequantize`` to f32 (F16/BF16 stay as stored) and compiled with the
  ``--dtype``/``--quant`` the user asks for. ``graph.meta["gguf"]`` records which was which.
- Llama-3 rope scaling arrives as a ``rope_freqs`` tensor of per-frequency divisors; the rope
  nodes get the divided inverse frequencies as an explicit ``inv_freq`` table.
- The tokenizer is built from the metadata into a ``tokenizer.json`` (the ``tokenizers`` library,
  shaped as transformers' GGUF tokenizer conversion shapes it) plus ``tokenizer_config.json``
  (special tokens, ``add_bos_token``, the chat template) in a cache directory, which the graph's
  ``model_dir`` and ``ModelSource.tokenizer_dir`` name, so ``compile.py`` copies them into the
  artifact as it does for a checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from infeng_common.errors import ModelFormatError, UnsupportedError, not_a_file

from ..ir import Graph, TensorType, Weight
from .hf import _Builder

#: ``general.architecture`` values infeng imports (Mistral is ``llama`` in GGUF).
ARCHITECTURES = ("llama", "qwen2", "gpt2")
#: GGML types kept bit for bit, and the infeng format they become.
EXACT_FORMATS = {"Q8_0": "q8g32", "Q4_0": "q4g32", "Q4_1": "q4g32m"}
#: GGML types kept as stored (the IR element type).
FLOAT_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
#: GGML types dequantized to f32 with ``gguf.quants.dequantize``.
DEQUANTIZED_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = tuple(FLOAT_TYPES) + tuple(EXACT_FORMATS) + DEQUANTIZED_TYPES

# GGUF metadata (under ``{arch}.``) -> Hugging Face config fields
_LLAMA_KEYS = {
    "context_length": "max_position_embeddings", "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
_GPT2_KEYS = {
    "context_length": "n_positions", "embedding_length": "n_embd", "block_count": "n_layer",
    "feed_forward_length": "n_inner", "attention.head_count": "n_head",
    "attention.layer_norm_epsilon": "layer_norm_epsilon",
}
_REQUIRED = ("embedding_length", "block_count", "attention.head_count")

# GGUF tensor names -> Hugging Face names (per block: ``blk.N.<gguf>`` -> ``<prefix>N.<hf>``)
_LLAMA_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GPT2_GLOBAL = {"token_embd": "wte", "position_embd": "wpe", "output_norm": "ln_f", "output": "lm_head"}
_GPT2_BLOCK = {
    "attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj",
}

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4
#: Bump when the generated tokenizer/config files change, so cached ones are rebuilt.
_GENERATED_VERSION = 1


# ---------------------------------------------------------------------------------------------
# reading the file
def _bad_alignment(path: Path, alignment: int | None) -> str:
    value = "" if alignment is None else f" is {alignment};"
    return f"{path}: general.alignment{value} must be a power of two (tensor data offsets are multiples of it)"


@lru_cache(maxsize=1)
def _reader_class():
    import gguf

    class Reader(gguf.GGUFReader):
        """``GGUFReader`` that names the tensor a truncated file cuts off, and an unknown type id,
        instead of failing on a reshape, and refuses tensors whose data is not aligned to the
        file's ``general.alignment`` or overlaps another tensor's."""

        def __init__(self, path: Path):
            self.path = path
            super().__init__(str(path))

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            size = len(self.data)
            spans: list[tuple[int, int, str]] = []               # (offset in the data section, bytes, name)
            for f in fields:
                name = bytes(f.parts[1]).decode("utf-8", "replace")
                dims, raw_type, offset = f.parts[3], int(f.parts[4][0]), int(f.parts[5][0])
                try:
                    qtype = gguf.GGMLQuantizationType(raw_type)
                except ValueError:
                    raise UnsupportedError(f"{self.path}: tensor {name} has ggml type id {raw_type}, unknown to the "
                                           f"gguf package; supported: {', '.join(SUPPORTED_TYPES)}") from None
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                n_bytes = math.prod(int(d) for d in dims) * type_size // block
                if start_offs + offset + n_bytes > size:
                    raise ModelFormatError(f"{self.path}: truncated file: tensor {name} ({qtype.name}, {n_bytes} bytes "
                                           f"at offset {start_offs + offset}) runs past its end ({size} bytes)")
                spans.append((offset, n_bytes, name))
            self._check_layout(spans)
            super()._build_tensors(start_offs, fields)

        def _check_layout(self, spans: list[tuple[int, int, str]]) -> None:
            """Every tensor starts at a multiple of the alignment, and no two share a byte."""
            alignment = int(self.alignment)
            if alignment <= 0 or alignment & (alignment - 1):
                raise ModelFormatError(_bad_alignment(self.path, alignment))
            for offset, _, name in spans:
                if offset % alignment:
                    raise ModelFormatError(f"{self.path}: tensor {name}: data offset {offset} is not a multiple of "
                                           f"the file's alignment ({alignment} bytes)")
            end, last = 0, None
            for offset, n_bytes, name in sorted(s for s in spans if s[1]):
                if offset < end:
                    raise ModelFormatError(f"{self.path}: tensors {last} and {name} overlap (tensor {name} starts at "
                                           f"data offset {offset}, inside {last}, which ends at {end})")
                end, last = offset + n_bytes, name

    return Reader


@dataclass(eq=False)
class GGUFTensor:
    """One tensor of the file: its GGML type, numpy shape ([out, in] for a matrix), the mapped data
    (the reader's view: elements for F32/F16, bytes otherwise), and the row order that undoes
    llama.cpp's Q/K permutation (None: rows as stored)."""

    name: str
    type: str
    shape: tuple[int, ...]
    data: np.ndarray
    path: Path
    rows: np.ndarray | None = None

    @cached_property
    def exact_format(self) -> str | None:
        """The infeng format this tensor is kept in bit for bit, or None (dequantized / float)."""
        fmt = EXACT_FORMATS.get(self.type)
        if fmt is None or len(self.shape) != 2:
            return None
        if self.type == "Q8_0" and np.any(self._blocks()[..., 2:] == 0x80):
            return None            # code -128: q8g32 stops at -127 (docs/quantization.md), so dequantize
        return fmt

    def _blocks(self) -> np.ndarray:
        import gguf

        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.type]]
        N, K = self.shape
        return np.asarray(self.data).reshape(N, K // block, type_size)

    def values(self) -> np.ndarray:
        """The elements in numpy order, HF row order: f32 (dequantized), f16, or bf16 bits (uint16)."""
        import gguf

        if self.type in ("F32", "F16"):
            a = np.asarray(self.data).reshape(self.shape)
        elif self.type == "BF16":
            a = np.asarray(self.data).view(np.uint16).reshape(self.shape)
        else:
            a = gguf.quants.dequantize(np.asarray(self.data), gguf.GGMLQuantizationType[self.type])
            a = np.asarray(a, dtype=np.float32).reshape(self.shape)
        return np.ascontiguousarray(a[self.rows]) if self.rows is not None else a

    def quantized(self):
        """The ``QuantizedTensor`` holding this Q8_0/Q4_0 matrix's own codes and scales."""
        from ..quant.formats import QuantizedTensor

        N, K = self.shape
        blocks = self._blocks()
        scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16).reshape(N, K // 32)
        mins = None
        if self.type == "Q8_0":             # int8 q -> unsigned code q + 128 (two's complement: flip bit 7)
            codes = (blocks[..., 2:] ^ np.uint8(0x80)).reshape(N, K)
        else:                               # Q4_0/Q4_1: byte j holds element j (low nibble) and j + 16 (high)
            start = 4 if self.type == "Q4_1" else 2
            qs = blocks[..., start:]
            codes = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1).reshape(N, K)
            if self.type == "Q4_1":         # d, then the minimum m: w = d * q + m
                mins = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).reshape(N, K // 32)
        if self.rows is not None:
            codes, scales = codes[self.rows], scales[self.rows]
            mins = None if mins is None else mins[self.rows]
        return QuantizedTensor(EXACT_FORMATS[self.type], (N, K), np.ascontiguousarray(codes),
                               np.ascontiguousarray(scales), None,
                               None if mins is None else np.ascontiguousarray(mins))


@dataclass(eq=False)
class GGUFWeight(Weight):
    """A weight read from a GGUF tensor on first use (``raw``: dequantized or as stored, Q/K rows
    un-permuted); a Q8_0/Q4_0 matrix kept exact gives its own codes and scales (``quantized``)."""

    tensor: GGUFTensor | None = field(default=None, repr=False)

    def raw(self) -> np.ndarray:
        if self.array is not None or self.tensor is None:
            return super().raw()
        return self.tensor.values()

    def quantized(self):
        if self.quant is None and self.tensor is not None and self.tensor.exact_format == self.format:
            self.quant = self.tensor.quantized()
        return super().quantized()


def _unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order undoing llama.cpp's ``permute(w, n_head)``: HF row i is GGUF row ``order[i]``."""
    half = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(-1)


class GGUFFile:
    """An opened GGUF file: metadata, tensors, the HF-style config and tensor table it implies."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise ModelFormatError(not_a_file(path))
        try:
            self.reader = _reader_class()(path)
        except (ModelFormatError, UnsupportedError):
            raise
        except ZeroDivisionError:                 # a gguf package that does not check general.alignment
            raise ModelFormatError(_bad_alignment(path, 0)) from None
        except (ValueError, IndexError, OverflowError, UnicodeDecodeError, KeyError, OSError) as e:
            # the gguf package's own words (numpy's reshape and index errors) would not help: say where
            if "alignment" in str(e):
                raise ModelFormatError(_bad_alignment(path, None)) from None
            what = "not a GGUF file (bad magic)" if "magic" in str(e) else (
                f"truncated or malformed GGUF header: its metadata and tensor table do not parse "
                f"(the file has {path.stat().st_size:,} bytes)")
            raise ModelFormatError(f"{path}: {what}") from None
        self._values: dict[str, Any] = {}
        self.arch = self.get("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise UnsupportedError(f"{path}: unknown architecture general.architecture={self.arch!r}; "
                                   f"supported: {', '.join(ARCHITECTURES)} (Mistral is llama in GGUF)")
        self.tensors: dict[str, GGUFTensor] = {}
        for t in self.reader.tensors:
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise UnsupportedError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which infeng cannot "
                                       f"import; supported: {', '.join(SUPPORTED_TYPES)}")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, shape, t.data, path)
        self.config = self._hf_config()
        self.hf_tensors = self._hf_tensors()

    # -- metadata ---------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python (int, float, bool, str, or a list of them); ``default`` if absent."""
        if key not in self._values:
            f = self.reader.fields.get(key)
            self._values[key] = None if f is None else _field_value(f, self.path, key)
        value = self._values[key]
        return default if value is None else value

    def arch_int(self, key: str, default: Any = None) -> Any:
        """``{arch}.key`` as one positive int (a per-layer list must hold one value); ``default`` if absent."""
        full = f"{self.arch}.{key}"
        v = self.get(full)
        if v is None:
            return default
        if isinstance(v, list):
            if len(set(v)) != 1:
                raise UnsupportedError(f"{self.path}: {full} differs between layers ({sorted(set(v))}); "
                                       "infeng needs one value for every layer")
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ModelFormatError(f"{self.path}: metadata {full} must be a positive integer, got {v!r}")
        return v

    def token_id(self, key: str) -> int | None:
        """``tokenizer.ggml.{key}`` as a token id (a non-negative integer), or None if absent."""
        value = self.get(f"tokenizer.ggml.{key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ModelFormatError(f"{self.path}: metadata tokenizer.ggml.{key}={value!r:.80} is not a token id")
        return value

    def _hf_config(self) -> dict[str, Any]:
        a = self.arch
        for k in _REQUIRED:
            if self.get(f"{a}.{k}") is None:
                raise ModelFormatError(f"{self.path}: missing metadata {a}.{k}")
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelFormatError(f"{self.path}: tensor token_embd.weight is missing")
        vocab = embd.shape[0]
        config: dict[str, Any] = {"_name_or_path": self.path.stem, "vocab_size": vocab,
                                  "tie_word_embeddings": self._tied()}
        keys = _GPT2_KEYS if a == "gpt2" else _LLAMA_KEYS
        for gguf_key, hf_key in keys.items():
            full = f"{a}.{gguf_key}"
            value = self.get(full)
            if value is None:
                continue
            config[hf_key] = float(value) if isinstance(value, float) else self.arch_int(gguf_key)
        bos, eos = self.token_id("bos_token_id"), self.token_id("eos_token_id")
        eos_ids = [e for e in (eos, self.token_id("eot_token_id"), self.token_id("eom_token_id")) if e is not None]
        eos_ids = list(dict.fromkeys(eos_ids))
        config["bos_token_id"] = bos
        config["eos_token_id"] = eos_ids if len(eos_ids) > 1 else (eos_ids[0] if eos_ids else None)
        if a == "gpt2":
            config.update({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                           "activation_function": "gelu_new"})
            config.setdefault("n_positions", self.tensors["position_embd.weight"].shape[0]
                              if "position_embd.weight" in self.tensors else 1024)
            return config
        heads = config["num_attention_heads"]
        head_dim = self.arch_int("attention.key_length") or config["hidden_size"] // heads
        if self.arch_int("attention.value_length", head_dim) != head_dim:
            raise UnsupportedError(f"{self.path}: {a}.attention.key_length != {a}.attention.value_length")
        rope_dim = self.arch_int("rope.dimension_count", head_dim)
        if rope_dim != head_dim:
            raise UnsupportedError(f"{self.path}: {a}.rope.dimension_count={rope_dim} rotates part of a head of "
                                   f"{head_dim}: partial rotary embeddings are not supported")
        window = self.arch_int("attention.sliding_window")
        family = "mistral" if a == "llama" and window else a
        config.update({
            "model_type": family, "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                                     "qwen2": "Qwen2ForCausalLM"}[family]],
            "head_dim": head_dim, "hidden_act": "silu",
            "attention_bias": "blk.0.attn_q.bias" in self.tensors and a == "llama",
            "mlp_bias": "blk.0.ffn_up.bias" in self.tensors,
        })
        config.setdefault("num_key_value_heads", heads)
        config.setdefault("intermediate_size", self.tensors["blk.0.ffn_up.weight"].shape[0]
                          if "blk.0.ffn_up.weight" in self.tensors else None)
        if family == "mistral":
            config["sliding_window"] = window
        scaling = self._rope_scaling()
        if scaling:
            config["rope_scaling"] = scaling
        return config

    def _rope_scaling(self) -> dict[str, Any] | None:
        a = self.arch
        kind, factor = self.get(f"{a}.rope.scaling.type", "none"), self.get(f"{a}.rope.scaling.factor")
        legacy = self.get(f"{a}.rope.scale_linear")                  # older files: the factor alone
        if kind == "none" and legacy not in (None, 1.0):
            kind, factor = "linear", legacy
        if kind == "none":
            return None
        if kind != "linear" or not isinstance(factor, (int, float)) or factor <= 0:
            raise UnsupportedError(f"{self.path}: rope scaling {a}.rope.scaling.type={kind!r} "
                                   f"(factor {factor!r}) is not supported (supported: none, linear, Llama 3 "
                                   "rope_freqs)")
        return {"rope_type": "linear", "factor": float(factor)}

    def _tied(self) -> bool:
        """No ``output`` matrix, or one identical to ``token_embd`` (llama.cpp writes GPT-2's out)."""
        out, embd = self.tensors.get("output.weight"), self.tensors["token_embd.weight"]
        if out is None:
            return True
        return (out.type == embd.type and out.shape == embd.shape
                and np.array_equal(np.asarray(out.data).view(np.uint8), np.asarray(embd.data).view(np.uint8)))

    # -- tensors ------------------------------------------------------------------------------
    def _hf_tensors(self) -> dict[str, GGUFTensor]:
        """The tensors under their Hugging Face names, Q/K rows un-permuted (llama family)."""
        gpt2 = self.arch == "gpt2"
        glob, block = (_GPT2_GLOBAL, _GPT2_BLOCK) if gpt2 else (_LLAMA_GLOBAL, _LLAMA_BLOCK)
        prefix = "h." if gpt2 else "model.layers."
        out: dict[str, GGUFTensor] = {}
        for name, t in self.tensors.items():
            base, _, suffix = name.rpartition(".")
            if name == "rope_freqs.weight" and not gpt2:
                continue                                    # -> rope inv_freq (rope_inv_freq)
            if name == "output.weight" and self.config["tie_word_embeddings"]:
                continue
            if base.startswith("blk."):
                _, layer, part = base.split(".", 2)
                hf = block.get(part)
                hf_name = f"{prefix}{layer}.{hf}.{suffix}" if hf else None
            else:
                hf_name = f"{glob[base]}.{suffix}" if base in glob else None
            if hf_name is None:
                raise UnsupportedError(f"{self.path}: tensor {name} has no place in the {self.arch} graph infeng "
                                       "builds (an unsupported variant of the architecture)")
            if self.arch == "llama" and base.endswith((".attn_q", ".attn_k")):
                heads = self.config["num_attention_heads"] if base.endswith(".attn_q") \
                    else self.config["num_key_value_heads"]
                if t.shape[0] % (2 * heads):
                    raise ModelFormatError(f"{self.path}: tensor {name} has {t.shape[0]} rows, not a multiple of "
                                           f"2 x {heads} heads")
                t.rows = _unpermute_rows(t.shape[0], heads)
            out[hf_name] = t
        return out

    def rope_inv_freq(self) -> list[float] | None:
        """Inverse rope frequencies divided by ``rope_freqs`` (Llama 3 scaling), or None."""
        t = self.tensors.get("rope_freqs.weight")
        if t is None or self.arch == "gpt2":
            return None
        hd = self.config["head_dim"]
        divisors = np.asarray(t.values(), dtype=np.float32).reshape(-1)
        if divisors.shape != (hd // 2,):
            raise ModelFormatError(f"{self.path}: tensor rope_freqs.weight has {divisors.size} values, a head of "
                                   f"{hd} needs {hd // 2}")
        theta = self.config.get("rope_theta", 10000.0)
        inv = (1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd))).astype(np.float32)
        return [float(x) for x in (inv / divisors).astype(np.float32)]

    def import_record(self, graph: Graph) -> dict[str, Any]:
        """``meta["gguf"]``: the file, and how each matrix came in (exactly, dequantized, as stored)."""
        exact: dict[str, str] = {}
        dequantized: dict[str, str] = {}
        stored: dict[str, int] = {}
        for w in graph.weights.values():
            t = getattr(w, "tensor", None)
            if t is None:
                continue
            if w.attrs.get("prequantized"):
                exact[w.name] = f"{t.type} -> {w.format}"
            elif t.type in FLOAT_TYPES:
                stored[t.type] = stored.get(t.type, 0) + 1
            else:
                dequantized[w.name] = t.type + (" (code -128: no exact q8g32)" if t.type == "Q8_0" else "")
        return {"file": str(self.path.resolve()), "architecture": self.arch, "imported_exactly": exact,
                "dequantized": dequantized, "as_stored": stored}


def _field_value(f, path: Path, key: str) -> Any:
    """A reader field as Python: scalars, strings, arrays of either (works across gguf versions)."""
    from gguf import GGUFValueType

    def scalar(part, t):
        if t == GGUFValueType.STRING:
            try:
                return bytes(part).decode("utf-8")
            except UnicodeDecodeError:
                raise ModelFormatError(f"{path}: metadata {key} holds invalid UTF-8") from None
        v = part[0].item()
        return bool(v) if t == GGUFValueType.BOOL else v

    if not f.types:
        return None
    if f.types[0] == GGUFValueType.ARRAY:
        item = f.types[-1] if len(f.types) > 1 else None
        if item == GGUFValueType.ARRAY:
            raise UnsupportedError(f"{path}: metadata {key} is a nested array")
        return [scalar(f.parts[i], item) for i in f.data]
    return scalar(f.parts[f.data[0]], f.types[0])


@lru_cache(maxsize=4)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(Path(path))


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file (cached per path, size and modification time: the reader takes seconds on
    a vocabulary of 100k tokens, and ``model_source`` and ``import_model`` both need it)."""
    p = Path(path)
    if not p.is_file():
        raise ModelFormatError(not_a_file(p))
    st = p.stat()
    return _open_cached(str(p.resolve()), st.st_size, st.st_mtime_ns)


# ---------------------------------------------------------------------------------------------
# the graph
class _GGUFBuilder(_Builder):
    """``hf._Builder`` over a GGUF file's HF-style config and tensors."""

    def __init__(self, gf: GGUFFile, tokenizer_dir: Path | None):
        super().__init__(tokenizer_dir or gf.path.parent, gf.config, gf.hf_tensors)
        self.gf = gf
        self.cfg_path = self.source = gf.path
        self.tokenizer_dir = tokenizer_dir

    def weight(self, g: Graph, name: str, shape: tuple[int, ...], transposed: bool = False) -> Weight:
        # ``transposed`` does not apply: llama.cpp stores GPT-2's Conv1D weights as [out, in] already
        if name in g.weights:
            return g.weights[name]
        t = self.tensors.get(name)
        if t is None:
            raise ModelFormatError(f"{self.gf.path}: tensor {_gguf_name(name, self.gf.arch)} ({name}) is missing")
        if t.shape != tuple(shape):
            raise ModelFormatError(f"{self.gf.path}: tensor {t.name} has shape {list(t.shape)} but the metadata "
                                   f"implies {list(shape)}")
        attrs: dict[str, Any] = {"gguf_type": t.type}
        exact = t.exact_format if len(shape) == 2 else None
        if exact:
            attrs.update({"format": exact, "prequantized": f"GGUF {t.type}"})
        dtype = FLOAT_TYPES.get(t.type, "f32")
        return g.add_weight(GGUFWeight(name, TensorType(dtype, tuple(shape)), attrs=attrs, tensor=t))

    def common_meta(self, *args: Any) -> dict[str, Any]:
        meta = super().common_meta(*args)
        meta["model_dir"] = str(self.tokenizer_dir.resolve()) if self.tokenizer_dir else None
        return meta


def _gguf_name(hf_name: str, arch: str) -> str:
    """The GGUF name of an HF tensor name (for messages)."""
    base, _, suffix = hf_name.rpartition(".")
    glob, block, prefix = (_GPT2_GLOBAL, _GPT2_BLOCK, "h.") if arch == "gpt2" else \
        (_LLAMA_GLOBAL, _LLAMA_BLOCK, "model.layers.")
    for g, h in glob.items():
        if base == h:
            return f"{g}.{suffix}"
    if base.startswith(prefix):
        layer, _, rest = base[len(prefix):].partition(".")
        for g, h in block.items():
            if rest == h:
                return f"blk.{layer}.{g}.{suffix}"
    return hf_name


def import_gguf(path: str | Path, tokenizer_dir: str | Path | None = None) -> Graph:
    """Import a GGUF file as the IR graph ``hf.import_hf`` builds for the same model."""
    gf = open_gguf(path)
    tok = Path(tokenizer_dir) if tokenizer_dir is not None else gguf_tokenizer_dir(gf)
    builder = _GGUFBuilder(gf, tok)
    graph = builder.build_gpt2() if gf.arch == "gpt2" else builder.build_llama()
    unused = [t.name for hf, t in gf.hf_tensors.items() if hf not in graph.weights]
    if unused:
        raise UnsupportedError(f"{gf.path}: tensor {unused[0]} is not used by the {gf.config['model_type']} graph "
                               "(an unsupported variant of the architecture)")
    inv_freq = gf.rope_inv_freq()
    if inv_freq is not None:
        for n in graph.find("rope"):
            n.attrs.pop("scaling", None)
            n.attrs["inv_freq"] = inv_freq
    graph.meta["gguf"] = gf.import_record(graph)
    return graph


def gguf_source(path: str | Path, tokenizer_dir: str | Path | None = None):
    """The ``ModelSource`` of a GGUF file: its config and tokenizer directory (generated)."""
    from . import ModelSource

    gf = open_gguf(path)
    tok = Path(tokenizer_dir) if tokenizer_dir is not None else gguf_tokenizer_dir(gf)
    if tok is not None and not tok.is_dir():
        raise ModelFormatError(f"{tok}: tokenizer directory not found")
    return ModelSource(Path(path), "gguf", tok, dict(gf.config), [Path(path)])


# ---------------------------------------------------------------------------------------------
# the tokenizer
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: ``tokenizer.ggml.pre`` -> the split regex its merges were learned with (as transformers maps
#: them); any other value splits as GPT-2 does (the ByteLevel pre-tokenizer's own regex).
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (``bytes_to_unicode``)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, shifted = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + shifted)
            shifted += 1
    return dict(zip(bs, map(chr, cs)))


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens, best
    score first (transformers' ``generate_merges``, which its GGUF tokenizers use)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    piece_scores = dict(zip(tokens, scores))
    merges = []
    for merge, score in piece_scores.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


#: What ``_array`` checks each element of a metadata array against, and how a message names it.
_ITEM_KINDS: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float)}


def _array(gf: GGUFFile, key: str, item: str, length: int | None = None) -> list | None:
    """The metadata array ``key`` (None if absent), every element an ``item`` (``_ITEM_KINDS``;
    bools are not numbers), ``length`` of them if given: ModelFormatError naming the file and key
    otherwise."""
    value = gf.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise ModelFormatError(f"{gf.path}: metadata {key} must be an array of {item}s, got {value!r:.80}")
    kinds = _ITEM_KINDS[item]
    bad = next((i for i, v in enumerate(value) if isinstance(v, bool) or not isinstance(v, kinds)), None)
    if bad is not None:
        raise ModelFormatError(f"{gf.path}: metadata {key}[{bad}] is {value[bad]!r:.80}; the array holds {item}s")
    if length is not None and len(value) != length:
        raise ModelFormatError(f"{gf.path}: metadata {key} has {len(value)} entries for {length} tokens")
    return value


def _string(gf: GGUFFile, key: str) -> str | None:
    """The metadata string ``key`` (None if absent); ModelFormatError if it is something else."""
    value = gf.get(key)
    if value is not None and not isinstance(value, str):
        raise ModelFormatError(f"{gf.path}: metadata {key} must be a string, got {value!r:.80}")
    return value


def _merges(gf: GGUFFile, merges_text: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` as pairs, each of two tokens of ``vocab`` whose concatenation is
    one too (``tokenizers`` panics on a merge whose result is missing)."""
    merges = []
    for i, text in enumerate(merges_text):
        pair = tuple(text.split(" "))
        if len(pair) != 2:
            raise ModelFormatError(f"{gf.path}: tokenizer.ggml.merges holds {text!r}, not two tokens")
        missing = next((t for t in (*pair, pair[0] + pair[1]) if t not in vocab), None)
        if missing is not None:
            raise ModelFormatError(f"{gf.path}: tokenizer.ggml.merges[{i}] = {text!r} needs the token {missing!r}, "
                                   "which is not in tokenizer.ggml.tokens")
        merges.append(pair)
    return merges


def build_tokenizer(gf: GGUFFile):
    """The ``tokenizers.Tokenizer`` the file's ``tokenizer.ggml.*`` metadata describes."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    kind = _string(gf, "tokenizer.ggml.model")
    tokens: list[str] = _array(gf, "tokenizer.ggml.tokens", "string") or []
    if not tokens:
        raise ModelFormatError(f"{gf.path}: metadata tokenizer.ggml.tokens is missing or empty")
    types: list[int] = _array(gf, "tokenizer.ggml.token_type", "integer", len(tokens)) or [1] * len(tokens)
    merges_text = _array(gf, "tokenizer.ggml.merges", "string")
    if kind == "gpt2":
        spelling = byte_alphabet()
        alphabet = set(spelling.values())
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        if not merges_text:
            raise ModelFormatError(f"{gf.path}: a gpt2 (byte-level BPE) vocabulary needs tokenizer.ggml.merges")
        merges = _merges(gf, merges_text, vocab)
        tok = Tokenizer(BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                            fuse_unk=False, byte_fallback=False))
        split = PRE_TOKENIZER_SPLITS.get(_string(gf, "tokenizer.ggml.pre"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) if split is None else \
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        specials = [t for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL and set(t) <= alphabet]
    elif kind == "llama":
        vocab = {t: i for i, t in enumerate(tokens)}
        if merges_text:
            merges = _merges(gf, merges_text, vocab)
        else:
            scores = _array(gf, "tokenizer.ggml.scores", "number", len(tokens))
            if scores is None:
                raise ModelFormatError(f"{gf.path}: a llama (SentencePiece) vocabulary without merges needs "
                                       "tokenizer.ggml.scores")
            merges = _spm_merges(tokens, scores)
        tok = Tokenizer(BPE(vocab, merges, dropout=None, fuse_unk=True, byte_fallback=True))
        prefix = gf.get("tokenizer.ggml.add_space_prefix", True)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        specials = [t for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL]
    else:
        raise UnsupportedError(f"{gf.path}: tokenizer.ggml.model={kind!r} is not supported (gpt2 byte-level BPE, "
                               "llama SentencePiece); give --tokenizer DIR with a tokenizer.json")
    cfg = tokenizer_config(gf)
    named = [cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if cfg.get(k)]
    specials += [t for t in named if t not in specials]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    user = [t for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    bos, eos = cfg.get("bos_token"), cfg.get("eos_token")
    single = ([bos] if cfg["add_bos_token"] and bos else []) + ["$A"] + ([eos] if cfg["add_eos_token"] and eos else [])
    ids = {t: tok.token_to_id(t) for t in (bos, eos) if t}
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(single + [s if s != "$A" else "$B" for s in single]),
        special_tokens=[(t, ids[t]) for t in dict.fromkeys(s for s in single if s != "$A")])
    return tok


def tokenizer_config(gf: GGUFFile) -> dict[str, Any]:
    """``tokenizer_config.json`` for the file: special tokens, BOS/EOS flags, the chat template."""
    tokens = gf.get("tokenizer.ggml.tokens") or []

    def token(key: str) -> str | None:
        i = gf.get(f"tokenizer.ggml.{key}")
        if i is None:
            return None
        if not isinstance(i, int) or not 0 <= i < len(tokens):
            raise ModelFormatError(f"{gf.path}: metadata tokenizer.ggml.{key}={i!r} is not a token id "
                                   f"(vocabulary of {len(tokens)})")
        return tokens[i]

    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
    add_bos = gf.get("tokenizer.ggml.add_bos_token", gf.get("tokenizer.ggml.model") == "llama")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
        "add_bos_token": bool(add_bos), "add_eos_token": bool(gf.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": gf.config.get("max_position_embeddings") or gf.config.get("n_positions"),
    }
    template = _string(gf, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "infeng" / "gguf"


def gguf_tokenizer_dir(gf: GGUFFile) -> Path | None:
    """A directory with the file's ``tokenizer.json``, ``tokenizer_config.json``,
    ``generation_config.json`` and HF-style ``config.json``, generated once per file (keyed by
    path, size and modification time) under ``$XDG_CACHE_HOME/infeng/gguf``; None when the file
    describes no tokenizer."""
    if gf.get("tokenizer.ggml.model") is None:
        return None
    st = gf.path.stat()
    key = hashlib.sha256(f"{gf.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{_GENERATED_VERSION}".encode())
    out = _cache_root() / f"{gf.path.stem}-{key.hexdigest()[:16]}"
    if (out / "tokenizer.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        build_tokenizer(gf).save(str(staging / "tokenizer.json"))
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(gf), indent=2) + "\n")
        generation = {"bos_token_id": gf.config.get("bos_token_id"), "eos_token_id": gf.config.get("eos_token_id")}
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        (staging / "config.json").write_text(json.dumps(gf.config, indent=2) + "\n")
        try:
            os.replace(staging, out)
        except OSError:                # another process wrote it first
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


__all__ = ["import_gguf", "gguf_source", "open_gguf", "GGUFFile", "GGUFWeight", "build_tokenizer",
           "tokenizer_config", "gguf_tokenizer_dir", "EXACT_FORMATS", "SUPPORTED_TYPES"]
