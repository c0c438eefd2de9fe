"""Prefix caching end to end on a tiny Llama (float32): requests that share a prefix with
earlier ones prefill only their new tokens and generate what an engine without the cache
generates, for every KV cache dtype, through preemptions, and with prompt logprobs."""

import random

import pytest
import torch
from checkpoints import load_hf_model, write_tiny_llama
from engine_runs import run_requests as run

from fp8serve.engine.llm_engine import LLMEngine
from fp8serve.kernels import cpu_ops
from fp8serve.sampling_params import SamplingParams

BLOCK_SIZE = 4
MAX_MODEL_LEN = 48
KV_DTYPES = ["auto", "fp8_e4m3", "fp8_e5m2"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("prefix") / "llama"))


def make_engine(model_dir: str, *, prefix_caching: bool, kv_cache_dtype: str = "auto",
                kv_cache_memory: int | str = "1MiB") -> LLMEngine:
    return LLMEngine.from_args(
        model_dir, dtype="float32", device="cpu", block_size=BLOCK_SIZE, kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=kv_cache_memory, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
        enable_prefix_caching=prefix_caching,
    )


def shared_prefix_prompts(seed: int, prefix_len: int = 13, n: int = 6, min_tail: int = 1,
                          max_tail: int = 9) -> list[list[int]]:
    """`n` prompts of one `prefix_len`-token prefix and a tail of `min_tail` to `max_tail` tokens whose
    first tokens differ."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(prefix_len)]
    firsts = rng.sample(range(3, 512), n)
    return [prefix + [firsts[i]] + [rng.randrange(3, 512) for _ in range(rng.randint(min_tail - 1, max_tail - 1))]
            for i in range(n)]


def generated_logprobs(out) -> list[float]:
    return [lp[t].logprob for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]


def assert_moved_less_than_fp8_storage(ours: dict, reference: dict, float32_kv: dict, context) -> None:
    """`ours` and `reference` ran with one FP8 KV cache and differ only in float32 rounding before
    some K/V writes (another batch composition or sum order), which now and then moves a value across
    a rounding midpoint to the neighbouring FP8 code (one e4m3 code is 1/8 of the value, an ulp of
    float32 2^-23). So no float32 tolerance holds; what does: the same tokens, and logprobs no further
    from the reference than FP8 storage itself moves them (the reference against a float32 cache on
    each request's first token, the same prompt either way). Reading wrong blocks moves them further."""
    fp8_effect = max(abs(generated_logprobs(ref)[0] - generated_logprobs(float32_kv[rid])[0])
                     for rid, ref in reference.items())
    assert_same_generation(ours, reference, max(2e-5, fp8_effect), (context, fp8_effect))


def run_one_at_a_time(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    finished = {}
    for i, prompt in enumerate(prompts):
        finished.update(run(engine, [(f"r{i}", prompt, params)]))
    return finished


def assert_same_generation(ours: dict, reference: dict, atol: float, context) -> None:
    assert ours.keys() == reference.keys()
    for rid, ref in reference.items():
        assert ours[rid].outputs[0].token_ids == ref.outputs[0].token_ids, (rid, context)
        torch.testing.assert_close(torch.tensor(generated_logprobs(ours[rid])),
                                   torch.tensor(generated_logprobs(ref)), rtol=0, atol=atol)


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_requests_after_a_shared_prefix_generate_what_an_uncached_engine_does(model_dir, kv_cache_dtype, seed):
    """One request at a time, so both engines run every step at the same batch size: the only
    difference is the prefix read from the cache, and the generations are the same bit for bit.
    Each row goes through the same kernels in the same order either way: the linear layers compute
    a row alike at 3+ rows, and float32 prefills of every length run the C++ attention kernel, whose
    context form (the cached engine's) sums a row as its fresh form does. Why bits matter for FP8:
    a K or V value an ulp from a rounding midpoint is stored as the neighbouring code when a
    computation moves it by that ulp (seen: one V code of 512 in layer 0 for 5 prompts batched
    against one alone, 0.004 in the layer's output; and with torch's SDPA for short prompts, whose
    rows depend on the prompt's length, e5m2 generations 4e-5 to 1.4e-3 apart in 6 seeds of 1000).
    Tails of 3+ new tokens after the cached blocks: fewer take the linear layers' 1-2-row walk, see
    the next test. Whole prompts of at most dense_gemv's rows on this CPU (32 on AMD, 16 on others),
    where the uncached engine's prefill takes the same kernel: past them it runs oneDNN, whose sums
    for a row depend on the number of rows (seen on a Xeon: logprobs 5e-7 to 2e-6 apart)."""
    gemv_rows = cpu_ops.dense_gemv_max_rows(torch.float32, torch.float32)
    # 12 cached tokens, then 1 + (2 to 9, or fewer for gemv_rows) new ones
    prompts = shared_prefix_prompts(seed, min_tail=2, max_tail=min(9, gemv_rows - 13))
    assert max(len(p) for p in prompts) <= gemv_rows
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    engine = make_engine(model_dir, prefix_caching=True, kv_cache_dtype=kv_cache_dtype)
    cached = run_one_at_a_time(engine, prompts, params)
    plain = make_engine(model_dir, prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    reference = run_one_at_a_time(plain, prompts, params)

    bm = engine.block_manager
    # 13 shared tokens: 3 full blocks of 4 for each of the 5 later requests.
    assert bm.prefix_cache_hits == 5 * 12, seed
    assert bm.prefix_cache_queries == sum(len(p) for p in prompts)
    assert engine.stats.prefill_tokens_total == sum(len(p) for p in prompts) - 5 * 12
    assert plain.stats.prefill_tokens_total == sum(len(p) for p in prompts)
    # vLLM's prompt_tokens counts whole prompts; the cached part is counted apart.
    assert engine.stats.prompt_tokens_total == plain.stats.prompt_tokens_total == sum(len(p) for p in prompts)
    assert (engine.stats.prompt_tokens_cached_total, plain.stats.prompt_tokens_cached_total) == (5 * 12, 0)
    assert plain.block_manager.prefix_cache_queries == 0
    # Same stored K/V (FP8 codes included), same row order: the same bits.
    assert_same_generation(cached, reference, 0.0, seed)
    assert bm.num_free_blocks == bm.num_blocks and bm.num_cached_blocks > 0


def test_a_one_or_two_token_tail_after_a_cached_prefix_differs_by_float32_rounding_only(model_dir, seed):
    """A prefill of 1-2 new tokens after the cached blocks: on AMD CPUs the linear layers walk their
    weights row by row at 1-2 activation rows, with two accumulators along k (kernels/cpu/dense_gemv.cpp),
    so those rows are summed in another order than in the uncached engine's prefill of the whole
    prompt: float32 rounding apart (up to 1.4e-6 seen in 300 seeds). A float32 cache only: with FP8 an
    ulp can move a value across a rounding midpoint to the neighbouring code (once in 1000 seeds)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(12)]
    prompts = [prefix] + [prefix + [rng.randrange(3, 512) for _ in range(tail)] for tail in (1, 2, 1, 2)]
    prompts[3][-1], prompts[4][-1] = 2, 1  # later prompts differ from earlier ones (ids of the drawn range are >= 3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    engine = make_engine(model_dir, prefix_caching=True)
    cached = run_one_at_a_time(engine, prompts, params)
    reference = run_one_at_a_time(make_engine(model_dir, prefix_caching=False), prompts, params)
    # The first prompt is the 3 blocks the others find cached.
    assert engine.stats.prefill_tokens_total == 12 + 1 + 2 + 1 + 2, seed
    assert_same_generation(cached, reference, 2e-5, seed)


def test_a_batch_mixing_fresh_and_cached_prompts(model_dir, seed, monkeypatch):
    """Fresh prompts and prompts continuing a cached prefix admitted in one step: the fresh ones
    are prefilled apart, and every request generates what the uncached engine does (float32
    cache; batch compositions differ between the engines, so rounding differs a little)."""
    from fp8serve.engine import model_runner

    groups = []
    real = model_runner.ModelRunner._prefill_groups
    monkeypatch.setattr(model_runner.ModelRunner, "_prefill_groups",
                        lambda self, *args: groups.append(real(self, *args)) or groups[-1])
    computed_at_call = []
    real_forward = model_runner.ModelRunner._forward

    def forward(self, seqs, is_prefill, *args, **kwargs):
        out = real_forward(self, seqs, is_prefill, *args, **kwargs)
        if is_prefill:
            computed_at_call.append([[s.num_computed_tokens for s in g] for g, _ in groups[-1]])
        return out

    monkeypatch.setattr(model_runner.ModelRunner, "_forward", forward)
    rng = random.Random(seed)
    shared = shared_prefix_prompts(seed, n=4)
    fresh = [[rng.randrange(3, 512) for _ in range(rng.randint(5, 20))] for _ in range(3)]
    mixed = [shared[1], fresh[0], shared[2], fresh[1], shared[3], fresh[2]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    results = {}
    for caching in (False, True):
        engine = make_engine(model_dir, prefix_caching=caching)
        first = run(engine, [("warm", shared[0], params)])
        results[caching] = (engine, {**first, **run(engine, [(f"m{i}", p, params) for i, p in enumerate(mixed)])})
    engine, cached = results[True]
    assert engine.block_manager.prefix_cache_hits == 3 * 12
    # The cached engine's mixed step: the three fresh prompts, then the three with a cached prefix.
    assert computed_at_call[-1] == [[0, 0, 0], [12, 12, 12]], computed_at_call
    assert_same_generation(cached, results[False][1], 1e-4, seed)


def test_requests_admitted_together_share_a_prefix_in_the_same_step(model_dir, seed):
    """Blocks are registered when their prefill is scheduled: the first request of a batch
    computes the shared prefix and the others read it from the cache in the same step."""
    prompts = shared_prefix_prompts(seed, prefix_len=21, n=5)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    requests = [(f"r{i}", p, params) for i, p in enumerate(prompts)]
    engine = make_engine(model_dir, prefix_caching=True)
    cached = run(engine, requests)
    assert engine.stats.num_steps == 6, "one prefill step for all five, then decode"
    assert engine.block_manager.prefix_cache_hits == 4 * 20
    assert_same_generation(cached, run(make_engine(model_dir, prefix_caching=False), requests), 1e-4, seed)


def test_a_cached_prefix_matches_transformers_in_float64(model_dir, seed):
    """The next-token distribution after a prompt whose prefix came from the cache is
    transformers' on the whole prompt."""
    prompts = shared_prefix_prompts(seed, prefix_len=17, n=3)
    engine = make_engine(model_dir, prefix_caching=True)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    run(engine, [("warm", prompts[0], params)])
    outs = run(engine, [(f"r{i}", p, params) for i, p in enumerate(prompts[1:])])
    assert engine.block_manager.prefix_cache_hits == 2 * 16
    hf = load_hf_model(model_dir, torch.float64)
    for i, prompt in enumerate(prompts[1:]):
        with torch.no_grad():
            ref = torch.log_softmax(hf(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
        lps = outs[f"r{i}"].outputs[0].logprobs[0]
        assert len(lps) >= 5
        for token, lp in lps.items():
            assert abs(lp.logprob - ref[token].item()) < 1e-4, (seed, i, token)
        assert outs[f"r{i}"].outputs[0].token_ids[0] == int(ref.argmax())


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_preemption_with_prefix_caching_finishes_every_request_exactly(model_dir, kv_cache_dtype):
    """A cache too small for the requests: preempted sequences come back through their own cached
    blocks (when not yet reused) and every output equals a roomy engine's without the cache."""
    rng = random.Random(1)
    prefixes = [[rng.randrange(3, 512) for _ in range(9)] for _ in range(2)]
    requests = []
    for i in range(10):
        prompt = prefixes[i % 2] + [rng.randrange(3, 512) for _ in range(rng.randint(1, 6))]
        params = SamplingParams(max_tokens=rng.randint(6, MAX_MODEL_LEN - len(prompt)), temperature=0.0,
                                ignore_eos=True)
        requests.append((f"r{i}", prompt, params))
    # 12 blocks (K and V of 4 tokens x 2 kv heads x 16 dims x 2 layers each): far fewer token slots
    # than the requests need together.
    bytes_per_block = 2 * BLOCK_SIZE * 2 * 16 * 2 * (4 if kv_cache_dtype == "auto" else 1)
    small = make_engine(model_dir, prefix_caching=True, kv_cache_dtype=kv_cache_dtype,
                        kv_cache_memory=12 * bytes_per_block)
    bm = small.block_manager
    assert bm.num_blocks == 12
    assert bm.num_blocks < sum(len(p) + s.max_tokens for _, p, s in requests) // BLOCK_SIZE // 3
    finished = run(small, requests)
    reference = run(make_engine(model_dir, prefix_caching=False, kv_cache_dtype=kv_cache_dtype), requests)
    assert small.scheduler.num_preemptions > 0 and bm.prefix_cache_hits > 0
    for rid, _, params in requests:
        assert len(finished[rid].outputs[0].token_ids) == params.max_tokens
        assert finished[rid].outputs[0].token_ids == reference[rid].outputs[0].token_ids, rid
    assert bm.num_free_blocks == bm.num_blocks


def test_prompt_logprobs_are_complete_after_a_cached_prefix(model_dir):
    prompts = shared_prefix_prompts(3, n=2)
    want = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    engine = make_engine(model_dir, prefix_caching=True)
    run(engine, [("warm", prompts[0], plain)])
    ours = run(engine, [("r", prompts[1], want)])["r"].prompt_logprobs
    assert engine.block_manager.prefix_cache_hits == 0, "a prompt-logprobs request prefills every position"
    ref = run(make_engine(model_dir, prefix_caching=False), [("r", prompts[1], want)])["r"].prompt_logprobs
    assert len(ours) == len(prompts[1]) and ours[0] is None
    for a, b in zip(ours[1:], ref[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


def test_the_same_prompt_again_recomputes_only_its_last_block(model_dir):
    prompt = shared_prefix_prompts(4, prefix_len=15, n=1)[0][:16]  # exactly 4 blocks
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine = make_engine(model_dir, prefix_caching=True)
    first = run(engine, [("a", prompt, params)])["a"].outputs[0].token_ids
    again = run(engine, [("b", prompt, params)])["b"].outputs[0].token_ids
    assert engine.block_manager.prefix_cache_hits == 12
    assert again == first


def test_a_failed_step_leaves_nothing_cached_that_it_did_not_write(model_dir, monkeypatch):
    """Blocks are registered when their prefill is scheduled; if that step raises (an interrupted
    LLM.generate, which then aborts its requests), none of them may be served to a later request."""
    prompt = shared_prefix_prompts(5, prefix_len=20, n=1)[0]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine = make_engine(model_dir, prefix_caching=True)
    real = engine.model_runner.execute

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.model_runner, "execute", interrupted)
    engine.add_request("a", {"prompt_token_ids": prompt}, params)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.abort_request("a")
    assert engine.block_manager.num_cached_blocks == 0
    monkeypatch.setattr(engine.model_runner, "execute", real)
    out = run(engine, [("b", prompt, params)])["b"].outputs[0].token_ids
    assert engine.block_manager.prefix_cache_hits == 0
    assert out == run(make_engine(model_dir, prefix_caching=False), [("c", prompt, params)])["c"].outputs[0].token_ids


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_mixtral_shares_prefixes_too(tmp_path, kv_cache_dtype, seed):
    """The cache lives in the block manager and the attention backend: a Mixtral (MoE layers,
    run eagerly) gets it without code of its own."""
    from checkpoints import write_tiny_mixtral

    model = str(write_tiny_mixtral(tmp_path / "mixtral"))
    prompts = shared_prefix_prompts(seed, n=3)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    engine = make_engine(model, prefix_caching=True, kv_cache_dtype=kv_cache_dtype)
    cached = run_one_at_a_time(engine, prompts, params)
    reference = run_one_at_a_time(make_engine(model, prefix_caching=False, kv_cache_dtype=kv_cache_dtype), prompts,
                                  params)
    assert engine.block_manager.prefix_cache_hits == 2 * 12
    if kv_cache_dtype == "auto":
        assert_same_generation(cached, reference, 2e-5, seed)
    else:
        # Each expert runs the rows routed to it, as many as the prompt sends it: 1-2 rows take another sum
        # order in the linear layers (see the tail test above), so an FP8 code can flip (2 seeds of 300).
        float32_kv = run_one_at_a_time(make_engine(model, prefix_caching=False), prompts, params)
        assert_moved_less_than_fp8_storage(cached, reference, float32_kv, seed)


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_decode_steps_attend_the_shared_blocks_once(model_dir, kv_cache_dtype, seed):
    """Cascade attention in the engine's decode steps, forced on ("always": the engine's own rule
    wants 16+ sequences over thousands of shared tokens): the batch's shared cached blocks reach
    the kernel's prefix phase in every layer of every decode step, and every request generates
    what the engine without it does (float32: the sums' order is all that differs)."""
    import json
    from pathlib import Path

    from fp8serve.kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None:
        pytest.skip("C++ CPU kernels unavailable")
    num_layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    prompts = shared_prefix_prompts(seed, prefix_len=21, n=5)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    requests = [(f"r{i}", p, params) for i, p in enumerate(prompts)]
    results, prefix_phases = {}, {}
    for mode in (0, 2):
        previous = ops.set_cascade_attention(mode)
        try:
            calls = ops.cascade_attention_stats()[0]
            results[mode] = run(make_engine(model_dir, prefix_caching=True, kv_cache_dtype=kv_cache_dtype), requests)
            prefix_phases[mode] = ops.cascade_attention_stats()[0] - calls
        finally:
            ops.set_cascade_attention(previous)
    # One prefill step, then 5 decode steps of all five requests over their 20 shared tokens (a
    # step that records the decode forward runs the layers' ops once more).
    assert prefix_phases[0] == 0 and prefix_phases[2] >= 5 * num_layers, (prefix_phases, seed)
    if kv_cache_dtype == "auto":
        assert_same_generation(results[2], results[0], 1e-4, seed)
    else:
        # The decode steps' attention sums differ, so the K/V a step writes can sit a code apart (1 seed of 300).
        float32_kv = run(make_engine(model_dir, prefix_caching=True), requests)
        assert_moved_less_than_fp8_storage(results[2], results[0], float32_kv, seed)
