"""Warm restarts: the prefix cache's KV blocks saved at shutdown and loaded at start
(``infeng serve --prefix-cache-dir DIR``).

One file, ``DIR/prefix-cache.bin``:

    MAGIC  (16 bytes)
    header length (8 bytes, little-endian) + header (JSON):
        {"format": 1, "artifact_sha256", "kv_format": {...}, "block_bytes", "hashes": [hex, ...],
         "payload_sha256"}
    payload: the blocks' bytes in the order of "hashes" (least recently used first), each
             ``block_bytes`` long, in the library's own KV layout (``ife_kv_block_read``)

Blocks are only meaningful to the library that wrote them, so the file is keyed by the artifact's
sha256 (over the sha256 of its weights and library, as its manifest records them) and by its KV
format (scheme, block size, bytes per block). A file of another artifact or KV format is ignored
with a line saying so; a file that does not parse or whose payload does not match its sha256 is
refused with a line saying why and never loaded. Either way the server starts cold, and its own
cache replaces the file at shutdown. The file is written to a temporary name and renamed, so a
crash mid-save leaves the previous file whole.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

from infeng_common.errors import InfengError

MAGIC = b"INFENG-KV-PREFIX"
FORMAT = 1
FILENAME = "prefix-cache.bin"

_log = logging.getLogger("infeng.prefix_store")


class PrefixCacheCorrupt(InfengError):
    """A saved prefix cache that cannot be trusted."""


def artifact_sha256(manifest: dict[str, Any]) -> str:
    """The artifact's identity: sha256 over the sha256 its manifest records for each file."""
    files = {name: entry.get("sha256") for name, entry in sorted((manifest.get("files") or {}).items())}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def kv_format(engine) -> dict[str, Any]:
    """What a KV block's bytes mean: the manifest's KV scheme, the block size, bytes per block."""
    return {**(engine.manifest.get("kv") or {}), "block_size": engine.block_size, "block_bytes": engine.kv_block_bytes}


def save_prefix_cache(engine, directory: str | Path) -> int:
    """Write every cached block of ``engine`` (its loop stopped) to ``directory``; returns the count."""
    if not engine.kv_blocks_portable:
        raise InfengError(f"{engine.path}: its library cannot copy KV blocks (compiled before "
                          f"ife_kv_block_read); recompile it to persist the prefix cache")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    published = engine.kv.published()
    payload = hashlib.sha256()
    blocks = []
    for _, block in published:
        data = engine.read_kv_block(block)
        payload.update(data)
        blocks.append(data)
    header = json.dumps({"format": FORMAT, "artifact_sha256": artifact_sha256(engine.manifest),
                         "kv_format": kv_format(engine), "block_bytes": engine.kv_block_bytes,
                         "hashes": [h.hex() for h, _ in published], "payload_sha256": payload.hexdigest()}).encode()
    path = directory / FILENAME
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        for data in blocks:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    return len(blocks)


def _read(path: Path) -> tuple[dict[str, Any], memoryview]:
    """Header and payload of a saved cache, checked for shape; PrefixCacheCorrupt otherwise."""
    data = memoryview(path.read_bytes())
    if bytes(data[:len(MAGIC)]) != MAGIC or len(data) < len(MAGIC) + 8:
        raise PrefixCacheCorrupt("not a prefix-cache file (bad magic)")
    (length,) = struct.unpack("<Q", data[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if start + length > len(data):
        raise PrefixCacheCorrupt("the header runs past the end of the file")
    try:
        header = json.loads(bytes(data[start:start + length]))
        hashes = [bytes.fromhex(h) for h in header["hashes"]]
        block_bytes = int(header["block_bytes"])
        typed = isinstance(header["artifact_sha256"], str) and isinstance(header["payload_sha256"], str) \
            and isinstance(header["kv_format"], dict)
    except (ValueError, KeyError, TypeError) as e:
        raise PrefixCacheCorrupt(f"a malformed header ({type(e).__name__})") from None
    if not typed:
        raise PrefixCacheCorrupt("a malformed header (a field of the wrong type)")
    if header.get("format") != FORMAT:
        raise PrefixCacheCorrupt(f"format {header.get('format')!r}, this runtime reads {FORMAT}")
    payload = data[start + length:]
    if block_bytes < 1 or len(payload) != block_bytes * len(hashes) or any(len(h) != 16 for h in hashes):
        raise PrefixCacheCorrupt(f"{len(payload)} payload bytes for {len(hashes)} blocks of {block_bytes}")
    if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
        raise PrefixCacheCorrupt("the blocks do not match their sha256")
    header["hashes"] = hashes
    return header, payload


def load_prefix_cache(engine, directory: str | Path) -> int:
    """Publish the blocks saved in ``directory`` into ``engine``'s prefix cache (before any request
    runs); returns how many were loaded. Every outcome is logged in one line."""
    path = Path(directory) / FILENAME
    if not path.exists():
        _log.info(f"prefix cache: {path} does not exist yet; starting cold")
        return 0
    if not engine.kv_blocks_portable:
        _log.warning(f"prefix cache: {engine.path}'s library cannot copy KV blocks; {path} not loaded")
        return 0
    try:
        header, payload = _read(path)
    except (PrefixCacheCorrupt, OSError) as e:
        _log.warning(f"prefix cache: {path} is corrupt and was refused ({e}); starting cold")
        return 0
    ours = artifact_sha256(engine.manifest)
    if header["artifact_sha256"] != ours:
        _log.warning(f"prefix cache: {path} belongs to another artifact (sha256 {header['artifact_sha256'][:16]}, "
                     f"this one {ours[:16]}); ignored, starting cold")
        return 0
    if header["kv_format"] != kv_format(engine) or header["block_bytes"] != engine.kv_block_bytes:
        _log.warning(f"prefix cache: {path} holds another KV format ({header['kv_format']}); ignored, starting cold")
        return 0
    size = engine.kv_block_bytes
    loaded = 0
    for i, block in enumerate(engine.kv.restore(header["hashes"])):
        if block >= 0:
            engine.write_kv_block(block, bytes(payload[i * size:(i + 1) * size]))
            loaded += 1
    _log.info(f"prefix cache: loaded {loaded} of {len(header['hashes'])} blocks from {path}")
    return loaded


def save_on_exit(engine, directory: str | Path) -> None:
    """``save_prefix_cache`` at shutdown: a failure is one logged line, never a crash on the way out."""
    try:
        saved = save_prefix_cache(engine, directory)
    except (InfengError, OSError) as e:
        _log.warning(f"prefix cache: not saved to {directory}: {e}")
        return
    _log.info(f"prefix cache: saved {saved} blocks to {Path(directory) / FILENAME}")
