"""Driving an LLMEngine to completion in tests: requests in, finished outputs out."""

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
