"""The one owner of LoRA adapter state in a loaded engine.

``AdapterManager`` knows which adapters are *served* (a name a request may ask for, with its
deltas read once from the PEFT directory and kept in host memory), which of them are *resident*
in one of the library's slots, which running sequences use which slot, and how many accepted
requests still need each adapter. Everything else asks it through ``AdapterPool`` (the
scheduler) or its public methods (the engine loop, the server, ``Engine.step`` callers):

- ``load`` (``read``, which needs no lock, then ``install``) serves an adapter and puts it in a slot
  (the least recently used idle one when all are taken); ``unload`` stops serving it, and requests already accepted for it finish with it
  (*draining*) before its slot is cleared;
- ``hold``/``drop`` count accepted requests per adapter; ``acquire``/``release`` give a running
  sequence its slot (loading an evicted adapter back from memory) and take it back;
- ``namespace`` names the prefix-cache namespace of an adapter: new on every (re)load, so K/V
  computed under an old adapter of the same name is never reused.

Not thread safe: the engine loop calls it under its lock.
"""
from __future__ import annotations

import itertools
import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from infeng_common.errors import InfengError
from infeng_common.peft import read_adapter

#: ``write(slot, site, rank, scale, a [rank, in] | None, b [out, rank] | None)`` copies one site's
#: low-rank factors into the library (rank 0 clears it).
SlotWriter = Callable[[int, int, int, float, "np.ndarray | None", "np.ndarray | None"], None]


class AdapterError(InfengError):
    """An adapter that cannot be loaded here (no slots, rank too large, wrong base, unknown name)."""


class AdapterPool(Protocol):
    """What the scheduler asks of the adapter manager."""

    served: dict[str, object]                         # the names requests may ask for

    def namespace(self, name: str) -> str: ...

    def hold(self, name: str, n: int) -> None: ...

    def drop(self, name: str, n: int) -> None: ...

    def acquire(self, name: str, seq_id: int) -> int | None: ...

    def release(self, seq_id: int) -> None: ...


@dataclass
class ServedAdapter:
    """An adapter requests may name: its deltas per slot site, read and checked once."""

    name: str
    namespace: str                                    # prefix-cache namespace of this load (unique to the process)
    sites: list[tuple[int, int, float, np.ndarray, np.ndarray]]   # (site, rank, scale, A, B)


