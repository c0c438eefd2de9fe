"""Scheduler: admission, continuous batching, preemption by recompute; pure Python, no model."""

import itertools
import random

import pytest

from fp8serve.config import SchedulerConfig
from fp8serve.engine.block_manager import BlockManager
from fp8serve.engine.scheduler import Scheduler, SchedulerOutput
from fp8serve.engine.sequence import Sequence, SequenceStatus
from fp8serve.sampling_params import SamplingParams

_ids = itertools.count()


def make_seq(num_prompt_tokens: int, name: str | None = None) -> Sequence:
    return Sequence(name or f"seq-{next(_ids)}", list(range(1, num_prompt_tokens + 1)), SamplingParams(max_tokens=None))


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=None, max_model_len=32,
                   reserve_growth=False, enable_prefix_caching=False):
    """The admission and preemption mechanics are tested with the watermark only (reserve_growth
    False): the growth reservation has its own tests below."""
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(config, bm, reserve_growth=reserve_growth)


def run_step(out: SchedulerOutput, token: int = 9, block_manager: BlockManager | None = None) -> None:
    """What the engine does with a step's output: every scheduled sequence's tokens are now in
    the cache (registered for prefix caching), and it samples one new token."""
    for seq in out.seqs:
        seq.num_computed_tokens = seq.num_tokens
        if block_manager is not None:
            block_manager.cache_computed_blocks(seq)
        seq.output_token_ids.append(token)


def names(seqs) -> list[str]:
    return [s.request_id for s in seqs]


# ------------------------------------------------------------------------------- admission


def test_prefill_first_then_decode():
    sched = make_scheduler()
    a, b = make_seq(5, "a"), make_seq(3, "b")
    sched.add(a)
    sched.add(b)
    assert sched.num_waiting == 2 and sched.has_unfinished()
    out = sched.schedule()
    assert out.is_prefill and names(out.seqs) == ["a", "b"]
    assert out.num_batched_tokens == 8
    assert a.status is b.status is SequenceStatus.RUNNING
    assert sched.num_waiting == 0 and sched.num_running == 2
    run_step(out)
    out = sched.schedule()
    assert not out.is_prefill and names(out.seqs) == ["a", "b"]
    assert out.num_batched_tokens == 2  # one token per sequence
    assert out.preempted == []


def test_nothing_to_do():
    sched = make_scheduler()
    assert sched.schedule() is None
    assert not sched.has_unfinished()


def test_max_num_seqs_caps_admission():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(3, n) for n in "abc"]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert out.is_prefill and names(out.seqs) == ["a", "b"]
    assert names(sched.waiting) == ["c"]
    run_step(out)
    # "c" is waiting but the batch is full: decode the two running ones.
    out = sched.schedule()
    assert not out.is_prefill and names(out.seqs) == ["a", "b"]
    run_step(out)
    sched.finish(seqs[0])
    out = sched.schedule()
    assert out.is_prefill and names(out.seqs) == ["c"]
    assert sched.num_running == 2


def test_max_num_batched_tokens_caps_a_prefill():
    sched = make_scheduler(max_num_batched_tokens=10, max_model_len=10)
    a, b, c = make_seq(4, "a"), make_seq(6, "b"), make_seq(1, "c")
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert names(out.seqs) == ["a", "b"] and out.num_batched_tokens == 10
    assert names(sched.waiting) == ["c"]
    run_step(out)
    out = sched.schedule()
    # The budget is per step: the next step admits "c".
    assert out.is_prefill and names(out.seqs) == ["c"] and out.num_batched_tokens == 1


def test_admission_is_first_come_first_served():
    # "big" does not fit in the budget left after "a"; "small" behind it must not jump the queue.
    sched = make_scheduler(max_num_batched_tokens=10, max_model_len=10)
    a, big, small = make_seq(4, "a"), make_seq(8, "big"), make_seq(1, "small")
    for s in (a, big, small):
        sched.add(s)
    out = sched.schedule()
    assert names(out.seqs) == ["a"]
    assert names(sched.waiting) == ["big", "small"]


def test_a_sequence_that_needs_the_whole_cache_is_admitted_when_nothing_runs():
    # No watermark is kept for an empty batch; otherwise a max_model_len request could never run.
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    seq = make_seq(16)
    sched.add(seq)
    out = sched.schedule()
    assert out is not None and out.seqs == [seq]
    assert sched.block_manager.num_free_blocks == 0


def test_admission_waits_for_blocks():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    a, b = make_seq(12, "a"), make_seq(8, "b")  # 3 + 2 blocks > 4
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert names(out.seqs) == ["a"] and names(sched.waiting) == ["b"]
    assert b.block_table == [] and b.status is SequenceStatus.WAITING
    run_step(out)
    out = sched.schedule()
    assert not out.is_prefill and names(out.seqs) == ["a"]
    run_step(out)
    sched.finish(a)
    assert sched.block_manager.num_free_blocks == 4
    out = sched.schedule()
    assert out.is_prefill and names(out.seqs) == ["b"]


# ----------------------------------------------------------------------- continuous batching


def test_new_request_joins_while_others_decode():
    sched = make_scheduler()
    a, b = make_seq(5, "a"), make_seq(7, "b")
    sched.add(a)
    sched.add(b)
    run_step(sched.schedule())  # prefill a, b
    out = sched.schedule()
    assert not out.is_prefill and names(out.seqs) == ["a", "b"]
    run_step(out)

    c = make_seq(6, "c")
    sched.add(c)
    out = sched.schedule()
    # The newcomer is prefilled alone; a and b wait one step, keeping their state.
    assert out.is_prefill and names(out.seqs) == ["c"] and out.num_batched_tokens == 6
    assert len(a.output_token_ids) == len(b.output_token_ids) == 2
    run_step(out)

    out = sched.schedule()
    assert not out.is_prefill and names(out.seqs) == ["a", "b", "c"]
    for s in out.seqs:
        assert s.num_computed_tokens == s.num_tokens - 1  # exactly one new token each
    run_step(out)
    assert [len(s.output_token_ids) for s in (a, b, c)] == [3, 3, 2]


