"""Per-request sampling parameters, with vLLM's field names, defaults and ranges.

Scripts ported from vLLM construct ``SamplingParams(...)`` with keyword arguments, so
the names and defaults below must stay vLLM's. Values are validated and normalized once
here; the sampler and the detokenizer trust them afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8serve.errors import InvalidParameterError

# Below this temperature a request is treated as greedy. Dividing logits by a tiny
# temperature overflows float32 long before it stops changing the argmax.
SAMPLING_EPS = 1e-5

# Most samples one request may ask for (OpenAI's limit for `n`).
MAX_N = 128
# vLLM's default --max-logprobs: the engine's bound on logprobs / prompt_logprobs per position
# (ModelConfig.max_logprobs, checked when a request is added; here only >= 0).
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables; stored as 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None  # stored as list[str]
    stop_token_ids: list[int] | None = None  # stored as list[int]
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Added to the logits of these token ids before penalties and sampling (OpenAI's
    # logit_bias; -100 bans a token in practice, +100 all but forces it).
    logit_bias: dict[int, float] | None = None
    # False: token ids only (output text "", logprobs without decoded tokens), as vLLM's
    # detokenize=False; the offline benchmarks' --disable-detokenize.
    detokenize: bool = True
    # vLLM's: keep only the prompt's last k tokens (left truncation); -1 = max_model_len.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        self.validate()
        if self.is_greedy:
            # Greedy decoding is an argmax; truncation filters cannot change it, and
            # leaving them on would only make the sampler take its slower paths.
            self.temperature = 0.0
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    def validate(self) -> None:
        """Normalize and check every field (InvalidParameterError naming it).
        Run at construction, and again by the engine when a request is added:
        a field changed in between is checked too."""
        self._normalize()
        self._verify()

    def _normalize(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, list, tuple)):
                raise InvalidParameterError(f"{name} must be a list (or None), got {type(value).__name__}.", name)
        if isinstance(self.stop_token_ids, str):
            raise InvalidParameterError("stop_token_ids must be a list of token ids, got a string.", "stop_token_ids")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidParameterError(
                    f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}.", "logit_bias")
            self.logit_bias = dict(self.logit_bias) or None

    def _verify(self) -> None:
        # Types first: a string or None where a number belongs would fail the
        # range checks below with a TypeError, or later inside a step.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value), name, f"{name} must be a number, got {value!r}.")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, f"{name} must be True or False, got {value!r}.")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"n must be an int in [1, {MAX_N}], got {self.n!r}.")
        if self.truncate_prompt_tokens is not None:
            _check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        _check(self.temperature >= 0.0, "temperature", f"temperature must be non-negative, got {self.temperature}.")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        _check(
            _is_int(self.top_k) and (self.top_k == 0 or self.top_k >= 1), "top_k",
            f"top_k must be -1 or 0 (disable), or at least 1, got {self.top_k}.",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        # torch's generators take seeds in [-2^63, 2^64); beyond that they wrap silently.
        _check(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64), "seed",
               f"seed must be an int in [-2^63, 2^64) or None, got {self.seed!r}.")
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
            f"max_tokens must be at least 1, got {self.max_tokens}.",
        )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
            f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens, "min_tokens",
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and value >= 0), name,
                f"{name} must be a non-negative int or None, got {value!r}.",
            )
        _check(
            self.repetition_penalty > 0.0, "repetition_penalty",
            f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}.")
        for s in self.stop:
            _check(isinstance(s, str) and len(s) > 0, "stop", f"stop must contain only non-empty strings, got {s!r}.")
        # Stop strings are matched in the decoded text (vLLM refuses the pair too).
        _check(self.detokenize or not self.stop, "stop",
               f"stop strings need detokenize=True (they are matched in the text), got stop={self.stop!r} with "
               "detokenize=False.")
        for t in self.stop_token_ids:
            _check(_is_int(t) and t >= 0, "stop_token_ids", f"stop_token_ids must be non-negative ints, got {t!r}.")
        for t, bias in (self.logit_bias or {}).items():
            _check(_is_int(t) and t >= 0, "logit_bias", f"logit_bias keys must be non-negative token ids, got {t!r}.")
            _check(isinstance(bias, (int, float)) and not isinstance(bias, bool) and -100.0 <= bias <= 100.0,
                   "logit_bias", f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {t}.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def truncate_prompt(token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """The prompt's last truncate_prompt_tokens tokens (-1: max_model_len), or all of it. Checked
    here too, as the server truncates before it builds the SamplingParams; a value above
    max_model_len is refused, as vLLM does (it could never make a long prompt fit)."""
    t = truncate_prompt_tokens
    if t is None:
        return token_ids
    _check_truncate_prompt_tokens(t)
    _check(t <= max_model_len, "truncate_prompt_tokens",
           f"truncate_prompt_tokens {t} is more than max_model_len {max_model_len}; choose a smaller one (or -1 "
           "for max_model_len).")
    keep = max_model_len if t == -1 else t
    return token_ids[-keep:]


def check_max_logprobs(params: SamplingParams, max_logprobs: int) -> None:
    """The engine's bound (--max-logprobs) on logprobs and prompt_logprobs per position."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        _check(value is None or value <= max_logprobs, name,
               f"{name}: requested {value} per position, more than max_logprobs {max_logprobs} (set by "
               "--max-logprobs)")


def _check_truncate_prompt_tokens(value: object) -> None:
    _check(_is_int(value) and (value >= 1 or value == -1), "truncate_prompt_tokens",
           f"truncate_prompt_tokens must be an int >= 1, or -1 for max_model_len, got {value!r}.")


def _is_int(value: object) -> bool:
    # bool is an int subclass; True as a seed or a count is a caller bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, parameter: str, message: str) -> None:
    if not ok:
        raise InvalidParameterError(message, parameter)
