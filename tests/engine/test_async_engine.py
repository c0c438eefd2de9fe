"""AsyncLLMEngine: one engine thread, per-request streams, aborts, failures, health."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from checkpoints import write_tiny_llama
from fp8serve.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineDrainingError
from fp8serve.engine.llm_engine import LLMEngine
from fp8serve.errors import UserError
from fp8serve.sampling_params import SamplingParams

ENGINE_ARGS = dict(dtype="float32", kv_cache_memory=1 << 20, max_model_len=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("async") / "llama")


@pytest.fixture
def engine(llama_dir):
    e = AsyncLLMEngine(LLMEngine.from_args(str(llama_dir), **ENGINE_ARGS), stall_timeout=5.0)
    yield e
    if e.is_running:
        asyncio.run(e.shutdown(drain_timeout=0))


async def _all_blocks_free(engine, tries: int = 100) -> bool:
    """Whether the engine loop gets back to no running sequence and a free cache within ~2 s."""
    for _ in range(tries):
        if engine.snapshot.num_free_blocks == engine.snapshot.num_blocks and engine.snapshot.num_running == 0:
            return True
        await asyncio.sleep(0.02)
    return False


async def _collect(engine, prompt, params, request_id=None):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_generate_matches_sync_engine_and_runs_concurrently(engine, llama_dir):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]

    async def main():
        return await asyncio.gather(*(_collect(engine, {"prompt_token_ids": p}, GREEDY) for p in prompts))

    results = asyncio.run(main())
    sync = LLMEngine.from_args(str(llama_dir), **ENGINE_ARGS)
    for p, outs in zip(prompts, results):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 9))
        sync.add_request("r", {"prompt_token_ids": p}, GREEDY)
        while sync.has_unfinished_requests():
            final = [o for o in sync.step() if o.finished]
        assert outs[-1].outputs[0].token_ids == final[0].outputs[0].token_ids
    assert engine.snapshot.num_free_blocks == engine.snapshot.num_blocks and engine.is_healthy()


def test_a_server_engine_records_without_waiting_for_64_eager_steps(engine):
    """The async (server) engine is long-lived: no engine-wide delay before its first recording,
    while a batch size still runs its record_after eager steps first."""
    captures = engine.engine.model_runner.decode_captures
    assert captures.first_record_after == 0 and captures.record_after == 4


def test_invalid_request_raises_without_affecting_others(engine):
    async def main():
        good = asyncio.ensure_future(_collect(engine, {"prompt_token_ids": [5, 6, 7]}, GREEDY))
        with pytest.raises(UserError, match="more than --max-model-len"):
            await _collect(engine, {"prompt_token_ids": [5] * 100}, GREEDY)
        with pytest.raises(UserError, match="out of range"):
            await _collect(engine, {"prompt_token_ids": [10**6]}, GREEDY)
        return await good

    assert asyncio.run(main())[-1].outputs[0].finish_reason == "length"


def test_consumer_leaving_aborts_and_frees_blocks(engine):
    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        gen = engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "leaver")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await gen.aclose()
        # An explicit abort of a running request ends its stream with finish_reason "abort".
        outs = []
        async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "aborted"):
            outs.append(out)
            if len(outs) == 2:
                engine.abort("aborted")
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        return await _all_blocks_free(engine)

    assert asyncio.run(main())


def test_n_samples_stream_together_and_abort_together(engine):
    """An n = 3 request streams one output per step with all three samples; aborting it ends
    the stream with every sample's finish_reason "abort" and frees all their blocks."""
    async def main():
        params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
        outs = []
        async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "many"):
            outs.append(out)
            assert out.request_id == "many" and [c.index for c in out.outputs] == [0, 1, 2]
            if len(outs) == 3:
                engine.abort("many")
        assert outs[-1].finished and [c.finish_reason for c in outs[-1].outputs] == ["abort"] * 3
        assert [len(c.token_ids) for c in outs[1].outputs] == [2, 2, 2]
        return await _all_blocks_free(engine)

    assert asyncio.run(main())


def test_step_failure_fails_requests_and_marks_unhealthy(engine):
    def broken_step():
        raise RuntimeError("kernel exploded")

    engine.engine.step = broken_step

    async def main():
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            await _collect(engine, {"prompt_token_ids": [5, 6]}, GREEDY)
        with pytest.raises(EngineDeadError):
            await _collect(engine, {"prompt_token_ids": [5, 6]}, GREEDY)

    asyncio.run(main())
    assert not engine.is_healthy() and not engine.is_running


