"""The artifact directory ``model.infeng/``: manifest.json, weights.bin, libmodel.so, src/, ir.txt,
tokenizer files. This module writes and reads it; the manifest schema is versioned."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .errors import InfengError

MANIFEST_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.bin"
LIBRARY = "libmodel.so"


class ArtifactError(InfengError):
    """An artifact directory that is missing, incomplete or from another version."""


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_artifact(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of an artifact, checked for version and for the files it lists."""
    root = Path(path)
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{root}: not an infeng artifact (no {MANIFEST})")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError as e:
        raise ArtifactError(f"{mpath}: malformed JSON: {e}") from None
    version = manifest.get("format_version")
    if version != MANIFEST_VERSION:
        raise ArtifactError(f"{mpath}: artifact format version {version}, this infeng reads {MANIFEST_VERSION}; "
                            "recompile the model")
    weights = root / WEIGHTS
    if not weights.is_file():
        raise ArtifactError(f"{weights}: file not found")
    if weights.stat().st_size != manifest["weights_bytes"]:
        raise ArtifactError(f"{weights}: {weights.stat().st_size} bytes, the manifest says {manifest['weights_bytes']}")
    if not (root / LIBRARY).is_file():
        raise ArtifactError(f"{root / LIBRARY}: file not found")
    return manifest


def write_weights(path: Path, graph, slots, total_bytes: int, progress=None) -> None:
    """Write every weight slot at its offset in its storage format; zero padding in between."""
    with open(path, "wb") as f:
        for i, slot in enumerate(slots):
            data = graph.weights[slot.name].stored()
            if data.nbytes != slot.nbytes:
                raise InfengError(f"weight {slot.name}: {data.nbytes} bytes, lowering planned {slot.nbytes}")
            f.seek(slot.offset)
            f.write(data.tobytes(order="C"))
            if progress:
                progress(i + 1, len(slots))
        f.truncate(total_bytes)


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    (root / MANIFEST).write_text(json.dumps({"format_version": MANIFEST_VERSION, **manifest}, indent=1))
