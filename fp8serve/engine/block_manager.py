"""Physical KV cache blocks: which are free, which belong to which sequence,
and (with prefix caching) which hold K/V that a new sequence can reuse.

Prefix caching (vLLM's automatic prefix caching, `--enable-prefix-caching`):
a full block is registered, when the step that computes its tokens is
scheduled, under a hash of its tokens and of every token before it (the
parent block's hash chained in). Two sequences with the same first k blocks
of tokens have the same k hashes and the same K/V there: positions, and so
RoPE, agree, and the per-layer k_scale/v_scale are fixed for the engine's
life, so an FP8 block holds the codes a fresh prefill would write. A new
sequence takes the longest run of registered blocks from its first token
(`cached_prefix`), shares them (reference counts) and computes only the rest.
Shared blocks are never written: a hit stops at least one token before the
sequence's end, so the block holding the token to compute is a private one.

Freed blocks that hold registered K/V stay registered, in least recently
freed order, and are the last to be handed out: blocks with nothing cached
first (the most recently freed first, see below), then the cached ones, the
oldest first, each losing its registration as it is taken.

The samples of one n > 1 request share their prompt's full blocks the same
way even without prefix caching: their chains start from a root of their
own (the request id), so only they can find each other's blocks, and n
samples prefill the prompt once.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from fp8serve.engine.sequence import Sequence

# The parent of a sequence's first block.
_ROOT_HASH = b""


def hash_block_tokens(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """SHA-256 of the parent block's hash and this block's token ids. Why not
    Python's hash(): a collision would hand one request another's K/V, and
    tuples of ints hash predictably enough to construct one on purpose."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks with nothing cached, as a stack: the most recently freed
        # blocks are handed out first, so a workload that needs few blocks
        # keeps reusing the same (mapped, likely cached) memory. A queue would
        # cycle through the whole cache and keep writing to pages touched for
        # the first time (page faults; ~1 GB/s on 2 MiB pages here) until
        # every block had been used once.
        self._free_block_ids: deque[int] = deque(reversed(range(num_blocks)))
        # Free blocks whose K/V stay registered, least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_blocks
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        # Prompt tokens looked up in the prefix cache, and those found (vLLM's prefix_cache_queries / _hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or free."""
        return len(self._hash_of_block)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0-1 (cached but free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---------------------------------------------------------- prefix cache
    def _shares(self, seq: Sequence) -> bool:
        """Whether `seq`'s blocks are registered and looked up: with prefix
        caching every sequence's, without it a sample's of an n > 1 request."""
        return self.enable_prefix_caching or seq.parent is not None

    def _root_hash(self, seq: Sequence) -> bytes:
        if self.enable_prefix_caching or seq.parent is None:
            return _ROOT_HASH
        # Without prefix caching only the samples of one request find each other's blocks.
        return b"samples of " + seq.parent.request_id.encode()

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hashes of `seq`'s first `num_blocks` full blocks, kept on the
        sequence: its tokens only ever grow, so they stay valid."""
        hashes = seq.block_hashes
        if len(hashes) < num_blocks:
            bs = self.block_size
            token_ids = seq.token_ids
            parent = hashes[-1] if hashes else self._root_hash(seq)
            for i in range(len(hashes), num_blocks):
                parent = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs])
                hashes.append(parent)
        return hashes

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Registered blocks holding `seq`'s first tokens, to share instead of
        recomputing; [] without prefix caching (but for the samples of an n > 1
        request), and for a sequence that still needs prompt logprobs (they
        come from the prefill of every position)."""
        if not self._shares(seq):
            return []
        if seq.sampling_params.prompt_logprobs is not None and seq.prompt_logprobs is None:
            return []
        # At least the last token is computed: it gives the next token's logits.
        hashes = self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        hits = []
        for h in hashes:
            block_id = self._block_of_hash.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s full blocks whose tokens are all computed (call
        after each step: decode fills blocks one token at a time)."""
        if self.enable_prefix_caching:
            self._register_blocks(seq, seq.num_computed_tokens // self.block_size)

    def _register_blocks(self, seq: Sequence, num_full: int) -> None:
        """Register `seq`'s first `num_full` blocks. A block whose tokens
        another block already holds stays private: the first one keeps the
        registration."""
        num_full = min(num_full, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block_id, h = seq.block_table[i], hashes[i]
            if block_id not in self._hash_of_block and h not in self._block_of_hash:
                self._hash_of_block[block_id] = h
                self._block_of_hash[h] = block_id
        seq.num_registered_blocks = num_full

    def reset_prefix_cache(self) -> None:
        """Forget every registration (vLLM's reset_prefix_cache): nothing is
        shared with later requests; blocks in use stay with their sequences."""
        self._free_block_ids.extend(self._evictable)
        self._evictable.clear()
        self._hash_of_block.clear()
        self._block_of_hash.clear()

    def _pop_free(self) -> int:
        if self._free_block_ids:
            block_id = self._free_block_ids.pop()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            del self._block_of_hash[self._hash_of_block.pop(block_id)]
        self._ref_counts[block_id] = 1
        return block_id

    # ------------------------------------------------------------ allocation
    def can_allocate(self, seq: Sequence, reserve: int = 0, cached: list[int] | None = None) -> bool:
        """Room for all of `seq`'s tokens while keeping `reserve` blocks free;
        `cached` (from cached_prefix) are shared, and cost a free block only
        where nothing else uses them now."""
        cached = cached or []
        taken_free = sum(1 for b in cached if self._ref_counts[b] == 0)
        needed = seq.num_blocks_needed(self.block_size) - len(cached) + taken_free
        return needed + reserve <= self.num_free_blocks

    def allocate(self, seq: Sequence, cached: list[int] | None = None, num_new_tokens: int | None = None) -> None:
        """Blocks for all of `seq`'s tokens: `cached` (from cached_prefix,
        their tokens then count as computed) followed by free ones. After a
        lookup (`cached` given, even empty: the scheduler's admissions) the
        sequence counts in the hit-rate numbers and the full blocks its first
        step computes (`num_new_tokens` after the cached ones, default all)
        are registered; without one (LLMEngine.prompt_logits) nothing is."""
        assert not seq.block_table, "sequence already holds blocks"
        looked_up = cached is not None
        cached = cached or []
        if not self.can_allocate(seq, cached=cached):
            raise RuntimeError(f"cannot allocate {seq.num_blocks_needed(self.block_size)} blocks "
                               f"({len(cached)} cached), {self.num_free_blocks} free")
        for block_id in cached:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1
        n = seq.num_blocks_needed(self.block_size) - len(cached)
        seq.block_table = list(cached) + [self._pop_free() for _ in range(n)]
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_registered_blocks = len(cached)
        if self._shares(seq) and looked_up:
            if self.enable_prefix_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += seq.num_computed_tokens
            # Registered now, before the prefill that computes them, so that
            # requests admitted in the same step share them: the model runner
            # prefills fresh prompts before those with a cached prefix, and a
            # forward pass writes every token's K/V of a layer before any
            # attention of that layer reads the cache. (The engine forgets the
            # cache if that step fails.)
            computed = seq.num_tokens if num_new_tokens is None else seq.num_computed_tokens + num_new_tokens
            self._register_blocks(seq, computed // self.block_size)

    def register_scheduled_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Chunked prefill: register `seq`'s full blocks within its first
        `num_tokens` tokens when the step computing them is scheduled (as
        allocate does for a first chunk). The scheduler puts this sequence
        before any admitted later in the step, so the forward pass writes
        these blocks before another sequence reads them."""
        if self._shares(seq):
            self._register_blocks(seq, num_tokens // self.block_size)

    def blocks_to_append(self, seq: Sequence, num_lookahead: int = 0) -> int:
        """New blocks `seq` needs for its newest token and `num_lookahead` more
        (speculative decoding's drafts, computed in the same pass)."""
        needed = -(-(seq.num_tokens + num_lookahead) // self.block_size)
        return max(0, needed - len(seq.block_table))

    def can_append(self, seq: Sequence, num_lookahead: int = 0) -> bool:
        """Whether the slots for `seq`'s newest token (and `num_lookahead` more) exist or can be had."""
        return self.blocks_to_append(seq, num_lookahead) <= self.num_free_blocks

    def append_slot(self, seq: Sequence, num_lookahead: int = 0) -> None:
        """Blocks for `seq`'s newest token and `num_lookahead` more. Blocks a
        rejected draft's slots took stay with the sequence: it grows into them."""
        for _ in range(self.blocks_to_append(seq, num_lookahead)):
            seq.block_table.append(self._pop_free())

    def free(self, seq: Sequence) -> None:
        # Reversed: the sequence's first block is the next one handed out of
        # the uncached stack, and its last cached block is the first evicted
        # (a prefix's early blocks are the ones other requests share).
        for block_id in reversed(seq.block_table):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if block_id in self._hash_of_block:
                    self._evictable[block_id] = None
                else:
                    self._free_block_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
