"""Physical KV cache blocks: which are free, which belong to which sequence."""

from __future__ import annotations

from collections import deque

from fp8serve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: the most recently freed blocks are handed out first, so a
        # workload that needs few blocks keeps reusing the same (mapped, likely
        # cached) memory. A queue would cycle through the whole cache and keep
        # writing to pages touched for the first time (page faults; ~1 GB/s on
        # 2 MiB pages here) until every block had been used once.
        self._free_block_ids: deque[int] = deque(reversed(range(num_blocks)))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0-1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        """Room for all of `seq`'s tokens while keeping `reserve` blocks free."""
        return seq.num_blocks_needed(self.block_size) + reserve <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        assert not seq.block_table, "sequence already holds blocks"
        n = seq.num_blocks_needed(self.block_size)
        if n > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {n} blocks, {self.num_free_blocks} free")
        seq.block_table = [self._free_block_ids.pop() for _ in range(n)]

    def can_append(self, seq: Sequence) -> bool:
        """Whether the slot for `seq`'s newest token exists or a block is free."""
        return len(seq.block_table) * self.block_size >= seq.num_tokens or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        if len(seq.block_table) * self.block_size < seq.num_tokens:
            seq.block_table.append(self._free_block_ids.pop())

    def free(self, seq: Sequence) -> None:
        # Reversed, so the sequence's first block is the next one handed out
        # (order is irrelevant to correctness: nothing is shared).
        self._free_block_ids.extend(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
