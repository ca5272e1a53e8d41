"""Element types and tensor types with symbolic dimensions.

A dimension is an int or one of the symbols below. Model dimensions are constants, so codegen
specialises on them; only the per-step sizes are symbolic.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from infeng_common.errors import IRError
from infeng_common.safetensors import bf16_to_f32  # noqa: F401  (the IR's bf16 widening)

#: Symbolic dimensions: tokens in the step, context length, rows that want logits.
SYMBOLS = {"T": "tokens in the step", "S": "context length", "R": "rows that want logits"}

#: Element types: name -> (numpy storage dtype, bytes per element).
DTYPES: dict[str, tuple[np.dtype, int]] = {
    "f32": (np.dtype(np.float32), 4),
    "f16": (np.dtype(np.float16), 2),
    "bf16": (np.dtype(np.uint16), 2),  # stored as raw uint16, widened on load
    "i32": (np.dtype(np.int32), 4),
    "i64": (np.dtype(np.int64), 8),
    # ONNX import only (primitive ops before raising): masks, double-precision constants
    "bool": (np.dtype(np.bool_), 1),
    "f64": (np.dtype(np.float64), 8),
}

#: A symbolic dimension: a symbol, optionally offset by a constant (``T+1`` appears in ONNX shape
#: arithmetic before it is folded).
_SYM_DIM = re.compile(r"^([TSR])([+-][0-9]+)?$")

Dim = int | str


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[Dim, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise IRError(f"unknown element type {self.dtype!r} (known: {', '.join(DTYPES)})")
        for d in self.shape:
            if isinstance(d, str) and not _SYM_DIM.match(d):
                raise IRError(f"unknown symbolic dimension {d!r} (known: {', '.join(SYMBOLS)}, "
                              "optionally offset, e.g. T+1)")

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"

    @property
    def rank(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        """Element count; only for fully static shapes."""
        n = 1
        for d in self.shape:
            if not isinstance(d, int):
                raise IRError(f"numel of symbolic type {self}")
            n *= d
        return n

    def nbytes(self) -> int:
        return self.numel() * DTYPES[self.dtype][1]


_TYPE_RE = re.compile(r"^\s*([a-z0-9]+)\[([^\]]*)\]\s*$")


def parse_type(text: str) -> TensorType:
    """Parse ``f32[T,576]``."""
    m = _TYPE_RE.match(text)
    if not m:
        raise IRError(f"bad tensor type {text!r}; expected e.g. f32[T,576]")
    dims: list[Dim] = []
    body = m.group(2).strip()
    if body:
        for part in body.split(","):
            part = part.strip()
            dims.append(int(part) if part.lstrip("-").isdigit() else part)
    return TensorType(m.group(1), tuple(dims))


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 bits (round to nearest even), as torch does."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    return ((bits + rounding) >> 16).astype(np.uint16)
