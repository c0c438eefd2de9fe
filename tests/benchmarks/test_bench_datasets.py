"""The offline benchmarks' requests: random token ids of exact (or ranged) lengths, and ShareGPT
conversations filtered as vLLM does."""

from __future__ import annotations

import json

import pytest
from checkpoints import SPECIAL_TOKENS, make_tokenizer

from fp8serve.benchmarks.datasets import (
    SHAREGPT_MAX_PROMPT_LEN,
    SHAREGPT_MAX_TOTAL_LEN,
    check_range_ratio,
    load_sharegpt,
    max_random_total_len,
    ordinary_token_ids,
    random_requests,
    sharegpt_requests,
)
from fp8serve.errors import UserError


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(d)
    return AutoTokenizer.from_pretrained(str(d), local_files_only=True)


def test_ordinary_token_ids_leave_out_special_and_eos_ids(tokenizer):
    ids = ordinary_token_ids(512, tokenizer, {7})
    special = {tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert special == {0, 1, 2}
    assert not (special | {7}) & set(ids)
    assert len(ids) == 512 - 4 and ids == sorted(ids) and ids[-1] == 511
    # No tokenizer: only the given ids (the config's EOS) are left out.
    assert ordinary_token_ids(10, None, {0, 9}) == list(range(1, 9))
    with pytest.raises(UserError, match="no ordinary token"):
        ordinary_token_ids(2, None, {0, 1})


def test_random_requests_exact_lengths_shared_prefix_and_seeded(seed):
    pool = list(range(100, 400))
    reqs = random_requests(pool, 7, input_len=33, output_len=5, prefix_len=4, seed=seed)
    assert len(reqs) == 7
    assert all(r.prompt_len == 37 and r.expected_output_len == 5 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:4]) for r in reqs}) == 1
    assert len({tuple(r.prompt_token_ids[4:]) for r in reqs}) == 7  # 300^33 draws: never equal by chance
    assert all(set(r.prompt_token_ids) <= set(pool) for r in reqs)
    again = random_requests(pool, 7, input_len=33, output_len=5, prefix_len=4, seed=seed)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    other = random_requests(pool, 7, input_len=33, output_len=5, prefix_len=4, seed=seed + 1)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in reqs]


def test_random_range_ratio_bounds(seed):
    reqs = random_requests(list(range(50)), 400, input_len=100, output_len=20, range_ratio=0.5, seed=seed)
    in_lens = [r.prompt_len for r in reqs]
    out_lens = [r.expected_output_len for r in reqs]
    assert min(in_lens) >= 50 and max(in_lens) <= 150 and len(set(in_lens)) > 20
    assert min(out_lens) >= 10 and max(out_lens) <= 30 and len(set(out_lens)) > 5
    assert max(i + o for i, o in zip(in_lens, out_lens)) <= max_random_total_len(100, 20, 0.5) == 180
    assert max_random_total_len(100, 20, 0.0, prefix_len=3) == 123
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match=r"\[0, 1\)"):
            check_range_ratio(bad)


def _write(tmp_path, data, name="sg.json") -> str:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(p)


def _conv(*values):
    return {"id": "x", "conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": v}
                                         for i, v in enumerate(values)]}


def test_load_sharegpt_takes_first_two_turns_and_skips_short_conversations(tmp_path):
    path = _write(tmp_path, [_conv("q1", "a1", "q2", "a2"), _conv("only"), _conv(), _conv("q3", "a3")])
    assert load_sharegpt(path) == [("q1", "a1"), ("q3", "a3")]


@pytest.mark.parametrize("data, message", [
    ("{not json", "not a JSON file"),
    ({"conversations": []}, "expected a JSON list of conversations.*got a dict"),
    ([_conv("a", "b"), {"turns": []}], "entry 1 has no \"conversations\" list"),
    (["text"], "entry 0 has no \"conversations\" list"),
    ([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]}],
     r"entry 0, conversations\[1\] has no string \"value\""),
    ([{"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]}],
     r"entry 0, conversations\[0\] has no string \"value\""),
    ([_conv("one"), _conv()], "no conversation has two turns"),
])
def test_load_sharegpt_refuses_what_is_not_sharegpt(tmp_path, data, message):
    path = _write(tmp_path, data)
    with pytest.raises(UserError, match=message) as e:
        load_sharegpt(path)
    assert path in str(e.value)


