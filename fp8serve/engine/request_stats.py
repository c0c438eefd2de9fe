"""What the engine reports about each step and each finished request, for
stat loggers (the server's Prometheus metrics) to record: vLLM's iteration
and finished-request stats, computed from the sequence's own timestamps.

The intervals are vLLM's: queued from arrival to the first time the
scheduler runs the request (a preempted request keeps its first time),
prefill from then to its first token, decode from the first to the last
token, inference from first scheduled to last token. Intervals a request
never reached (aborted while waiting, or before its first token) are None
and not observed, rather than recorded as zero."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from fp8serve.engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished sequence (a sample of an n > 1 request is one, as in vLLM)."""

    request_id: str  # the request's (every sample of an n > 1 request reports its parent's)
    # "stop" | "length" | "abort", or "error" for the requests an engine failure ended
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    e2e_latency: float
    queued_time: float | None
    prefill_time: float | None
    decode_time: float | None
    inference_time: float | None

    @classmethod
    def from_sequence(cls, seq: Sequence, now: float) -> "FinishedRequestStats":
        scheduled, first, last = seq.first_scheduled_time, seq.first_token_time, seq.last_token_time
        return cls(
            request_id=seq.parent.request_id if seq.parent is not None else seq.request_id,
            finish_reason=seq.finish_reason or "abort",
            num_prompt_tokens=seq.num_prompt_tokens,
            num_generation_tokens=len(seq.output_token_ids),
            max_tokens_param=seq.sampling_params.max_tokens,
            e2e_latency=now - seq.arrival_time,
            queued_time=None if scheduled is None else scheduled - seq.arrival_time,
            prefill_time=None if scheduled is None or first is None else first - scheduled,
            decode_time=None if first is None or last is None else last - first,
            inference_time=None if scheduled is None or last is None else last - scheduled,
        )


@dataclass
class IterationStats:
    """What happened since the last report: normally one engine step, or an
    abort between steps. `num_batched_tokens` is None for an abort (no forward
    pass ran), else the tokens the step's forward passes computed (prefill
    chunks, decoded tokens and their drafts)."""

    num_batched_tokens: int | None = None
    # Tokens sampled and kept (accepted drafts included), as vLLM's IterationStats.
    num_generation_tokens: int = 0
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # `n` of each request whose last sample finished (vLLM's request_params_n).
    finished_params_n: list[int] = field(default_factory=list)
    # (request id, the most tokens any of its samples generated) of the same requests
    # (vLLM's request_max_num_generation_tokens).
    finished_max_generation_tokens: list[tuple[str, int]] = field(default_factory=list)

    def record_finish(self, seq: Sequence, now: float | None = None) -> None:
        self.finished_requests.append(FinishedRequestStats.from_sequence(seq, time.monotonic() if now is None
                                                                         else now))
        parent = seq.parent
        if parent is None:
            self.finished_params_n.append(1)
            self.finished_max_generation_tokens.append((seq.request_id, len(seq.output_token_ids)))
        elif parent.is_finished:
            self.finished_params_n.append(len(parent.children))
            self.finished_max_generation_tokens.append(
                (parent.request_id, max(len(c.output_token_ids) for c in parent.children)))


StatLogger = Callable[[IterationStats], None]


def report(loggers: list[StatLogger], stats: IterationStats) -> None:
    """Give `stats` to every logger. A failing logger is logged and skipped:
    metrics must never take down the engine step that produced them."""
    for log in loggers:
        try:
            log(stats)
        except Exception:  # noqa: BLE001 - see docstring
            logger.exception("stat logger %r failed; the engine goes on", log)
