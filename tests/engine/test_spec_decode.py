"""Speculative decoding with n-gram drafts, end to end on a tiny Llama (float32): an engine that
checks drafted tokens in one forward pass generates what plain decoding generates (greedy
tokens and their logprobs), with every sampling parameter that reads the tokens so far, stops,
prefix caching, chunked prefill and preemption; drafts both kept and rejected along the way."""

import random

import pytest
from checkpoints import write_tiny_llama, write_tiny_mixtral
from engine_runs import run_requests as run

from fp8serve.engine.llm_engine import LLMEngine
from fp8serve.errors import ConfigError
from fp8serve.sampling_params import SamplingParams

BLOCK_SIZE = 4
MAX_MODEL_LEN = 96
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("spec") / "llama"))


def make_engine(model_dir: str, spec: dict | None, **kwargs) -> LLMEngine:
    args = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, kv_cache_memory="1MiB",
                max_model_len=MAX_MODEL_LEN, speculative_config=spec)
    args.update(kwargs)
    return LLMEngine.from_args(model_dir, **args)


def repetitive_requests(test_seed: int, n: int = 10, **params) -> list:
    """Prompts that repeat a short random phrase (so n-grams match), varied max_tokens."""
    rng = random.Random(test_seed)
    requests = []
    for i in range(n):
        phrase = [rng.randrange(3, 512) for _ in range(rng.randint(2, 8))]
        prompt = (phrase * 8)[:rng.randint(3, 40)]
        max_tokens = rng.randint(params.get("min_tokens", 1), 40)
        params.setdefault("ignore_eos", True)
        requests.append((f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, **params)))
    return requests


def assert_same(got: dict, ref: dict, tol: float = 1e-4) -> None:
    assert got.keys() == ref.keys()
    for rid in ref:
        a, b = got[rid].outputs[0], ref[rid].outputs[0]
        assert a.token_ids == b.token_ids, rid
        assert (a.finish_reason, a.stop_reason, a.text) == (b.finish_reason, b.stop_reason, b.text), rid
        if b.logprobs is not None:
            assert len(a.logprobs) == len(b.logprobs) == len(b.token_ids), rid
            for la, lb in zip(a.logprobs, b.logprobs):
                assert la.keys() == lb.keys(), rid
                for t in lb:
                    assert abs(la[t].logprob - lb[t].logprob) < tol, rid
                    assert la[t].rank == lb[t].rank, rid


def assert_drafts_kept_and_rejected(engine: LLMEngine) -> None:
    """The run exercised both outcomes of a verify pass."""
    st = engine.stats
    assert st.spec_decode_num_drafts > 0
    assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens, st


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tokens_and_logprobs_equal_plain_decoding(model_dir, k, seed):
    requests = repetitive_requests(seed, temperature=0, logprobs=2)
    ref = run(make_engine(model_dir, None), requests)
    spec = dict(NGRAM, num_speculative_tokens=k)
    engine = make_engine(model_dir, spec)
    got = run(engine, repetitive_requests(seed, temperature=0, logprobs=2))
    assert_same(got, ref)
    assert_drafts_kept_and_rejected(engine)


def test_default_lookup_bounds_are_vllms(model_dir):
    engine = make_engine(model_dir, {"method": "ngram", "num_speculative_tokens": 2})
    spec = engine.config.speculative_config
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    assert (engine.proposer.min_n, engine.proposer.max_n, engine.proposer.k) == (5, 5, 2)


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.3),
    dict(frequency_penalty=0.7, presence_penalty=0.4),
    dict(logit_bias={7: 5.0, 11: -100.0}),
    dict(min_tokens=6, ignore_eos=False),
], ids=["repetition", "frequency-presence", "logit-bias", "min-tokens"])
def test_parameters_that_read_the_tokens_so_far(model_dir, params, seed):
    """Each verify row is processed as if the drafts before it were generated: penalties count
    them, min_tokens bans lift at the right position."""
    requests = repetitive_requests(seed, temperature=0, **params)
    ref = run(make_engine(model_dir, None), requests)
    got = run(make_engine(model_dir, NGRAM), repetitive_requests(seed, temperature=0, **params))
    assert_same(got, ref)


