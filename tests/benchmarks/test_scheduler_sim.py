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


def test_policies_and_early_stops(sim):
    """--policy: the growth reservation preempts less than the watermark alone on the KV-limited
    workload; --min-output-len: requests stop at their own drawn lengths (fewer tokens in all)."""
    wm = sim.simulate(256, policy="watermark", step_ms=8.0, step_ms_per_seq=0.7, prefill_ms_per_token=0.64)
    res = sim.simulate(256, policy="reserve", step_ms=8.0, step_ms_per_seq=0.7, prefill_ms_per_token=0.64)
    assert wm.num_preemptions == 32 and res.num_preemptions < 5
    assert res.output_tokens == wm.output_tokens == 48 * 256
    early = sim.simulate(256, policy="reserve", max_tokens=1024, min_output_len=16, max_model_len=1280)
    assert 48 * 16 <= early.output_tokens < 48 * 256
    again = sim.simulate(256, policy="reserve", max_tokens=1024, min_output_len=16, max_model_len=1280)
    assert again.output_tokens == early.output_tokens  # seeded lengths
    with pytest.raises(ValueError, match="policy must be"):
        sim.simulate(256, policy="fifo")


@pytest.mark.parametrize("argv, message", [
    (["--policy", "reserve,fifo"], "unknown policy 'fifo'"),
    (["--max-tokens", "100"], "--max-tokens (100) must be at least --output-len (256)"),
    (["--min-output-len", "0"], "--min-output-len must be in [1, --output-len], got 0"),
])
def test_rejects_bad_flags(sim, monkeypatch, capsys, argv, message):
    monkeypatch.setattr("sys.argv", ["scheduler_sim.py", *argv])
    with pytest.raises(SystemExit) as e:
        sim.main()
    assert e.value.code == 2
    assert message in capsys.readouterr().err
