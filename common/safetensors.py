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

from .errors import ModelFormatError, not_a_file

#: safetensors dtype names -> IR element types. U8 tensors are MXFP4 blocks and scales (GPT-OSS),
#: which the frontend reads as one packed weight (``frontends/mxfp4.py``), never as a u8 IR weight.
SAFETENSORS_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "U8": "u8"}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: str
    dtype: str              # IR element type
    shape: tuple[int, ...]
    offset: int             # absolute byte offset in ``file``


#: Bytes per element of every dtype the format defines (infeng reads the SAFETENSORS_DTYPES ones).
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
#: The largest header the safetensors library accepts.
MAX_HEADER_BYTES = 100_000_000


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """The tensor table of one safetensors file, checked as strictly as the ``safetensors`` library
    checks it: a JSON object header; per tensor a known dtype, a shape of non-negative integers and
    ``data_offsets`` of non-negative integers whose span is the shape's bytes; the spans sorted,
    contiguous, non-overlapping and covering exactly the data after the header."""
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(not_a_file(path))
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFormatError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise ModelFormatError(f"{path}: truncated safetensors file (header says {header_len} bytes, "
                                   f"file has {size - 8} after the length)")
        if header_len > MAX_HEADER_BYTES:
            raise ModelFormatError(f"{path}: safetensors header of {header_len} bytes (at most {MAX_HEADER_BYTES})")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ModelFormatError(f"{path}: bad safetensors header JSON: {str(e)[:200]}") from None
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ModelFormatError(f"{path}: __metadata__ must be an object of strings")
    data_start, data_bytes = 8 + header_len, size - 8 - header_len
    table, spans = {}, []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        name_shown = name if name.isprintable() and len(name) <= 200 else repr(name[:200])
        dtype, shape, begin, end = _entry(path, name_shown, spec)
        if dtype not in SAFETENSORS_DTYPES:
            raise ModelFormatError(f"{path}: tensor {name_shown}: dtype {dtype} is not supported "
                                   f"(supported: {', '.join(SAFETENSORS_DTYPES)})")
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * _ITEMSIZE[dtype]:
            raise ModelFormatError(f"{path}: tensor {name_shown}: {end - begin} bytes for shape {list(shape)} {dtype}")
        if data_start + end > size:
            raise ModelFormatError(f"{path}: truncated safetensors file: tensor {name_shown} ends at byte "
                                   f"{data_start + end}, file has {size}")
        spans.append((begin, end, name_shown))
        table[name] = TensorEntry(name, str(path.resolve()), SAFETENSORS_DTYPES[dtype], shape, data_start + begin)
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ModelFormatError(f"{path}: tensor {name}: data_offsets start at {begin}, expected {at} "
                                   f"({'overlaps the previous tensor' if begin < at else 'a gap before it'})")
        at = end
    if at != data_bytes:
        raise ModelFormatError(f"{path}: the tensors cover {at} bytes of the {data_bytes}-byte data section "
                               f"(the header length or the offsets are wrong)")
    return table


def _entry(path: Path, name: str, spec: object) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, each of the type the format defines."""
    def bad(what: str) -> ModelFormatError:
        return ModelFormatError(f"{path}: tensor {name}: {what}")

    def index(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise bad("a header entry needs exactly dtype, shape and data_offsets")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
        raise bad(f"unknown dtype {str(dtype)[:40]!r}")
    if not isinstance(shape, list) or not all(index(d) for d in shape):
        raise bad("shape must be a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(index(o) for o in offsets) \
            or offsets[0] > offsets[1]:
        raise bad("data_offsets must be [begin, end], non-negative integers with begin <= end")
    return dtype, tuple(shape), offsets[0], offsets[1]


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """Widen raw bf16 bits (uint16) to float32 exactly."""
    return (raw.astype(np.uint32) << 16).view(np.float32)
