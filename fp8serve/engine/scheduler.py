"""Continuous batching: which sequences run in the next step.

Each step is either a prefill of newly admitted (or resumed) sequences or
one decode token for every running sequence; new requests therefore join
between decode steps of the others. When the cache runs out of blocks, the
most recently admitted sequences are preempted by recompute: their blocks
are freed and they go back to the front of the queue, keeping their output
so far, to be prefilled again later. No request is ever dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fp8serve.config import SchedulerConfig
from fp8serve.engine.block_manager import BlockManager
from fp8serve.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    is_prefill: bool
    num_batched_tokens: int
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Keep a few blocks free when admitting new work so that running
        # sequences are not preempted by the very next decode step.
        self._watermark = max(1, block_manager.num_blocks // 100)

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

    def _schedule_prefill(self) -> SchedulerOutput | None:
        scheduled: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) + len(scheduled) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if num_tokens + seq.num_tokens > self.config.max_num_batched_tokens:
                break
            reserve = self._watermark if (self.running or scheduled) else 0
            if not self.block_manager.can_allocate(seq, reserve=reserve):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            scheduled.append(seq)
            num_tokens += seq.num_tokens
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
