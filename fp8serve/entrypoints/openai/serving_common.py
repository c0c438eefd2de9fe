"""What completions and chat completions share: prompt checks, the token
budget, request timing for the metrics, stream-safe text deltas, SSE framing,
and aborting a request whose client went away."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from fp8serve.entrypoints.openai.metrics import ServerMetrics
from fp8serve.outputs import RequestOutput


class RequestError(Exception):
    """Becomes an OpenAI-style error response with this status."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.err_type, self.param = status, err_type, param


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int, param: str = "prompt") -> None:
    """The engine checks these again; checking here gives a 400 before a stream starts.
    `param`: the request field the prompt came from (chat: messages)."""
    if not token_ids:
        raise RequestError("the prompt is empty (0 tokens)", param=param)
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad} is out of range for a vocabulary of {vocab_size}", param=param)
    if len(token_ids) > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{len(token_ids)} tokens. Please reduce the length of the prompt.", param=param)


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                       prompt_param: str = "prompt", cap: int | None = None, budget_param: str = "max_tokens") -> int:
    """The output budget; None means "up to the context length". `requested` was
    checked by the request (check_max_tokens): at least 1, or 0 for a prompt-only
    completion, which is served by generating one hidden token.
    `prompt_param`: the field a prompt that leaves no room is blamed on.
    `cap`: the generation config's max_new_tokens, which bounds every budget (vLLM's get_max_tokens).
    `budget_param`: the request's field `requested` came from (chat: max_completion_tokens when sent)."""
    if requested is None:
        budget = max_model_len - num_prompt_tokens
        if budget < 1:
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens and the prompt has "
                f"{num_prompt_tokens}, leaving no room for output.", param=prompt_param)
        return budget if cap is None else min(budget, cap)
    if num_prompt_tokens + requested > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} in the "
            f"completion). Please reduce the prompt or {budget_param}.", param=budget_param)
    return requested if cap is None else min(requested, cap)


def stream_safe_len(text: str, stop: list[str], include_stop_str: bool) -> int:
    """How much of an unfinished output's text may be streamed: a suffix that
    could still grow into a stop string is held back, because the engine cuts
    the text there if it does."""
    if not stop or include_stop_str:
        return len(text)
    held = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return len(text) - held


@dataclass
class RequestTimer:
    """Feeds TTFT and inter-token latency into the histograms, per sample as
    vLLM does (each sample of an n > 1 request is a request of its own in
    vLLM's engine): a sample's first token is one TTFT, the gaps between its
    later tokens are ITLs (tokens that arrive together, kept drafts of
    speculative decoding, share the gap). E2E latency comes from the engine's
    finished-request stats (ServerMetrics.record), which aborted requests
    reach too; no output reaches a client that went away."""

    metrics: ServerMetrics
    start: float = field(default_factory=time.monotonic)
    last: dict[int, float] = field(default_factory=dict)  # by sample index: when its newest tokens came
    num_tokens: dict[int, int] = field(default_factory=dict)

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        for sample in out.outputs:
            i = sample.index
            new = len(sample.token_ids) - self.num_tokens.get(i, 0)
            if new > 0:
                last = self.last.get(i)
                if last is None:
                    self.metrics.ttft.observe(now - self.start)
                else:
                    gap = (now - last) / new
                    for _ in range(new):
                        self.metrics.itl.observe(gap)
                self.last[i], self.num_tokens[i] = now, len(sample.token_ids)


def prompt_logprobs_json(token_ids: list[int], per_position: list | None, tokenizer) -> list[dict | None]:
    """vLLM's `prompt_logprobs` field: per prompt position null (the first token, predicted from
    nothing) or {token id: {"logprob", "rank", "decoded_token"}} for the prompt's own token and
    the top-k (token ids as JSON object keys, i.e. strings)."""
    result: list[dict | None] = []
    for entry in per_position or [None] * len(token_ids):
        if entry is None:
            result.append(None)
            continue
        result.append({str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                "decoded_token": lp.decoded_token if lp.decoded_token is not None
                                else tokenizer.decode([t]) if tokenizer is not None else str(t)}
                       for t, lp in entry.items()})
    return result


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def wait_for_disconnect(request: Request) -> None:
    # After the body is read, the server's receive() returns only when the
    # client disconnects (or the response is complete).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, coro):
    """Awaits `coro`; if the client disconnects first, cancels it (which
    aborts its engine requests and frees their KV blocks) and returns None."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - nobody is listening any more
        pass
    return None


async def merge(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(index, item) from several async iterators as items arrive."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, it):
        try:
            async for item in it:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
