"""Safetensors checkpoints: tensor tables read from the file headers, nothing else read.

infeng needs each tensor's byte offset so that weights stay memory-mapped from the original file
(and later from ``weights.bin``) and bf16 stays bf16, which ``safetensors.numpy`` cannot load. The
format is an 8-byte little-endian header length, a JSON header, then the data; this module reads
the header only and validates it against the file size.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFormatError

#: safetensors dtype names -> IR element types.
SAFETENSORS_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: str
    dtype: str              # IR element type
    shape: tuple[int, ...]
    offset: int             # absolute byte offset in ``file``


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """The tensor table of one safetensors file, checked against the file's size."""
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(f"{path}: file not found")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFormatError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise ModelFormatError(f"{path}: truncated safetensors file (header says {header_len} bytes, "
                                   f"file has {size - 8} after the length)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{path}: bad safetensors header JSON: {e}") from None
    data_start = 8 + header_len
    table = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFormatError(f"{path}: tensor {name}: malformed header entry {spec!r}") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise ModelFormatError(f"{path}: tensor {name}: dtype {dtype} is not supported "
                                   f"(supported: {', '.join(SAFETENSORS_DTYPES)})")
        numel = 1
        for d in shape:
            numel *= d
        itemsize = 4 if dtype == "F32" else 2
        if end - begin != numel * itemsize:
            raise ModelFormatError(f"{path}: tensor {name}: {end - begin} bytes for shape {list(shape)} {dtype}")
        if data_start + end > size:
            raise ModelFormatError(f"{path}: truncated safetensors file: tensor {name} ends at byte "
                                   f"{data_start + end}, file has {size}")
        table[name] = TensorEntry(name, str(path.resolve()), SAFETENSORS_DTYPES[dtype], shape, data_start + begin)
    return table


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
