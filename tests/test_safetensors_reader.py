"""The safetensors header reader (``infeng_common.safetensors``) is as strict as the format: every
malformed file is one ``ModelFormatError`` naming the file (and tensor), never a traceback of
another kind and never a table that reads the wrong bytes. A fuzz test throws generated headers
at it."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from infeng_common.errors import ModelFormatError
from infeng_common.safetensors import read_safetensors_header


def write_raw(path: Path, header: bytes, data: bytes) -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def good_file(tmp_path: Path) -> Path:
    path = tmp_path / "good.safetensors"
    save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, dtype=np.float16)}, str(path))
    return path


def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def test_a_good_file_reads(tmp_path):
    table = read_safetensors_header(good_file(tmp_path))
    assert table["a"].shape == (2, 3) and table["b"].dtype == "f16"


def test_header_length_one_byte_short(tmp_path):
    """Writers pad the header with spaces to 8-byte alignment: one byte less still parses, and
    would shift every tensor by a byte."""
    header, data = split(good_file(tmp_path))
    path = write_raw(tmp_path / "good.safetensors", json.dumps(header).encode() + b"    ", data)
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[:8] = struct.pack("<Q", n - 1)
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelFormatError, match=r"good.safetensors: the tensors cover \d+ bytes of the \d+-byte"):
        read_safetensors_header(path)


@pytest.mark.parametrize("edit, message", [
    (lambda h: h["a"].update(data_offsets=[-8, 16]), "tensor a: data_offsets must be"),
    (lambda h: h["b"].update(data_offsets=[16, 24]), "tensor b: data_offsets start at 16, expected 24 "
                                                      r"\(overlaps the previous tensor\)"),
    (lambda h: h["a"].update(dtype=5), "tensor a: unknown dtype"),
    (lambda h: h["a"].update(shape="2x3"), "tensor a: shape must be a list"),
    (lambda h: h["a"].update(shape=[2, -3]), "tensor a: shape must be a list"),
    (lambda h: h["a"].update(data_offsets={"begin": 0}), "tensor a: data_offsets must be"),
    (lambda h: h["a"].update(data_offsets=[0.0, 24.0]), "tensor a: data_offsets must be"),
    (lambda h: h["a"].pop("dtype"), "tensor a: a header entry needs exactly"),
    (lambda h: h.update(c="not an object"), "tensor c: a header entry needs exactly"),
    (lambda h: h.update(__metadata__={"format": 1}), "__metadata__ must be an object of strings"),
    (lambda h: h["a"].update(dtype="F64"), "tensor a: dtype F64 is not supported"),
])
def test_malformed_entries(tmp_path, edit, message):
    header, data = split(good_file(tmp_path))
    edit(header)
    path = write_raw(tmp_path / "bad.safetensors", json.dumps(header).encode(), data)
    with pytest.raises(ModelFormatError, match="bad.safetensors: " + message):
        read_safetensors_header(path)


def test_gap_and_trailing_bytes(tmp_path):
    header, data = split(good_file(tmp_path))
    path = write_raw(tmp_path / "trailing.safetensors", json.dumps(header).encode(), data + b"\0" * 8)
    with pytest.raises(ModelFormatError, match="cover 32 bytes of the 40-byte data section"):
        read_safetensors_header(path)


def test_deeply_nested_header(tmp_path):
    path = write_raw(tmp_path / "nested.safetensors", b"[" * 100_000 + b"]" * 100_000, b"")
    with pytest.raises(ModelFormatError, match="nested.safetensors: bad safetensors header JSON"):
        read_safetensors_header(path)


# -- fuzzing -------------------------------------------------------------------------------------
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                         st.text(max_size=6))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=4), inner,
                                                                                 max_size=4)), max_leaves=12)
entries = st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from(["F32", "F16", "BF16", "F64", "I8", "X"]), json_values),
    "shape": st.one_of(st.lists(st.integers(-2, 4), max_size=3), json_values),
    "data_offsets": st.one_of(st.lists(st.integers(-4, 64), min_size=2, max_size=2), json_values),
}) | json_values
headers = st.dictionaries(st.text(min_size=1, max_size=5), entries, max_size=4)


#: 2,000 headers in the suite, the same every run; INFENG_FUZZ_EXAMPLES=N runs N random ones (the
#: longer run docs/architecture.md reports).
@settings(max_examples=int(os.environ.get("INFENG_FUZZ_EXAMPLES", 2000)), deadline=None,
          derandomize="INFENG_FUZZ_EXAMPLES" not in os.environ,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=headers, data_len=st.integers(0, 80), length_delta=st.integers(-3, 3))
def test_fuzzed_headers_load_or_fail_cleanly(tmp_path, header, data_len, length_delta):
    body = json.dumps(header).encode()
    raw = struct.pack("<Q", max(0, len(body) + length_delta)) + body + bytes(data_len)
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(raw)
    try:
        table = read_safetensors_header(path)
    except ModelFormatError as e:
        assert str(e).startswith(str(path)) and "\n" not in str(e)
        return
    n = len(raw) - 8 - max(0, len(body) + length_delta)
    assert sum(int(np.prod(t.shape)) * {"f32": 4, "f16": 2, "bf16": 2}[t.dtype] for t in table.values()) == n
