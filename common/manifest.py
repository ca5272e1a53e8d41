"""Reading an artifact directory ``model.infeng/``: the manifest (versioned), and where the files
it names live. The compiler writes artifacts (``infeng_compiler/artifact.py``); the runtime and
the compiler read them through this module."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from .errors import InfengError
from .jsonfile import read_json_object

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
    if not root.exists():
        raise ArtifactError(f"{root}: no such file or directory")
    if not mpath.is_file():
        raise ArtifactError(f"{root}: not an infeng artifact (no {MANIFEST})")
    manifest = read_json_object(mpath, ArtifactError)
    version = manifest.get("format_version")
    if version != MANIFEST_VERSION:
        raise ArtifactError(f"{mpath}: artifact format version {version}, this infeng reads {MANIFEST_VERSION}; "
                            "recompile the model")
    for key, kind in _REQUIRED.items():
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise ArtifactError(f"{mpath}: {key!r} is missing or not a {kind.__name__}; recompile the model")
    for name in (WEIGHTS, LIBRARY, ABI_HEADER):
        if not (root / name).is_file():
            raise ArtifactError(f"{root / name}: file not found")
    weights = root / WEIGHTS
    if weights.stat().st_size != manifest["weights_bytes"]:
        raise ArtifactError(f"{weights}: {weights.stat().st_size} bytes, the manifest says {manifest['weights_bytes']}")
    for name, recorded in _recorded_files(mpath, manifest).items():     # before anything maps them
        size = (root / name).stat().st_size
        if size != recorded["bytes"]:
            raise ArtifactError(f"{root / name}: {size} bytes, the manifest says {recorded['bytes']} "
                                f"(truncated or replaced); recompile the model")
    return manifest


def verify_artifact(path: str | Path) -> dict[str, str]:
    """Check the sha256 of every file the manifest records; returns name -> sha256."""
    root = Path(path)
    manifest = read_manifest(root)
    files = _recorded_files(root / MANIFEST, manifest)
    if not files:
        raise ArtifactError(f"{root / MANIFEST}: records no file hashes (built by an older infeng); recompile")
    digests = {}
    for name, recorded in files.items():
        digest = file_sha256(root / name)
        if digest != recorded["sha256"]:
            raise ArtifactError(f"{root / name}: sha256 {digest[:16]}..., the manifest says "
                                f"{recorded['sha256'][:16]}...: the file was modified; recompile the model")
        digests[name] = digest
    return digests


def _recorded_files(mpath: Path, manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The manifest's ``files`` table (name -> bytes, sha256), checked for shape."""
    files = manifest.get("files", {})
    ok = isinstance(files, dict) and all(
        name in (LIBRARY, WEIGHTS) and isinstance(v, dict) and isinstance(v.get("bytes"), int)
        and isinstance(v.get("sha256"), str) for name, v in files.items())
    if not ok:
        raise ArtifactError(f"{mpath}: 'files' must map {LIBRARY}/{WEIGHTS} to their bytes and sha256")
    return files


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def weight_storage(manifest: dict) -> str:
    """The storage formats of the artifact's matrices, most bytes first (``q4g32m+q8g32`` for a GGUF
    Q4_1 file's: what decode reads; the manifest's ``dtype`` is only the cast of float matrices)."""
    nbytes: dict[str, int] = {}
    for t in manifest["tensors"]:
        if len(t["shape"]) >= 2:
            nbytes[t["format"]] = nbytes.get(t["format"], 0) + t["nbytes"]
    return "+".join(sorted(nbytes, key=lambda f: -nbytes[f])) or manifest["dtype"]