def test_requests_a_failed_step_ends_are_reported_as_error(engine):
    """The requests a failing step ends reach the stat loggers with finish reason "error" (vLLM's
    FinishReason.ERROR), not "abort": their clients got an error, they neither left nor were drained.
    Before, /metrics counted them under request_success_total{finished_reason="abort"}."""
    reports = []
    engine.engine.stat_loggers.append(reports.append)
    step, num_steps = engine.engine.step, [0]

    def step_then_fail():
        num_steps[0] += 1
        if num_steps[0] > 2:
            raise RuntimeError("kernel exploded")
        return step()

    engine.engine.step = step_then_fail

    async def main():
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            await _collect(engine, {"prompt_token_ids": [5, 6]}, GREEDY)

    asyncio.run(main())
    finished = [f for r in reports for f in r.finished_requests]
    assert [(f.finish_reason, f.num_generation_tokens) for f in finished] == [("error", 2)]


def test_stalled_engine_is_unhealthy(engine):
    engine.stall_timeout = 0.2
    engine.has_work = True
    engine.last_progress_time = time.monotonic() - 1.0
    assert not engine.is_healthy()


def test_shutdown_drains_then_refuses(engine):
    async def main():
        running = asyncio.ensure_future(_collect(engine, {"prompt_token_ids": [5, 6, 7]}, GREEDY))
        await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        shutdown = asyncio.ensure_future(engine.shutdown(drain_timeout=30))
        await asyncio.sleep(0.01)
        with pytest.raises(EngineDrainingError):
            await _collect(engine, {"prompt_token_ids": [5]}, GREEDY)
        outs = await running
        await shutdown
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
    assert not engine.is_running


def test_requests_after_shutdown_are_refused_as_shutting_down(engine):
    """However fast the drain ends (it may end before the next request
    arrives), a late request hears "shutting down", not "engine dead"."""

    async def main():
        await engine.shutdown(drain_timeout=30)
        assert not engine.is_running
        with pytest.raises(EngineDrainingError, match="shutting down"):
            await _collect(engine, {"prompt_token_ids": [5]}, GREEDY)

    asyncio.run(main())


def test_prefix_cache_numbers_reach_the_snapshot_and_metrics(llama_dir):
    from fp8serve.entrypoints.openai.metrics import ServerMetrics

    e = AsyncLLMEngine(LLMEngine.from_args(str(llama_dir), enable_prefix_caching=True, block_size=4,
                                           **ENGINE_ARGS), stall_timeout=5.0)
    try:
        prefix = list(range(20, 33))  # 13 tokens: 3 full blocks

        async def main():
            await _collect(e, {"prompt_token_ids": prefix + [40]}, GREEDY)
            await _collect(e, {"prompt_token_ids": prefix + [41, 42]}, GREEDY)

        asyncio.run(main())
        snap = e.snapshot
        assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (14 + 15, 12)
        text = ServerMetrics(e, "tiny").render().decode()
        assert 'fp8serve:prefix_cache_queries_total{model_name="tiny"} 29.0' in text
        assert 'fp8serve:prefix_cache_hits_total{model_name="tiny"} 12.0' in text
        assert 'enable_prefix_caching="True"' in text
    finally:
        asyncio.run(e.shutdown(drain_timeout=0))


@pytest.mark.parametrize("log_stats", [True, False])
def test_stats_lines_while_working_unless_disabled(llama_dir, caplog, log_stats):
    e = AsyncLLMEngine(LLMEngine.from_args(str(llama_dir), **ENGINE_ARGS), stall_timeout=5.0, log_stats=log_stats,
                       log_stats_interval=0.0)
    try:
        with caplog.at_level(logging.INFO, logger="fp8serve.engine.stats_logger"):
            asyncio.run(_collect(e, {"prompt_token_ids": [5, 6, 7, 8]}, GREEDY))
            time.sleep(0.5)  # an idle poll reports the last interval
        lines = [m for m in caplog.messages if m.startswith("Avg prompt throughput:")]
        if log_stats:
            assert lines and all("KV cache usage:" in m and "Prefix cache" not in m for m in lines)
        else:
            assert lines == []
    finally:
        asyncio.run(e.shutdown(drain_timeout=0))
