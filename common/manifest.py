"""Reading an artifact directory ``model.infeng/``: the manifest (versioned), and where the files
it names live. The compiler writes artifacts (``infeng_compiler/artifact.py``); the runtime and
the compiler read them through this module."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import InfengError

MANIFEST_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.bin"
LIBRARY = "libmodel.so"
ABI_HEADER = "src/infeng.h"            # the C ABI the library was built against, shipped with it

#: Keys every manifest has, with the JSON type each must be.
_REQUIRED = {"name": str, "target": str, "meta": dict, "constants": dict, "weights_bytes": int}


class ArtifactError(InfengError):
    """An artifact directory that is missing, incomplete or from another version."""


def is_artifact(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of an artifact, checked for version, shape and the files it lists."""
    root = Path(path)
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{root}: not an infeng artifact (no {MANIFEST})")
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mpath}: malformed JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{mpath}: not a JSON object")
    version = manifest.get("format_version")
    if version != MANIFEST_VERSION:
        raise ArtifactError(f"{mpath}: artifact format version {version}, this infeng reads {MANIFEST_VERSION}; "
                            "recompile the model")
    for key, kind in _REQUIRED.items():
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise ArtifactError(f"{mpath}: {key!r} is missing or not a {kind.__name__}; recompile the model")
    weights = root / WEIGHTS
    if not weights.is_file():
        raise ArtifactError(f"{weights}: file not found")
    if weights.stat().st_size != manifest["weights_bytes"]:
        raise ArtifactError(f"{weights}: {weights.stat().st_size} bytes, the manifest says {manifest['weights_bytes']}")
    for name in (LIBRARY, ABI_HEADER):
        if not (root / name).is_file():
            raise ArtifactError(f"{root / name}: file not found")
    return manifest
