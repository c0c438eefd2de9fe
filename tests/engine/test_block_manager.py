"""BlockManager accounting: which blocks are free, which belong to which sequence."""

import itertools

import pytest

from fp8serve.engine.block_manager import BlockManager
from fp8serve.engine.sequence import Sequence
from fp8serve.sampling_params import SamplingParams

_ids = itertools.count()


def make_seq(num_prompt_tokens: int, num_output_tokens: int = 0) -> Sequence:
    seq = Sequence(f"seq-{next(_ids)}", list(range(num_prompt_tokens)), SamplingParams(max_tokens=None))
    seq.output_token_ids = [7] * num_output_tokens
    return seq


def owned(*seqs: Sequence) -> list[int]:
    return [b for s in seqs for b in s.block_table]


def assert_accounting(bm: BlockManager, *seqs: Sequence) -> None:
    blocks = owned(*seqs)
    assert len(blocks) == len(set(blocks)), "a block is owned twice"
    assert set(blocks).isdisjoint(bm._free_block_ids), "an owned block is also free"
    assert bm.num_free_blocks + len(blocks) == bm.num_blocks
    assert set(blocks) | set(bm._free_block_ids) == set(range(bm.num_blocks))


@pytest.mark.parametrize("num_tokens, num_blocks", [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_allocate_takes_ceil_tokens_over_block_size(num_tokens, num_blocks):
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(num_tokens)
    bm.allocate(seq)
    assert len(seq.block_table) == num_blocks
    assert bm.num_free_blocks == 8 - num_blocks
    assert_accounting(bm, seq)


def test_allocate_counts_output_tokens_of_a_resumed_sequence():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(3, num_output_tokens=6)  # 9 tokens after a preemption
    bm.allocate(seq)
    assert len(seq.block_table) == 3


def test_sequences_get_disjoint_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    seqs = [make_seq(n) for n in (3, 8, 12, 1)]
    for s in seqs:
        bm.allocate(s)
    assert bm.num_free_blocks == 10 - (1 + 2 + 3 + 1)
    assert_accounting(bm, *seqs)


def test_allocate_more_than_free_raises_and_takes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    big = make_seq(4 * 5)
    assert not bm.can_allocate(big)
    with pytest.raises(RuntimeError, match="5 blocks"):
        bm.allocate(big)
    assert big.block_table == []
    assert bm.num_free_blocks == 4


def test_allocate_twice_is_a_bug():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(2)
    bm.allocate(seq)
    with pytest.raises(AssertionError):
        bm.allocate(seq)
    assert bm.num_free_blocks == 3


def test_can_allocate_keeps_reserve_free():
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate(make_seq(8))  # 2 blocks, 4 free
    three = make_seq(12)  # needs 3
    assert bm.can_allocate(three)
    assert bm.can_allocate(three, reserve=1)  # 3 + 1 == 4: exactly fits
    assert not bm.can_allocate(three, reserve=2)
    four = make_seq(13)  # needs 4: all that is free
    assert bm.can_allocate(four, reserve=0)
    assert not bm.can_allocate(four, reserve=1)
    assert not bm.can_allocate(make_seq(17))  # needs 5


def test_a_block_is_appended_exactly_when_crossing_a_block_boundary():
    block_size = 4
    bm = BlockManager(num_blocks=8, block_size=block_size)
    seq = make_seq(3)
    bm.allocate(seq)
    grew_at = []
    for _ in range(14):  # decode: the engine appends a token, then the scheduler appends a slot
        seq.output_token_ids.append(1)
        before = list(seq.block_table)
        assert bm.can_append(seq)
        bm.append_slot(seq)
        assert seq.block_table[: len(before)] == before, "existing blocks must not move"
        if len(seq.block_table) > len(before):
            assert len(seq.block_table) == len(before) + 1
            grew_at.append(seq.num_tokens)
        assert len(seq.block_table) == -(-seq.num_tokens // block_size)
        assert_accounting(bm, seq)
    # Token 5 is the first of block 2, token 9 of block 3, ...
    assert grew_at == [5, 9, 13, 17]
    assert bm.num_free_blocks == 8 - 5


def test_append_slot_is_idempotent_within_a_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(5)
    bm.allocate(seq)
    bm.append_slot(seq)
    bm.append_slot(seq)
    assert len(seq.block_table) == 2
    assert bm.num_free_blocks == 2


def test_can_append_without_free_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    a, b = make_seq(4), make_seq(3)
    bm.allocate(a)
    bm.allocate(b)
    assert bm.num_free_blocks == 0
    b.output_token_ids.append(1)  # 4th token: its slot is in b's block
    assert bm.can_append(b)
    a.output_token_ids.append(1)  # 5th token: needs a new block, none free
    assert not bm.can_append(a)
    bm.free(b)
    assert bm.can_append(a)
    bm.append_slot(a)
    assert len(a.block_table) == 2


def test_free_returns_every_block_and_resets_the_sequence():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(9), make_seq(4)
    bm.allocate(a)
    bm.allocate(b)
    a.output_token_ids += [1, 1, 1, 1]
    bm.append_slot(a)
    a.num_computed_tokens = a.num_tokens - 1
    a_blocks = list(a.block_table)
    assert len(a_blocks) == 4
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert bm.num_free_blocks == 8 - 1
    assert set(a_blocks) <= set(bm._free_block_ids)
    assert_accounting(bm, b)
    bm.free(b)
    assert bm.num_free_blocks == 8
    assert sorted(bm._free_block_ids) == list(range(8))
    # The freed blocks are usable again, all of them.
    c = make_seq(32)
    bm.allocate(c)
    assert sorted(c.block_table) == list(range(8))


def test_usage_fraction():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.usage == 0.0
    a = make_seq(8)
    bm.allocate(a)
    assert bm.usage == pytest.approx(0.25)
    b = make_seq(24)
    bm.allocate(b)
    assert bm.usage == pytest.approx(1.0)
    bm.free(a)
    assert bm.usage == pytest.approx(0.75)
    bm.free(b)
    assert bm.usage == 0.0


def test_most_recently_freed_blocks_are_reused_first():
    """A workload that needs few blocks keeps reusing the same ones (already
    mapped and likely cached) instead of walking the whole cache."""
    bm = BlockManager(num_blocks=64, block_size=4)
    first = make_seq(10)
    bm.allocate(first)
    assert first.block_table == [0, 1, 2]
    used = list(first.block_table)
    bm.free(first)
    again = make_seq(10)
    bm.allocate(again)
    assert again.block_table == used, "a freed sequence's blocks come back in the same order"
    other = make_seq(3)
    bm.allocate(other)
    assert other.block_table == [3]
    assert_accounting(bm, again, other)


# ---------------------------------------------------------------- prefix caching
def seq_of(token_ids: list[int], **params) -> Sequence:
    return Sequence(f"seq-{next(_ids)}", list(token_ids), SamplingParams(max_tokens=None, **params))


def computed(bm: BlockManager, seq: Sequence) -> None:
    """What the engine does after a step: every token computed, full blocks registered."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """What the scheduler does: look up, then allocate with the hits; returns the hits."""
    cached = bm.cached_prefix(seq)
    assert bm.can_allocate(seq, cached=cached)
    bm.allocate(seq, cached=cached)
    return cached


def assert_shared_accounting(bm: BlockManager, *seqs: Sequence) -> None:
    """Every block is free (uncached or evictable) or used; its reference count is its number of owners."""
    owners = {}
    for s in seqs:
        for b in s.block_table:
            owners[b] = owners.get(b, 0) + 1
    free = list(bm._free_block_ids) + list(bm._evictable)
    assert len(free) == len(set(free)) and set(free).isdisjoint(owners)
    assert set(free) | set(owners) == set(range(bm.num_blocks))
    assert all(bm._ref_counts[b] == n for b, n in owners.items())
    assert all(bm._ref_counts[b] == 0 for b in free)
    assert bm.num_free_blocks == len(free)
    assert set(bm._evictable) <= set(bm._hash_of_block)
    assert {bm._block_of_hash[h] for h in bm._hash_of_block.values()} == set(bm._hash_of_block)


def test_without_prefix_caching_nothing_is_shared():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(10))
    admit(bm, a)
    computed(bm, a)
    b = seq_of(range(10))
    assert bm.cached_prefix(b) == []
    assert bm.num_cached_blocks == 0 and bm.prefix_cache_queries == 0


def test_a_shared_prefix_reuses_full_computed_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq_of(list(range(10)))  # blocks [0-3], [4-7], [8, 9]
    assert admit(bm, a) == []
    computed(bm, a)
    assert bm.num_cached_blocks == 2, "only full blocks are registered"
    b = seq_of(list(range(9)) + [99, 98])  # shares tokens 0-8: blocks 0 and 1 full
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert b.block_table[:2] == hits and b.block_table[2] not in a.block_table
    assert b.num_computed_tokens == 8
    assert bm.num_free_blocks == 8 - 3 - 1
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 11, 8)
    assert_shared_accounting(bm, a, b)


def test_a_hit_leaves_the_last_token_to_compute():
    """A prompt that is all cached still computes its last block: it gives the
    next token's logits, and a shared block is never written."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq_of(list(range(8)))
    admit(bm, a)
    computed(bm, a)
    assert bm.num_cached_blocks == 2
    same = seq_of(list(range(8)))
    assert admit(bm, same) == a.block_table[:1]
    assert same.num_computed_tokens == 4 and same.block_table[1] != a.block_table[1]
    assert_shared_accounting(bm, a, same)


def test_blocks_match_only_with_the_same_tokens_before_them():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    computed(bm, a)
    # Same second block, different first one: the chained hash differs.
    assert bm.cached_prefix(seq_of([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []
    # Same first block only.
    assert bm.cached_prefix(seq_of([1, 2, 3, 4, 5, 6, 7, 0, 9])) == a.block_table[:1]


def test_generated_tokens_are_cached_too():
    """A preempted sequence resumes from its own blocks (prompt and output)."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq_of(list(range(6)))
    admit(bm, a)
    computed(bm, a)  # 1 full block
    for t in (50, 51, 52):  # decode: 9 tokens, two full blocks computed
        a.output_token_ids.append(t)
        bm.append_slot(a)
        computed(bm, a)
    a.output_token_ids.append(53)  # sampled, not yet computed
    bm.append_slot(a)
    blocks = list(a.block_table)
    bm.free(a)  # a preemption
    assert a.num_computed_tokens == 0 and bm.num_free_blocks == 8
    assert admit(bm, a) == blocks[:2]
    assert a.num_computed_tokens == 8 and a.num_tokens == 10
    assert_shared_accounting(bm, a)


def test_prompt_logprobs_requests_skip_the_cache():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq_of(list(range(10)))
    admit(bm, a)
    computed(bm, a)
    wants = seq_of(list(range(10)), prompt_logprobs=1)
    assert bm.cached_prefix(wants) == []
    wants.prompt_logprobs = [None]  # computed earlier (a resumed request): the cache applies again
    assert bm.cached_prefix(wants) == a.block_table[:2]


def test_shared_blocks_stay_until_their_last_owner_frees_them():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq_of(list(range(10)))
    admit(bm, a)
    computed(bm, a)
    b = seq_of(list(range(12)))
    shared = admit(bm, b)
    assert len(shared) == 2
    bm.free(a)
    assert all(bm._ref_counts[x] == 1 for x in shared)
    assert_shared_accounting(bm, b)
    computed(bm, b)
    bm.free(b)
    assert_shared_accounting(bm)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    assert bm.num_cached_blocks == 3  # a's two, then b's third block


def test_freed_cached_blocks_are_handed_out_last_oldest_first():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = seq_of(list(range(9)))  # 3 blocks, 2 registered
    admit(bm, a)
    computed(bm, a)
    cached_a = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 6 and set(bm._evictable) == set(cached_a)
    # 4 blocks: the 4 uncached ones first, a's prefix survives.
    c = seq_of([100 + i for i in range(16)])
    admit(bm, c)
    assert set(c.block_table).isdisjoint(cached_a)
    assert bm.cached_prefix(seq_of(list(range(9)))) == cached_a
    # One more block: the oldest evictable goes, which is a's second block (freed first).
    d = seq_of([200, 201])
    admit(bm, d)
    assert d.block_table == [cached_a[1]]
    assert bm.cached_prefix(seq_of(list(range(9)))) == cached_a[:1]
    assert_shared_accounting(bm, c, d)


def test_can_allocate_counts_cached_free_blocks_as_taken():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = seq_of(list(range(9)))
    admit(bm, a)
    computed(bm, a)
    bm.free(a)  # 2 evictable + 2 uncached
    b = seq_of(list(range(8)) + [70, 71, 72, 73, 74])  # 4 blocks: 2 hits, 2 new
    hits = bm.cached_prefix(b)
    assert len(hits) == 2
    assert bm.can_allocate(b, cached=hits)
    assert not bm.can_allocate(b, reserve=1, cached=hits), "the hits are free blocks that become used"
    bm.allocate(b, cached=hits)
    assert bm.num_free_blocks == 0
    assert_shared_accounting(bm, b)


def test_a_duplicate_block_stays_private():
    """Two sequences that generate the same tokens fill equal private blocks: the first one
    registered keeps the registration, the other stays private and is freed as uncached."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a, b = seq_of(list(range(5))), seq_of(list(range(5)))
    admit(bm, a)
    assert admit(bm, b) == a.block_table[:1], "registered at admission: shared in the same step"
    for s in (a, b):
        computed(bm, s)
        for t in (60, 61, 62):
            s.output_token_ids.append(t)
            bm.append_slot(s)
            computed(bm, s)
    assert a.block_table[1] != b.block_table[1]
    assert a.block_table[1] in bm._hash_of_block and b.block_table[1] not in bm._hash_of_block
    private = b.block_table[1]
    bm.free(b)
    assert private in bm._free_block_ids and bm.num_free_blocks == 8 - 2
    assert_shared_accounting(bm, a)


def test_reset_prefix_cache_forgets_every_registration():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a, b = seq_of(list(range(9))), seq_of([50 + i for i in range(9)])
    for s in (a, b):
        admit(bm, s)
        computed(bm, s)
    bm.free(a)  # a's blocks evictable, b's in use
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and not bm._evictable and bm.num_free_blocks == 8 - 3
    assert bm.cached_prefix(seq_of(list(range(9)))) == [] and bm.cached_prefix(seq_of([50 + i for i in range(9)])) == []
    assert_shared_accounting(bm, b)
    bm.free(b)
    assert sorted(bm._free_block_ids) == list(range(8))


def test_block_hash_chains_the_parent():
    from fp8serve.engine.block_manager import hash_block_tokens

    h = hash_block_tokens(b"", [1, 2, 3, 4])
    assert h == hash_block_tokens(b"", [1, 2, 3, 4]) and len(h) == 32
    assert hash_block_tokens(h, [5, 6]) != hash_block_tokens(b"", [5, 6])
    assert hash_block_tokens(b"", [1, 2, 3, 4]) != hash_block_tokens(b"", [1, 2, 3, 5])


def test_an_allocation_without_a_lookup_registers_nothing():
    """LLMEngine.prompt_logits allocates without looking up: neither counted nor registered."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq_of(list(range(9)))
    bm.allocate(a)
    assert bm.num_cached_blocks == 0 and bm.prefix_cache_queries == 0
    bm.free(a)
    assert bm.cached_prefix(seq_of(list(range(9)))) == []


def test_samples_of_one_request_share_their_prompt_without_prefix_caching():
    """The samples of an n > 1 request find each other's full prompt blocks; another request's
    samples with the same tokens, and plain requests, do not (their chains start elsewhere)."""
    from fp8serve.engine.sequence import ParentRequest

    bm = BlockManager(num_blocks=32, block_size=4)

    def samples(request_id: str, n: int) -> list[Sequence]:
        parent = ParentRequest(request_id, [])
        for i in range(n):
            seq = Sequence(f"{i}_{request_id}", list(range(10)), SamplingParams(max_tokens=None))
            seq.parent, seq.index = parent, i
            parent.children.append(seq)
        return parent.children

    a0, a1, a2 = samples("a", 3)
    bm.allocate(a0, cached=bm.cached_prefix(a0))
    assert a0.num_computed_tokens == 0 and bm.num_cached_blocks == 2
    for s in (a1, a2):
        bm.allocate(s, cached=bm.cached_prefix(s))
        assert s.block_table[:2] == a0.block_table[:2] and s.num_computed_tokens == 8
    (b0,) = samples("b", 1)
    plain = Sequence("plain", list(range(10)), SamplingParams(max_tokens=None))
    assert bm.cached_prefix(b0) == [] and bm.cached_prefix(plain) == []
    assert bm.prefix_cache_queries == bm.prefix_cache_hits == 0  # the prefix-cache counters: off
    for s in (a0, a1, a2):
        bm.free(s)
    assert bm.num_free_blocks == 32
