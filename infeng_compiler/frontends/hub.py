"""Hugging Face Hub ids as model arguments.

A model argument that is not an existing path and reads ``org/name``, ``org/name@revision`` or
``org/name/FILE.gguf[@revision]`` names a Hub repository; one that starts with ``./``, ``../``, ``/``
or ``~``, or names a model file (``.gguf``, ``.safetensors``, ``.onnx``) other than in the
``org/name/FILE.gguf`` form, is a local path (missing: "PATH: no such file or directory"). It resolves to a snapshot directory of the
local Hub cache (``HF_HUB_CACHE``, as transformers and vLLM share it): the cache first, so that
``HF_HUB_OFFLINE=1`` works, then a download of the files infeng reads (``HUB_PATTERNS``; for a
GGUF file, that file and the tokenizer files) through ``huggingface_hub.snapshot_download``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from infeng_common.errors import InfengError, ModelFormatError

#: The files of a checkpoint snapshot infeng reads (weights, configs, tokenizer, chat template).
HUB_PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
#: With a named GGUF file: the file itself plus these (the GGUF carries weights and config).
GGUF_COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")

# Hub repository names: letters, digits, '-', '_', '.'; not starting with '-' or '.'.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./-]*")
_TRUE = ("1", "on", "yes", "true")
_LOCAL_PREFIXES = ("./", "../", "/", "~")
_MODEL_FILES = (".gguf", ".safetensors", ".onnx")


class HubModelError(InfengError):
    """A Hub id that is neither in the local cache nor downloadable."""


@dataclass(frozen=True)
class HubId:
    repo_id: str                    # "org/name"
    revision: str | None = None     # branch, tag or commit hash; None: the default branch
    filename: str | None = None     # a .gguf file in the repository

    def __str__(self) -> str:
        text = self.repo_id + (f"/{self.filename}" if self.filename else "")
        return text + (f"@{self.revision}" if self.revision else "")

    @property
    def name(self) -> str:
        """The model's name (``name`` of ``org/name``, or the GGUF file's stem)."""
        return Path(self.filename).stem if self.filename else self.repo_id.split("/")[1]


def is_local_path(text: str) -> bool:
    """Whether the model argument ``text`` (as typed) can only be a local path: it starts with
    ``./``, ``../``, ``/`` or ``~`` (or is ``.``/``..``), or names a model file that is not a Hub
    repository's GGUF file (``org/name/FILE.gguf``)."""
    text = str(text)
    if text in (".", "..") or text.startswith(_LOCAL_PREFIXES):
        return True
    spec = text.partition("@")[0]
    return spec.lower().endswith(_MODEL_FILES) and not (spec.lower().endswith(".gguf") and spec.count("/") >= 2)


def parse_hub_id(text: str) -> HubId | None:
    """``text`` as a Hub id, or None when it does not read as one (``is_local_path``)."""
    if is_local_path(text):
        return None
    spec, at, revision = str(text).partition("@")
    if at and not _REVISION.fullmatch(revision):
        return None
    parts = spec.split("/")
    if len(parts) < 2 or not all(_NAME.fullmatch(p) and ".." not in p for p in parts):
        return None
    filename = "/".join(parts[2:]) or None
    if filename is not None and not filename.endswith(".gguf"):
        return None
    return HubId("/".join(parts[:2]), revision or None, filename)


def hub_cache_dir() -> Path:
    """The Hub cache, from the environment as it is now (huggingface_hub reads it once, at import)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    return value.strip().lower() in _TRUE if value is not None else bool(constants.HF_HUB_OFFLINE)


def resolve_model_path(path: str | Path) -> Path:
    """``path`` when it exists; else the local file or directory of the Hub id it reads as. Give
    the argument as typed (a ``str``: ``Path`` drops a leading ``./``). Raises ModelFormatError
    ("PATH: no such file or directory") for a missing path that is not a Hub id."""
    p = Path(path).expanduser()
    if p.exists():
        return p
    hub_id = parse_hub_id(str(path))
    if hub_id is None:
        raise ModelFormatError(f"{path}: no such file or directory")
    return fetch(hub_id)


def hub_model_name(path: str | Path) -> str | None:
    """The model's name when ``path`` is a Hub id (not an existing path), else None."""
    if Path(path).exists():
        return None
    hub_id = parse_hub_id(str(path))
    return hub_id.name if hub_id is not None else None


def fetch(hub_id: HubId) -> Path:
    """The snapshot directory (or GGUF file) of ``hub_id``: from the cache, else downloaded."""
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    patterns = [hub_id.filename, *GGUF_COMPANIONS] if hub_id.filename else list(HUB_PATTERNS)
    kwargs = {"repo_id": hub_id.repo_id, "revision": hub_id.revision, "cache_dir": str(cache),
              "allow_patterns": patterns}
    try:
        folder = Path(snapshot_download(**kwargs, local_files_only=True))
        if _complete(folder, hub_id):
            return _target(folder, hub_id)
    except Exception:  # not cached (or cached in part): download below
        pass
    where = f"{hub_id}: not a local path, not in the local cache (HF_HUB_CACHE={cache})"
    if hub_offline():
        raise HubModelError(f"{where} and the hub cannot be reached: HF_HUB_OFFLINE is set") from None
    try:
        folder = Path(snapshot_download(**kwargs))
    except Exception as e:  # huggingface_hub's errors: connection, not found, gated, bad revision
        kind = type(e).__name__
        if kind in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"):
            raise HubModelError(f"{where} and the hub refuses it ({kind}; a private or gated model needs "
                                f"HF_TOKEN): {_one_line(e)}") from None
        raise HubModelError(f"{where} and the hub cannot be reached: {kind}: {_one_line(e)}") from None
    if not _complete(folder, hub_id):
        what = f"no {hub_id.filename}" if hub_id.filename else \
            "no config.json and .safetensors files (for a GGUF repository, name the file: org/name/FILE.gguf)"
        raise HubModelError(f"{hub_id}: the hub snapshot {folder} has {what}")
    return _target(folder, hub_id)


def _complete(folder: Path, hub_id: HubId) -> bool:
    if hub_id.filename:
        return (folder / hub_id.filename).is_file()
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _target(folder: Path, hub_id: HubId) -> Path:
    return folder / hub_id.filename if hub_id.filename else folder


def _one_line(error: Exception) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())[:500]


__all__ = ["HUB_PATTERNS", "HubId", "HubModelError", "fetch", "hub_cache_dir", "hub_model_name", "hub_offline",
           "is_local_path", "parse_hub_id", "resolve_model_path"]
