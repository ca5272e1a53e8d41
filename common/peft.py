"""PEFT LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors`` -> per-module low-rank
deltas keyed by the base model's weight names, validated against the shapes of its linear layers.

Semantics follow PEFT: scale = lora_alpha / r (``/ sqrt(r)`` with ``use_rslora``), with
``rank_pattern`` / ``alpha_pattern`` overrides; ``target_modules`` as a list of name suffixes, a
regex (full match) or ``"all-linear"``; ``layers_to_transform``; DoRA magnitude vectors. Deltas
are expressed in the IR's [out, in] layout, so GPT-2 Conv1D adapters (``fan_in_fan_out``) need no
transpose: B @ A already is [out, in].
"""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelFormatError, UnsupportedError
from .jsonfile import read_json_object
from .safetensors import bf16_to_f32, read_safetensors_header

PEFT_PREFIX = "base_model.model."


class AdapterMismatchError(ModelFormatError):
    """An adapter that does not fit the base model: a missing target or a shape mismatch."""


@dataclass
class LoraModule:
    """One adapted linear: delta = scale * B @ A, optionally DoRA-renormalised by ``magnitude``."""

    weight: str                      # base weight name in the graph
    A: np.ndarray                    # [r, in]
    B: np.ndarray                    # [out, r]
    scale: float
    magnitude: np.ndarray | None = None   # [out] (DoRA)

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    def delta(self) -> np.ndarray:
        return self.scale * (self.B.astype(np.float64) @ self.A.astype(np.float64))

    def merged(self, base: np.ndarray) -> np.ndarray:
        """W + s*B*A (DoRA: rows rescaled to the magnitude vector), in float32."""
        w = base.astype(np.float64) + self.delta()
        if self.magnitude is not None:
            w *= (self.magnitude.astype(np.float64) / np.linalg.norm(w, axis=1))[:, None]
        return w.astype(np.float32)


@dataclass
class LoraAdapter:
    name: str
    path: Path
    config: dict[str, Any]
    modules: dict[str, LoraModule] = field(default_factory=dict)   # base weight name -> module

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _layer_index(module: str) -> int | None:
    m = re.search(r"\.(?:layers|h|blocks|layer)\.(\d+)\.", module + ".")
    return int(m.group(1)) if m else None


def _targeted(config: dict[str, Any], module: str, linear_modules: set[str]) -> bool:
    targets = config.get("target_modules")
    if targets == "all-linear":
        hit = module in linear_modules
    elif isinstance(targets, str):
        hit = re.fullmatch(targets, module) is not None
    elif isinstance(targets, list):
        hit = any(module == t or module.endswith("." + t) for t in targets)
    else:
        hit = False
    layers = config.get("layers_to_transform")
    if hit and layers is not None:
        wanted = [layers] if isinstance(layers, int) else list(layers)
        hit = _layer_index(module) in wanted
    return hit