def test_finished_sequence_leaves_the_batch_and_frees_its_blocks():
    sched = make_scheduler(num_blocks=16)
    a, b = make_seq(5, "a"), make_seq(7, "b")
    sched.add(a)
    sched.add(b)
    run_step(sched.schedule())
    used_by_a = len(a.block_table)
    free_before = sched.block_manager.num_free_blocks
    sched.finish(a)
    assert a.status is SequenceStatus.FINISHED and a.block_table == []
    assert sched.block_manager.num_free_blocks == free_before + used_by_a
    out = sched.schedule()
    assert names(out.seqs) == ["b"]


def test_finish_a_waiting_sequence_removes_it_from_the_queue():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_seq(3, "a"), make_seq(3, "b")
    sched.add(a)
    sched.add(b)
    run_step(sched.schedule())
    sched.finish(b)  # e.g. aborted while waiting
    assert sched.num_waiting == 0 and b.status is SequenceStatus.FINISHED
    sched.finish(a)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


# ------------------------------------------------------------------------------ preemption


def test_preempts_the_most_recently_admitted_not_the_one_that_needs_a_block():
    # 4 blocks of 4 tokens; one block is kept free when admitting next to running sequences.
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    a = make_seq(4, "a")
    sched.add(a)
    run_step(sched.schedule())  # a: 5 tokens in 1 block, 3 free
    b = make_seq(2, "b")
    sched.add(b)
    out = sched.schedule()
    assert names(out.seqs) == ["b"]
    run_step(out)  # b: 3 tokens, 2 free
    c = make_seq(2, "c")
    sched.add(c)
    out = sched.schedule()
    assert names(out.seqs) == ["c"]
    run_step(out)  # c: 3 tokens, 1 free

    out = sched.schedule()  # a takes the last free block for its 5th token
    assert not out.is_prefill and names(out.seqs) == ["a", "b", "c"] and out.preempted == []
    assert sched.block_manager.num_free_blocks == 0
    run_step(out)  # a 6, b 4, c 4 tokens
    out = sched.schedule()
    assert names(out.seqs) == ["a", "b", "c"] and out.preempted == []
    run_step(out)  # a 7, b 5, c 5: b needs a new block and none is free

    c_blocks = list(c.block_table)
    out = sched.schedule()
    assert names(out.preempted) == ["c"]
    assert names(out.seqs) == ["a", "b"]
    assert c_blocks[0] in b.block_table  # c's freed block went to b
    assert sched.num_preemptions == 1 and c.num_preemptions == 1
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert names(sched.running) == ["a", "b"] and names(sched.waiting) == ["c"]


def test_preempted_sequence_goes_to_the_front_keeps_its_output_and_is_recomputed():
    sched = make_scheduler(num_blocks=3, block_size=4, max_model_len=12)
    a, b = make_seq(4, "a"), make_seq(4, "b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert names(out.seqs) == ["a", "b"]  # 1 block each, 1 free
    run_step(out, token=101)  # a, b: 5 tokens each; each needs a 2nd block
    d = make_seq(4, "d")
    sched.add(d)  # arrives now; must not be admitted into the last free block
    out = sched.schedule()
    assert not out.is_prefill
    assert names(out.seqs) == ["a"] and names(out.preempted) == ["b"]
    assert names(sched.waiting) == ["b", "d"], "the preempted sequence goes before later arrivals"
    assert b.output_token_ids == [101] and b.block_table == []
    run_step(out, token=102)  # a: 6 tokens in 2 blocks

    out = sched.schedule()  # b needs 2 blocks plus the watermark: it waits, a decodes
    assert not out.is_prefill and names(out.seqs) == ["a"]
    run_step(out)
    sched.finish(a)

    out = sched.schedule()
    assert out.is_prefill and names(out.seqs) == ["b"]
    # Recompute: the whole prompt and the output so far are prefilled again.
    assert b.num_computed_tokens == 0
    assert b.token_ids == [1, 2, 3, 4, 101]
    assert out.num_batched_tokens == 5
    assert len(b.block_table) == 2
    run_step(out, token=103)
    assert b.output_token_ids == [101, 103]
    assert names(sched.waiting) == ["d"]


def test_several_preempted_sequences_keep_their_order_at_the_front():
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=16)
    seqs = [make_seq(4, n) for n in "abcd"]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert names(out.seqs) == ["a", "b", "c", "d"]  # 1 block each, 1 free
    run_step(out)  # all at 5 tokens: each needs a second block
    sched.add(make_seq(4, "e"))
    out = sched.schedule()
    # a takes the free block; b gets d's; c, needing one with nothing newer left, yields its own.
    assert not out.is_prefill and names(out.seqs) == ["a", "b"]
    assert sorted(names(out.preempted)) == ["c", "d"]
    assert names(sched.waiting) == ["c", "d", "e"]
    assert sched.num_preemptions == 2
    assert sched.block_manager.num_free_blocks == 1  # c's block; a and b hold 2 each


# ----------------------------------------------------------------------- randomized simulation


def arrive(rng: random.Random, sched: Scheduler, all_seqs: list[Sequence], target: dict[str, int],
           max_model_len: int, counts: list[int]) -> None:
    """The randomized simulations' arrivals: with probability 0.35 a step brings rng.choice(counts)
    new sequences of 1-16 prompt tokens, each with a random output length (`target`) that fits."""
    if rng.random() < 0.35:
        for _ in range(rng.choice(counts)):
            seq = make_seq(rng.randint(1, 16))
            target[seq.request_id] = rng.randint(1, max_model_len - seq.num_prompt_tokens)
            all_seqs.append(seq)
            sched.add(seq)