def test_load_sharegpt_missing_file_and_folder(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_sharegpt(str(tmp_path / "missing.json"))
    with pytest.raises(UserError, match="is a folder"):
        load_sharegpt(str(tmp_path))


def _text_of_len(tokenizer, n: int) -> str:
    """Text of exactly n tokens: a word that is one token after a space, n times (the byte-level
    pre-tokenizer splits at spaces, so the copies never merge)."""
    word = next(t for t in tokenizer.get_vocab() if t.startswith("\u0120") and t[1:].isalpha() and len(t) > 2)
    text = (" " + word[1:]) * n
    assert len(tokenizer.encode(text, add_special_tokens=True)) == n
    return text


def test_sharegpt_filter_is_vllms(tokenizer, seed):
    lens = {  # name: (prompt tokens, reply tokens), and whether vLLM keeps it
        "ok": ((10, 20), True),
        "short_prompt": ((3, 20), False),
        "short_reply": ((10, 3), False),
        "min_both": ((4, 4), True),
        "long_prompt": ((SHAREGPT_MAX_PROMPT_LEN + 1, 10), False),
        "max_prompt": ((SHAREGPT_MAX_PROMPT_LEN, 10), True),
        "long_total": ((1000, SHAREGPT_MAX_TOTAL_LEN - 1000 + 1), False),
        "max_total": ((1000, SHAREGPT_MAX_TOTAL_LEN - 1000), True),
    }
    texts = {name: (_text_of_len(tokenizer, p), _text_of_len(tokenizer, r)) for name, ((p, r), _) in
             lens.items()}
    pairs = list(texts.values())
    reqs = sharegpt_requests(pairs, tokenizer, num_requests=100, seed=seed)
    kept = sorted((r.prompt_len, r.expected_output_len) for r in reqs)
    assert kept == sorted(pr for pr, keep in lens.values() if keep)
    # The prompt is the first turn's tokens, as the engine would tokenize it.
    by_len = {r.prompt_len: r for r in reqs}
    assert by_len[10].prompt_token_ids == tokenizer.encode(texts["ok"][0], add_special_tokens=True)

    # --output-len fixes the output length: a short reply no longer matters, the total still does.
    fixed = sharegpt_requests(pairs, tokenizer, num_requests=100, seed=seed, output_len=1100)
    assert sorted(r.prompt_len for r in fixed) == [4, 10, 10]  # ok, short_reply, min_both
    assert {r.expected_output_len for r in fixed} == {1100}
    # max_model_len caps the total below 2048.
    capped = sharegpt_requests(pairs, tokenizer, num_requests=100, seed=seed, max_model_len=30)
    assert sorted((r.prompt_len, r.expected_output_len) for r in capped) == [(4, 4), (10, 20)]


def test_sharegpt_requests_shuffled_by_seed_and_capped(tokenizer, seed):
    pairs = [(_text_of_len(tokenizer, 5 + i), _text_of_len(tokenizer, 5)) for i in range(30)]
    a = sharegpt_requests(pairs, tokenizer, num_requests=10, seed=seed)
    assert len(a) == 10
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in
                                              sharegpt_requests(pairs, tokenizer, num_requests=10, seed=seed)]
    lens = [r.prompt_len for r in a]
    assert len(set(lens)) == 10 and lens != list(range(5, 15))  # a sample of the file, not its first ten
    b = sharegpt_requests(pairs, tokenizer, num_requests=10, seed=seed + 1)
    assert [r.prompt_len for r in b] != lens
    assert sorted(r.prompt_len for r in sharegpt_requests(pairs, tokenizer, num_requests=100, seed=seed)) == \
        list(range(5, 35))
