"""Request schemas of the OpenAI-compatible API, with vLLM's extra sampling fields.

Unknown fields are accepted and logged (clients such as lm-evaluation-harness
send fields we do not use); responses are built as plain dicts by the serving
modules, in the shapes OpenAI's clients parse.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fp8serve.engine.tokenizer import check_text
from fp8serve.entrypoints.chat_utils import content_text
from fp8serve.errors import InvalidParameterError
from fp8serve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown_fields(self):
        if self.model_extra:
            logger.info("%s: ignoring unknown fields %s", type(self).__name__, sorted(self.model_extra))
        return self


def check_request_text(body: BaseModel) -> None:
    """Every string of a request (prompt, messages, stop strings, unknown
    fields) must be valid Unicode: InvalidParameterError naming the field
    otherwise (tokenizer.check_text)."""
    for name, value in body.model_dump().items():
        check_text(value, name, parameter=name)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# vLLM's guided-decoding fields. fp8serve has no guided decoding, and a request
# that asks for it must fail rather than get unconstrained text as if it had.
GUIDED_DECODING_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions, with vLLM's names."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: dict[str, Any] | None = None
    prompt_logprobs: int | None = None
    # vLLM's: keep the prompt's last k tokens (-1: max_model_len) instead of refusing a long one.
    truncate_prompt_tokens: int | None = None

    def _check_supported(self) -> None:
        """Refuse what would change the output's meaning and is not built:
        structured output (response_format other than text, vLLM's guided_*);
        and, as vLLM, stream options without a stream and prompt logprobs
        with one (they are returned in the whole response only)."""
        if self.stream_options is not None and not self.stream:
            raise InvalidParameterError("stream_options can only be set when stream is true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidParameterError("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise InvalidParameterError(
                f"response_format type {kind!r} is not supported: fp8serve has no structured output (guided "
                f"decoding); leave response_format out or send {{\"type\": \"text\"}}", "response_format")
        for name in GUIDED_DECODING_FIELDS:
            if (self.model_extra or {}).get(name) is not None:
                raise InvalidParameterError(f"{name} is not supported: fp8serve has no guided decoding", name)

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI sends token ids as JSON object keys, i.e. strings."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise InvalidParameterError(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias") from None
        return bias

    def _sampling_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """`defaults`: the model's generation-config values for fields the request leaves unset
        (ModelConfig.default_sampling_params), else the engine's own."""
        self._check_supported()

        def unset(field: str, own):
            value = getattr(self, field)
            return value if value is not None else defaults.get(field, own)

        return dict(
            n=self.n,
            temperature=unset("temperature", 1.0),
            top_p=unset("top_p", 1.0),
            top_k=unset("top_k", 0),
            min_p=unset("min_p", 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=unset("repetition_penalty", 1.0),
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            logit_bias=self._logit_bias(),
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's: the tokenizer's special tokens (e.g. BOS) around a text prompt; false for a prompt
    # that already carries them (a rendered chat template).
    add_special_tokens: bool = True

    def check_max_tokens(self) -> None:
        """As vLLM: at least 1, or 0 with echo (a prompt-only request: the prompt scored, nothing
        generated, as lm-evaluation-harness asks for loglikelihoods); None: up to the context."""
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            raise InvalidParameterError(
                f"max_tokens must be at least 1 (or 0 with echo=true, to score the prompt only), got "
                f"{self.max_tokens}.", "max_tokens")

    @property
    def is_prompt_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, max_tokens: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`max_tokens` is the resolved budget (>= 1); prompt logprobs are
        computed when echo and logprobs are both asked for; `defaults` as in _sampling_kwargs."""
        echoed = self.logprobs if self.echo and self.logprobs is not None else None
        wanted = [k for k in (echoed, self.prompt_logprobs) if k is not None]
        return SamplingParams(
            max_tokens=max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=max(wanted) if wanted else None,
            **self._sampling_kwargs(defaults or {}),
        )


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        # The served models take text: a part of another type (image_url,
        # input_audio, ...) is refused rather than dropped unseen, and a text
        # part must carry a string (chat_utils.content_text).
        content_text(content, "content")
        return content

    def text(self) -> str:
        return content_text(self.content, "content")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: leave the last message open for the model to continue (add_generation_prompt
    # false); extra variables for the template (e.g. {"enable_thinking": false}).
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    # vLLM's: the tokenizer's special tokens (e.g. BOS) added on top of what the template writes;
    # false by default, as templates write their own.
    add_special_tokens: bool = False
    # As vLLM without a tool-call parser: tools go to the chat template (the
    # model sees them in its prompt), tool_choice "none" (the default) only.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def check_max_tokens(self) -> None:
        """The field that counts (max_completion_tokens when sent: vLLM ignores the deprecated
        max_tokens then) at least 1, as vLLM's SamplingParams (OpenAI's minimum too)."""
        name = self.max_tokens_field()
        value = getattr(self, name)
        if value is not None and value < 1:
            raise InvalidParameterError(f"{name} must be at least 1, got {value}.", name)

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return getattr(self, self.max_tokens_field())

    def to_sampling_params(self, max_tokens: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.tool_choice not in (None, "none"):
            raise InvalidParameterError(
                f"tool_choice {self.tool_choice!r} is not supported: fp8serve parses no tool calls; send "
                f"tool_choice \"none\" (the default), which gives the model the tools in its prompt only",
                "tool_choice")
        k = None
        if self.logprobs:
            k = self.top_logprobs or 0
        elif self.top_logprobs:
            raise InvalidParameterError("top_logprobs requires logprobs=true", "top_logprobs")
        return SamplingParams(max_tokens=max_tokens, logprobs=k, prompt_logprobs=self.prompt_logprobs,
                              **self._sampling_kwargs(defaults or {}))


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: true for a prompt, false for messages (the chat request's).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: also return each token's string (the tokenizer's own pieces, e.g. "ĠHello").
    return_token_strs: bool = False
    # With messages, as in a chat request (vLLM's tokenize takes both).
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, err_type: str = "BadRequestError", code: int = 400,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


FinishReason = Literal["stop", "length", "abort"] | None
