"""Safetensors files: the tensor table read from the header, checked against the format and the
file, nothing else read (tensors stay memory-mapped; bf16 stays bf16, which ``safetensors.numpy``
cannot load). The format is an 8-byte little-endian header length, a JSON header, then the data."""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ModelFormatError

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


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """Widen raw bf16 bits (uint16) to float32 exactly."""
    return (raw.astype(np.uint32) << 16).view(np.float32)