def check_invariants(sched: Scheduler, out: SchedulerOutput | None, all_seqs: list[Sequence],
                     finished: set[str], max_drafts: int = 0) -> None:
    """max_drafts: speculative decoding's drafts per sequence, whose slots a sequence may hold
    beyond its tokens."""
    bm = sched.block_manager
    bs = bm.block_size
    owned = [b for s in sched.running for b in s.block_table]
    if bm.enable_prefix_caching:
        # Only registered blocks (full, computed, read-only) are shared.
        shared = {b for b in owned if owned.count(b) > 1}
        assert shared <= set(bm._hash_of_block), "a block owned by two sequences is not a cached one"
        assert all(bm._ref_counts[b] == owned.count(b) for b in set(owned))
        for s in sched.running:
            assert all(b in bm._hash_of_block for b in s.block_table[:s.num_computed_tokens // bs]
                       if b in shared)
    else:
        assert len(owned) == len(set(owned)), "a block is owned by two sequences"
    free = list(bm._free_block_ids) + list(bm._evictable)
    assert set(owned).isdisjoint(free), "a block is both free and owned"
    assert bm.num_free_blocks == len(free) and bm.num_free_blocks + len(set(owned)) == bm.num_blocks
    assert all(0 <= b < bm.num_blocks for b in owned)
    for s in sched.waiting:
        assert s.block_table == [] and s.status is SequenceStatus.WAITING
    for s in sched.running:
        assert s.status is SequenceStatus.RUNNING
        # Blocks for every token except, at most, the newest one that the next decode will add;
        # and never more blocks than the tokens need.
        assert len(s.block_table) * bs >= s.num_tokens - 1
        if max_drafts:
            assert len(s.block_table) <= -(-(s.num_tokens + max_drafts) // bs)
        else:
            assert len(s.block_table) == -(-s.num_tokens // bs) or len(s.block_table) == (s.num_tokens - 1) // bs
    if out is not None:
        for s in out.seqs:
            assert len(s.block_table) * bs >= s.num_tokens + len(s.spec_token_ids), "a scheduled sequence lacks a slot"
    assert len(sched.running) <= sched.config.max_num_seqs
    # No sequence is lost or duplicated.
    live = names(sched.running) + names(sched.waiting)
    assert len(live) == len(set(live))
    assert set(live) | finished == {s.request_id for s in all_seqs}
    assert not set(live) & finished


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("reserve_growth", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_simulation_keeps_invariants(seed, reserve_growth, prefix_caching):
    """make_seq's prompts are 1, 2, 3, ...: every two share a prefix, so with prefix caching many
    admissions share blocks, and preempted sequences find their own blocks again."""
    rng = random.Random(seed)
    block_size, num_blocks, max_model_len = 4, 12, 24
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=6,
                           max_num_batched_tokens=32, max_model_len=max_model_len, reserve_growth=reserve_growth,
                           enable_prefix_caching=prefix_caching)
    bm = sched.block_manager
    all_seqs: list[Sequence] = []
    target: dict[str, int] = {}
    finished: set[str] = set()
    admitted_at: dict[str, int] = {}  # request id -> order of its latest (re)admission
    admissions = itertools.count()
    num_arrival_steps, max_steps = 300, 3000
    num_prefills = num_decodes = 0

    for step in range(max_steps):
        if step < num_arrival_steps:
            arrive(rng, sched, all_seqs, target, max_model_len, [1, 1, 1, 2, 3])
        if step >= num_arrival_steps and not sched.has_unfinished():
            break

        running_before = list(sched.running)
        outputs_before = {s.request_id: len(s.output_token_ids) for s in all_seqs}
        out = sched.schedule()
        check_invariants(sched, out, all_seqs, finished)
        if out is None:
            # With nothing running the whole cache is free, so a waiting sequence always fits.
            assert not sched.has_unfinished(), f"step {step}: stalled with work left"
            continue

        if out.is_prefill:
            num_prefills += 1
            assert out.preempted == []
            assert out.num_batched_tokens == sum(s.num_tokens - s.num_computed_tokens for s in out.seqs)
            assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
            for s in out.seqs:
                if prefix_caching:  # whole shared blocks, and at least the newest token computed
                    assert s.num_computed_tokens % block_size == 0 and s.num_computed_tokens < s.num_tokens
                else:
                    assert s.num_computed_tokens == 0  # (re)computed from scratch
                admitted_at[s.request_id] = next(admissions)
            # Fresh sequences first (the model runner prefills them apart).
            has_context = [s.num_computed_tokens > 0 for s in out.seqs]
            assert has_context == sorted(has_context)
        else:
            num_decodes += 1
            assert out.num_batched_tokens == len(out.seqs)
            # Every running sequence either decodes or is preempted, none are skipped; the
            # preempted ones are the most recently admitted (the tail of the running list).
            kept = len(out.seqs)
            assert names(out.seqs) == names(running_before)[:kept]
            assert sorted(names(out.preempted)) == sorted(names(running_before)[kept:])
            for s in out.seqs:
                assert s.num_computed_tokens == s.num_tokens - 1
            if out.preempted:
                newest_kept = max((admitted_at[s.request_id] for s in out.seqs), default=-1)
                assert all(admitted_at[s.request_id] > newest_kept for s in out.preempted), \
                    "preemption must take the most recently admitted sequences"
                assert names(sched.waiting)[: len(out.preempted)] == \
                    sorted(names(out.preempted), key=lambda r: admitted_at[r]), \
                    "preempted sequences go to the front of the queue"
                for s in out.preempted:
                    assert len(s.output_token_ids) == outputs_before[s.request_id]

        run_step(out, token=rng.randrange(1, 500), block_manager=bm if prefix_caching else None)
        for s in out.seqs:
            if len(s.output_token_ids) >= target[s.request_id] or s.num_tokens >= max_model_len:
                sched.finish(s)
                finished.add(s.request_id)
                assert s.block_table == []
        check_invariants(sched, None, all_seqs, finished)
    else:
        pytest.fail(f"not done after {max_steps} steps: {sched.num_running} running, {sched.num_waiting} waiting")

    assert len(all_seqs) > 50
    assert finished == {s.request_id for s in all_seqs}, "every request finishes"
    for s in all_seqs:
        assert len(s.output_token_ids) == target[s.request_id], "recompute must not lose or repeat tokens"
    if not reserve_growth:  # the reservation exists to make preemptions rare
        assert sched.num_preemptions > 0, "the pool is too big to exercise preemption"
    assert num_prefills > 0 and num_decodes > 0
    assert bm.num_free_blocks == num_blocks
    assert sorted(list(bm._free_block_ids) + list(bm._evictable)) == list(range(num_blocks))
    if prefix_caching:
        assert bm.prefix_cache_hits > 0 and bm.num_cached_blocks > 0
    else:
        assert bm.prefix_cache_queries == 0 and not bm._evictable


# ------------------------------------------------------------------ growth reservation at admission


def make_seq_max(num_prompt_tokens: int, max_tokens: int | None, name: str) -> Sequence:
    return Sequence(name, list(range(1, num_prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens))


def finish_as(sched: Scheduler, seq: Sequence, num_outputs: int, reason: str) -> None:
    """What the engine does when `seq` ends after `num_outputs` tokens for `reason`."""
    seq.output_token_ids[:] = [7] * num_outputs
    seq.finish_reason = reason
    sched.finish(seq)


def test_budget_and_expected_growth():
    sched = make_scheduler(max_model_len=32, reserve_growth=True)
    assert sched.reserve_ratio == 0.7  # nothing has finished yet
    a = make_seq_max(4, 10, "a")
    assert sched.output_budget(a) == 10 and sched.expected_growth(a) == 7  # ceil(0.7 * 10)
    a.output_token_ids += [7, 7, 7]
    assert sched.expected_growth(a) == 4  # less what it generated
    a.output_token_ids += [7] * 5
    assert sched.expected_growth(a) == 0  # past the estimate: nothing, not negative
    b = make_seq_max(4, None, "b")
    assert sched.output_budget(b) == 28 and sched.expected_growth(b) == 20  # to the model length
    assert sched.output_budget(make_seq_max(30, 10, "c")) == 2  # the model length caps max_tokens
    assert sched.growth_reserve(13) == 4 and sched.growth_reserve(0) == 0  # blocks of 4 tokens
    long = make_scheduler(max_model_len=10000, reserve_growth=True)
    assert long.expected_growth(make_seq_max(4, None, "d")) == 4096  # 0.7 * 9996, clipped
    off = make_scheduler(max_model_len=32, reserve_growth=False)
    assert off.reserve_ratio == 0.0 and off.expected_growth(make_seq_max(4, 10, "e")) == 0


def test_outputs_that_nothing_but_the_budget_can_end_are_reserved_whole():
    """ignore_eos without stop strings or stop token ids: the whole budget will be generated, so it is
    all reserved, whatever the ratio (0.7 before anything finished); min_tokens is a floor otherwise."""
    from fp8serve.engine.sequence import Sequence

    sched = make_scheduler(max_model_len=32, reserve_growth=True)

    def seq(name, **params):
        return Sequence(name, [5] * 4, SamplingParams(max_tokens=20, **params))

    sure = seq("a", ignore_eos=True)
    assert sched.certain_output(sure) == 20 and sched.expected_growth(sure) == 20  # not ceil(0.7 * 20) = 14
    sure.output_token_ids += [7] * 5
    assert sched.expected_growth(sure) == 15
    assert sched.expected_growth(seq("b", ignore_eos=True, stop=["x"])) == 14  # a stop string may end it
    assert sched.expected_growth(seq("c", ignore_eos=True, stop_token_ids=[9])) == 14
    assert sched.certain_output(seq("d", min_tokens=18)) == 18 and sched.expected_growth(seq("d", min_tokens=18)) == 18
    assert sched.expected_growth(seq("e", min_tokens=3)) == 14  # below the ratio's estimate
    longer = Sequence("f", [5] * 30, SamplingParams(max_tokens=20, ignore_eos=True))
    assert sched.certain_output(longer) == 2  # the model length ends it first
    off = make_scheduler(max_model_len=32, reserve_growth=False)
    assert off.expected_growth(seq("g", ignore_eos=True)) == 0  # no reservation at all


def test_a_saturating_workload_of_ignore_eos_requests_runs_without_preemptions():
    """The KV-limited benchmark's shape (benchmarks/kv_saturation_engine.py, scheduler_sim.py): requests
    that all run to max_tokens, a cache for 4 of them at full length. The ratio's 0.7 before any has
    finished admitted a fifth, and the first wave ran out of blocks; reserving what they will
    certainly generate admits 4 and never preempts (every recompute is a prefill done twice)."""
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=16, max_model_len=32, reserve_growth=True)
    for i in range(12):
        sched.add(Sequence(f"r{i}", [5] * 16, SamplingParams(max_tokens=16, ignore_eos=True)))
    finished = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out is not None, "stuck"
        assert len(sched.running) <= 4
        run_step(out)
        for s in list(sched.running):
            if len(s.output_token_ids) >= 16:
                s.finish_reason = "length"
                sched.finish(s)
                finished += 1
    assert finished == 12 and sched.num_preemptions == 0


def test_ratio_is_learned_from_the_requests_that_finished():
    from fp8serve.engine.scheduler import RESERVE_WINDOW

    sched = make_scheduler(max_model_len=64, reserve_growth=True)
    finish_as(sched, make_seq_max(4, 20, "a"), 2, "stop")  # 2 of 20
    assert sched.reserve_ratio == pytest.approx(0.1)
    finish_as(sched, make_seq_max(4, 20, "b"), 5, "length")  # the largest share of the window counts
    assert sched.reserve_ratio == pytest.approx(0.25)
    finish_as(sched, make_seq_max(4, 20, "c"), 20, "abort")  # aborted: says nothing about output lengths
    assert sched.reserve_ratio == pytest.approx(0.25)
    for i in range(RESERVE_WINDOW):  # the window forgets: 64 later requests of 1 token in 20
        finish_as(sched, make_seq_max(4, 20, f"w{i}"), 1, "stop")
    assert sched.reserve_ratio == pytest.approx(0.05)
    off = make_scheduler(reserve_growth=False)
    finish_as(off, make_seq_max(4, 20, "x"), 20, "length")
    assert off.reserve_ratio == 0.0


def test_admission_keeps_room_for_the_running_sequences_expected_growth():
    """16 blocks of 4 tokens. a (4 prompt tokens, max_tokens 20) runs; b's 48-token prompt needs
    12 blocks. The watermark alone (1 block) admits b into 15 free blocks; the reservation keeps
    room for a's expected ceil(0.7 * 20) - 1 = 13 tokens (4 blocks) and holds b back. Once a
    request has finished after 2 tokens of 20, the ratio is 0.1 and b fits beside a new a."""
    for reserve_growth, b_admitted in ((False, True), (True, False)):
        sched = make_scheduler(num_blocks=16, block_size=4, max_model_len=64, reserve_growth=reserve_growth)
        a = make_seq_max(4, 20, "a")
        sched.add(a)
        run_step(sched.schedule())  # a alone: nothing runs, no reserve; 1 block, 15 free
        b = make_seq_max(48, 4, "b")
        sched.add(b)
        out = sched.schedule()
        assert out.is_prefill is b_admitted, f"reserve_growth={reserve_growth}"
        if b_admitted:
            continue
        assert names(out.seqs) == ["a"] and names(sched.waiting) == ["b"]
        run_step(out)
        sched.running.remove(a)
        finish_as(sched, a, 2, "stop")  # 2 of its 20 tokens: the ratio is now 0.1
        a2 = make_seq_max(4, 20, "a2")
        sched.waiting.appendleft(a2)
        out = sched.schedule()  # a2 first (nothing runs), then b beside it: 12 + max(1, ceil((2 - 0) / 4)) <= 15
        assert out.is_prefill and names(out.seqs) == ["a2", "b"]


def test_a_preemption_lifts_the_ratio_to_one_then_the_floor_decays():
    from fp8serve.engine.scheduler import RESERVE_FLOOR_DECAY, RESERVE_RATIO_AFTER_PREEMPTION

    sched = make_scheduler(num_blocks=3, block_size=4, max_model_len=12, reserve_growth=True)
    finish_as(sched, make_seq_max(4, 8, "x"), 1, "stop")  # learned: 1 of 8
    assert sched.reserve_ratio == pytest.approx(0.125)
    b, c = make_seq_max(4, 8, "b"), make_seq_max(4, 8, "c")
    sched.add(b)
    sched.add(c)
    out = sched.schedule()
    assert names(out.seqs) == ["b", "c"]  # 1 block each, 1 free; each expected to grow by 1 token
    run_step(out)  # both at 5 tokens: each needs a second block, one is free
    out = sched.schedule()
    assert names(out.preempted) == ["c"]
    assert sched.reserve_ratio == RESERVE_RATIO_AFTER_PREEMPTION == 1.0
    run_step(out)
    out = sched.schedule()  # c waits (2 blocks, 1 free): b decodes alone
    assert not out.is_prefill and names(out.seqs) == ["b"] and out.preempted == []
    run_step(out)
    assert sched.reserve_ratio == pytest.approx(1.0 - RESERVE_FLOOR_DECAY)  # one decode step since
    sched.preemption_floor = RESERVE_FLOOR_DECAY / 2
    run_step(sched.schedule())
    assert sched.preemption_floor == 0.0 and sched.reserve_ratio == pytest.approx(0.125)


def test_without_growth_reservation_nothing_is_learned_or_lifted():
    sched = make_scheduler(num_blocks=3, block_size=4, max_model_len=12, reserve_growth=False)
    b, c = make_seq_max(4, 8, "b"), make_seq_max(4, 8, "c")
    sched.add(b)
    sched.add(c)
    run_step(sched.schedule())
    out = sched.schedule()
    assert names(out.preempted) == ["c"] and sched.reserve_ratio == 0.0


# ------------------------------------------------------------------------- prefix caching


def test_a_cached_prefix_counts_only_the_new_tokens_against_the_token_budget():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=32, max_model_len=32,
                           enable_prefix_caching=True)
    first = make_seq(20, "first")
    sched.add(first)
    out = sched.schedule()
    run_step(out, block_manager=sched.block_manager)
    sched.finish(first)
    # Three prompts of 21 tokens (63 > 32) whose first 20 tokens are cached: 1 new token each.
    others = [make_seq(21, name) for name in ("a", "b", "c")]
    for s in others:
        sched.add(s)
    out = sched.schedule()
    assert out.is_prefill and names(out.seqs) == ["a", "b", "c"]
    assert [s.num_computed_tokens for s in out.seqs] == [20, 20, 20]
    assert out.num_batched_tokens == 3
    assert all(s.block_table[:5] == out.seqs[0].block_table[:5] for s in out.seqs)


def test_fresh_prompts_are_scheduled_before_those_with_a_cached_prefix():
    sched = make_scheduler(num_blocks=32, block_size=4, enable_prefix_caching=True)
    first = make_seq(9, "first")
    sched.add(first)
    run_step(sched.schedule(), block_manager=sched.block_manager)
    sched.finish(first)
    cached = make_seq(10, "cached")  # shares first's two full blocks
    fresh = Sequence("fresh", [400 + i for i in range(10)], SamplingParams(max_tokens=None))
    sched.add(cached)
    sched.add(fresh)
    out = sched.schedule()
    assert names(out.seqs) == ["fresh", "cached"]
    assert [s.num_computed_tokens for s in out.seqs] == [0, 8]


# ------------------------------------------------------------------------------- chunked prefill


def make_chunked_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32,
                           reserve_growth=False, enable_prefix_caching=False):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, enable_chunked_prefill=True)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(config, bm, reserve_growth=reserve_growth)


