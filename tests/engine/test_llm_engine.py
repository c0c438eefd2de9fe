"""The engine loop on a tiny Llama with a KV cache too small for all requests at once:
preemption by recompute must finish every request, exactly, and give every block back."""

import random

import pytest
from checkpoints import write_tiny_llama

from fp8serve.engine.llm_engine import LLMEngine
from fp8serve.sampling_params import SamplingParams

BLOCK_SIZE = 4
MAX_MODEL_LEN = 32
NUM_BLOCKS = 12  # 48 token slots; one max_model_len request needs 8 blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("engine") / "llama"))


def make_engine(model_dir: str, num_blocks: int) -> LLMEngine:
    # float32 K and V of 4 tokens x 2 kv heads x 16 dims x 2 layers.
    bytes_per_block = 2 * BLOCK_SIZE * 2 * 16 * 4 * 2
    engine = LLMEngine.from_args(
        model_dir, dtype="float32", device="cpu", block_size=BLOCK_SIZE,
        kv_cache_memory=num_blocks * bytes_per_block, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
    )
    assert engine.block_manager.num_blocks == num_blocks
    return engine


def make_requests(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randint(3, 12))]  # 0-2 are special tokens
        requests.append((prompt, rng.randint(4, MAX_MODEL_LEN - len(prompt))))
    return requests


def run_to_completion(engine: LLMEngine, max_steps: int = 2000) -> dict:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            assert out.request_id not in finished, "output after the request finished"
            if out.finished:
                finished[out.request_id] = out
    pytest.fail(f"not finished after {max_steps} steps")


def submit(engine: LLMEngine, requests) -> list[str]:
    ids = []
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids.append(engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params).request_id)
    return ids


def test_more_requests_than_fit_all_finish_exactly(model_dir):
    requests = make_requests(10)
    # The cache holds far fewer tokens than the requests need together.
    assert sum(len(p) + m for p, m in requests) > 3 * NUM_BLOCKS * BLOCK_SIZE
    engine = make_engine(model_dir, NUM_BLOCKS)
    ids = submit(engine, requests)
    finished = run_to_completion(engine)

    assert set(finished) == set(ids)
    for rid, (prompt, max_tokens) in zip(ids, requests):
        out = finished[rid]
        assert out.prompt_token_ids == prompt
        assert len(out.outputs[0].token_ids) == max_tokens, rid
        assert out.outputs[0].finish_reason == "length"
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    assert engine.seqs == {}

    # Recompute reproduces what an uninterrupted run computes: greedy tokens match an engine
    # with room for everything at once (no preemptions).
    roomy = make_engine(model_dir, 128)
    submit(roomy, requests)
    reference = run_to_completion(roomy)
    assert roomy.scheduler.num_preemptions == 0
    for rid in ids:
        assert finished[rid].outputs[0].token_ids == reference[rid].outputs[0].token_ids, rid


def test_abort_mid_generation_frees_blocks(model_dir):
    engine = make_engine(model_dir, NUM_BLOCKS)
    requests = [([5, 6, 7, 8, 9], 20), ([10, 11, 12], 20), ([13, 14, 15, 16], 6)]
    ids = submit(engine, requests)
    for _ in range(4):  # a prefill, then decodes: everyone holds blocks
        engine.step()
    victim = engine.seqs["r0"]
    assert victim.block_table and victim.output_token_ids
    held = len(victim.block_table)
    free_before = engine.block_manager.num_free_blocks

    assert engine.abort_request("r0") is True
    assert victim.block_table == [] and victim.finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == free_before + held
    assert victim not in engine.scheduler.running and victim not in engine.scheduler.waiting
    assert engine.abort_request("r0") is False  # already gone
    assert engine.abort_request("no-such-request") is False

    finished = run_to_completion(engine)
    assert set(finished) == {"r1", "r2"}, "an aborted request produces no more outputs"
    assert len(finished["r1"].outputs[0].token_ids) == 20
    assert len(finished["r2"].outputs[0].token_ids) == 6
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.abort_request("r1") is False  # finished requests cannot be aborted


