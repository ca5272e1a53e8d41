"""Numeric formats: int8/int4/fp8 weight formats and their search, activation and KV cache formats,
calibration. Importing the package registers what it adds to the IR (``ir/storage.py``: the
weight, KV and activation formats; the ``quantize_act`` op); the IR imports nothing from here."""
from ..ir import storage as _storage
from . import act, formats, kv, ops, search  # noqa: F401  (ops: registers quantize_act with the op registry)


def _quantize(f32, format_name: str):
    return search.quantize(f32, formats.get_format(format_name))


_storage.register(_storage.WeightFormats(formats.is_quantized, _quantize), kv, act.fake_quant)