def run_chunked_step(out: SchedulerOutput, token: int = 9, block_manager: BlockManager | None = None) -> list:
    """What the engine does with a chunked-prefill step: every decode and every chunk that reaches
    its sequence's last token samples one token; an earlier chunk only advances. Returns the
    sequences that got a token."""
    sampled = []
    chunks = out.num_new_tokens if out.is_prefill else [1] * len(out.seqs)
    for seq, n in zip(out.seqs, chunks):
        assert 1 <= n <= seq.num_tokens - seq.num_computed_tokens
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            sampled.append(seq)
    for seq in out.decode_seqs:
        assert seq.num_tokens - seq.num_computed_tokens == 1 and seq.output_token_ids
        seq.num_computed_tokens = seq.num_tokens
        sampled.append(seq)
    for seq in out.seqs + out.decode_seqs:
        if block_manager is not None:
            block_manager.cache_computed_blocks(seq)
    for seq in sampled:
        seq.output_token_ids.append(token)
    return sampled


def test_chunked_a_long_prompt_is_prefilled_in_chunks_of_the_budget():
    sched = make_chunked_scheduler(max_num_batched_tokens=8)
    a = make_seq(21, "a")
    sched.add(a)
    chunks = []
    while not a.output_token_ids:
        out = sched.schedule()
        assert out.is_prefill and names(out.seqs) == ["a"] and out.decode_seqs == []
        chunks.append(out.num_new_tokens[0])
        assert out.num_batched_tokens == out.num_prefill_tokens == chunks[-1]
        run_chunked_step(out)
    assert chunks == [8, 8, 5]
    assert len(a.block_table) == 6  # blocks for the whole prompt from admission on
    out = sched.schedule()
    assert not out.is_prefill and names(out.seqs) == ["a"] and out.num_batched_tokens == 1


