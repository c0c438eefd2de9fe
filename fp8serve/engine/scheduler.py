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
still hold `reserve_ratio` times the tokens the running sequences may still
generate (up to max_tokens and max_model_len, at most 4096 per request), as
SGLang's scheduler does with its new-token ratio. Outputs that stop early at EOS need less than
their max_tokens, so the ratio starts at 0.7 and decays by 0.001 per decode
step down to 0.1; a preemption shows it was too low and resets it to 1.0.
Replayed through this scheduler with this machine's step times
(benchmarks/scheduler_sim.py --policy, results in
benchmarks/results/scheduler_reserve_2026-12-01_zen4.md): 1.07-1.16x the
output rate of the watermark-only admission for a 16-bit cache and
1.02-1.20x for FP8 on four workloads (all to max_tokens, or stopping early),
preemptions 15-94 -> 0-9; always reserving the whole max_tokens (TGI's
policy) ran 0.77x when outputs stop early under a generous max_tokens.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from fp8serve.config import SchedulerConfig
from fp8serve.engine.block_manager import BlockManager
from fp8serve.engine.sequence import Sequence, SequenceStatus


# Admission's growth reservation (see the module docstring).
RESERVE_RATIO_INIT = 0.7
RESERVE_RATIO_MIN = 0.1
RESERVE_RATIO_DECAY = 0.001  # per decode step without a preemption
RESERVE_RATIO_AFTER_PREEMPTION = 1.0
# A request's possible growth counts at most this many tokens (SGLang's clip too): a request without
# max_tokens may run to the model length, and 0.7 x 8k tokens per request would hold back admission
# long after most outputs have stopped.
RESERVE_MAX_TOKENS_PER_SEQ = 4096


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    is_prefill: bool
    num_batched_tokens: int
    preempted: list[Sequence] = field(default_factory=list)


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
        # Share of the running sequences' possible growth kept free at admission (module docstring).
        self.reserve_growth = reserve_growth
        self.reserve_ratio = RESERVE_RATIO_INIT if reserve_growth else 0.0

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
        return self._schedule_prefill() or self._schedule_decode()

    def remaining_tokens(self, seq: Sequence) -> int:
        """Tokens `seq` may still generate (up to its max_tokens and the model length), as the
        reservation counts them: at most RESERVE_MAX_TOKENS_PER_SEQ."""
        max_tokens = seq.sampling_params.max_tokens
        limit = self.config.max_model_len if max_tokens is None else min(
            self.config.max_model_len, seq.num_prompt_tokens + max_tokens)
        return min(RESERVE_MAX_TOKENS_PER_SEQ, max(0, limit - seq.num_tokens))

    def growth_reserve(self, remaining_tokens: int) -> int:
        """Blocks kept free for `remaining_tokens` of possible growth at the current ratio."""
        return math.ceil(self.reserve_ratio * remaining_tokens / self.block_manager.block_size)

    def _schedule_prefill(self) -> SchedulerOutput | None:
        scheduled: list[Sequence] = []
        num_tokens = 0
        remaining = sum(self.remaining_tokens(s) for s in self.running) if self.waiting and self.reserve_growth else 0
        while self.waiting and len(self.running) + len(scheduled) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if num_tokens + seq.num_tokens > self.config.max_num_batched_tokens:
                break
            reserve = max(self._watermark, self.growth_reserve(remaining)) if (self.running or scheduled) else 0
            if not self.block_manager.can_allocate(seq, reserve=reserve):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            scheduled.append(seq)
            num_tokens += seq.num_tokens
            remaining += self.remaining_tokens(seq)
        if not scheduled:
            return None
        self.running.extend(scheduled)
        return SchedulerOutput(scheduled, is_prefill=True, num_batched_tokens=num_tokens)

    def _schedule_decode(self) -> SchedulerOutput | None:
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            while not self.block_manager.can_append(seq):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slot(seq)
                scheduled.append(seq)
                i += 1
                continue
            break
        if self.reserve_growth and preempted:
            self.reserve_ratio = RESERVE_RATIO_AFTER_PREEMPTION
        elif self.reserve_growth and scheduled:
            self.reserve_ratio = max(RESERVE_RATIO_MIN, self.reserve_ratio - RESERVE_RATIO_DECAY)
        if not scheduled:
            return SchedulerOutput([], is_prefill=False, num_batched_tokens=0, preempted=preempted) if preempted else None
        return SchedulerOutput(scheduled, is_prefill=False, num_batched_tokens=len(scheduled), preempted=preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.free(seq)