def test_abort_a_waiting_request(model_dir):
    # max_model_len prompts: one at a time fits in 12 blocks, so the second waits.
    engine = make_engine(model_dir, NUM_BLOCKS)
    long_prompt = list(range(3, 3 + 24))
    submit(engine, [(long_prompt, 4), (long_prompt, 4)])
    engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["r1"]
    assert engine.abort_request("r1") is True
    assert engine.scheduler.num_waiting == 0
    finished = run_to_completion(engine)
    assert set(finished) == {"r0"}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_every_request_leaves_the_engine_empty(model_dir):
    engine = make_engine(model_dir, NUM_BLOCKS)
    ids = submit(engine, make_requests(6, seed=1))
    for _ in range(6):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for rid in ids:
        engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_changing_params_after_a_request_reaches_only_later_requests(model_dir, seed):
    """A caller reusing one SamplingParams object and changing it between
    requests (a common pattern with LLM.generate) gets the new settings on the
    next request, and the running one keeps its own."""
    rng = random.Random(seed)
    engine = make_engine(model_dir, NUM_BLOCKS)
    prompt = [rng.randrange(3, 512) for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("greedy", {"prompt_token_ids": prompt}, params)
    params.max_tokens = 2  # after submission: must not shorten the running request
    greedy = run_to_completion(engine)["greedy"].outputs[0].token_ids
    assert len(greedy) == 6, seed

    # The same object, now sampling with a fixed seed at a high temperature:
    # the engine must not serve it the greedy metadata of the earlier steps.
    params.temperature, params.seed, params.max_tokens = 5.0, rng.randrange(1 << 30), 6
    engine.add_request("hot", {"prompt_token_ids": prompt}, params)
    hot = run_to_completion(engine)["hot"].outputs[0].token_ids
    fresh = make_engine(model_dir, NUM_BLOCKS)
    fresh.add_request("ref", {"prompt_token_ids": prompt},
                      SamplingParams(temperature=5.0, seed=params.seed, max_tokens=6, ignore_eos=True))
    assert hot == run_to_completion(fresh)["ref"].outputs[0].token_ids, seed
    assert hot != greedy, seed  # temperature 5 over a random tiny model: not the argmax path


def test_logit_bias_steers_generation_and_bad_token_ids_are_refused(model_dir):
    """+100 on one token makes a greedy request generate only it, in a batch with an unbiased
    one that generates what it generates alone; token ids outside the vocabulary (in logit_bias,
    or stop_token_ids that min_tokens would ban) are refused at add_request, naming the field,
    and the engine keeps serving."""
    from fp8serve.errors import UserError

    engine = make_engine(model_dir, 64)
    prompt = [5, 6, 7, 8]
    plain = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("alone", {"prompt_token_ids": prompt}, plain)
    alone = run_to_end(engine)["alone"]
    engine.add_request("biased", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias={77: 100.0}))
    engine.add_request("plain", {"prompt_token_ids": prompt}, plain)
    done = run_to_end(engine)
    assert done["biased"] == [77] * 5
    assert done["plain"] == alone and alone != [77] * 5
    vocab = engine.config.model_config.arch.vocab_size
    with pytest.raises(UserError, match=rf"logit_bias: token id\(s\) \[{vocab}\] out of range for a vocabulary of {vocab}"):
        engine.add_request("bad1", {"prompt_token_ids": prompt}, SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(UserError, match=r"stop_token_ids: token id\(s\) \[100000\] out of range"):
        engine.add_request("bad2", {"prompt_token_ids": prompt}, SamplingParams(stop_token_ids=[100000], min_tokens=2))
    assert not engine.has_unfinished_requests()
    engine.add_request("after", {"prompt_token_ids": prompt}, plain)
    assert run_to_end(engine)["after"] == alone


def run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_n_samples_are_the_requests_seeded_seed_plus_i(model_dir, seed):
    """vLLM's parallel sampling: n=3 with seed s samples what three requests seeded s, s+1, s+2
    sample, reported as one request (one output per step, completions in index order)."""
    engine = make_engine(model_dir, 64)
    prompt = [5, 6, 7, 8]
    params = SamplingParams(n=3, temperature=1.0, top_k=50, seed=seed % 10_000, max_tokens=6, ignore_eos=True,
                            logprobs=1)
    parent = engine.add_request("p", {"prompt_token_ids": prompt}, params)
    assert parent.request_id == "p" and [c.request_id for c in parent.children] == ["0_p", "1_p", "2_p"]
    outs = []
    while engine.has_unfinished_requests():
        step = engine.step()
        assert [o.request_id for o in step] == ["p"]
        outs += step
    final = outs[-1]
    assert final.finished and not any(o.finished for o in outs[:-1])
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" and len(c.logprobs) == 6 for c in final.outputs)
    assert engine.parents == {} and engine.seqs == {}
    for i in range(3):
        engine.add_request(f"s{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=1.0, top_k=50, seed=seed % 10_000 + i, max_tokens=6,
                                          ignore_eos=True))
    alone = run_to_end(engine)
    assert [c.token_ids for c in final.outputs] == [alone[f"s{i}"] for i in range(3)]
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1, "the samples must differ"


