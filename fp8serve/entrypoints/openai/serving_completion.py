"""`POST /v1/completions`: the legacy completions API, including the
echo + logprobs form that lm-evaluation-harness uses for loglikelihoods
(`echo=true, max_tokens=0, logprobs=k`: per prompt position the token's
logprob and the top-k, the first position null)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fp8serve.entrypoints.openai.protocol import CompletionRequest
from fp8serve.entrypoints.openai.serving_common import (
    RequestError, RequestTimer, check_prompt, merge, prompt_logprobs_json, random_id, resolve_max_tokens, sse,
    stream_safe_len, usage,
)
from fp8serve.outputs import RequestOutput
from fp8serve.sampling_params import SamplingParams, check_max_logprobs, truncate_prompt


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]


class CompletionServer:
    def __init__(self, state) -> None:
        self.state = state  # ServerState: engine, metrics, model name

    def _prompts(self, request: CompletionRequest) -> list[_Prompt]:
        p = request.prompt
        tok = self.state.engine.tokenizer
        if isinstance(p, str):
            items: list = [p]
        elif p and all(isinstance(t, int) for t in p):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise RequestError("prompt must not be empty", param="prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                if tok is None:
                    raise RequestError("this model has no tokenizer: send token ids as the prompt", param="prompt")
                prompts.append(_Prompt(item, tok.encode(item, add_special_tokens=request.add_special_tokens)))
            else:
                prompts.append(_Prompt(None, list(item)))
        return prompts

    @staticmethod
    def _truncated(p: _Prompt, truncate_prompt_tokens, max_model_len: int) -> _Prompt:
        """truncate_prompt_tokens applied before the length checks (an echo then shows the kept
        tokens' text, not the whole prompt's)."""
        kept = truncate_prompt(p.token_ids, truncate_prompt_tokens, max_model_len)
        return p if len(kept) == len(p.token_ids) else _Prompt(None, kept)

    def prepare(self, request: CompletionRequest) -> tuple[list[_Prompt], list[SamplingParams], bool]:
        if request.best_of not in (None, request.n):
            raise RequestError(f"best_of must equal n ({request.n}) or be left out: fp8serve returns every sample",
                               param="best_of")
        if request.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        request.check_max_tokens()
        mc = self.state.engine.config.model_config
        prompts = [self._truncated(p, request.truncate_prompt_tokens, mc.max_model_len)
                   for p in self._prompts(request)]
        # Prompt-only: the engine samples one token (it always samples), which no response shows.
        hide_output = request.is_prompt_only
        params = []
        for p in prompts:
            check_prompt(p.token_ids, mc.arch.vocab_size, mc.max_model_len)
            defaults = mc.default_sampling_params
            budget = resolve_max_tokens(request.max_tokens, len(p.token_ids), mc.max_model_len,
                                        cap=defaults.get("max_tokens"))
            try:
                params.append(request.to_sampling_params(max(budget, 1), defaults))
                check_max_logprobs(params[-1], mc.max_logprobs)
            except ValueError as e:
                raise RequestError(str(e), param=getattr(e, "parameter", None)) from None
        return prompts, params, hide_output

    def _generate(self, prompt: _Prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        return self.state.engine.generate({"prompt_token_ids": prompt.token_ids}, params, request_id)

    async def _outputs(self, request_id: str, prompts: list[_Prompt], params: list[SamplingParams],
                       hide_output: bool) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of the engine requests of one completion request, one per
        prompt, as they come; while they run, the metrics know them as prompt-only where their
        sampled tokens are hidden."""
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        iterators = [self._generate(p, sp, rid) for p, sp, rid in zip(prompts, params, ids)]
        with self.state.metrics.prompt_only(ids if hide_output else []):
            async for item in merge(iterators):
                yield item

    async def complete(self, request: CompletionRequest, prepared) -> dict:
        prompts, params, hide_output = prepared
        request_id = random_id("cmpl")
        timers = [RequestTimer(self.state.metrics) for _ in prompts]
        finals: list[RequestOutput | None] = [None] * len(prompts)
        async for i, out in self._outputs(request_id, prompts, params, hide_output):
            timers[i].on_output(out)
            finals[i] = out
        choices, num_prompt, num_completion = [], 0, 0
        n = request.n
        for i, (p, out) in enumerate(zip(prompts, finals)):
            for c in out.outputs:  # n samples of prompt i: choices i * n .. i * n + n - 1, as in vLLM
                token_ids = [] if hide_output else c.token_ids
                text = "" if hide_output else c.text
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(p, out, c, request.echo, hide_output)
                if request.echo:
                    text = self._prompt_text(p) + text
                choice = {"index": i * n + c.index, "text": text, "logprobs": logprobs,
                          "finish_reason": "length" if hide_output else c.finish_reason,
                          "stop_reason": c.stop_reason}
                if request.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs_json(p, out, request.prompt_logprobs)
                choices.append(choice)
                num_completion += len(token_ids)
            num_prompt += len(p.token_ids)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": request.model or self.state.model_name, "choices": choices,
                "usage": usage(num_prompt, num_completion)}

    async def stream(self, request: CompletionRequest, prepared) -> AsyncIterator[str]:
        prompts, params, hide_output = prepared
        request_id = random_id("cmpl")
        created = int(time.time())
        timers = [RequestTimer(self.state.metrics) for _ in prompts]
        opts = request.stream_options
        # vLLM's continuous_usage_stats: each chunk also carries the usage of
        # its choice so far.
        continuous_usage = opts is not None and opts.include_usage and opts.continuous_usage_stats
        n = request.n
        # Per choice (prompt i, sample j) at index i * n + j.
        sent_chars = [0] * (len(prompts) * n)
        sent_tokens = [0] * (len(prompts) * n)
        echoed = [not request.echo] * (len(prompts) * n)
        finished = [False] * (len(prompts) * n)
        num_completion = [0] * (len(prompts) * n)

        def chunk(choices: list, **extra) -> str:
            return sse({"id": request_id, "object": "text_completion", "created": created,
                        "model": request.model or self.state.model_name, "choices": choices, **extra})

        async for i, out in self._outputs(request_id, prompts, params, hide_output):
            timers[i].on_output(out)
            for c in out.outputs:
                k = i * n + c.index
                if finished[k]:
                    continue
                done = c.finish_reason is not None
                text, token_ids = ("", []) if hide_output else (c.text, c.token_ids)
                end = len(text) if done else stream_safe_len(text, params[i].stop, params[i].include_stop_str_in_output)
                delta = text[sent_chars[k]:end] if end > sent_chars[k] else ""
                logprobs = None
                if request.logprobs is not None:
                    logprobs = _legacy_logprobs(token_ids[sent_tokens[k]:], (c.logprobs or [])[sent_tokens[k]:],
                                                self.state.engine.tokenizer)
                if not echoed[k]:
                    echoed[k] = True
                    delta = self._prompt_text(prompts[i]) + delta
                    if request.logprobs is not None:
                        logprobs = _concat_logprobs(self._prompt_logprobs(prompts[i], out), logprobs)
                sent_chars[k] = max(sent_chars[k], end)
                # One chunk per step that produced tokens, even when its text is
                # held back or empty, so clients can time every token.
                has_new_tokens = len(token_ids) > sent_tokens[k]
                sent_tokens[k] = len(token_ids)
                num_completion[k] = len(token_ids)
                finished[k] = done
                finish = ("length" if hide_output else c.finish_reason) if done else None
                if delta or finish or has_new_tokens or (logprobs and logprobs["tokens"]):
                    extra = {"usage": usage(len(prompts[i].token_ids), num_completion[k])} if continuous_usage else {}
                    yield chunk([{"index": k, "text": delta, "logprobs": logprobs, "finish_reason": finish,
                                  "stop_reason": c.stop_reason if done else None}], **extra)
        if opts is not None and opts.include_usage:
            yield chunk([], usage=usage(sum(len(p.token_ids) for p in prompts), sum(num_completion)))
        yield sse("[DONE]")

    # --------------------------------------------------------------- logprobs
    def _prompt_text(self, p: _Prompt) -> str:
        if p.text is not None:
            return p.text
        tok = self.state.engine.tokenizer
        return tok.decode(p.token_ids) if tok is not None else ""

    def _prompt_logprobs(self, p: _Prompt, out: RequestOutput) -> dict:
        per_pos = out.prompt_logprobs or [None] * len(p.token_ids)
        return _legacy_logprobs(p.token_ids, per_pos, self.state.engine.tokenizer)

    def _prompt_logprobs_json(self, p: _Prompt, out: RequestOutput, k: int) -> list:
        # The engine computed max(k, echo's logprobs) per position: keep the prompt token and the top k.
        per_pos = [None if e is None else {t: lp for t, lp in e.items()
                                           if t == tid or (lp.rank is not None and lp.rank <= k)}
                   for tid, e in zip(p.token_ids, out.prompt_logprobs or [None] * len(p.token_ids))]
        return prompt_logprobs_json(p.token_ids, per_pos, self.state.engine.tokenizer)

    def _logprobs(self, p: _Prompt, out: RequestOutput, c, echo: bool, hide_output: bool) -> dict:
        gen = _legacy_logprobs([] if hide_output else c.token_ids, [] if hide_output else (c.logprobs or []),
                               self.state.engine.tokenizer)
        if not echo:
            return gen
        return _concat_logprobs(self._prompt_logprobs(p, out), gen)


def _token_str(tokenizer, token_id: int, entry: dict | None) -> str:
    if entry is not None and token_id in entry and entry[token_id].decoded_token is not None:
        return entry[token_id].decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _legacy_logprobs(token_ids: list[int], per_position: list, tokenizer) -> dict:
    """OpenAI legacy format: tokens, token_logprobs, top_logprobs, text_offset;
    a position without logprobs (the first prompt token) is null."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = 0
    for tid, entry in zip(token_ids, per_position):
        s = _token_str(tokenizer, tid, entry)
        tokens.append(s)
        text_offset.append(offset)
        offset += len(s)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry[tid].logprob if tid in entry else None)
        ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank))
        top_logprobs.append({_token_str(tokenizer, t, entry): lp.logprob for t, lp in ranked})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def _concat_logprobs(first: dict, second: dict | None) -> dict:
    if second is None:
        return first
    shift = (first["text_offset"][-1] + len(first["tokens"][-1])) if first["tokens"] else 0
    return {
        "tokens": first["tokens"] + second["tokens"],
        "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
        "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
        "text_offset": first["text_offset"] + [o + shift for o in second["text_offset"]],
    }
