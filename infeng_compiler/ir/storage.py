"""The storage formats the IR refers to but does not define: quantized weight formats (``q4g32``,
``q8r``, ``f8e4m3``, ...), KV cache formats (int8/int4 rows, the Hadamard rotation) and the
rounding of activations to integer codes. ``quant/`` owns them and registers them here when it
is imported (``infeng_compiler/__init__.py`` imports it, so they are always there); the IR only
asks, and imports nothing from ``quant/`` (DESIGN §2).

    storage.weights().is_quantized("q4g32")       -> True
    storage.weights().quantize(f32, "q4g32")      -> QuantizedTensor (codes chosen by the search)
    storage.kv()                                   -> the KV cache formats' numerics (quant/kv.py)
    storage.round_activations(x, block, bits)     -> x through integer codes (quant/act.py)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from infeng_common.errors import IRError


@dataclass(frozen=True)
class WeightFormats:
    is_quantized: Callable[[str], bool]                    # format name -> quantized (codes + scales)?
    quantize: Callable[[np.ndarray, str], Any]             # (float32 [N, K], format) -> QuantizedTensor


@dataclass
class _Registered:
    weights: WeightFormats | None = None
    kv: ModuleType | None = None
    round_activations: Callable[[np.ndarray, int, int], np.ndarray] | None = None


_registered = _Registered()


def register(weights: WeightFormats, kv: ModuleType,
             round_activations: Callable[[np.ndarray, int, int], np.ndarray]) -> None:
    """Called once by ``quant/__init__.py``."""
    _registered.weights, _registered.kv, _registered.round_activations = weights, kv, round_activations


def _need(what: Any, name: str) -> Any:
    if what is None:
        raise IRError(f"{name} are not registered: import infeng_compiler.quant (infeng_compiler does)")
    return what


def weights() -> WeightFormats:
    return _need(_registered.weights, "quantized weight formats")


def kv() -> ModuleType:
    return _need(_registered.kv, "KV cache formats")


def round_activations(x: np.ndarray, block: int, bits: int) -> np.ndarray:
    return _need(_registered.round_activations, "activation formats")(x, block, bits)
