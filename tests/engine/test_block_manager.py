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