def test_stops_inside_a_run_of_kept_drafts(model_dir, seed):
    """A stop token, a stop string or max_tokens in the middle of the kept drafts ends the
    output there, as plain decoding does; no token after it is reported."""
    base = run(make_engine(model_dir, None), repetitive_requests(seed, temperature=0))
    requests = []
    rng = random.Random(seed)
    for rid, prompt, params in repetitive_requests(seed, temperature=0):
        out = base[rid].outputs[0].token_ids
        cut = rng.randrange(len(out))
        requests.append((rid + "-tok", prompt, SamplingParams(temperature=0, max_tokens=params.max_tokens,
                                                              ignore_eos=True, stop_token_ids=[out[cut]])))
        requests.append((rid + "-len", prompt, SamplingParams(temperature=0, max_tokens=cut + 1, ignore_eos=True)))
        text = base[rid].outputs[0].text
        if len(text) > 3:
            start = rng.randrange(1, len(text) - 1)
            requests.append((rid + "-str", prompt, SamplingParams(temperature=0, max_tokens=params.max_tokens,
                                                                  ignore_eos=True, stop=[text[start:start + 2]])))
    ref = run(make_engine(model_dir, None), requests)
    engine = make_engine(model_dir, NGRAM)
    got = run(engine, requests)
    assert_same(got, ref)
    assert_drafts_kept_and_rejected(engine)
    max_tokens = {rid: params.max_tokens for rid, _, params in requests}
    for rid, out in got.items():
        if rid.endswith("-len"):
            assert len(out.outputs[0].token_ids) == max_tokens[rid]


@pytest.mark.parametrize("mode", ["prefix-caching", "chunked-prefill", "preemption"])
def test_with_other_scheduler_features(model_dir, mode, seed):
    """Prefix caching (registered blocks hold only kept tokens), chunked prefill (drafts share
    the token budget with prefill chunks) and a cache so small that sequences are preempted and
    recomputed (their drafts dropped) generate what plain decoding does."""
    kwargs = {"prefix-caching": dict(enable_prefix_caching=True),
              "chunked-prefill": dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8),
              # 26 blocks of 4 tokens (2 layers x K, V x 2 kv heads x 16 x float32): one request of the model
              # length needs 24.
              "preemption": dict(kv_cache_memory=26 * 2 * BLOCK_SIZE * 2 * 16 * 2 * 4)}[mode]
    requests = repetitive_requests(seed, n=12, temperature=0)
    if mode == "prefix-caching":  # shared prefixes: each prompt twice
        requests += [(rid + "-again", prompt, params) for rid, prompt, params in requests]
    ref = run(make_engine(model_dir, None, **kwargs), requests)
    engine = make_engine(model_dir, NGRAM, **kwargs)
    # Admission without the growth reserve (vLLM's policy), which keeps preemptions rare.
    engine.scheduler.reserve_growth = mode != "preemption"
    got = run(engine, requests)
    assert_same(got, ref)
    assert_drafts_kept_and_rejected(engine)
    if mode == "preemption":
        assert engine.block_manager.num_blocks == 26 and engine.scheduler.num_preemptions > 0
    if mode == "prefix-caching":
        assert engine.block_manager.prefix_cache_hits > 0


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache(model_dir, kv_cache_dtype, seed):
    """With an FP8 cache a verify pass reads the same codes a decode step reads: same tokens,
    logprobs within FP8's noise (a draft's K/V come from a matmul of another shape)."""
    requests = repetitive_requests(seed, temperature=0, logprobs=0)
    ref = run(make_engine(model_dir, None, kv_cache_dtype=kv_cache_dtype), requests)
    got = run(make_engine(model_dir, NGRAM, kv_cache_dtype=kv_cache_dtype), requests)
    assert_same(got, ref, tol=3e-2)


def test_seeded_sampling_is_reproducible_and_batch_independent(model_dir, seed):
    """Seeded random samples are a function of the request alone: the same with other requests
    in the batch or not (drafts depend only on the sequence's own tokens)."""
    requests = repetitive_requests(seed, temperature=0.8, top_p=0.9, seed=seed % 1000)
    together = run(make_engine(model_dir, NGRAM), requests)
    for rid, prompt, params in requests[:3]:
        alone = run(make_engine(model_dir, NGRAM), [(rid, prompt, params)])
        assert alone[rid].outputs[0].token_ids == together[rid].outputs[0].token_ids
    again = run(make_engine(model_dir, NGRAM), requests)
    assert {r: o.outputs[0].token_ids for r, o in again.items()} == {
        r: o.outputs[0].token_ids for r, o in together.items()}


def test_parallel_samples(model_dir, seed):
    engine = make_engine(model_dir, NGRAM)
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 512) for _ in range(5)] * 4
    engine.add_request("p", {"prompt_token_ids": prompt}, SamplingParams(n=3, max_tokens=20, temperature=1.0,
                                                                          ignore_eos=True, seed=seed % 1000))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.finished and [len(c.token_ids) for c in final.outputs] == [20, 20, 20]


