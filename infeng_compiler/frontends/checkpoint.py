"""Safetensors checkpoints: the tensor tables of a single-file or sharded checkpoint, read from the
file headers (``infeng_common.safetensors``), nothing else read: weights stay memory-mapped from
the original file (and later from ``weights.bin``) and bf16 stays bf16."""
from __future__ import annotations

import json
from pathlib import Path

from infeng_common.errors import ModelFormatError
from infeng_common.safetensors import TensorEntry, read_safetensors_header


def read_checkpoint(model_dir: Path) -> dict[str, TensorEntry]:
    """All tensors of a single-file or sharded (``model.safetensors.index.json``) checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ModelFormatError(f"{index}: malformed shard index: {e}") from None
        table: dict[str, TensorEntry] = {}
        for shard in sorted(set(weight_map.values())):
            table.update(read_safetensors_header(model_dir / shard))
        missing = [t for t in weight_map if t not in table]
        if missing:
            raise ModelFormatError(f"{index}: tensor {missing[0]} is listed but not in its shard {weight_map[missing[0]]}")
        return table
    if single.is_file():
        return read_safetensors_header(single)
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pth")):
        raise ModelFormatError(f"{model_dir}: only safetensors checkpoints are supported (found a pickle .bin/.pth); "
                               "convert with transformers' save_pretrained(safe_serialization=True)")
    raise ModelFormatError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