def test_chunked_decodes_come_first_then_the_running_prefills_then_new_admissions():
    sched = make_chunked_scheduler(max_num_batched_tokens=8)
    a = make_seq(3, "a")
    sched.add(a)
    run_chunked_step(sched.schedule())  # a: prefilled, one token
    b, c = make_seq(12, "b"), make_seq(6, "c")
    sched.add(b)
    sched.add(c)
    out = sched.schedule()
    # a decodes (1 token of 8), b gets the other 7; c waits: no budget left.
    assert names(out.decode_seqs) == ["a"] and names(out.seqs) == ["b"] and out.num_new_tokens == [7]
    assert out.num_batched_tokens == 8 and out.num_prefill_tokens == 7
    assert names(sched.waiting) == ["c"]
    run_chunked_step(out)
    out = sched.schedule()
    # a decodes, b finishes its prompt (5 tokens), c starts with the 2 left; fresh prompts run
    # first in the pass (c has nothing computed yet, b continues its cached context).
    assert names(out.decode_seqs) == ["a"]
    assert names(out.seqs) == ["c", "b"] and out.num_new_tokens == [2, 5]
    sampled = run_chunked_step(out)
    assert sorted(names(sampled)) == ["a", "b"]
    out = sched.schedule()
    assert names(out.decode_seqs) == ["a", "b"] and names(out.seqs) == ["c"] and out.num_new_tokens == [4]
    run_chunked_step(out)
    out = sched.schedule()
    assert not out.is_prefill and names(out.seqs) == ["a", "b", "c"]