def test_mixtral(tmp_path, seed):
    model_dir = str(write_tiny_mixtral(tmp_path / "mixtral"))
    requests = repetitive_requests(seed, n=6, temperature=0)
    ref = run(make_engine(model_dir, None), requests)
    got = run(make_engine(model_dir, NGRAM), requests)
    assert_same(got, ref)


def test_drafts_stop_at_max_tokens_and_the_model_length(model_dir):
    """No draft is proposed past what a request may still generate (max_tokens, the model
    length), so a verify pass never computes positions beyond them."""
    engine = make_engine(model_dir, NGRAM)
    prompt = [5, 6, 7] * 30  # 90 tokens: the model length (96) allows 6 more
    engine.add_request("long", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, ignore_eos=True))
    engine.add_request("short", {"prompt_token_ids": prompt[:12]},
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()  # prefill: both sampled a token; drafts proposed
    long, short = engine.seqs["long"], engine.seqs["short"]
    assert len(short.spec_token_ids) <= 1  # one more token allowed: a draft and the emitted one
    assert len(long.spec_token_ids) <= MAX_MODEL_LEN - long.num_tokens - 1
    while engine.has_unfinished_requests():
        for seq in engine.seqs.values():
            assert seq.num_tokens + len(seq.spec_token_ids) <= MAX_MODEL_LEN
        engine.step()


@pytest.mark.parametrize("trim", [True, False])
def test_busy_steps_cut_drafts_to_twice_what_the_last_pass_kept(model_dir, trim, seed):
    """Scheduler.trim_drafts with every step counting as busy (spec_free_rows 0): a verify pass
    checks at most max(1, 2a) of a sequence's drafts after its pass that kept a; without
    trimming, up to num_speculative_tokens. Outputs are the same either way."""
    k = 6
    engine = make_engine(model_dir, dict(NGRAM, num_speculative_tokens=k))
    engine.scheduler.spec_free_rows = 0 if trim else None
    passes: dict[str, list[tuple[int, int]]] = {}  # request id -> (drafts checked, drafts kept) per pass
    verify = engine.model_runner._execute_verify

    def spy(seqs, eos):
        drafts = [len(s.spec_token_ids) for s in seqs]
        out = verify(seqs, eos)
        for s, n, emitted in zip(seqs, drafts, out.num_sampled_tokens):
            if n:
                passes.setdefault(s.request_id, []).append((n, emitted - 1))
        return out

    engine.model_runner._execute_verify = spy
    requests = repetitive_requests(seed, temperature=0)
    got = run(engine, requests)
    assert_same(got, run(make_engine(model_dir, None), requests))
    over = 0
    for history in passes.values():
        for (_, kept), (checked, _) in zip(history, history[1:]):
            assert checked <= k
            over += checked > max(1, 2 * kept)
    assert sum(len(h) for h in passes.values()) > len(passes)  # sequences with several passes
    # Without trimming some pass exceeds the limit: the check above tells the two apart.
    assert (over == 0) if trim else (over > 0)


def test_disable_by_batch_size(model_dir, seed):
    """vLLM's disable_by_batch_size: no drafts while at least that many requests are running or
    waiting; drafts again once fewer are left. Outputs are plain decoding's either way."""
    engine = make_engine(model_dir, dict(NGRAM, disable_by_batch_size=4))
    # Three short requests, then three long ones that go on alone.
    requests = [(rid, prompt, SamplingParams(temperature=0, ignore_eos=True, max_tokens=8 if i < 3 else 48))
                for i, (rid, prompt, _) in enumerate(repetitive_requests(seed, n=6))]
    for rid, prompt, params in requests:
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    outputs, busy_steps, drafted_when_few = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        live = engine.scheduler.num_running + engine.scheduler.num_waiting
        drafts = sum(len(s.spec_token_ids) for s in engine.scheduler.running)
        if live >= 4:
            busy_steps += 1
            assert drafts == 0
        else:
            drafted_when_few += drafts
    assert busy_steps > 0 and drafted_when_few > 0
    assert_same(outputs, run(make_engine(model_dir, None), requests))


def test_speculative_config_errors(model_dir):
    for bad, words in [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle'"),
        ({"method": "ngram"}, "'num_speculative_tokens' is required"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unsupported field(s) ['model']"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "must be an integer in [1, 16]"),
        ("not json", "must be a JSON object"),
    ]:
        with pytest.raises(ConfigError) as e:
            make_engine(model_dir, bad)
        assert words in str(e.value) and "--speculative-config" in str(e.value)
