"""KV block manager: the library owns the block pool, Python decides which block holds what.

Each live sequence gets a slot (a row of ``block_table``) and the blocks its positions need,
``block_size`` tokens per block. Blocks are reference counted so that sequences with the same
prefix can point their block tables at the same *full* blocks (prefix caching):

- a full block is named by a hash chain over token ids, ``h_i = H(h_{i-1}, tokens of block i)``,
  rooted in a namespace (the adapter: the same tokens under another LoRA adapter give other K/V);
- ``register`` publishes a sequence's computed full blocks under their hashes, ``lookup`` finds
  the longest cached prefix of a hash chain, ``claim`` attaches those blocks to a new sequence;
- a published block whose last reference goes away stays cached (its contents intact) on an LRU
  list, and is evicted (its hash forgotten) when a block is needed and either no other is left or
  the cache already keeps ``cache_blocks`` unreferenced blocks: memory is committed as block ids
  are first used, so the cache may keep at most ``cache_blocks`` blocks committed beyond the most
  blocks in use at once (``PREFIX_CACHE_SHARE`` of the pool by default).

A sequence only ever writes positions past its cached prefix, and only full blocks are published,
so a shared block is never written again.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from infeng_common.errors import InfengError

#: Share of the pool that unreferenced prefix-cache blocks may keep committed beyond the blocks in
#: use: past it, a block is taken by evicting the least recently used cached one rather than
#: committing a never-used id (docs/serving.md, *KV memory*).
PREFIX_CACHE_SHARE = 0.125

class KVCacheFull(InfengError):
    """No free KV block (or sequence slot) is left; retry when a sequence finishes."""


def block_hashes(token_ids: Sequence[int], block_size: int, namespace: str = "",
                 known: list[bytes] | None = None) -> list[bytes]:
    """The hash chain of the full blocks of ``token_ids``; ``known`` (a prefix of the chain,
    extended in place and returned) saves rehashing blocks already named."""
    hashes = known if known is not None else []
    parent = hashes[-1] if hashes else hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        chunk = np.asarray(token_ids[start:start + block_size], dtype=np.int32).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class BlockAllocator:
    """Slots, blocks and the prefix cache of one engine's KV pool.

    The per-sequence API (``ensure``, ``free``) is what ``Engine.step`` uses; the scheduler also
    uses ``blocks_needed``/``num_free`` to plan, and ``lookup``/``claim``/``register`` to share
    prefixes.
    """

    def __init__(self, n_blocks: int, block_size: int, max_seqs: int, max_context: int,
                 prefix_cache: bool = True, cache_blocks: int | None = None):
        if n_blocks < 1 or max_seqs < 1:
            raise InfengError(f"the KV pool needs at least one block and one sequence slot "
                              f"(got {n_blocks} blocks, {max_seqs} slots)")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.max_blocks = -(-max_context // block_size)
        self.max_context = max_context
        self.max_seqs = max_seqs
        self.prefix_cache = prefix_cache
        # unreferenced cached blocks kept before a never-used id is taken (the cache's committed share)
        self.cache_blocks = max(1, int(PREFIX_CACHE_SHARE * n_blocks)) if cache_blocks is None else cache_blocks
        self.free_blocks: list[int] = []                              # returned, unpublished
        self.fresh = 0                                                # blocks [fresh, n_blocks) never handed out
        self.evictable: OrderedDict[int, None] = OrderedDict()        # published, refcount 0, LRU first
        self.refcount = [0] * n_blocks
        self.cached: dict[bytes, int] = {}                            # hash -> block
        self.hash_of: dict[int, bytes] = {}                           # block -> hash
        self.free_slots = list(range(max_seqs - 1, -1, -1))
        self.block_table = np.zeros((max_seqs, self.max_blocks), dtype=np.int32)   # [slots, max_blocks]
        self.slot_of: dict[int, int] = {}
        self.blocks_of: dict[int, list[int]] = {}
        self.published_of: dict[int, int] = {}                        # seq -> blocks registered so far
        # called with a slot when its sequence frees it (the engine tells the library: the slot's
        # next sequence is another one, whatever positions it starts at)
        self.on_slot_free: Callable[[int], None] | None = None
        # prefix-cache counters, in blocks: looked up at admission, found, evicted
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    # -- slots and blocks -------------------------------------------------------------------
    def slot(self, seq: int) -> int:
        """The block-table row of ``seq``, claiming one on first use."""
        if seq not in self.slot_of:
            if not self.free_slots:
                raise KVCacheFull(f"all {self.max_seqs} sequence slots are in use")
            self.slot_of[seq] = self.free_slots.pop()
            self.blocks_of[seq] = []
            self.published_of[seq] = 0
        return self.slot_of[seq]

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, or cached and unreferenced)."""
        return len(self.free_blocks) + self.n_blocks - self.fresh + len(self.evictable)

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by live sequences."""
        return self.n_blocks - self.num_free

    @property
    def cached_blocks(self) -> int:
        return len(self.cached)

    def blocks_needed(self, seq: int, length: int) -> int:
        """New blocks ``seq`` needs for positions [0, length)."""
        have = len(self.blocks_of.get(seq, ()))
        return max(0, -(-length // self.block_size) - have)

    def _take_block(self) -> int:
        """A returned block, else a never-used id while the cache keeps fewer than ``cache_blocks``
        blocks, else the least recently used cached block (so that ``fresh``, the blocks committed,
        stays within the most blocks in use at once plus ``cache_blocks``)."""
        if self.free_blocks:
            return self.free_blocks.pop()
        if self.fresh < self.n_blocks and (len(self.evictable) < self.cache_blocks or not self.evictable):
            self.fresh += 1
            return self.fresh - 1
        block, _ = self.evictable.popitem(last=False)
        del self.cached[self.hash_of.pop(block)]
        self.evictions += 1
        return block

    def ensure(self, seq: int, length: int) -> None:
        """Make positions [0, length) of ``seq`` backed by blocks."""
        if length > self.max_context:
            raise InfengError(f"sequence {seq} needs {length} positions; the engine was loaded with "
                              f"max context {self.max_context}")
        slot = self.slot(seq)
        blocks = self.blocks_of[seq]
        need = -(-length // self.block_size) - len(blocks)
        if need > self.num_free:
            raise KVCacheFull(f"KV cache full: sequence {seq} needs {need} more blocks, "
                              f"{self.num_free} free of {self.n_blocks}")
        for _ in range(need):
            block = self._take_block()
            self.refcount[block] = 1
            self.block_table[slot, len(blocks)] = block
            blocks.append(block)

    def free(self, seq: int) -> None:
        """Release ``seq``'s slot and its references; published blocks stay cached (LRU)."""
        if seq not in self.slot_of:
            return
        slot = self.slot_of.pop(seq)
        self.free_slots.append(slot)
        if self.on_slot_free is not None:
            self.on_slot_free(slot)
        self.published_of.pop(seq, None)
        # last block first, so that the tail of a chain is evicted before its head
        for block in reversed(self.blocks_of.pop(seq)):
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                if block in self.hash_of:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)

    # -- prefix cache -----------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of the hash chain ``hashes`` (no references taken)."""
        if not self.prefix_cache:
            return []
        found = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def claim(self, seq: int, blocks: list[int], queried: int) -> None:
        """Start ``seq`` (which must hold no blocks) on the cached ``blocks`` found by ``lookup``
        among ``queried`` looked-up blocks; counts hits and queries."""
        slot = self.slot(seq)
        own = self.blocks_of[seq]
        if own:
            raise InfengError(f"sequence {seq} already holds KV blocks")
        for i, block in enumerate(blocks):
            if self.refcount[block] == 0:
                del self.evictable[block]
            self.refcount[block] += 1
            self.block_table[slot, i] = block
            own.append(block)
        self.published_of[seq] = len(blocks)
        self.queries += queried
        self.hits += len(blocks)

    def register(self, seq: int, hashes: Sequence[bytes], n_full: int) -> None:
        """Publish the first ``n_full`` blocks of ``seq`` (fully computed) under ``hashes``.

        A block whose hash another block already holds stays private (both have the same
        contents; the first one published is the one later sequences get)."""
        if not self.prefix_cache:
            return
        done = self.published_of.get(seq, 0)
        if n_full <= done:
            return
        blocks = self.blocks_of[seq]
        for i in range(done, n_full):
            h, block = hashes[i], blocks[i]
            if h not in self.cached and block not in self.hash_of:
                self.cached[h] = block
                self.hash_of[block] = h
        self.published_of[seq] = n_full

    def published(self) -> list[tuple[bytes, int]]:
        """(hash, block) of every cached block, least recently used first (the unreferenced ones
        in LRU order, then those live sequences hold)."""
        idle = [(self.hash_of[b], b) for b in self.evictable]
        return idle + [(h, b) for h, b in self.cached.items() if b not in self.evictable]

    def restore(self, hashes: Sequence[bytes]) -> list[int]:
        """Publish blocks for ``hashes`` (least recently used first) as unreferenced cached blocks,
        before any sequence runs; at most ``cache_blocks`` of them, the most recent kept. Returns
        the block of each hash kept (the caller writes their contents), -1 for one not kept."""
        if not self.prefix_cache:
            return [-1] * len(hashes)
        keep_from = max(0, len(hashes) - min(self.cache_blocks, self.n_blocks))
        blocks = []
        for i, h in enumerate(hashes):
            if i < keep_from or h in self.cached:
                blocks.append(-1)
                continue
            block = self._take_block()
            self.cached[h] = block
            self.hash_of[block] = h
            self.evictable[block] = None
            blocks.append(block)
        return blocks

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (e.g. after an adapter is replaced)."""
        while self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.hash_of.pop(block)]
            self.free_blocks.append(block)