def test_chunked_a_chunk_never_leaves_a_single_token():
    """One uncomputed token marks a decode, so a chunk stops two tokens short instead."""
    sched = make_chunked_scheduler(max_num_batched_tokens=8)
    a = make_seq(9, "a")
    sched.add(a)
    out = sched.schedule()
    assert out.num_new_tokens == [7]
    run_chunked_step(out)
    out = sched.schedule()
    assert out.is_prefill and names(out.seqs) == ["a"] and out.num_new_tokens == [2]
    run_chunked_step(out)
    assert a.output_token_ids == [9] and a.num_computed_tokens == 9


def test_chunked_prefix_blocks_are_registered_only_as_far_as_the_step_computes():
    """A block is shared only once the step that writes it is scheduled: a request admitted
    while the first one is still in its prefill finds just the blocks computed by then."""
    sched = make_chunked_scheduler(max_num_batched_tokens=12, enable_prefix_caching=True)
    bm = sched.block_manager
    first = make_seq(20, "first")
    sched.add(first)
    out = sched.schedule()
    assert out.num_new_tokens == [12]
    assert bm.num_cached_blocks == 3  # tokens 0-11, computed by this step; not the two after
    run_chunked_step(out, block_manager=bm)
    second = make_seq(20, "second")
    sched.add(second)
    out = sched.schedule()
    # first finishes (tokens 12-19: blocks 3 and 4 registered now); second, admitted after it in
    # the same step, shares four blocks (a hit leaves its last token to compute): the forward
    # pass writes first's block 3 before second's attention reads it.
    assert names(out.seqs) == ["first", "second"] and out.num_new_tokens == [8, 4]
    assert bm.num_cached_blocks == 5
    assert second.num_computed_tokens == 16 and second.block_table[:4] == first.block_table[:4]


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("reserve_growth", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_randomized_simulation_keeps_invariants(seed, reserve_growth, prefix_caching):
    rng = random.Random(seed)
    block_size, num_blocks, max_model_len, budget = 4, 12, 24, 7
    sched = make_chunked_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=5,
                                   max_num_batched_tokens=budget, max_model_len=max_model_len,
                                   reserve_growth=reserve_growth, enable_prefix_caching=prefix_caching)
    bm = sched.block_manager
    all_seqs: list[Sequence] = []
    target: dict[str, int] = {}
    finished: set[str] = set()
    num_chunked = num_mixed = 0
    for step in range(3000):
        if step < 300:
            arrive(rng, sched, all_seqs, target, max_model_len, [1, 1, 2])
        if step >= 300 and not sched.has_unfinished():
            break
        running_before = names(sched.running)
        out = sched.schedule()
        check_invariants(sched, None, all_seqs, finished)
        if out is None:
            assert not sched.has_unfinished(), f"step {step}: stalled with work left"
            continue
        assert out.num_batched_tokens <= budget
        decodes = out.decode_seqs if out.is_prefill else out.seqs
        prefills = out.seqs if out.is_prefill else []
        chunks = out.num_new_tokens or []
        assert out.num_batched_tokens == len(decodes) + sum(chunks)
        for s in decodes:
            assert s.num_tokens - s.num_computed_tokens == 1 and len(s.block_table) * block_size >= s.num_tokens
        for s, n in zip(prefills, chunks):
            assert 1 <= n and s.num_computed_tokens + n <= s.num_tokens
            num_chunked += s.num_computed_tokens + n < s.num_tokens
        num_mixed += bool(prefills and decodes)
        # Every running sequence either decodes or is preempted; none that can decode waits.
        assert set(names(decodes)) | set(names(out.preempted)) >= {
            r for r in running_before if r not in names(prefills)
            and next(s for s in all_seqs if s.request_id == r).num_tokens
            - next(s for s in all_seqs if s.request_id == r).num_computed_tokens == 1}
        has_context = [s.num_computed_tokens > 0 for s in prefills]
        assert has_context == sorted(has_context)
        for s in run_chunked_step(out, token=rng.randrange(1, 500), block_manager=bm if prefix_caching else None):
            if len(s.output_token_ids) >= target[s.request_id] or s.num_tokens >= max_model_len:
                sched.finish(s)
                finished.add(s.request_id)
        check_invariants(sched, None, all_seqs, finished)
        # A registered block that a running sequence holds has been computed.
        for s in sched.running:
            for i, b in enumerate(s.block_table):
                if b in bm._hash_of_block:
                    assert (i + 1) * block_size <= s.num_computed_tokens
    else:
        pytest.fail("not done after 3000 steps")
    assert finished == {s.request_id for s in all_seqs}
    for s in all_seqs:
        assert len(s.output_token_ids) == target[s.request_id], "recompute must not lose or repeat tokens"
    assert num_chunked > 0 and num_mixed > 0
    if prefix_caching:
        assert bm.prefix_cache_hits > 0
    if not reserve_growth:
        assert sched.num_preemptions > 0, "the pool is too big to exercise preemption"
    assert bm.num_free_blocks == num_blocks


