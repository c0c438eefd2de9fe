"""The engine's per-step and per-request reports to stat loggers (the server's
Prometheus metrics): what each finished sequence reports, intervals a request
never reached left out, and a failing logger that cannot take down a step."""

from __future__ import annotations

import logging

import pytest

from checkpoints import write_tiny_llama
from fp8serve.engine.llm_engine import LLMEngine
from fp8serve.engine.request_stats import IterationStats
from fp8serve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("stats") / "llama")


def make_engine(model_dir, **kw) -> LLMEngine:
    args = dict(dtype="float32", device="cpu", block_size=4, kv_cache_memory=1 << 20, max_model_len=64)
    return LLMEngine.from_args(str(model_dir), **{**args, **kw})


def run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_finished_requests_report_their_phases(model_dir):
    engine = make_engine(model_dir, max_num_seqs=2)
    reports: list[IterationStats] = []
    engine.stat_loggers.append(reports.append)
    prompt = {"prompt_token_ids": list(range(5, 17))}
    engine.add_request("a", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("b", prompt, SamplingParams(max_tokens=3, n=2, ignore_eos=True))
    # max_num_seqs=2: b's second sample waits until a sequence finishes.
    run(engine)
    steps = [r for r in reports if r.num_batched_tokens is not None]
    assert len(steps) == engine.stats.num_steps == len(reports)
    # Every computed token: the three prompts (b's second sample shares 8 tokens: 2 full blocks
    # before the last token) and one per decoded token after each sample's first.
    assert sum(r.num_batched_tokens for r in steps) == 3 * 12 - 8 + 4 + 2 * 2
    finished = [f for r in reports for f in r.finished_requests]
    assert sorted((f.finish_reason, f.num_generation_tokens, f.max_tokens_param) for f in finished) == \
        [("length", 3, 3), ("length", 3, 3), ("length", 5, 5)]
    assert sorted(n for r in reports for n in r.finished_params_n) == [1, 2]
    for f in finished:
        assert f.num_prompt_tokens == 12
        assert min(f.queued_time, f.prefill_time, f.decode_time) >= 0
        assert f.inference_time == pytest.approx(f.prefill_time + f.decode_time)
        assert f.e2e_latency >= f.queued_time + f.inference_time
    # The sample admitted late waited for a finish: its queue time is the longest.
    assert max(finished, key=lambda f: f.queued_time).queued_time > 0


def test_abort_reports_only_what_happened(model_dir):
    """A request aborted while waiting has no queue / prefill / decode time (None, not 0);
    one aborted while running has queue and prefill time and counts as "abort"."""
    engine = make_engine(model_dir, max_num_seqs=1)
    reports: list[IterationStats] = []
    engine.stat_loggers.append(reports.append)
    engine.add_request("run", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("wait", {"prompt_token_ids": [8, 9]}, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort_request("wait") and engine.abort_request("run")
    aborts = [r for r in reports if r.num_batched_tokens is None]
    assert len(aborts) == 2
    waiting, running = (r.finished_requests[0] for r in aborts)
    assert (waiting.finish_reason, running.finish_reason) == ("abort", "abort")
    assert (waiting.queued_time, waiting.prefill_time, waiting.decode_time, waiting.inference_time) == \
        (None, None, None, None)
    assert waiting.num_generation_tokens == 0 and waiting.e2e_latency > 0
    assert running.num_generation_tokens == 2
    assert None not in (running.queued_time, running.prefill_time, running.decode_time, running.inference_time)
    assert [r.finished_params_n for r in aborts] == [[1], [1]]


def test_a_failing_stat_logger_does_not_stop_the_engine(model_dir, caplog):
    engine = make_engine(model_dir)
    good: list[IterationStats] = []

    def broken(stats: IterationStats) -> None:
        raise RuntimeError("metrics backend down")

    engine.stat_loggers += [broken, good.append]
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True))
    with caplog.at_level(logging.ERROR):
        run(engine)
    assert len(good) == engine.stats.num_steps == 4
    assert [f.num_generation_tokens for r in good for f in r.finished_requests] == [4]
    assert "metrics backend down" in caplog.text and "the engine goes on" in caplog.text
