"""benchmarks/scheduler_sim.py: the real Scheduler under a step-time model."""

from __future__ import annotations

import pytest

from benchmark_scripts import loaded_script


@pytest.fixture(scope="module")
def sim():
    with loaded_script("scheduler_sim.py") as module:
        yield module


def test_room_for_everyone_means_one_batch_and_no_preemption(sim):
    # 8 requests of 32 + 32 tokens = 4 blocks each; 64 blocks hold them all.
    r = sim.simulate(64, num_prompts=8, input_len=32, output_len=32, max_model_len=64,
                     step_ms=10.0, step_ms_per_seq=0.0, prefill_ms_per_token=1.0)
    assert r.num_preemptions == 0
    assert r.output_tokens == 8 * 32
    assert r.decode_steps == 31 and r.mean_decode_batch == 8  # the prefill emitted each first token
    assert r.total_s == pytest.approx((8 * 32 * 1.0 + 31 * 10.0) / 1000)
    # Everyone was admitted in the first step: the saturated window is that prefill.
    assert r.saturated_s == pytest.approx(0.256) and r.saturated_tokens == 8


def test_tight_cache_preempts_but_loses_no_token(sim):
    tight = sim.simulate(256)
    roomy = sim.simulate(512)
    for r in (tight, roomy):
        assert r.output_tokens == 48 * 256  # every request finishes, preempted or not
        assert r.num_preemptions > 0  # prompts fill the cache, so admission overshoots in both
        assert 0 < r.saturated_s < r.total_s
    assert roomy.mean_decode_batch > tight.mean_decode_batch
    assert roomy.output_tok_s > tight.output_tok_s