def test_n_abort_and_request_ids(model_dir):
    """Aborting an n > 1 request aborts every sample and frees their blocks; the samples' ids
    ("{i}_{id}") may not collide with a request already queued."""
    from fp8serve.errors import UserError

    engine = make_engine(model_dir, 64)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=20, ignore_eos=True)
    engine.add_request("1_q", {"prompt_token_ids": [5]}, SamplingParams(max_tokens=1))
    with pytest.raises(UserError, match=r"request id '1_q' \(sample of 'q'\) is already in use"):
        engine.add_request("q", {"prompt_token_ids": [5, 6]}, params)
    assert "0_q" not in engine.seqs and "q" not in engine.parents  # nothing half-added
    engine.abort_request("1_q")
    engine.add_request("p", {"prompt_token_ids": [5, 6, 7]}, params)
    with pytest.raises(UserError, match="request id 'p' is already in use"):
        engine.add_request("p", {"prompt_token_ids": [5]}, SamplingParams())
    engine.step()
    engine.step()
    request = engine.get_request("p")
    out = engine.make_output(request)
    assert len(out.outputs) == 4 and not out.finished
    assert engine.abort_request("p") is True
    assert engine.abort_request("p") is False
    final = engine.make_output(request)
    assert final.finished and [c.finish_reason for c in final.outputs] == ["abort"] * 4
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == 64


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n_samples_prefill_the_prompt_once(model_dir, prefix_caching):
    """Samples admitted together share the prompt's full blocks (registered when the step that
    computes them is scheduled), with or without prefix caching: 4 samples of a 21-token prompt
    prefill 21 + 3 x 1 tokens. Without prefix caching no other request finds those blocks, and
    the prefix-cache counters stay 0."""
    bytes_per_block = 2 * BLOCK_SIZE * 2 * 16 * 4 * 2
    engine = LLMEngine.from_args(model_dir, dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                                 kv_cache_memory=64 * bytes_per_block, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                 enable_prefix_caching=prefix_caching)
    prompt = list(range(10, 31))
    params = SamplingParams(n=4, temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1)
    engine.add_request("p", {"prompt_token_ids": prompt}, params)
    outs = run_to_end_outputs(engine)
    assert engine.stats.prefill_tokens_total == 21 + 3 * 1
    # As vLLM counts prompt tokens: each sample's prompt, the shared part apart.
    assert (engine.stats.prompt_tokens_total, engine.stats.prompt_tokens_cached_total) == (4 * 21, 3 * 20)
    samples = outs["p"].outputs
    assert len({tuple(c.token_ids) for c in samples}) == 1  # greedy: the same sample four times
    lps = [[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] for c in samples]
    assert all(max(abs(a - b) for a, b in zip(lps[0], other)) < 1e-5 for other in lps[1:])
    bm = engine.block_manager
    assert bm.prefix_cache_hits == (3 * 20 if prefix_caching else 0)
    # Another request with the same prompt: shares them only with prefix caching.
    engine.add_request("q", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    run_to_end_outputs(engine)
    assert engine.stats.prefill_tokens_total == 24 + (1 if prefix_caching else 21)
    assert engine.stats.prompt_tokens_total == 5 * 21
    assert engine.stats.prompt_tokens_cached_total == 3 * 20 + (20 if prefix_caching else 0)
    assert bm.num_free_blocks == 64


def run_to_end_outputs(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_detokenize_false_gives_the_same_tokens_without_text(model_dir, seed):
    """vLLM's detokenize=False: the same token ids and logprobs, no text and no decoded tokens
    (the offline benchmarks' --disable-detokenize)."""
    rng = random.Random(seed)
    tokenizer = make_engine(model_dir, NUM_BLOCKS).tokenizer
    # A prompt that ends on a character boundary: the output text is decoded in a window that
    # starts inside the prompt (as vLLM's is), so a prompt ending in part of a UTF-8 character
    # would let the first output bytes complete it there, and decode(output ids) alone is then not
    # the text to expect (seed 952906247 drew one).
    prompt = [rng.randrange(3, 512) for _ in range(9)]
    while tokenizer.decode(prompt, skip_special_tokens=True).endswith("\ufffd"):
        prompt = [rng.randrange(3, 512) for _ in range(9)]
    outs = {}
    for detokenize in (True, False):
        engine = make_engine(model_dir, NUM_BLOCKS)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                                detokenize=detokenize)
        engine.add_request("r", {"prompt_token_ids": prompt}, params)
        (outs[detokenize],) = run_to_completion(engine).values()
    on, off = outs[True].outputs[0], outs[False].outputs[0]
    assert off.token_ids == on.token_ids and len(on.token_ids) == 6
    # The incremental detokenizer holds back trailing incomplete UTF-8 characters (U+FFFD).
    assert on.text == engine.tokenizer.decode(on.token_ids, skip_special_tokens=True).rstrip("\ufffd")
    assert off.text == ""
    assert [{t: lp.logprob for t, lp in d.items()} for d in off.logprobs] == \
        [{t: lp.logprob for t, lp in d.items()} for d in on.logprobs]
    assert all(lp.decoded_token is None for d in off.logprobs for lp in d.values())
    assert all(lp.decoded_token == engine.tokenizer.decode([t]) for d in on.logprobs for t, lp in d.items())
    prompt_off = [d for d in outs[False].prompt_logprobs if d is not None]
    prompt_on = [d for d in outs[True].prompt_logprobs if d is not None]
    assert len(prompt_off) == len(prompt) - 1
    assert all(lp.decoded_token is None for d in prompt_off for lp in d.values())
    assert all(lp.decoded_token is not None for d in prompt_on for lp in d.values())
