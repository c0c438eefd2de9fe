"""Greedy steps through the screened LM head (kernels/screened_argmax.py):
the engine must produce the tokens it produces with the screen off, serve
plain greedy steps from the screen and keep every other step (logprobs,
sampling, penalties) on the full logits. Fresh random prompts each run (the
seed is in every failure message)."""

from __future__ import annotations

import random

import pytest
from checkpoints import write_tiny_llama
from engine_runs import run_requests

from fp8serve.engine.llm_engine import LLMEngine
from fp8serve.kernels import screened_argmax
from fp8serve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A vocabulary big enough that the screen has something to skip, tied like SmolLM2's.
    return write_tiny_llama(tmp_path_factory.mktemp("greedy") / "llama", vocab_size=3000, tie_word_embeddings=True)


def engine(model_dir, monkeypatch, switch: str, dtype: str = "float32") -> LLMEngine:
    monkeypatch.setenv(screened_argmax.SCREENED_ARGMAX_ENV, switch)
    return LLMEngine.from_args(str(model_dir), dtype=dtype, device="cpu", block_size=16,
                               kv_cache_memory=4 << 20, max_model_len=128, enforce_eager=True)


def requests(seed: int, params_for) -> list:
    """11 requests of different lengths: the first steps' batches have more
    rows than the screen takes (8), the last ones fewer."""
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(3, 3000) for _ in range(rng.randint(2, 40))], params_for(i, 2 + 2 * i))
            for i in range(11)]


def tokens(outs: dict) -> dict:
    return {rid: out.outputs[0].token_ids for rid, out in outs.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_equal_the_full_heads(model_dir, monkeypatch, seed, ops, dtype):
    """float32 compute (a float32 head, 1-8 rows) and bf16 compute (the bf16
    head, bf16 logits with their ties, 1-2 rows)."""
    calls = []
    real = screened_argmax.greedy_tokens

    def spy(x, *rest):
        calls.append(x.shape[0])
        return real(x, *rest)

    greedy = lambda i, n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    off = engine(model_dir, monkeypatch, "0", dtype)
    assert off.model_runner.model.lm_head.greedy_screen is None
    want = tokens(run_requests(off, requests(seed, greedy)))
    on = engine(model_dir, monkeypatch, "auto", dtype)
    head = on.model_runner.model.lm_head
    assert head.greedy_screen is not None
    monkeypatch.setattr(screened_argmax, "greedy_tokens", spy)
    got = tokens(run_requests(on, requests(seed, greedy)))
    assert got == want, seed
    rows = screened_argmax.engine_rows(head.weight.dtype, on.model_runner.dtype)
    assert calls and max(calls) <= rows, (calls, seed)
    # Every step from `rows` rows down: the last 10 (8 rows) or 3 (2 rows) at least.
    assert len(calls) >= (10 if rows >= 8 else 3), (calls, seed)


def test_other_steps_keep_the_full_logits(model_dir, monkeypatch, seed, ops):
    """Logprobs, sampling and penalties need the logits: those batches never
    touch the screen, and their results stay what they are with it off."""
    calls = []
    monkeypatch.setattr(screened_argmax, "greedy_tokens", lambda *a: calls.append(1))

    def mixed(i, n):
        if i % 3 == 0:
            return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
        if i % 3 == 1:
            return SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True)
        return SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=n, ignore_eos=True)

    on = engine(model_dir, monkeypatch, "1")
    got = run_requests(on, requests(seed, mixed))
    assert not calls, seed
    off = engine(model_dir, monkeypatch, "0")
    want = run_requests(off, requests(seed, mixed))
    assert tokens(got) == tokens(want), seed
    assert all(got[rid].outputs[0].logprobs for rid in got if int(rid[1:]) % 3 == 0)
