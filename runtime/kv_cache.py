"""KV block allocator: the library owns the block pool, Python decides which block holds what.

Each live sequence gets a slot (a row of the block table) and the blocks its positions need,
``block_size`` tokens per block.
"""
from __future__ import annotations

import numpy as np

from infeng_compiler.errors import InfengError


class KVCacheFull(InfengError):
    """No free KV block (or sequence slot) is left; retry when a sequence finishes."""


class BlockAllocator:
    def __init__(self, n_blocks: int, block_size: int, max_seqs: int, max_context: int):
        self.n_blocks, self.block_size = n_blocks, block_size
        self.max_blocks = -(-max_context // block_size)
        self.max_context = max_context
        self.free_blocks = list(range(n_blocks - 1, -1, -1))
        self.free_slots = list(range(max_seqs - 1, -1, -1))
        self.block_table = np.zeros((max_seqs, self.max_blocks), dtype=np.int32)   # [slots, max_blocks]
        self.slot_of: dict[int, int] = {}
        self.blocks_of: dict[int, list[int]] = {}

    def slot(self, seq: int) -> int:
        """The block-table row of ``seq``, claiming one on first use."""
        if seq not in self.slot_of:
            if not self.free_slots:
                raise KVCacheFull(f"all {self.block_table.shape[0]} sequence slots are in use")
            self.slot_of[seq] = self.free_slots.pop()
            self.blocks_of[seq] = []
        return self.slot_of[seq]

    def ensure(self, seq: int, length: int) -> None:
        """Make positions [0, length) of ``seq`` backed by blocks."""
        if length > self.max_context:
            raise InfengError(f"sequence {seq} needs {length} positions; the engine was loaded with "
                              f"max context {self.max_context}")
        slot, blocks = self.slot(seq), self.blocks_of[seq]
        need = -(-length // self.block_size)
        if need - len(blocks) > len(self.free_blocks):
            raise KVCacheFull(f"KV cache full: sequence {seq} needs {need - len(blocks)} more blocks, "
                              f"{len(self.free_blocks)} free of {self.n_blocks}")
        while len(blocks) < need:
            block = self.free_blocks.pop()
            self.block_table[slot, len(blocks)] = block
            blocks.append(block)

    def free(self, seq: int) -> None:
        if seq in self.slot_of:
            self.free_blocks.extend(reversed(self.blocks_of.pop(seq)))
            self.free_slots.append(self.slot_of.pop(seq))

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - len(self.free_blocks)
