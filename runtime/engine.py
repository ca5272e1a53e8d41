"""Engine: loads a compiled artifact and runs forward steps through its C ABI (cffi, declared by
the ``infeng.h`` shipped in the artifact; the GIL is released during each call)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import cffi
import numpy as np

from infeng_common.errors import InfengError
from infeng_common.manifest import ABI_HEADER, LIBRARY, WEIGHTS, ArtifactError, read_manifest
from infeng_common.tokenizer import Tokenizer

from .adapters import AdapterError, AdapterManager
from .kv_cache import BlockAllocator

ABI_VERSION = 1
_SMALL_STEP = 64    # steps of at most this many tokens take the pure-Python bookkeeping path
#: Sequences a KV pool is sized for when the caller does not say.
DEFAULT_MAX_SEQS = 16
#: Share of the memory available at load (MemAvailable less the weights) that a KV pool of default
#: size may reach: a bigger default pool is cut to it (docs/serving.md).
KV_MEMORY_SHARE = 0.5
#: A default pool cut to the share must hold one sequence of min(the model's context, this many
#: tokens); less memory is refused rather than served with a context too short to be of use.
MIN_DEFAULT_CONTEXT = 2048
_log = logging.getLogger("infeng.engine")


class CPUFeatureError(InfengError):
    """The artifact was compiled for instructions this CPU lacks."""


@lru_cache(maxsize=4)
def _ffi(header: str) -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef("\n".join(line for line in header.splitlines() if not line.lstrip().startswith("#")))
    return ffi


def _read_int(path: Path) -> int | None:
    """The integer a one-value file holds (cgroup's ``max`` and unreadable files: None)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def available_memory(meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/sys/fs/cgroup") -> int | None:
    """Bytes that can be allocated without swapping, None if unknown: the kernel's MemAvailable,
    cut to what the cgroup (a container's limit) leaves: v2 ``memory.max - memory.current``, v1
    ``memory/memory.limit_in_bytes - memory/memory.usage_in_bytes``."""
    known: list[int] = []
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    known.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    cgroup = Path(cgroup)
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit = _read_int(cgroup / limit_file)            # "max" (no limit) reads as None
        if limit is not None:
            known.append(max(0, limit - (_read_int(cgroup / usage_file) or 0)))
    return min(known) if known else None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 or n == 0 else f"{n / 2**10:.0f} KiB"


@dataclass(frozen=True)
class KVPoolSize:
    """How many KV blocks the pool holds and why: ``sized_by`` names what fixed it."""

    n_blocks: int
    max_context: int
    sized_by: str


class Engine:
    """One loaded model: ``step`` runs a batch of tokens, ``free`` releases a sequence's KV blocks."""

    def __init__(self, path: str | Path, *, threads: int = 0, max_seqs: int = DEFAULT_MAX_SEQS, max_context: int | None = None,
                 kv_blocks: int | None = None, kv_memory: int | None = None):
        if max_seqs < 1:
            raise InfengError(f"max_seqs must be >= 1, got {max_seqs}")
        if max_context is not None and max_context < 1:
            raise InfengError(f"max_context must be >= 1, got {max_context}")
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        header = self.path / ABI_HEADER
        try:
            self.ffi = _ffi(header.read_text())
        except (OSError, UnicodeDecodeError, cffi.CDefError) as e:
            raise ArtifactError(f"{header}: cannot read the C ABI header: {e}") from None
        try:
            self.lib = self.ffi.dlopen(str((self.path / LIBRARY).resolve()))
        except OSError as e:
            raise ArtifactError(f"{self.path / LIBRARY}: cannot load the library: {e}") from None
        missing = self.ffi.new("char[]", 256)
        if self.lib.ife_cpu_check(missing, 256) != 0:
            raise CPUFeatureError(f"{self.path}: compiled for target {self.manifest['target']}, but this CPU lacks "
                                  f"{self.ffi.string(missing).decode()}; recompile with --target native")
        if self.lib.ife_abi_version() != ABI_VERSION:
            raise ArtifactError(f"{self.path / LIBRARY}: C ABI version {self.lib.ife_abi_version()}, "
                                f"this runtime speaks {ABI_VERSION}; recompile the model")
        meta = self.manifest["meta"]
        self.vocab_size = int(self.lib.ife_vocab_size())
        self.max_tokens = int(self.lib.ife_max_tokens())
        self.block_size = int(self.lib.ife_block_size())
        model_context = meta.get("max_position_embeddings")
        self.max_context = int(max_context or (model_context if isinstance(model_context, int) and
                                               model_context > 0 else 2048))
        self.kv_block_bytes = int(self.lib.ife_kv_block_bytes())
        pool = self._pool_size(max_seqs, max_context, kv_blocks, kv_memory)
        self.max_context, self.kv_sized_by = pool.max_context, pool.sized_by
        self.kv = BlockAllocator(pool.n_blocks, self.block_size, max_seqs, self.max_context)
        err = self.ffi.new("char[]", 512)
        handle = self.lib.ife_create(str((self.path / WEIGHTS).resolve()).encode(), pool.n_blocks, threads, err, 512)
        if handle == self.ffi.NULL:
            raise InfengError(f"{self.path}: cannot create the model: {self.ffi.string(err).decode()}")
        self._handle = self.ffi.gc(handle, self.lib.ife_destroy)
        # libraries compiled before ife_kv_on_demand commit the whole pool in ife_create
        on_demand = getattr(self.lib, "ife_kv_on_demand", None)
        self.kv_on_demand = on_demand is not None and on_demand() == 1
        self.threads = int(self.lib.ife_threads(self._handle))
        # a freed slot's per-slot library state (the f16 window ring) is forgotten; libraries built
        # before ife_slot_free existed restart the ring at any step that does not continue it
        self._slot_free = getattr(self.lib, "ife_slot_free", None)
        if self._slot_free is not None:
            self.kv.on_slot_free = self._slot_freed
        constants = self.manifest["constants"]
        try:                    # values of the wrong JSON type in the manifest: one line, not a traceback
            self.adapters = AdapterManager(constants.get("lora_sites", []), int(constants.get("lora_slots", 0)),
                                           int(constants.get("lora_rank", 0)), self.manifest["name"], self._write_lora)
            bundled = (self.manifest.get("adapters") or {}).get("bundled") or []
            for name in bundled:
                self.adapters.load(str(name), self.path / "adapters" / str(name))
            self.tokenizer = Tokenizer(self.path, meta.get("bos_token_id"), meta.get("eos_token_ids")) \
                if (self.path / "tokenizer.json").is_file() else None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ArtifactError(f"{self.path / 'manifest.json'}: a malformed value ({type(e).__name__}: "
                                f"{str(e)[:200]}); recompile the model") from None
        _log.info(self.kv_summary())

    def _pool_size(self, max_seqs: int, max_context: int | None, kv_blocks: int | None,
                   kv_memory: int | None) -> KVPoolSize:
        """The KV pool's blocks and the context it serves, decided before anything is allocated.

        ``kv_blocks``/``kv_memory`` fix the pool; else it holds ``max_seqs`` sequences of the
        context. An asked ``max_context`` (with ``max_seqs``) fixes it exactly and must fit in
        the memory available; the model's own context (``max_position_embeddings``) gives a
        default pool that is cut to ``KV_MEMORY_SHARE`` of the memory available after the
        weights (the sequences then share it; a context longer than the pool holds is cut to it).
        Memory is committed as blocks are used (``ife_kv_on_demand``), so the size is a cap."""
        block_bytes = self.kv_block_bytes
        per_sequence = -(-self.max_context // self.block_size)
        available = available_memory()
        if kv_blocks is None and kv_memory is not None:
            kv_blocks = int(kv_memory) // block_bytes
            if kv_blocks < 1:
                raise InfengError(f"KV memory {kv_memory} bytes holds no block (one block takes {block_bytes} bytes)")
        if kv_blocks:
            n_blocks = kv_blocks
            sized_by = f"--kv-memory {_mib(kv_memory)}" if kv_memory is not None else f"{kv_blocks} blocks asked"
        elif max_context is not None:
            n_blocks, sized_by = max_seqs * per_sequence, f"{max_seqs} sequences x --max-context {max_context}"
        else:
            n_blocks = max_seqs * per_sequence
            sized_by = f"{max_seqs} sequences x the model's {self.max_context}-token context"
            if available is not None:
                weights = int(self.lib.ife_weights_bytes())
                budget = int(KV_MEMORY_SHARE * max(0, available - weights)) // (block_bytes + 8)
                least = min(self.max_context, MIN_DEFAULT_CONTEXT)
                if budget * self.block_size < least:
                    raise InfengError(f"{KV_MEMORY_SHARE:.0%} of the {_gib(available)} of memory available (less "
                                      f"{_mib(weights)} of weights) holds a KV pool of {budget * self.block_size} "
                                      f"tokens, less than one sequence of {least}; free memory, or give "
                                      f"--kv-memory or --max-context")
                if budget < n_blocks:
                    n_blocks = budget
                    sized_by = (f"{KV_MEMORY_SHARE:.0%} of the {_gib(available)} available less "
                                f"{_mib(weights)} of weights")
        context = self.max_context
        capacity = n_blocks * self.block_size
        if context > capacity:
            if max_context is not None:
                raise InfengError(f"max context {max_context} tokens does not fit in the KV pool ({n_blocks} blocks "
                                  f"of {self.block_size} tokens, {_gib(n_blocks * block_bytes)}); lower --max-context "
                                  f"or give more --kv-memory")
            context = capacity
        # the pool, its reference counts (8 bytes a block), the block table and per-sequence
        # bookkeeping (~100 bytes a sequence)
        need = n_blocks * (block_bytes + 8) + max_seqs * (4 * -(-context // self.block_size) + 100)
        if available is not None and need > available:
            asked = f"{kv_memory} bytes of KV memory" if kv_memory is not None else \
                f"a KV pool for {max_seqs} sequences of {context} tokens"
            raise InfengError(f"{asked} takes {_gib(need)}, more than the {_gib(available)} of memory available; "
                              f"lower --max-context or --max-seqs, or give a smaller --kv-memory")
        return KVPoolSize(n_blocks, context, sized_by)

    @property
    def kv_bytes_touched(self) -> int:
        """KV blocks ever handed out x block bytes (the allocator hands out the lowest ids first and
        reuses freed ones), or the whole pool for a library that commits it at create: a lower
        bound of the KV memory committed (with transparent huge pages each layer's K and V pool
        commits in steps of up to 2 MiB, more than the blocks written)."""
        blocks = self.kv.fresh if self.kv_on_demand else self.kv.n_blocks
        return blocks * self.kv_block_bytes

    def kv_summary(self) -> str:
        """The line ``infeng serve`` logs at start: the pool, the blocks touched, and what sized it."""
        kv = self.kv
        growth = "committed as blocks are used" if self.kv_on_demand else "committed at load"
        return (f"KV cache: {kv.n_blocks} blocks of {self.block_size} tokens ({_mib(self.kv_block_bytes)} each), "
                f"{_mib(self.kv_bytes_touched)} touched / up to {_mib(kv.n_blocks * self.kv_block_bytes)} "
                f"({growth}), max context {self.max_context}, max sequences {kv.max_seqs}; sized by {self.kv_sized_by}")

    @classmethod
    def load(cls, path: str | Path, **kwargs) -> "Engine":
        return cls(path, **kwargs)

    # -- adapters ---------------------------------------------------------------------------
    def _write_lora(self, slot: int, site: int, rank: int, scale: float, a, b) -> None:
        null = self.ffi.NULL
        rc = self.lib.ife_lora_set(self._handle, slot, site, rank, scale,
                                   null if a is None else self.ffi.from_buffer("float[]", a),
                                   null if b is None else self.ffi.from_buffer("float[]", b))
        if rc != 0:
            raise InfengError(f"ife_lora_set(slot={slot}, site={site}, rank={rank}) refused")

    def load_adapter(self, name: str, path: str | Path, scale: float = 1.0) -> int:
        """Serve a PEFT LoRA adapter (``self.adapters.load``); returns its slot."""
        return self.adapters.load(name, path, scale)

    def unload_adapter(self, name: str) -> None:
        self.adapters.unload(name)

    def adapter_slot(self, name: str | None, seq: int | None = None) -> int:
        """The slot for ``name`` (-1 for None = base), held by sequence ``seq`` until ``free(seq)``
        (and put back in a slot if it was evicted)."""
        if name is None:
            return -1
        if seq is None:
            return self.adapters.slot(name)
        slot = self.adapters.acquire(name, int(seq))
        if slot is None:
            raise AdapterError(f"all {self.adapters.n_slots} adapter slots are in use by running sequences")
        return slot

    def step(self, tokens, positions, seq_ids, logits_rows=None, adapter_slots=None) -> np.ndarray:
        """Logits [R, vocab] for ``logits_rows`` (default: every row) after running all tokens.

        ``adapter_slots`` [T]: the LoRA slot of each token (``adapter_slot(name)``), -1 = base."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        positions = np.ascontiguousarray(positions, dtype=np.int32)
        seq_ids = np.asarray(seq_ids)
        n = len(tokens)
        rows = np.arange(n, dtype=np.int32) if logits_rows is None else np.asarray(logits_rows, dtype=np.int32)
        if n == 0 or positions.shape != (n,) or seq_ids.shape != (n,):
            raise InfengError("tokens, positions and seq_ids must be non-empty 1-D arrays of one length")
        if n <= _SMALL_STEP:      # decode-sized: plain Python beats numpy's per-call overhead
            ids, seqs = tokens.tolist(), seq_ids.tolist()
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise InfengError(f"token id out of range [0, {self.vocab_size})")
            length: dict[int, int] = {}
            for seq, pos in zip(seqs, positions.tolist()):
                length[seq] = max(length.get(seq, 0), pos + 1)
            for seq, need in length.items():
                self.kv.ensure(int(seq), need)
            slot_of = self.kv.slot_of
            slots = np.array([slot_of[int(seq)] for seq in seqs], dtype=np.int32)
        else:
            if tokens.min() < 0 or tokens.max() >= self.vocab_size:
                raise InfengError(f"token id out of range [0, {self.vocab_size})")
            slots = np.empty(n, dtype=np.int32)
            for seq in np.unique(seq_ids):
                mask = seq_ids == seq
                self.kv.ensure(int(seq), int(positions[mask].max()) + 1)
                slots[mask] = self.kv.slot_of[int(seq)]
        if adapter_slots is not None:
            adapter_slots = np.ascontiguousarray(adapter_slots, dtype=np.int32)
            if adapter_slots.shape != (n,):
                raise InfengError("adapter_slots must have one entry per token")
            if adapter_slots.max() >= max(self.adapters.n_slots, 0) and adapter_slots.max() >= 0:
                raise InfengError(f"adapter slot {adapter_slots.max()} out of range (the artifact has "
                                  f"{self.adapters.n_slots} slots)")
        return self.forward(tokens, positions, slots, rows, adapter_slots)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, rows: np.ndarray,
                adapter_slots: np.ndarray | None = None) -> np.ndarray:
        """``step`` without checks or block allocation, for a caller that owns ``self.kv`` (the
        scheduler): int32 arrays, ``slots`` the block-table row of each token, ``rows`` the
        logits rows. Returns logits [len(rows), vocab]."""
        n = len(tokens)
        logits = np.empty((len(rows), self.vocab_size), dtype=np.float32)
        ffi, table = self.ffi, self.kv.block_table
        single = n <= self.max_tokens         # one call: logits written in place, no copies
        for start in range(0, n, self.max_tokens):
            end = min(n, start + self.max_tokens)
            if single:
                want, chunk_rows, out = slice(None), np.ascontiguousarray(rows, dtype=np.int32), logits
            else:
                want = np.nonzero((rows >= start) & (rows < end))[0]
                chunk_rows = np.ascontiguousarray(rows[want] - start, dtype=np.int32)
                out = np.empty((len(want), self.vocab_size), dtype=np.float32)
            rc = self.lib.ife_forward(
                self._handle, end - start,
                ffi.from_buffer("int32_t[]", tokens[start:end]), ffi.from_buffer("int32_t[]", positions[start:end]),
                ffi.from_buffer("int32_t[]", slots[start:end]), ffi.from_buffer("int32_t[]", table),
                table.shape[1], len(chunk_rows), ffi.from_buffer("int32_t[]", chunk_rows),
                ffi.from_buffer("float[]", out),
                ffi.NULL if adapter_slots is None else ffi.from_buffer("int32_t[]", adapter_slots[start:end]))
            if rc != 0:
                raise InfengError(f"ife_forward failed with code {rc}")
            if not single:
                logits[want] = out
        return logits

    # -- profile (artifacts compiled with --profile) ---------------------------------------
    @property
    def profiled(self) -> bool:
        return int(self.lib.ife_profile_entries()) > 0

    def profile(self) -> list[dict]:
        """Per IR node: name, op, accumulated ns and calls, and its span in the latest step."""
        n = int(self.lib.ife_profile_entries())
        arrays = [np.zeros(n, dtype=np.int64) for _ in range(4)]
        self.lib.ife_profile_read(self._handle, *(self.ffi.from_buffer("int64_t[]", a) for a in arrays))
        ns, calls, begin, end = arrays
        return [{**entry, "ns": int(ns[i]), "calls": int(calls[i]), "last_begin_ns": int(begin[i]),
                 "last_end_ns": int(end[i])} for i, entry in enumerate(self.manifest.get("profile", [])[:n])]

    def profile_reset(self) -> None:
        self.lib.ife_profile_reset(self._handle)

    def free(self, seq: int) -> None:
        self.kv.free(int(seq))
        self.adapters.release(int(seq))

    @property
    def kv_blocks_portable(self) -> bool:
        """The library can copy KV blocks in and out (``ife_kv_block_read``/``_write``)."""
        return hasattr(self.lib, "ife_kv_block_read") and hasattr(self.lib, "ife_kv_block_write")

    def read_kv_block(self, block: int) -> bytes:
        """The bytes of KV block ``block`` (``kv_block_bytes`` of them, the library's format)."""
        buf = bytearray(self.kv_block_bytes)
        if self.lib.ife_kv_block_read(self._handle, block, self.ffi.from_buffer(buf)) != 0:
            raise InfengError(f"KV block {block} is out of range")
        return bytes(buf)

    def write_kv_block(self, block: int, data: bytes) -> None:
        if len(data) != self.kv_block_bytes:
            raise InfengError(f"a KV block takes {self.kv_block_bytes} bytes, got {len(data)}")
        if self.lib.ife_kv_block_write(self._handle, block, self.ffi.from_buffer(data)) != 0:
            raise InfengError(f"KV block {block} is out of range")

    def _slot_freed(self, slot: int) -> None:
        if self._handle is not None:
            self._slot_free(self._handle, slot)

    def close(self) -> None:
        if getattr(self, "_handle", None) is not None:
            self.ffi.release(self._handle)
            self._handle = None

