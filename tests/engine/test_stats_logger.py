"""The periodic stats line: rates over the last interval, quiet when idle, the prefix cache hit
rate only with prefix caching."""

import logging

import pytest

from fp8serve.engine.async_engine import EngineSnapshot
from fp8serve.engine.stats_logger import StatsLogger


def snap(prompt=0, generated=0, running=0, waiting=0, free=100, queries=0, hits=0) -> EngineSnapshot:
    return EngineSnapshot(num_running=running, num_waiting=waiting, num_blocks=100, num_free_blocks=free,
                          prompt_tokens_total=prompt, generation_tokens_total=generated,
                          prefix_cache_queries=queries, prefix_cache_hits=hits)


def test_rates_over_the_interval_and_the_batch(caplog):
    stats = StatsLogger(interval_s=5.0, prefix_caching=True)
    t0 = stats._last_time
    assert stats.maybe_log(snap(prompt=500, running=2), t0 + 4.9) is None, "before the interval"
    with caplog.at_level(logging.INFO, logger="fp8serve.engine.stats_logger"):
        line = stats.maybe_log(snap(prompt=1000, generated=50, running=3, waiting=1, free=75, queries=1000, hits=250),
                               t0 + 10.0)
    assert line == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    assert caplog.messages == [line]
    # The next interval counts from there: 200 more generated tokens in 4 s.
    line = stats.maybe_log(snap(prompt=1000, generated=250, running=1, free=90, queries=1000, hits=250), t0 + 14.0)
    assert line is None
    line = stats.maybe_log(snap(prompt=1000, generated=250, running=1, free=90, queries=1000, hits=250), t0 + 15.0)
    assert line.startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 40.0 tokens/s, Running: 1")


def test_quiet_when_nothing_happened_but_reports_the_last_busy_interval():
    stats = StatsLogger(interval_s=1.0)
    t0 = stats._last_time
    assert stats.maybe_log(snap(), t0 + 2.0) is None
    line = stats.maybe_log(snap(prompt=10, generated=20), t0 + 4.0)  # finished in this interval, nothing running
    assert line is not None and "Prefix cache" not in line, "no hit rate without prefix caching"
    assert stats.maybe_log(snap(prompt=10, generated=20), t0 + 6.0) is None


def test_negative_interval_is_rejected():
    with pytest.raises(ValueError, match="stats interval must be >= 0 seconds, got -1"):
        StatsLogger(interval_s=-1)
