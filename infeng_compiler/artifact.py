"""The artifact directory ``model.infeng/``: manifest.json, weights.bin, libmodel.so, src/, ir.txt,
tokenizer files. This module writes it; ``infeng_common.manifest`` reads it (the runtime does too)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from infeng_common.errors import InfengError
from infeng_common.manifest import MANIFEST, MANIFEST_VERSION


def write_weights(path: Path, graph, slots, total_bytes: int, progress=None) -> None:
    """Write every weight slot at its offset in its storage format; zero padding in between."""
    with open(path, "wb") as f:
        for i, slot in enumerate(slots):
            data = graph.weights[slot.name].stored()
            if data.nbytes != slot.nbytes:
                raise InfengError(f"weight {slot.name}: {data.nbytes} bytes, lowering planned {slot.nbytes}")
            f.seek(slot.offset)
            f.write(memoryview(np.ascontiguousarray(data)).cast("B"))     # no copy of the bytes
            if progress:
                progress(i + 1, len(slots))
        f.truncate(total_bytes)


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    (root / MANIFEST).write_text(json.dumps({"format_version": MANIFEST_VERSION, **manifest}, indent=1))
