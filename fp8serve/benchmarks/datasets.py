"""Requests for the offline benchmarks (`fp8serve bench throughput` / `latency`), as vLLM's
benchmark datasets build them: `random` (token ids drawn from the ordinary vocabulary, exact
lengths) and `sharegpt` (the first two turns of each conversation in a local ShareGPT JSON file:
the human turn is the prompt, the reply's token count the output length).

Random prompts are token ids, not text: text would re-tokenize to a different length, and the
lengths are what the benchmark is about."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from fp8serve.errors import UserError

# vLLM's ShareGPT filter (benchmarks/datasets.py is_valid_sequence): very short prompts or replies
# say little about serving, long ones are outliers the sample would be dominated by.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class SampleRequest:
    prompt_token_ids: list[int]
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def ordinary_token_ids(vocab_size: int, tokenizer, special_ids: set[int] = frozenset()) -> list[int]:
    """The token ids a random prompt may use: the model's vocabulary without the tokenizer's special
    and added tokens (an EOS or a chat-template marker mid-prompt is not an ordinary prompt), nor
    `special_ids` (the config's EOS ids, for a checkpoint that ships no tokenizer)."""
    excluded = set(special_ids)
    if tokenizer is not None:
        excluded |= set(tokenizer.all_special_ids)
        excluded |= {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    ids = [t for t in range(vocab_size) if t not in excluded]
    if not ids:
        raise UserError(f"the vocabulary of {vocab_size} tokens has no ordinary token to build prompts from")
    return ids


def check_range_ratio(ratio: float) -> None:
    """vLLM's --random-range-ratio: lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"must be in [0, 1), got {ratio:g}")


def _length_range(length: int, ratio: float) -> tuple[int, int]:
    return max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))


def max_random_total_len(input_len: int, output_len: int, ratio: float, prefix_len: int = 0) -> int:
    """The longest prompt + output a random dataset with these settings can draw."""
    return prefix_len + _length_range(input_len, ratio)[1] + _length_range(output_len, ratio)[1]


def random_requests(pool: list[int], num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    """`num_requests` prompts of `prefix_len` shared tokens then ~`input_len` random ones from `pool`,
    each to generate ~`output_len` tokens (exactly, at range_ratio 0)."""
    check_range_ratio(range_ratio)
    rng = random.Random(seed)
    prefix = [rng.choice(pool) for _ in range(prefix_len)]
    in_lo, in_hi = _length_range(input_len, range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    requests = []
    for _ in range(num_requests):
        n_in = rng.randint(in_lo, in_hi)
        requests.append(SampleRequest(prefix + [rng.choice(pool) for _ in range(n_in)], rng.randint(out_lo, out_hi)))
    return requests


def load_sharegpt(path: str) -> list[tuple[str, str]]:
    """(prompt, reply) of every conversation in a ShareGPT JSON file with two turns or more; a file
    that is not one is refused naming the entry and field."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--dataset-path {path}: {'is a folder' if p.is_dir() else 'no such file'}; expected a "
                        "ShareGPT JSON file (e.g. ShareGPT_V3_unfiltered_cleaned_split.json)")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"--dataset-path {path}: not a JSON file ({e})") from None
    if not isinstance(data, list):
        raise UserError(f"--dataset-path {path}: expected a JSON list of conversations (ShareGPT's "
                        f"[{{\"conversations\": [{{\"from\": ..., \"value\": ...}}, ...]}}, ...]), got a "
                        f"{type(data).__name__}")
    pairs = []
    for i, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise UserError(f"--dataset-path {path}: entry {i} has no \"conversations\" list")
        if len(turns) < 2:
            continue  # vLLM skips these too: no reply to take an output length from
        texts = []
        for j in (0, 1):
            value = turns[j].get("value") if isinstance(turns[j], dict) else None
            if not isinstance(value, str):
                raise UserError(f"--dataset-path {path}: entry {i}, conversations[{j}] has no string \"value\"")
            texts.append(value)
        pairs.append((texts[0], texts[1]))
    if not pairs:
        raise UserError(f"--dataset-path {path}: no conversation has two turns (a prompt and a reply)")
    return pairs


def sharegpt_keeps(prompt_len: int, output_len: int, output_len_fixed: bool, max_model_len: int | None) -> bool:
    """vLLM's filter: prompt and reply >= 4 tokens (the reply's length not checked when --output-len
    fixes it), prompt <= 1024, prompt + output <= 2048 and <= `max_model_len`."""
    max_total = SHAREGPT_MAX_TOTAL_LEN if max_model_len is None else min(SHAREGPT_MAX_TOTAL_LEN, max_model_len)
    if prompt_len < SHAREGPT_MIN_LEN or (not output_len_fixed and output_len < SHAREGPT_MIN_LEN):
        return False
    return prompt_len <= SHAREGPT_MAX_PROMPT_LEN and prompt_len + output_len <= max_total


def sharegpt_order(num_pairs: int, seed: int) -> list[int]:
    """The order conversations are tried in: shuffled with `seed`, the sample is the first that pass."""
    order = list(range(num_pairs))
    random.Random(seed).shuffle(order)
    return order


def sharegpt_requests(pairs: list[tuple[str, str]], tokenizer, num_requests: int, seed: int = 0,
                      output_len: int | None = None, max_model_len: int | None = None) -> list[SampleRequest]:
    """Up to `num_requests` conversations, shuffled with `seed`, that pass `sharegpt_keeps`."""
    requests = []
    for i in sharegpt_order(len(pairs), seed):
        if len(requests) == num_requests:
            break
        prompt, reply = pairs[i]
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        n_out = output_len if output_len is not None else len(tokenizer.encode(reply, add_special_tokens=False))
        if sharegpt_keeps(len(ids), n_out, output_len is not None, max_model_len):
            requests.append(SampleRequest(list(ids), n_out))
    return requests
