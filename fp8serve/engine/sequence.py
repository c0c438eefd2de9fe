"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from fp8serve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache; 0 again after a preemption.
    num_computed_tokens: int = 0
    # Prefix caching (block_manager.py): hashes of the full blocks of tokens
    # (valid for good: tokens are only appended), and how many of
    # block_table's first blocks are registered in the cache.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_preemptions: int = 0
    # Tokens its latest admission found in the prefix cache (not computed).
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Per generated token: {token_id: Logprob}; None unless requested.
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None
    # Chunked prefill: the prompt logprobs of the chunks computed so far.
    prompt_logprob_parts: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    detokenizer: object | None = None
    # When the scheduler first ran it (kept through preemptions: vLLM's
    # queue time ends there), and when its first and newest tokens came.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Parallel sampling (n > 1): the request this sequence is sample `index` of.
    parent: "ParentRequest | None" = None
    index: int = 0
    # Speculative decoding: tokens proposed to follow this sequence, checked in
    # its next decode step (fp8serve/spec_decode/).
    spec_token_ids: list[int] = field(default_factory=list)
    # Twice the drafts its last verify pass kept (at least 1); None before
    # its first one. Scheduler.trim_drafts cuts drafts to it in busy steps.
    spec_draft_limit: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks_needed(self, block_size: int, num_tokens: int | None = None) -> int:
        n = self.num_tokens if num_tokens is None else num_tokens
        return (n + block_size - 1) // block_size


@dataclass(eq=False)
class ParentRequest:
    """A request for n > 1 samples (vLLM's parallel sampling): one sequence per
    sample, each scheduled on its own, reported together under this id."""

    request_id: str
    children: list[Sequence]

    @property
    def is_finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)
