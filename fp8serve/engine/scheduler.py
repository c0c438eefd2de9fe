"""Continuous batching: which sequences run in the next step.

Each step is either a prefill of newly admitted (or resumed) sequences or
one decode token for every running sequence; new requests therefore join
between decode steps of the others. When the cache runs out of blocks, the
most recently admitted sequences are preempted by recompute: their blocks
are freed and they go back to the front of the queue, keeping their output
so far, to be prefilled again later. No request is ever dropped.

Admission keeps room for the running sequences' growth. Admitting whatever
fits the prompt (vLLM's policy, with a 1% watermark) fills the cache with
prompts whose decode then runs out of blocks: on the KV-limited workload
(48 x 256 -> 256 tokens, a cache for 8 or 16 full-length requests) both
caches preempted and recomputed 30-32 times, ~6 s of prefill in 30-40 s runs.
So a new sequence is admitted only if, after its prompt, the free blocks
still hold what the running sequences are expected to generate: each one's
budget (max_tokens, within the model length) times `reserve_ratio`, less
what it has generated, at most 4096 tokens per sequence. The ratio is
learned from the requests that finished: the largest share of its budget
any of the last 64 used (0.7 until one has finished), so outputs that stop
at EOS long before max_tokens stop holding back admission, while outputs
that run to max_tokens get their whole budget kept. A preemption shows the
estimate was too low: it lifts the ratio to 1.0, a floor that then decays
by 0.001 per decode step. SGLang's scheduler keeps such a reserve too, with
a ratio that starts at 0.7 and decays without looking at the outputs; the
decay alone (tried first) ran chat-like work (outputs of 16-256 tokens
under max_tokens up to the model length) at 0.86-0.89x of the watermark's
rate, where the learned ratio ran 0.99-1.07x, and 1.08-1.21x where the
outputs run to max_tokens under KV pressure.
Numbers: benchmarks/results/scheduler_reserve_2026-12-01_zen4.md (the
scheduler replayed with this machine's step times, benchmarks/scheduler_sim.py
--policy) and kv_saturation_engine_2026-12-01_zen4_admission.md (the engine).

Requests that only their budget can end
(ignore_eos, no stop strings or stop token ids: benchmarks, fixed-length
generation) reserve all of it from the start, and min_tokens is a floor:
with 0.7 before any request finished, the first wave of the KV-limited
workload overran the cache and preempted 1 (bf16) and 3 (FP8) sequences,
each a prompt and its output prefilled again; reserving what they will
certainly generate ran it without one, 1.03-1.05x FP8 / bf16 output tok/s
where it was 0.97-0.98x (AVX2 Zen 2 guest,
benchmarks/results/kv_saturation_engine_2026-12-05_zen2_certain.md).

With prefix caching (block_manager.py), a waiting sequence shares the
registered blocks of its longest cached prefix and only its new tokens count
against the step's token budget; fresh prompts go first in the step, so the
model runner can prefill them apart from those continuing a cached prefix.

Chunked prefill (vLLM's --enable-chunked-prefill): a step no longer chooses
between prefill and decode. It takes every running sequence's next decode
token first (one token of the budget each), then prefill chunks within what
is left of --max-num-batched-tokens: the running sequences still in their
prefill continue, oldest first, then waiting ones are admitted with a first
chunk. A sequence holds blocks for its whole prompt from admission, so a
chunk never waits for blocks. Why: without it one step prefills every newly
admitted prompt while all running requests wait; a burst of 16 prompts of
512 tokens is a 5 s step here (~0.64 ms per prompt token, bf16). Chunks bound
that wait to about one chunk's prefill: the longest gap between two tokens of
a request fell from 1.1-3.5 s to 0.4-0.6 s with chunks of 512 tokens, while
time to first token rose 1.09-1.5x and throughput stayed the same
(benchmarks/results/chunked_prefill_2026-12-01_zen4.md).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from fp8serve.config import SchedulerConfig
from fp8serve.engine.block_manager import BlockManager
from fp8serve.engine.sequence import Sequence, SequenceStatus


# Admission's growth reservation (see the module docstring).
RESERVE_RATIO_INIT = 0.7  # until a request has finished
RESERVE_WINDOW = 64  # finished requests the learned ratio looks at
RESERVE_RATIO_AFTER_PREEMPTION = 1.0  # the floor a preemption sets ...
RESERVE_FLOOR_DECAY = 0.001  # ... and its decay per decode step without one
# Speculative decoding: a verify pass of up to this many rows costs about what a decode step
# of one sequence costs here (see Scheduler.trim_drafts).
SPEC_FREE_ROWS = 8
# A sequence's expected growth counts at most this many tokens (SGLang clips its estimate the same way):
# a request without max_tokens may run to the model length.
RESERVE_MAX_TOKENS_PER_SEQ = 4096


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    is_prefill: bool
    num_batched_tokens: int
    preempted: list[Sequence] = field(default_factory=list)
    # Chunked prefill only: how many of each of `seqs`' uncomputed tokens this
    # step computes (a chunk that ends before the last token samples nothing),
    # and the running sequences that decode one token in the same step.
    num_new_tokens: list[int] | None = None
    decode_seqs: list[Sequence] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        if not self.is_prefill:
            return 0
        return sum(self.num_new_tokens) if self.num_new_tokens is not None else self.num_batched_tokens


def num_decode_tokens(seqs: list[Sequence]) -> int:
    """Tokens a decode pass over `seqs` computes: each one's newest token and its drafts."""
    return len(seqs) + sum(len(s.spec_token_ids) for s in seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, *, reserve_growth: bool = True) -> None:
        """reserve_growth=False: admission keeps only the watermark free (vLLM's policy; tests of
        the preemption mechanics and benchmarks/scheduler_sim.py's comparison use it)."""
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Keep a few blocks free when admitting new work so that running
        # sequences are not preempted by the very next decode step.
        self._watermark = max(1, block_manager.num_blocks // 100)
        # Expected growth of the running sequences kept free at admission (module docstring).
        self.reserve_growth = reserve_growth
        self.output_fractions: deque[float] = deque(maxlen=RESERVE_WINDOW)  # output / budget of finished requests
        self.preemption_floor = 0.0
        # Speculative decoding: verify rows a step may hold before drafts are cut (trim_drafts);
        # None: never cut them.
        self.spec_free_rows: int | None = SPEC_FREE_ROWS

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput | None:
        if self.config.enable_chunked_prefill:
            return self._schedule_chunked()
        return self._schedule_prefill() or self._schedule_decode()

    @property
    def reserve_ratio(self) -> float:
        """The share of its budget a running sequence is expected to generate (module docstring)."""
        if not self.reserve_growth:
            return 0.0
        learned = max(self.output_fractions) if self.output_fractions else RESERVE_RATIO_INIT
        return max(learned, self.preemption_floor)

    def output_budget(self, seq: Sequence) -> int:
        """Tokens `seq` may generate in all: its max_tokens, within the model length."""
        room = max(0, self.config.max_model_len - seq.num_prompt_tokens)
        max_tokens = seq.sampling_params.max_tokens
        return room if max_tokens is None else min(room, max_tokens)

    def certain_output(self, seq: Sequence) -> int:
        """Tokens `seq` will generate whatever it samples: its whole budget where only the budget can end
        it (ignore_eos without stop strings or stop token ids), else its min_tokens (no stop is honoured
        before them), within the budget. An abort can still end it sooner."""
        p = seq.sampling_params
        budget = self.output_budget(seq)
        if p.ignore_eos and not p.stop and not p.stop_token_ids:
            return budget
        return min(p.min_tokens, budget)

    def expected_growth(self, seq: Sequence, ratio: float | None = None) -> int:
        """Tokens to keep free for `seq`: `ratio` (default reserve_ratio) of its budget, or what it will
        certainly generate where that is more, less what it has generated, at most
        RESERVE_MAX_TOKENS_PER_SEQ; nothing without the reservation."""
        if not self.reserve_growth:
            return 0
        expected = math.ceil((self.reserve_ratio if ratio is None else ratio) * self.output_budget(seq))
        expected = max(expected, self.certain_output(seq))
        return min(RESERVE_MAX_TOKENS_PER_SEQ, max(0, expected - len(seq.output_token_ids)))

    def growth_reserve(self, tokens: int) -> int:
        """Blocks that hold `tokens` tokens of growth."""
        return -(-tokens // self.block_manager.block_size)

    def _schedule_prefill(self) -> SchedulerOutput | None:
        scheduled: list[Sequence] = []
        num_tokens = 0
        ratio = self.reserve_ratio  # once per step: it takes a max over the finished requests' window
        growth = 0
        if self.waiting and self.reserve_growth:
            growth = sum(self.expected_growth(s, ratio) for s in self.running)
        bm = self.block_manager
        while self.waiting and len(self.running) + len(scheduled) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.cached_prefix(seq)  # shared with earlier requests: not recomputed
            new_tokens = seq.num_tokens - len(cached) * bm.block_size
            if num_tokens + new_tokens > self.config.max_num_batched_tokens:
                break
            reserve = max(self._watermark, self.growth_reserve(growth)) if (self.running or scheduled) else 0
            if not bm.can_allocate(seq, reserve=reserve, cached=cached):
                break
            self.waiting.popleft()
            bm.allocate(seq, cached=cached)
            seq.status = SequenceStatus.RUNNING
            seq.num_cached_tokens = len(cached) * bm.block_size
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            scheduled.append(seq)
            num_tokens += new_tokens
            growth += self.expected_growth(seq, ratio) if self.reserve_growth else 0
        if not scheduled:
            return None
        # Fresh prompts first: the model runner prefills them apart from those
        # continuing a cached prefix, which attend over the paged cache (the
        # fresh ones run the faster kernel over their own K/V).
        scheduled.sort(key=lambda s: s.num_computed_tokens > 0)
        self.running.extend(scheduled)
        return SchedulerOutput(scheduled, is_prefill=True, num_batched_tokens=num_tokens)

    def _schedule_chunked(self) -> SchedulerOutput | None:
        """A step of decodes and prefill chunks (module docstring)."""
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        decodes, continuing, preempted = self._reserve_decode_slots()
        # >= 0: the config keeps the budget >= max_num_seqs, and drafts fit in what is left.
        budget -= num_decode_tokens(decodes)
        prefills: list[Sequence] = []
        chunks: list[int] = []
        for seq in continuing:
            chunk = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            if chunk == 0:
                break
            bm.register_scheduled_blocks(seq, seq.num_computed_tokens + chunk)
            prefills.append(seq)
            chunks.append(chunk)
            budget -= chunk
        ratio = self.reserve_ratio
        growth = 0
        if self.waiting and self.reserve_growth:
            growth = sum(self.expected_growth(s, ratio) for s in self.running)
        admitted: list[Sequence] = []
        while budget > 0 and self.waiting and len(self.running) + len(admitted) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.cached_prefix(seq)
            reserve = max(self._watermark, self.growth_reserve(growth)) if (self.running or admitted) else 0
            chunk = self._chunk(seq.num_tokens - len(cached) * bm.block_size, budget)
            if chunk == 0 or not bm.can_allocate(seq, reserve=reserve, cached=cached):
                break
            self.waiting.popleft()
            bm.allocate(seq, cached=cached, num_new_tokens=chunk)
            seq.status = SequenceStatus.RUNNING
            seq.num_cached_tokens = len(cached) * bm.block_size
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            admitted.append(seq)
            prefills.append(seq)
            chunks.append(chunk)
            budget -= chunk
            growth += self.expected_growth(seq, ratio) if self.reserve_growth else 0
        self.running.extend(admitted)
        if preempted:
            self.preemption_floor = RESERVE_RATIO_AFTER_PREEMPTION
        elif decodes:
            self.preemption_floor = max(0.0, self.preemption_floor - RESERVE_FLOOR_DECAY)
        if not prefills:
            if not decodes:
                return SchedulerOutput([], is_prefill=False, num_batched_tokens=0,
                                       preempted=preempted) if preempted else None
            return SchedulerOutput(decodes, is_prefill=False, num_batched_tokens=num_decode_tokens(decodes),
                                   preempted=preempted)
        # Fresh prompts first (see _schedule_prefill); stable, so a sequence whose
        # blocks another one shares in this step still comes before it.
        order = sorted(range(len(prefills)), key=lambda i: prefills[i].num_computed_tokens > 0)
        return SchedulerOutput([prefills[i] for i in order], is_prefill=True,
                               num_batched_tokens=sum(chunks) + num_decode_tokens(decodes), preempted=preempted,
                               num_new_tokens=[chunks[i] for i in order], decode_seqs=decodes)

    @staticmethod
    def _chunk(remaining: int, budget: int) -> int:
        """The tokens of a prefill to compute within `budget`: all that remain
        if they fit, else as many as fit but never leaving just one: a running
        sequence with one uncomputed token is a decode (_reserve_decode_slots)."""
        if remaining <= budget:
            return remaining
        return budget if remaining - budget > 1 else budget - 1

    def _reserve_decode_slots(self, chunked: bool = True) -> tuple[list[Sequence], list[Sequence], list[Sequence]]:
        """A slot for the next token of every running sequence whose prefill is
        done (without chunking: of every running sequence; a prefill step
        computes whole prompts), preempting the most recently admitted ones
        when blocks run out. Returns (decodes, sequences still in their
        prefill, preempted). A prefill chunk never leaves one token (_chunk),
        so one uncomputed token is the one sampled last step.

        Speculative decoding: a sequence's drafts (`spec_token_ids`) get slots
        too, but never at another sequence's expense: they are dropped for
        this step when blocks taken for them would leave fewer free than the
        sequences after it may need (one each), or when the step's drafts would pass
        --max-num-batched-tokens (counting one token per running sequence)."""
        decodes: list[Sequence] = []
        continuing: list[Sequence] = []
        preempted: list[Sequence] = []
        bm = self.block_manager
        self.trim_drafts()
        draft_budget = self.config.max_num_batched_tokens - len(self.running)
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if chunked and seq.num_tokens - seq.num_computed_tokens > 1:
                continuing.append(seq)  # its blocks were allocated at admission
                i += 1
                continue
            k = len(seq.spec_token_ids)
            if k:
                needed = bm.blocks_to_append(seq, k)
                takes_more = needed > bm.blocks_to_append(seq)  # blocks for the drafts alone
                if k > draft_budget or (takes_more and needed + len(self.running) - i - 1 > bm.num_free_blocks):
                    seq.spec_token_ids = []
                    k = 0
                draft_budget -= k
            while not bm.can_append(seq, k):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.append_slot(seq, k)
                decodes.append(seq)
                i += 1
                continue
            break
        return decodes, continuing, preempted

    def trim_drafts(self) -> None:
        """Where the running sequences' tokens and drafts would make a verify
        pass of more than `spec_free_rows` rows, cut each sequence's drafts to
        its `spec_draft_limit` (twice what its last verify pass kept, at
        least one). Why: a pass's cost is nearly flat while it is bound by
        reading the weights and grows ~0.75 ms per row past ~8 rows here
        (default model, bf16, FP8 KV: 10.3 ms for a decode step of one
        sequence; verify passes of 5 rows 12.3 ms, 9 rows 13.8, 12 rows 15.4,
        30 rows 27.4, 80 rows 67.5), so below that drafts are nearly free and
        every one may as well be tried, while above it a draft the model
        rejects slows the whole batch. Measured (benchmarks/spec_decode.py,
        one-round development runs): the limit in every step cost single
        streams up to a fifth of their gain; without any, a batch of six
        free-writing requests with 8 drafts ran at 0.74x of plain decoding
        (0.94x with it). In the committed runs the two were within noise."""
        if self.spec_free_rows is None:
            return
        rows = sum(1 + len(s.spec_token_ids) for s in self.running)
        if rows <= self.spec_free_rows:
            return
        for s in self.running:
            if s.spec_draft_limit is not None and len(s.spec_token_ids) > s.spec_draft_limit:
                del s.spec_token_ids[s.spec_draft_limit:]

    def _schedule_decode(self) -> SchedulerOutput | None:
        scheduled, _, preempted = self._reserve_decode_slots(chunked=False)
        if preempted:
            self.preemption_floor = RESERVE_RATIO_AFTER_PREEMPTION
        elif scheduled:
            self.preemption_floor = max(0.0, self.preemption_floor - RESERVE_FLOOR_DECAY)
        if not scheduled:
            return SchedulerOutput([], is_prefill=False, num_batched_tokens=0, preempted=preempted) if preempted else None
        return SchedulerOutput(scheduled, is_prefill=False, num_batched_tokens=num_decode_tokens(scheduled),
                               preempted=preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.spec_token_ids = []
        seq.prompt_logprob_parts.clear()  # its prefill starts over
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks; a finished one (finish_reason "stop" or
        "length") also tells the reservation how much of its budget it used."""
        budget = self.output_budget(seq)
        if seq.finish_reason in ("stop", "length") and budget > 0:
            self.output_fractions.append(min(1.0, len(seq.output_token_ids) / budget))
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.free(seq)