# ------------------------------------------------------------------ speculative decoding drafts


def test_drafts_get_slots_and_count_as_batched_tokens():
    """A decode with k drafts computes 1 + k positions: blocks for all of them, in the token count."""
    sched = make_scheduler(num_blocks=16, block_size=4)
    a, b = make_seq(3, "a"), make_seq(4, "b")
    sched.add(a)
    sched.add(b)
    run_step(sched.schedule())  # prefill; a has 4 tokens (one block), b 5 (two)
    a.spec_token_ids = [7, 8, 9, 10, 11]  # positions 3..8 -> 9 tokens -> three blocks
    out = sched.schedule()
    assert not out.is_prefill and names(out.seqs) == ["a", "b"]
    assert out.num_batched_tokens == 2 + 5
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert a.spec_token_ids == [7, 8, 9, 10, 11]


def test_drafts_are_dropped_rather_than_taking_blocks_other_sequences_need():
    """Drafts never cause a preemption: when their blocks would leave the sequences after them
    without one each, the sequence decodes without drafts this step."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    a, b = make_seq(4, "a"), make_seq(4, "b")
    for s in (a, b):
        sched.add(s)
    run_step(sched.schedule())  # 5 tokens each, one block each: each needs a second block to decode
    assert sched.block_manager.num_free_blocks == 2
    a.spec_token_ids = [1, 2, 3, 4]  # 9 positions: two more blocks for a, none left for b
    out = sched.schedule()
    assert names(out.seqs) == ["a", "b"] and not out.preempted
    assert a.spec_token_ids == [] and out.num_batched_tokens == 2
    assert len(a.block_table) == len(b.block_table) == 2


def test_drafts_are_dropped_beyond_the_token_budget():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=32, max_model_len=32)
    seqs = [make_seq(3, f"s{i}") for i in range(4)]
    for s in seqs:
        sched.add(s)
    run_step(sched.schedule())
    for s in seqs:
        s.spec_token_ids = [5] * 10
    out = sched.schedule()
    # 32 - 4 running = 28 draft tokens: two sequences' 10 fit, the third's would not, the fourth's neither.
    assert [len(s.spec_token_ids) for s in seqs] == [10, 10, 0, 0]
    assert out.num_batched_tokens == 4 + 20


def test_a_preempted_sequence_loses_its_drafts():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    a, b = make_seq(4, "a"), make_seq(4, "b")
    for s in (a, b):
        sched.add(s)
    for _ in range(5):  # prefill, then four decodes: 9 tokens each, the 9th's slot not yet held
        run_step(sched.schedule())
    assert sched.block_manager.num_free_blocks == 0 and a.num_tokens == b.num_tokens == 9
    b.spec_token_ids = [1]
    out = sched.schedule()  # a needs a block: b, the most recently admitted, is preempted
    assert names(out.preempted) == ["b"] and b.status is SequenceStatus.WAITING
    assert b.spec_token_ids == []


def test_drafts_are_trimmed_only_in_steps_past_the_free_rows():
    """Up to spec_free_rows verify rows every draft is kept; past them each sequence's drafts are
    cut to its spec_draft_limit (sequences without one yet keep theirs)."""
    sched = make_scheduler(num_blocks=64, block_size=4, max_model_len=32)
    seqs = [make_seq(3, f"s{i}") for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_step(sched.schedule())
    sched.spec_free_rows = 3 + 6
    seqs[0].spec_token_ids, seqs[0].spec_draft_limit = [1, 2, 3, 4], 1
    seqs[1].spec_token_ids, seqs[1].spec_draft_limit = [5, 6], None
    sched.schedule()  # 3 + 6 rows: nothing cut
    assert [len(s.spec_token_ids) for s in seqs] == [4, 2, 0]
    seqs[2].spec_token_ids, seqs[2].spec_draft_limit = [7, 8, 9], 2
    for s in seqs:  # as if the step ran and kept nothing; the same drafts proposed again
        s.num_computed_tokens = s.num_tokens
        s.output_token_ids.append(9)
    sched.schedule()  # 3 + 9 rows: cut to the limits
    assert [s.spec_token_ids for s in seqs] == [[1], [5, 6], [7, 8]]
    sched.spec_free_rows = None  # never cut
    seqs[0].spec_token_ids = [1, 2, 3, 4]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
        s.output_token_ids.append(9)
    sched.schedule()
    assert len(seqs[0].spec_token_ids) == 4


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("reserve_growth", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_simulation_with_drafts_keeps_invariants(seed, reserve_growth, prefix_caching):
    """Speculative decoding's drafts in the randomized simulation, trimmed in every step, past 8
    rows or never: every decode gets slots for its token and the drafts it keeps, a step's tokens
    count them, preempted sequences lose theirs, blocks stay consistent (with prefix caching
    too), and verify passes that keep some drafts (the engine appends them and one more token)
    neither lose nor overshoot tokens."""
    rng = random.Random(seed)
    block_size, num_blocks, max_model_len, max_drafts = 4, 12, 24, 4
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=6,
                           max_num_batched_tokens=32, max_model_len=max_model_len, reserve_growth=reserve_growth,
                           enable_prefix_caching=prefix_caching)
    sched.spec_free_rows = rng.choice([0, 8, None])
    bm = sched.block_manager
    all_seqs: list[Sequence] = []
    target: dict[str, int] = {}
    finished: set[str] = set()
    num_verified = num_kept = 0
    for step in range(3000):
        if step < 300:
            arrive(rng, sched, all_seqs, target, max_model_len, [1, 1, 2])
        if step >= 300 and not sched.has_unfinished():
            break
        for s in sched.running:  # what LLMEngine._propose_drafts leaves: within max_tokens and the model length
            room = min(target[s.request_id] - len(s.output_token_ids), max_model_len - s.num_tokens) - 1
            s.spec_token_ids = [rng.randrange(1, 500) for _ in range(rng.randint(0, max(0, min(max_drafts, room))))]
        out = sched.schedule()
        check_invariants(sched, out, all_seqs, finished, max_drafts)
        if out is None:
            assert not sched.has_unfinished(), f"step {step}: stalled with work left"
            continue
        for s in out.preempted:
            assert s.spec_token_ids == []
        if out.is_prefill:
            for s in out.seqs:
                s.num_computed_tokens = s.num_tokens
                if prefix_caching:
                    bm.cache_computed_blocks(s)
                s.output_token_ids.append(rng.randrange(1, 500))
        else:
            assert out.num_batched_tokens == sum(1 + len(s.spec_token_ids) for s in out.seqs)
            assert out.num_batched_tokens - len(out.seqs) <= sched.config.max_num_batched_tokens - len(out.seqs)
            for s in out.seqs:
                kept = rng.randint(0, len(s.spec_token_ids))
                num_verified += len(s.spec_token_ids)
                num_kept += kept
                s.output_token_ids += s.spec_token_ids[:kept] + [rng.randrange(1, 500)]
                s.num_computed_tokens = s.num_tokens - 1
                if prefix_caching:
                    bm.cache_computed_blocks(s)
                if s.spec_token_ids:
                    s.spec_draft_limit = max(1, 2 * kept)
                s.spec_token_ids = []
        for s in out.seqs:
            assert len(s.output_token_ids) <= target[s.request_id] and s.num_tokens <= max_model_len
            if len(s.output_token_ids) >= target[s.request_id] or s.num_tokens >= max_model_len:
                sched.finish(s)
                finished.add(s.request_id)
        check_invariants(sched, None, all_seqs, finished, max_drafts)
    else:
        pytest.fail("not done after 3000 steps")
    assert finished == {s.request_id for s in all_seqs}
    for s in all_seqs:
        assert len(s.output_token_ids) == target[s.request_id] or s.num_tokens == max_model_len
    assert num_verified > 100 and 0 < num_kept < num_verified
    assert bm.num_free_blocks == num_blocks


def test_drafts_that_fit_in_the_sequences_own_new_block_are_kept():
    """Drafts are dropped only for blocks they would take beyond the sequence's own next block: b is
    preempted for a's next block with or without a's drafts, so they stay."""
    sched = make_scheduler(num_blocks=3, block_size=4, max_model_len=12)
    a, b = make_seq(4, "a"), make_seq(4, "b")
    for s in (a, b):
        sched.add(s)
    run_step(sched.schedule())  # 5 tokens each, one block each; one free
    assert sched.block_manager.num_free_blocks == 1
    a.spec_token_ids = [1, 2, 3]  # positions 4..7: all in a's second block, which it needs anyway
    out = sched.schedule()
    assert names(out.seqs) == ["a"] and names(out.preempted) == ["b"]
    assert a.spec_token_ids == [1, 2, 3] and out.num_batched_tokens == 1 + 3 and len(a.block_table) == 2
