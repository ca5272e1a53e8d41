"""Search results cached by weight hash and options, so that compiling a model again (another
``-o``, another target, other KV options) does not search its scales again, nor run calibration.

An entry is ``<root>/<key>.npz`` holding one ``QuantizedTensor``'s arrays. The key is the sha256
of everything the result depends on: the float32 weight bytes and shape, the format, the search
method and its options (clipping on or off, GPTQ), the calibration Gram matrix when there is one,
and the source of the modules that compute the result (``SEARCH_MODULES``), so a changed search
never reads an old answer. A calibration (``calib-<key>.npz``: the statistics as the quantize pass
keeps them, Gram matrices reduced to their group blocks, and the AWQ scale choices made on the
full ones) is keyed by the graph's text, every weight's bytes, the calibration token ids
(``stats_key``), the weights' formats and whether AWQ ran and full Grams were kept
(``calibration_key``). Entries are written to a temporary name and renamed into place: two
compiles filling the same entry both succeed.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np

from .awq import AwqChoices
from .calibrate import ActStats
from .formats import QuantizedTensor, get_format

#: Modules whose code decides a search result or calibration statistics (paths relative to the
#: compiler package).
SEARCH_MODULES = ("quant/search.py", "quant/formats.py", "quant/gptq.py", "codegen/clip_search.py",
                  "quant/calibrate.py", "interp.py", "ir/ops.py", "quant/kv.py", "quant/act.py", "quant/awq.py")


@lru_cache(maxsize=1)
def _code_hash() -> bytes:
    package = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for module in SEARCH_MODULES:
        h.update(module.encode() + b"\0" + (package / module).read_bytes())
    return h.digest()


def search_key(w: np.ndarray, fmt: str, method: str, gram: np.ndarray | None) -> str:
    """The cache key of quantizing ``w`` to ``fmt`` by ``method`` (e.g. ``clip``, ``rtn``, ``gptq``)
    weighted by ``gram`` (None: weight error)."""
    h = hashlib.sha256(_code_hash())
    h.update(f"{fmt}\0{method}\0{w.shape}\0".encode())
    h.update(np.ascontiguousarray(w, dtype=np.float32).data)
    if gram is not None:
        g = np.ascontiguousarray(gram, dtype=np.float64)
        h.update(f"gram{g.shape}\0".encode())
        h.update(g.data)
    return h.hexdigest()


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """4-bit codes kept two to a byte (low nibble first) back to one per byte."""
    codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = packed & 0x0F, packed >> 4
    return codes


def stats_key(graph_text: str, weights: list[np.ndarray], chunks: np.ndarray) -> str:
    """The cache key of calibration statistics: the graph (its text), its weights' stored bytes in
    the text's order, the calibration token ids."""
    h = hashlib.sha256(_code_hash())
    h.update(graph_text.encode() + b"\0")
    for w in weights:
        h.update(f"{w.dtype}{w.shape}\0".encode())
        h.update(np.ascontiguousarray(w).data)
    h.update(np.ascontiguousarray(chunks, dtype=np.int64).data)
    return "stats-" + h.hexdigest()


def calibration_key(stats: str, formats: dict[str, str], awq: bool, full_grams: bool) -> str:
    """The cache key of a calibration on the statistics ``stats`` (a ``stats_key``) for weights
    quantized to ``formats`` (weight name -> format), with or without AWQ's choices and full Grams."""
    h = hashlib.sha256(stats.encode())
    h.update(f"awq={awq}\0full={full_grams}\0".encode())
    for name in sorted(formats):
        h.update(f"{name}\0{formats[name]}\0".encode())
    return "calib-" + h.hexdigest()


class SearchCache:
    """Quantized tensors by ``search_key``, under ``root`` (None: no cache, every search runs)."""

    def __init__(self, root: Path | None):
        self.root = root
        self.hits = 0

    def get_or_search(self, key: str, search: Callable[[], QuantizedTensor]) -> QuantizedTensor:
        if self.root is None:
            return search()
        path = self.root / f"{key}.npz"
        try:
            with np.load(path, allow_pickle=False) as entry:
                codes = _unpack_nibbles(entry["nibbles"]) if "nibbles" in entry else entry["codes"]
                found = QuantizedTensor(str(entry["format"]), tuple(int(n) for n in entry["shape"]), codes,
                                        entry["scales"], entry["zeros"] if "zeros" in entry else None,
                                        entry["mins"] if "mins" in entry else None)
            self.hits += 1
            return found
        except (OSError, KeyError, ValueError):            # absent or damaged: search again
            pass
        result = search()
        self._put(path, result)
        return result

    def get_or_calibrate(self, key: str, calibrate: Callable[[], tuple[dict[str, ActStats], AwqChoices]]
                         ) -> tuple[dict[str, ActStats], AwqChoices]:
        """A calibration's statistics and AWQ choices under ``key`` (``calibration_key``), else
        ``calibrate()``'s, kept."""
        if self.root is None:
            return calibrate()
        path = self.root / f"{key}.npz"
        try:
            with np.load(path, allow_pickle=False) as entry:
                stats = {}
                for i, name in enumerate(str(n) for n in entry["names"]):
                    blocks = {int(k[len(f"blocks{i}_"):]): entry[k] for k in entry.files if k.startswith(f"blocks{i}_")}
                    stats[name] = ActStats(int(entry["tokens"][i]), entry[f"abs_mean{i}"],
                                           entry[f"gram{i}"] if f"gram{i}" in entry.files else None,
                                           blocks if f"gram{i}" not in entry.files else None)
                chosen = {str(name): (float(a), float(b), float(c))
                          for name, (a, b, c) in zip(entry["awq_names"], entry["awq_choices"])}
            self.hits += 1
            return stats, chosen
        except (OSError, KeyError, ValueError):
            pass
        stats, chosen = calibrate()
        names, awq_names = sorted(stats), sorted(chosen)
        arrays: dict[str, np.ndarray] = {"names": np.array(names), "tokens": np.array([stats[n].tokens for n in names]),
                                         "awq_names": np.array(awq_names, dtype=str),
                                         "awq_choices": np.array([chosen[n] for n in awq_names], np.float64)
                                         .reshape(-1, 3)}
        for i, name in enumerate(names):
            st = stats[name]
            arrays[f"abs_mean{i}"] = st.abs_mean
            if st.gram is not None:
                arrays[f"gram{i}"] = st.gram
            for group, block in (st.blocks or {}).items():
                arrays[f"blocks{i}_{group}"] = block
        self._write(path, arrays)
        return stats, chosen

    def _put(self, path: Path, qt: QuantizedTensor) -> None:
        codes = np.asarray(qt.codes)
        four_bit = get_format(qt.format).bits == 4 and codes.shape[-1] % 2 == 0
        arrays = {"format": np.array(qt.format), "shape": np.array(qt.shape), "scales": qt.scales,
                  **({"nibbles": codes[..., 0::2] | (codes[..., 1::2] << 4)} if four_bit else {"codes": codes})}
        if qt.zeros is not None:
            arrays["zeros"] = qt.zeros
        if qt.mins is not None:
            arrays["mins"] = qt.mins
        self._write(path, arrays)

    @staticmethod
    def _write(path: Path, arrays: dict[str, np.ndarray]) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".", suffix=".npz", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        except OSError:                                     # a read-only or full cache only costs time
            pass
