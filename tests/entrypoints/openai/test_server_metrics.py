"""ServerMetrics in process, where the engine can be made to fail: what /metrics shows for
requests an engine failure ended, and for prompt-only requests the engine reports directly."""

from __future__ import annotations

import asyncio
import re

import pytest

from checkpoints import write_tiny_llama
from fp8serve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from fp8serve.engine.llm_engine import LLMEngine
from fp8serve.entrypoints.openai.metrics import ServerMetrics
from fp8serve.sampling_params import SamplingParams

ENGINE_ARGS = dict(dtype="float32", kv_cache_memory=1 << 20, max_model_len=64)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("metrics") / "llama")


@pytest.fixture
def engine(llama_dir):
    e = AsyncLLMEngine(LLMEngine.from_args(str(llama_dir), **ENGINE_ARGS), log_stats=False)
    yield e
    if e.is_running:
        asyncio.run(e.shutdown(drain_timeout=0))


def _value(metrics: ServerMetrics, name: str, **labels) -> float:
    text = metrics.render().decode()
    for m in re.finditer(rf"^fp8serve:{re.escape(name)}\{{(.*)\}} (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    raise AssertionError(f"fp8serve:{name}{labels} missing from /metrics")


def test_requests_an_engine_failure_ends_count_as_error(engine):
    """A request in flight when a step raises ends with an error response: it counts under
    request_success_total{finished_reason="error"} (before: "abort"); its tokens stay counted."""
    metrics = ServerMetrics(engine, "m")
    step, num_steps = engine.engine.step, [0]

    def step_then_fail():
        num_steps[0] += 1
        if num_steps[0] > 3:
            raise RuntimeError("kernel exploded")
        return step()

    engine.engine.step = step_then_fail

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, params):
                pass

    asyncio.run(main())
    assert _value(metrics, "request_success_total", finished_reason="error") == 1
    assert _value(metrics, "request_success_total", finished_reason="abort") == 0
    assert _value(metrics, "request_generation_tokens_sum") == 3
    assert _value(metrics, "generation_tokens_total") == 3


def test_prompt_only_requests_count_no_generated_token(engine):
    """A request registered as prompt-only (echo with max_tokens 0: the engine samples one token
    that no response shows) counts its prompt, and none of its samples' tokens; others as usual."""
    metrics = ServerMetrics(engine, "m")
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}

    async def run(request_id: str, params: SamplingParams) -> None:
        async for _ in engine.generate(prompt, params, request_id):
            pass

    async def main():
        with metrics.prompt_only(["score-0", "score-1"]):
            await asyncio.gather(run("score-0", SamplingParams(max_tokens=1, n=2)),
                                 run("score-1", SamplingParams(max_tokens=1, prompt_logprobs=1)),
                                 run("other", SamplingParams(max_tokens=3, ignore_eos=True)))

    asyncio.run(main())
    assert _value(metrics, "generation_tokens_total") == 3
    assert _value(metrics, "request_generation_tokens_sum") == 3
    assert _value(metrics, "request_generation_tokens_count") == 4
    assert _value(metrics, "request_params_max_tokens_sum") == 3  # a prompt-only request asked for 0
    assert _value(metrics, "request_success_total", finished_reason="length") == 4
    assert _value(metrics, "prompt_tokens_total") == 4 * 4
    assert not metrics.prompt_only_ids  # forgotten once their requests are done
