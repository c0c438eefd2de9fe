"""Greedy output of the built-in SmolLM2-135M with an FP8 KV cache against the
same model with a float32 KV cache (float32 compute throughout).

FP8 rounding of K and V changes logits slightly, so an argmax can flip and the
continuations then diverge; identity is not expected. We report, per prompt,
the length of the prefix that matches the float32-KV output, and require the
mean to be at least half of the generated tokens."""

from __future__ import annotations

import pytest

from fp8serve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
]
MAX_TOKENS = 24


def greedy(kv_cache_dtype: str) -> tuple[LLM, list[list[int]]]:
    llm = LLM(None, dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory="64MiB", max_model_len=512)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def matching_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def reference():
    llm, ids = greedy("auto")
    assert llm.llm_engine.model_runner.kv_cache_spec.kv_cache_dtype == "float32"
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_greedy_agrees_with_float32_kv(reference, kv_cache_dtype):
    llm, ids = greedy(kv_cache_dtype)
    # No scales in a 16-bit checkpoint: every layer uses 1.0.
    assert all((a._k_scale, a._v_scale, a.kv_scale_source) == (1.0, 1.0, "default")
               for a in llm.llm_engine.model_runner.attn_layers)
    prefixes = [matching_prefix(r, o) for r, o in zip(reference, ids)]
    positions = sum(x == y for r, o in zip(reference, ids) for x, y in zip(r, o))
    mean_fraction = sum(prefixes) / (len(PROMPTS) * MAX_TOKENS)
    print(f"\n{kv_cache_dtype} vs float32 KV: matching prefix per prompt {prefixes} of {MAX_TOKENS}, "
          f"mean {mean_fraction:.0%}; same token at {positions}/{len(PROMPTS) * MAX_TOKENS} positions")
    assert all(len(o) == MAX_TOKENS for o in ids)
    assert all(p >= 1 for p in prefixes)  # the first token comes from the same prefill logits, nearly
    assert mean_fraction >= 0.5
