"""LoRA adapter slots of a loaded engine: which adapter sits in which slot, loading a PEFT adapter
into a free slot (evicting the least recently used idle one when all are taken), unloading."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable

import numpy as np

from infeng_compiler.errors import InfengError
from infeng_compiler.frontends.peft import load_adapter


class AdapterError(InfengError):
    """An adapter that cannot be loaded here (no slots, rank too large, wrong base, unknown name)."""


class AdapterSlots:
    """Slot bookkeeping; ``write(slot, site, rank, scale, a, b)`` copies one site into the library."""

    def __init__(self, sites: list[dict], n_slots: int, max_rank: int, base_name: str,
                 write: Callable[[int, int, int, float, np.ndarray | None, np.ndarray | None], None]):
        self.sites = sites                                    # [{"site", "target", "in", "out"}]
        self.n_slots, self.max_rank, self.base_name = n_slots, max_rank, base_name
        self.write = write
        self.slot_of: dict[str, int] = {}
        self.last_used: dict[str, int] = {}
        self.clock = itertools.count()

    def load(self, name: str, path: str | Path, scale: float = 1.0, busy: set[str] = frozenset()) -> int:
        """Load the PEFT adapter at ``path`` as ``name``; returns its slot."""
        if not self.sites:
            raise AdapterError("this artifact has no LoRA slots; compile it with --max-adapters K --max-rank R")
        if name in self.slot_of:
            raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first")
        linears = {s["target"]: (s["out"], s["in"]) for s in self.sites}
        adapter = load_adapter(path, linears, name, base_name=self.base_name)
        dora = [t for t, m in adapter.modules.items() if m.magnitude is not None]
        if dora:
            raise AdapterError(f"{path}: DoRA adapters ({dora[0]} has a magnitude vector) can only be merged: "
                               f"compile with --lora {name}=DIR --merge {name}")
        if adapter.max_rank > self.max_rank:
            raise AdapterError(f"{path}: adapter rank {adapter.max_rank} exceeds the artifact's max rank "
                               f"{self.max_rank}; recompile with --max-rank {adapter.max_rank}")
        slot = self._free_slot(busy)
        site_of = {s["target"]: s["site"] for s in self.sites}
        for site in range(len(self.sites)):
            self.write(slot, site, 0, 0.0, None, None)
        for target, module in adapter.modules.items():
            a = np.ascontiguousarray(module.A, dtype=np.float32)
            b = np.ascontiguousarray(module.B, dtype=np.float32)
            self.write(slot, site_of[target], module.rank, module.scale * scale, a, b)
        self.slot_of[name] = slot
        self.touch(name)
        return slot

    def _free_slot(self, busy: set[str]) -> int:
        used = set(self.slot_of.values())
        free = [s for s in range(self.n_slots) if s not in used]
        if free:
            return free[0]
        idle = [n for n in self.slot_of if n not in busy]
        if not idle:
            raise AdapterError(f"all {self.n_slots} adapter slots are in use by running requests")
        victim = min(idle, key=lambda n: self.last_used[n])
        return self.unload(victim)

    def unload(self, name: str) -> int:
        if name not in self.slot_of:
            raise AdapterError(f"no adapter named {name!r} is loaded (loaded: {', '.join(self.slot_of) or 'none'})")
        slot = self.slot_of.pop(name)
        self.last_used.pop(name, None)
        for site in range(len(self.sites)):
            self.write(slot, site, 0, 0.0, None, None)
        return slot

    def touch(self, name: str) -> int:
        """The slot of ``name``, marked as just used."""
        if name not in self.slot_of:
            raise AdapterError(f"unknown adapter {name!r} (loaded: {', '.join(self.slot_of) or 'none'})")
        self.last_used[name] = next(self.clock)
        return self.slot_of[name]
