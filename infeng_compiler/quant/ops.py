"""IR ops of the quantized path, registered with the op registry (``ir/ops.py``) on import.

``quantize_act(x) {bits=8, block=32}``: x rounded to int8 per token in blocks of 32, or with
``{bits=16, block=0}`` to int16 with one scale per token (``quant/act.py``). Its value in the IR is
the float32 it represents; codegen keeps it as integer codes, scales and block sums, which the
integer ``linear`` kernels read. With ``f32_below=N`` (``act-precision(auto)``, docs/quantization.md)
a step of fewer than N token rows leaves x as it is: its matmuls read the f32 rows (codegen's
``linear_qf32`` kernels), and only steps of N rows or more are quantized.
"""
from __future__ import annotations

from ..ir.ops import _expect, op, reference
from .act import fake_quant


@op("quantize_act", inputs=("x",), attrs=("bits", "block"))
def _quantize_act_shape(ins, ws, attrs):
    """x [T,K] rounded to ``bits``-bit integers per token in blocks of ``block`` (0: the whole
    row), symmetric, a float32 scale per block."""
    _expect(ins[0].dtype == "f32" and ins[0].rank == 2, f"quantize_act takes f32[T,K], got {ins[0]}")
    _expect(attrs["bits"] in (8, 16), f"quantize_act bits must be 8 or 16, got {attrs['bits']!r}")
    _expect(isinstance(attrs["block"], int) and attrs["block"] >= 0 and attrs["block"] % 4 == 0,
            f"quantize_act block must be 0 or a positive multiple of 4, got {attrs['block']!r}")
    _expect(isinstance(attrs.get("f32_below", 0), int) and attrs.get("f32_below", 0) >= 0,
            f"quantize_act f32_below must be a token row count >= 0, got {attrs.get('f32_below')!r}")
    return [ins[0]]


@reference("quantize_act")
def _quantize_act_ref(ins, ws, attrs, step):
    if ins[0].shape[0] < attrs.get("f32_below", 0):
        return [ins[0]]
    return [fake_quant(ins[0], attrs["block"], attrs["bits"])]
