"""`POST /v1/chat/completions`: the model's chat template, then one generation."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fp8serve.entrypoints.chat_utils import template_options
from fp8serve.entrypoints.openai.protocol import ChatCompletionRequest
from fp8serve.entrypoints.openai.serving_common import (
    RequestError, RequestTimer, check_prompt, prompt_logprobs_json, random_id, resolve_max_tokens, sse,
    stream_safe_len, usage,
)
from fp8serve.errors import InvalidParameterError
from fp8serve.sampling_params import SamplingParams, check_max_logprobs, truncate_prompt


class ChatServer:
    def __init__(self, state) -> None:
        self.state = state

    def apply_chat_template(self, request) -> list[int]:
        tok = self.state.engine.tokenizer
        # The request's own template, then the server's --chat-template, then the tokenizer's (as vLLM).
        template = request.chat_template if request.chat_template is not None else self.state.chat_template
        if tok is None or (getattr(tok, "chat_template", None) is None and template is None):
            raise RequestError("this model has no chat template (the server takes one with --chat-template)",
                               param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        # add_generation_prompt counts as given only when the request sent it: its default (true)
        # gives way to continue_final_message.
        given = "add_generation_prompt" in request.model_fields_set
        try:
            options = template_options(request.add_generation_prompt if given else None,
                                       request.continue_final_message, request.chat_template_kwargs)
        except InvalidParameterError as e:
            raise RequestError(str(e), param=e.parameter) from None
        # add_special_tokens: the text the template renders, encoded with the tokenizer's special
        # tokens around it (a BOS the template does not write); else the template's tokens alone.
        special = bool(request.add_special_tokens)
        try:
            ids = tok.apply_chat_template(messages, tokenize=not special, chat_template=template,
                                          tools=getattr(request, "tools", None), **options)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise RequestError(f"chat template failed: {e}", param="messages") from None
        if special:
            return tok.encode(ids, add_special_tokens=True)
        # transformers 5 returns a BatchEncoding-like mapping; older versions a list.
        return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)

    def prepare(self, request: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        request.check_max_tokens()
        mc = self.state.engine.config.model_config
        ids = self.apply_chat_template(request)
        ids = truncate_prompt(ids, request.truncate_prompt_tokens, mc.max_model_len)
        check_prompt(ids, mc.arch.vocab_size, mc.max_model_len, param="messages")
        defaults = mc.default_sampling_params
        budget = resolve_max_tokens(request.requested_max_tokens(), len(ids), mc.max_model_len, prompt_param="messages",
                                    cap=defaults.get("max_tokens"), budget_param=request.max_tokens_field())
        try:
            params = request.to_sampling_params(budget, defaults)
            check_max_logprobs(params, mc.max_logprobs)
            return ids, params
        except ValueError as e:
            # Chat's name for SamplingParams.logprobs is top_logprobs.
            param = getattr(e, "parameter", None)
            raise RequestError(str(e), param="top_logprobs" if param == "logprobs" else param) from None

    async def complete(self, request: ChatCompletionRequest, prepared) -> dict:
        ids, params = prepared
        request_id = random_id("chatcmpl")
        timer = RequestTimer(self.state.metrics)
        final = None
        async for out in self.state.engine.generate({"prompt_token_ids": ids}, params, request_id):
            timer.on_output(out)
            final = out
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(request, c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in final.outputs]
        response = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                    "model": request.model or self.state.model_name, "choices": choices,
                    "usage": usage(len(ids), sum(len(c.token_ids) for c in final.outputs))}
        if request.prompt_logprobs is not None:  # vLLM's place for them in a chat response
            response["prompt_logprobs"] = prompt_logprobs_json(ids, final.prompt_logprobs,
                                                               self.state.engine.tokenizer)
        return response

    async def stream(self, request: ChatCompletionRequest, prepared) -> AsyncIterator[str]:
        ids, params = prepared
        request_id = random_id("chatcmpl")
        created = int(time.time())
        timer = RequestTimer(self.state.metrics)

        def chunk(choices: list, **extra) -> str:
            return sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                        "model": request.model or self.state.model_name, "choices": choices, **extra})

        opts = request.stream_options
        # vLLM's continuous_usage_stats: each chunk also carries the usage of
        # its choice so far.
        continuous_usage = opts is not None and opts.include_usage and opts.continuous_usage_stats
        n = request.n
        for j in range(n):
            extra = {"usage": usage(len(ids), 0)} if continuous_usage else {}
            yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}], **extra)
        sent_chars, sent_tokens, finished = [0] * n, [0] * n, [False] * n
        async for out in self.state.engine.generate({"prompt_token_ids": ids}, params, request_id):
            timer.on_output(out)
            for c in out.outputs:
                j = c.index
                if finished[j]:
                    continue
                done = finished[j] = c.finish_reason is not None
                end = len(c.text) if done else stream_safe_len(c.text, params.stop, params.include_stop_str_in_output)
                delta = c.text[sent_chars[j]:end] if end > sent_chars[j] else ""
                logprobs = self._logprobs(request, c.token_ids[sent_tokens[j]:], (c.logprobs or [])[sent_tokens[j]:])
                sent_chars[j] = max(sent_chars[j], end)
                sent_tokens[j] = len(c.token_ids)
                finish = c.finish_reason if done else None
                if delta or finish or (logprobs and logprobs["content"]):
                    extra = {"usage": usage(len(ids), sent_tokens[j])} if continuous_usage else {}
                    yield chunk([{"index": j, "delta": {"content": delta} if delta else {}, "logprobs": logprobs,
                                  "finish_reason": finish, "stop_reason": c.stop_reason if finish else None}],
                                **extra)
        if opts is not None and opts.include_usage:
            yield chunk([], usage=usage(len(ids), sum(sent_tokens)))
        yield sse("[DONE]")

    def _logprobs(self, request: ChatCompletionRequest, token_ids: list[int], per_position: list) -> dict | None:
        """Chat format: per token {token, logprob, bytes, top_logprobs: [...k]}."""
        if not request.logprobs:
            return None
        k = request.top_logprobs or 0
        tok = self.state.engine.tokenizer
        content = []
        for tid, entry in zip(token_ids, per_position):
            def item(t, lp):
                s = lp.decoded_token if lp.decoded_token is not None else tok.decode([t])
                return {"token": s, "logprob": lp.logprob, "bytes": list(s.encode("utf-8"))}
            ranked = sorted((kv for kv in entry.items() if kv[1].rank is not None and kv[1].rank <= k),
                            key=lambda kv: kv[1].rank)
            content.append({**item(tid, entry[tid]), "top_logprobs": [item(t, lp) for t, lp in ranked]})
        return {"content": content}
