"""Driving an LLMEngine (or an LLM) in tests: requests in, finished outputs out, and checks on them."""

from __future__ import annotations

import pytest


def run_requests(engine, requests, max_steps: int = 3000) -> dict:
    """Add (request id, prompt token ids, SamplingParams) requests, step until all finish;
    {request id: final RequestOutput}. Fails the test if they are not done in max_steps."""
    for rid, prompt, params in requests:
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    pytest.fail(f"not finished after {max_steps} steps")


def assert_greedy_batch_invariant(llm, prompts, max_tokens: int) -> None:
    """Greedy tokens of `prompts` generated in one batch by `llm` equal those of each prompt
    alone, unless the top two candidates were within 1e-4 in logprob at the first step where
    they diverge (a float tie the batch may flip)."""
    from fp8serve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    batched = llm.generate(prompts, params, use_tqdm=False)
    for prompt, b in zip(prompts, batched):
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        b_ids, a_ids = b.outputs[0].token_ids, alone.outputs[0].token_ids
        if b_ids == a_ids:
            continue
        step = next(i for i, (x, y) in enumerate(zip(b_ids, a_ids)) if x != y)
        for out in (b, alone):
            top2 = sorted((lp.logprob for lp in out.outputs[0].logprobs[step].values()), reverse=True)[:2]
            assert top2[0] - top2[1] < 1e-4, (
                f"batched and single runs diverge at step {step} ({b_ids[step]} vs {a_ids[step]}) "
                f"although the top two logprobs differ by {top2[0] - top2[1]:.2e}")
