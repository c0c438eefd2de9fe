"""Incremental detokenization of one request's output, with stop-string handling.

Decoding token by token is wrong for byte-level BPE (a character's bytes can span
tokens) and for SentencePiece (a token's leading space depends on its left context), and
decoding the whole sequence every step is quadratic. Instead each step decodes a short
window twice -- [prefix_offset, read_offset) and [prefix_offset, end) -- and emits the
difference, advancing the window only when the text ends on a complete character.

Stop strings are searched for only in the region a new match could occupy, and while the
end of the text could still grow into a stop string that part is held back from the
streamed deltas, so a client never sees text that is later cut off.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

from fp8serve.sampling_params import SamplingParams

# Tokens of prompt context decoded in front of the first output token, so its leading
# space (SentencePiece) or merged bytes come out as they would in the full text.
INITIAL_PREFIX_TOKENS = 5

# What a decoder yields for an incomplete UTF-8 sequence.
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """Both ``tokenizers.Tokenizer`` and transformers' tokenizers satisfy this."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def direct_decoder(tokenizer: Decoder) -> Callable[..., str]:
    """The `decode` that gives `tokenizer.decode`'s text with the least work.

    transformers' tokenizers backed by a `tokenizers.Tokenizer` decode with it and then
    only clean up spaces when `clean_up_tokenization_spaces` is set. When that is off and
    the class does not override the decode path, the backend's own `decode` returns the
    same string without the wrapper: 1.6 against 4.9 us per call hot. A decode step runs
    it cold, right after the weights streamed through the caches: `append`, which calls
    it once or twice, took 0.35 ms (median) of a 31 ms float32 batch-1 step on a 2-vCPU
    Xeon. Anything else keeps its own `decode`."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (isinstance(tokenizer, TokenizersBackend) and backend is not None
            and cls.decode is PreTrainedTokenizerBase.decode and cls._decode is TokenizersBackend._decode
            and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False):
        return backend.decode
    return tokenizer.decode


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop must contain only non-empty strings, got {list(stop)!r}.")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {min_tokens}.")
        self.tokenizer = tokenizer
        self._decoder = direct_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        # Stop strings are not honoured before min_tokens tokens are out (vLLM semantics).
        self.min_tokens = min_tokens

        self._token_ids = list(prompt_token_ids)
        self._num_prompt_tokens = len(self._token_ids)
        self._read_offset = len(self._token_ids)
        self._prefix_offset = max(self._read_offset - INITIAL_PREFIX_TOKENS, 0)
        self._prefix_text: str | None = None  # decode of [prefix_offset, read_offset), cached
        self._text = ""
        self._num_streamed_chars = 0
        self.stop_reason: str | None = None

    @classmethod
    def from_params(
        cls, tokenizer: Decoder, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> "IncrementalDetokenizer":
        return cls(tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                   params.include_stop_str_in_output, params.min_tokens)

    @property
    def text(self) -> str:
        """Output text so far, already truncated at a matched stop string."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self._num_prompt_tokens:]

    @property
    def is_stopped(self) -> bool:
        return self.stop_reason is not None

    def append(self, token_id: int) -> str:
        """Adds one generated token; returns the text that may be streamed now."""
        if self.is_stopped:
            raise RuntimeError(f"append() after the stop string {self.stop_reason!r} matched.")
        self._token_ids.append(token_id)
        delta = self._decode_delta()
        prev_len = len(self._text)
        self._text += delta
        if self.stop and len(self.output_token_ids) > self.min_tokens:
            self._check_stop(prev_len)
        if self.is_stopped:
            return self.flush()
        return self._take(len(self._text) - self._held_back_len())

    def flush(self) -> str:
        """Releases any held-back text; call once when the request finishes for another reason."""
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        # end never moves backwards: text held back at one step stays held until released.
        end = max(end, self._num_streamed_chars)
        delta = self._text[self._num_streamed_chars:end]
        self._num_streamed_chars = end
        return delta

    def _decode_delta(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset:])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Either a token that decodes to nothing (skipped special token) or the
            # middle of a multi-byte character: wait for more tokens.
            return ""
        delta = new_text[len(self._prefix_text):]
        # The window now ends on a character boundary; restart it from here.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._prefix_text = None
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._decoder(ids, skip_special_tokens=self.skip_special_tokens)

    def _check_stop(self, prev_len: int) -> None:
        # A new match must end inside the new text, so it starts at most len(s) - 1
        # characters before it; searching further back could find an old match made
        # before min_tokens, part of which has already been streamed.
        best: tuple[int, str] | None = None
        for s in self.stop:
            index = self._text.find(s, max(prev_len - len(s) + 1, 0))
            if index != -1 and (best is None or index < best[0]):
                best = (index, s)
        if best is None:
            return
        index, s = best
        self._text = self._text[:index + len(s)] if self.include_stop_str_in_output else self._text[:index]
        self.stop_reason = s

    def _held_back_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        if not self.stop or self.include_stop_str_in_output:
            # Included stop strings are streamed anyway; nothing can be taken back.
            return 0
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._text)), held, -1):
                if self._text.endswith(s[:k]):
                    held = k
                    break
        return held
