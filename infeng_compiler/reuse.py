"""Recompiles that reuse an artifact already built from the same inputs, the way build systems do.

The key of a compile (``inputs_key``) names every file it reads by path, size, modification time and
a cheap content check (sha256 of the file's first and last 64 KiB), the options, the resolved target
and this compiler's code. After a compile, ``record_built`` notes which artifact the key produced and
the size and modification time of every file in it; ``find_built`` returns that artifact only while
all of them are unchanged, so an artifact edited, truncated or replaced since is never copied. A
recompile with the same key copies the recorded artifact (same bytes: it is that compile's output)
instead of importing, quantizing, building and writing the weights again.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from . import __version__
from .codegen.build import cache_root

_SAMPLE_BYTES = 1 << 16                 # read at each end of every input file for the content check
_MODEL_DIR_SUFFIXES = (".json", ".safetensors", ".gguf", ".jinja")


@functools.lru_cache(maxsize=1)
def compiler_fingerprint() -> str:
    """A hash of the compiler's code (its Python modules, the templates, the shared package): an
    artifact from another version of any of them is never reused."""
    import infeng_common
    import infeng_templates

    h = hashlib.sha256(__version__.encode())
    for package in (Path(__file__).parent, Path(infeng_templates.__file__).parent,
                    Path(infeng_common.__file__).parent):
        for path in sorted(package.rglob("*")):
            if path.suffix in (".py", ".j2", ".h", ".c") and path.is_file():
                h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def artifact_cache_root() -> Path:
    """Where ``cached_artifact`` keeps compiled models and this module its records: beside the build
    cache."""
    return cache_root().parent / "artifacts"


def _file_stamp(path: Path) -> list[Any]:
    """(path, size, modification time, sha256 of the first and last 64 KiB) of an input file."""
    info = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_SAMPLE_BYTES))
        if info.st_size > _SAMPLE_BYTES:
            f.seek(max(_SAMPLE_BYTES, info.st_size - _SAMPLE_BYTES))
            h.update(f.read(_SAMPLE_BYTES))
    return [str(path.resolve()), info.st_size, info.st_mtime_ns, h.hexdigest()]


def inputs_key(model_files: list[Path], options: Any, target: str) -> str:
    """The key of a compile of ``model_files`` with ``options`` (a ``CompileOptions``) for ``target``:
    every file it reads (the model's, the adapters', the calibration text, the policy, the
    tokenizer's), the options, the compiler's code and ``$CC``."""
    inputs = list(model_files) + [p for d in options.lora.values() for p in sorted(Path(d).glob("adapter_*"))]
    for folder in (options.tokenizer,):
        if folder is not None and Path(folder).is_dir():
            inputs += sorted(f for f in Path(folder).iterdir() if f.suffix in _MODEL_DIR_SUFFIXES and f.is_file())
    inputs += [p for p in (options.calib, options.quant_policy) if p is not None and Path(p).is_file()]
    described = {"infeng": compiler_fingerprint(), "target": target, "cc": os.environ.get("CC", ""),
                 "files": [_file_stamp(Path(p)) for p in inputs],
                 "options": {k: str(v) for k, v in sorted(vars(options).items()) if k not in ("dump_ir", "target")}}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


def model_dir_files(path: Path) -> list[Path]:
    """The files of a model directory a compile may read (weights, config, tokenizer, template)."""
    return sorted(f for f in path.iterdir() if f.suffix in _MODEL_DIR_SUFFIXES and f.is_file())


def _record_path(key: str) -> Path:
    return artifact_cache_root() / "built" / f"{key}.json"


def _artifact_files(artifact: Path) -> dict[str, list[int]]:
    """{relative path: [size, modification time]} of every file in ``artifact``."""
    files = {}
    for path in sorted(artifact.rglob("*")):
        if path.is_file():
            info = path.stat()
            files[str(path.relative_to(artifact))] = [info.st_size, info.st_mtime_ns]
    return files


def written_files(staging: Path) -> dict[str, list[int]]:
    """What ``record_built`` records of an artifact, read in its staging directory before it moves
    into place (a rename keeps every file's size and time; another compile may replace it after)."""
    return _artifact_files(staging)


def record_built(key: str, artifact: Path, files: dict[str, list[int]]) -> None:
    """Note that ``artifact``, whose files were ``files`` (``written_files``), is what ``key`` builds;
    a record that cannot be written only costs the next recompile its reuse."""
    record = {"artifact": str(artifact.resolve()), "files": files}
    target = _record_path(key)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", dir=target.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, target)
    except OSError:
        pass


def find_built(key: str) -> Path | None:
    """The artifact ``key`` built, if it is still there with every file as it was written."""
    try:
        record = json.loads(_record_path(key).read_text())
        artifact = Path(record["artifact"])
        if _artifact_files(artifact) == record["files"]:
            return artifact
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def copy_built(source: Path, staging: Path) -> bool:
    """Copy the artifact ``source`` into the empty directory ``staging`` (the kernel copies the
    bytes); False when ``source`` changed or went away meanwhile (then compile it afresh)."""
    before = _artifact_files(source)
    try:
        shutil.copytree(source, staging, dirs_exist_ok=True)
    except (OSError, shutil.Error):
        return False
    return _artifact_files(source) == before and _artifact_files(staging).keys() == before.keys()