def _check_config(cfg_path: Path, config: Any) -> None:
    """The types the reader relies on, so that a bad config is one line naming the key."""
    if not isinstance(config, dict):
        raise ModelFormatError(f"{cfg_path}: expected a JSON object")

    def number(key: str, value: Any, positive: bool) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (positive and value <= 0):
            raise ModelFormatError(f"{cfg_path}: {key} must be a {'positive ' if positive else ''}finite number, "
                                   f"got {value if isinstance(value, (int, float)) else 'a ' + type(value).__name__}")

    for key, positive in (("r", True), ("lora_alpha", False)):
        if key in config:
            number(key, config[key], positive)
    for key, positive in (("rank_pattern", True), ("alpha_pattern", False)):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict):
            raise ModelFormatError(f"{cfg_path}: {key} must be an object of pattern -> number")
        for pattern, value in patterns.items():
            number(f"a {key} entry", value, positive)
            _check_regex(cfg_path, key, pattern)
    layers = config.get("layers_to_transform")
    if layers is not None and not (_is_index(layers) or (isinstance(layers, list) and all(map(_is_index, layers)))):
        raise ModelFormatError(f"{cfg_path}: layers_to_transform must be a layer index or a list of them")
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        _check_regex(cfg_path, "target_modules", targets)
    elif targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise ModelFormatError(f"{cfg_path}: target_modules must be a string or a list of strings")


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_regex(cfg_path: Path, key: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error:
        raise ModelFormatError(f"{cfg_path}: {key} is not a valid regular expression") from None


def read_adapter(path: str | Path, linears: dict[str, tuple[int, int]], name: str | None = None,
                 base_name: str = "the base model") -> LoraAdapter:
    """Read a PEFT LoRA adapter directory and check it against the base model: ``linears`` holds the
    [out, in] shapes of its linear weights by name (from the graph, or what an artifact records).
    Tensors with NaN or Inf are refused, naming the tensor."""
    path = Path(path)
    name = name or path.name
    cfg_path = path / "adapter_config.json"
    if not path.is_dir():
        raise ModelFormatError(f"{path}: adapter directory not found")
    if not cfg_path.is_file():
        raise ModelFormatError(f"{cfg_path}: file not found (a PEFT adapter needs it)")
    config = read_json_object(cfg_path)
    _check_config(cfg_path, config)
    weights_path = path / "adapter_model.safetensors"
    if not weights_path.is_file():
        if (path / "adapter_model.bin").is_file():
            raise ModelFormatError(f"{path / 'adapter_model.bin'}: pickled adapters are not loaded (they can run "
                                   "code); re-save it with save_pretrained(safe_serialization=True)")
        raise ModelFormatError(f"{weights_path}: file not found")
    if config.get("peft_type", "LORA") != "LORA":
        raise UnsupportedError(f"{cfg_path}: peft_type is not LORA (only LoRA adapters are supported)")
    trained_on = str(config.get("base_model_name_or_path") or "").split("/")[-1]
    if trained_on and trained_on not in base_name and base_name not in trained_on:
        warnings.warn(f"{cfg_path}: adapter was trained on {config['base_model_name_or_path']}, "
                      f"the base model is {base_name}", stacklevel=2)

    table = read_safetensors_header(weights_path)
    linear_modules = {k[: -len(".weight")] for k in linears}
    by_module: dict[str, dict[str, np.ndarray]] = {}
    for key, entry in table.items():
        m = re.match(r"^(.*)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight$|^(.*)\.lora_magnitude_vector(?:\.[^.]+)?(?:\.weight)?$",
                     key)
        if not m:
            continue
        module = (m.group(1) or m.group(3)).removeprefix(PEFT_PREFIX)
        part = m.group(2) or "magnitude"
        raw = np.memmap(entry.file, dtype={"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[entry.dtype],
                        mode="r", offset=entry.offset, shape=entry.shape)
        values = bf16_to_f32(np.asarray(raw)) if entry.dtype == "bf16" else np.asarray(raw, dtype=np.float32)
        if not np.isfinite(values).all():
            raise ModelFormatError(f"{weights_path}: tensor {key} has non-finite values (NaN or Inf)")
        by_module.setdefault(module, {})[part] = values

    adapter = LoraAdapter(name, path, config)
    r_default, alpha_default = config.get("r", 8), config.get("lora_alpha", 8)
    for module, parts in sorted(by_module.items()):
        weight_name = module + ".weight"
        if weight_name not in linears:
            raise AdapterMismatchError(f"{weights_path}: tensor for {module} targets no linear layer of the base "
                                       f"model {base_name} (no weight {weight_name})")
        if "lora_A" not in parts or "lora_B" not in parts:
            raise ModelFormatError(f"{weights_path}: {module} lacks lora_A or lora_B")
        A, B = parts["lora_A"], parts["lora_B"]
        out_dim, in_dim = linears[weight_name]
        if A.ndim != 2 or B.ndim != 2 or A.shape[1] != in_dim or B.shape[0] != out_dim or A.shape[0] != B.shape[1]:
            raise AdapterMismatchError(f"{weights_path}: tensor {PEFT_PREFIX}{module}.lora_A/B has shapes "
                                       f"{list(A.shape)} / {list(B.shape)}, but base weight {weight_name} is "
                                       f"[{out_dim}, {in_dim}]")
        rank = _pattern_value(config.get("rank_pattern") or {}, module, r_default)
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, alpha_default)
        if rank != A.shape[0]:
            raise AdapterMismatchError(f"{weights_path}: {module}.lora_A has rank {A.shape[0]}, config says r={rank}")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        magnitude = parts.get("magnitude")
        if config.get("use_dora") and magnitude is None:
            raise ModelFormatError(f"{weights_path}: use_dora is set but {module} has no lora_magnitude_vector")
        if magnitude is not None and magnitude.reshape(-1).shape != (out_dim,):
            raise AdapterMismatchError(f"{weights_path}: {module}.lora_magnitude_vector has shape "
                                       f"{list(magnitude.shape)}, base weight {weight_name} has {out_dim} rows")
        adapter.modules[weight_name] = LoraModule(weight_name, A, B, float(scale),
                                                  None if magnitude is None else magnitude.reshape(-1))
    missing = [m for m in sorted(linear_modules) if _targeted(config, m, linear_modules)
               and m + ".weight" not in adapter.modules]
    if missing:
        raise AdapterMismatchError(f"{weights_path}: target module {missing[0]} of the base model has no LoRA "
                                   f"weights in the adapter ({len(missing)} missing)")
    if not adapter.modules:
        raise AdapterMismatchError(f"{weights_path}: no LoRA tensor matches a linear layer of {base_name}")
    return adapter