class AdapterManager:
    """Served adapters, their slots, their users. ``sites`` come from the artifact's manifest:
    ``[{"site", "target", "in", "out"}]``, one per linear layer with a LoRA slot."""

    def __init__(self, sites: list[dict], n_slots: int, max_rank: int, base_name: str, write: SlotWriter):
        self.sites, self.n_slots, self.max_rank, self.base_name = sites, n_slots, max_rank, base_name
        self._write = write
        self.served: dict[str, ServedAdapter] = {}
        self._draining: dict[str, ServedAdapter] = {}     # unloaded, still needed by accepted requests
        self._users: dict[str, int] = {}                  # accepted, unfinished sequences per adapter
        self._slot_of: dict[str, int] = {}                # resident adapters
        self._last_used: dict[str, int] = {}
        self._seq_adapter: dict[int, str] = {}            # running sequences -> their adapter
        self._clock = itertools.count()
        self._loads = itertools.count(1)
        # in the namespace of every load: a prefix cache saved by one process (--prefix-cache-dir)
        # never gives another process's adapter, of the same name and load count, its blocks
        self._process = uuid.uuid4().hex[:12]

    # -- serving --------------------------------------------------------------------------------
    def load(self, name: str, path: str | Path, scale: float = 1.0) -> int:
        """Serve the PEFT adapter at ``path`` as ``name``, resident now; returns its slot."""
        return self.install(self.read(name, path, scale))

    def read(self, name: str, path: str | Path, scale: float = 1.0) -> ServedAdapter:
        """Read and check the adapter (no state is touched: safe on any thread, without the loop's
        lock); ``install`` then serves it."""
        if not self.sites:
            raise AdapterError("this artifact has no LoRA slots; compile it with --max-adapters K --max-rank R")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise AdapterError(f"adapter {name!r}: scale must be a finite number")
        linears = {s["target"]: (s["out"], s["in"]) for s in self.sites}
        adapter = read_adapter(Path(path), linears, name, base_name=self.base_name)
        dora = [t for t, m in adapter.modules.items() if m.magnitude is not None]
        if dora:
            raise AdapterError(f"{path}: DoRA adapters ({dora[0]} has a magnitude vector) can only be merged: "
                               f"compile with --lora {name}=DIR --merge {name}")
        if adapter.max_rank > self.max_rank:
            raise AdapterError(f"{path}: adapter rank {adapter.max_rank} exceeds the artifact's max rank "
                               f"{self.max_rank}; recompile with --max-rank {adapter.max_rank}")
        site_of = {s["target"]: s["site"] for s in self.sites}
        sites = [(site_of[target], m.rank, m.scale * float(scale), np.ascontiguousarray(m.A, dtype=np.float32),
                  np.ascontiguousarray(m.B, dtype=np.float32)) for target, m in adapter.modules.items()]
        return ServedAdapter(name, f"{name}#{self._process}.{next(self._loads)}", sites)

    def install(self, adapter: ServedAdapter) -> int:
        """Serve an adapter ``read`` returned, resident now; returns its slot."""
        name = adapter.name
        if name in self.served:
            raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first")
        if name in self._draining:
            raise AdapterError(f"adapter {name!r} is still finishing requests; retry shortly")
        slot = self._free_slot()
        if slot is None:
            raise AdapterError(f"all {self.n_slots} adapter slots are in use by running requests")
        self.served[name] = adapter
        self._put(adapter, slot)
        return slot

    def unload(self, name: str) -> None:
        """Stop serving ``name``; requests already accepted for it still finish with it."""
        adapter = self.served.pop(name, None)
        if adapter is None:
            raise AdapterError(f"no adapter named {name!r} is loaded (loaded: {', '.join(self.served) or 'none'})")
        if self._users.get(name):
            self._draining[name] = adapter
        else:
            self._evict(name)

    # -- slots ----------------------------------------------------------------------------------
    def _free_slot(self) -> int | None:
        """An empty slot, or the slot of the least recently used adapter no running sequence uses
        (evicted); None when every slot is busy."""
        used = set(self._slot_of.values())
        for slot in range(self.n_slots):
            if slot not in used:
                return slot
        busy = set(self._seq_adapter.values())
        idle = [n for n in self._slot_of if n not in busy]
        if not idle:
            return None
        victim = min(idle, key=self._last_used.__getitem__)
        slot = self._slot_of[victim]
        self._evict(victim)
        return slot

    def _put(self, adapter: ServedAdapter, slot: int) -> None:
        for site in range(len(self.sites)):
            self._write(slot, site, 0, 0.0, None, None)
        for site, rank, scale, a, b in adapter.sites:
            self._write(slot, site, rank, scale, a, b)
        self._slot_of[adapter.name] = slot
        self._last_used[adapter.name] = next(self._clock)

    def _evict(self, name: str) -> None:
        slot = self._slot_of.pop(name, None)
        self._last_used.pop(name, None)
        if slot is not None:
            for site in range(len(self.sites)):
                self._write(slot, site, 0, 0.0, None, None)

    @property
    def resident(self) -> dict[str, int]:
        """Adapters in a slot: name -> slot."""
        return dict(self._slot_of)

    def slot(self, name: str) -> int:
        """The slot of resident adapter ``name``, marked as just used (for ``Engine.step`` callers)."""
        if name not in self._slot_of:
            raise AdapterError(f"unknown adapter {name!r} (loaded: {', '.join(self._slot_of) or 'none'})")
        self._last_used[name] = next(self._clock)
        return self._slot_of[name]

    # -- AdapterPool: what the scheduler asks ------------------------------------------------------
    def namespace(self, name: str) -> str:
        adapter = self.served.get(name) or self._draining.get(name)
        return adapter.namespace if adapter else name

    def hold(self, name: str, n: int) -> None:
        """``n`` sequences of a newly accepted request will use ``name``."""
        if name not in self.served:
            raise AdapterError(f"the model {name!r} does not exist")
        self._users[name] = self._users.get(name, 0) + n

    def drop(self, name: str, n: int) -> None:
        """``n`` sequences that used ``name`` are finished; a draining adapter leaves with its last."""
        left = self._users.get(name, 0) - n
        if left > 0:
            self._users[name] = left
            return
        self._users.pop(name, None)
        if self._draining.pop(name, None) is not None:
            self._evict(name)

    def acquire(self, name: str, seq_id: int) -> int | None:
        """The slot of ``name`` for sequence ``seq_id`` (put back in a slot if it was evicted);
        None while every slot is held by running sequences."""
        if name not in self._slot_of:
            adapter = self.served.get(name) or self._draining.get(name)
            if adapter is None:
                raise AdapterError(f"adapter {name!r} was unloaded")
            slot = self._free_slot()
            if slot is None:
                return None
            self._put(adapter, slot)
        self._seq_adapter[seq_id] = name
        return self.slot(name)

    def release(self, seq_id: int) -> None:
        self._seq_adapter.pop(seq_id, None)
