"""What a request returns, shaped like vLLM's outputs so ported scripts keep working.

``RequestOutput.outputs[0].text`` and friends are read field-by-field by user code, so
the names and the meaning of ``None`` follow vLLM: ``logprobs`` is None when the request
did not ask for them, and ``prompt_logprobs[0]`` is None because the first prompt token
has no context to be predicted from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = ("stop", "length", "abort")

# One entry per generated (or prompt) position: token id -> its logprob.
PositionLogprobs = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the model's distribution
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    # The stop string or stop token id that ended the sequence; None for EOS or length.
    stop_reason: int | str | None = None

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"index must be non-negative, got {self.index}.")
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS} or None, got {self.finish_reason!r}.")

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob}, logprobs={_summarize(self.logprobs)}, "
            f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, Any] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) != len(self.prompt_token_ids):
            raise ValueError(
                f"prompt_logprobs must have one entry per prompt token ({len(self.prompt_token_ids)}), "
                f"got {len(self.prompt_logprobs)}."
            )

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, prompt_logprobs={_summarize(self.prompt_logprobs)}, "
            f"outputs={self.outputs}, finished={self.finished}, metrics={self.metrics})"
        )


def _summarize(per_position: list | None) -> str:
    # Full logprob dicts make a repr unreadable (k entries per token); show the size only.
    if per_position is None:
        return "None"
    return f"<{len(per_position)} positions>"
