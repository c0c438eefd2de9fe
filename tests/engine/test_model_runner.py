"""The model runner's step inputs (engine/model_runner.py): the decode fast
path must build exactly the metadata the general path builds for the same
sequences. Fresh random batches each run (the seed is in every failure message)."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import write_tiny_llama

from fp8serve.engine.llm_engine import LLMEngine
from fp8serve.engine.sequence import Sequence
from fp8serve.sampling_params import SamplingParams

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    model_dir = write_tiny_llama(tmp_path_factory.mktemp("runner") / "llama")
    engine = LLMEngine.from_args(str(model_dir), dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                                 kv_cache_memory=1 << 20, max_model_len=64)
    return engine.model_runner


def decode_batch(rng: random.Random, num_blocks: int, n: int) -> list[Sequence]:
    """n sequences one token past their cached K/V, lengths on and off block
    boundaries, each with its own scattered physical blocks."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = []
    for i in range(n):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))]
        s = Sequence(f"r{i}", prompt, SamplingParams(max_tokens=64))
        s.output_token_ids = [rng.randrange(3, 500) for _ in range(rng.randint(1, 12))]
        s.block_table = [free.pop() for _ in range(-(-s.num_tokens // BLOCK_SIZE))]
        s.num_computed_tokens = s.num_tokens - 1
        seqs.append(s)
    return seqs


@pytest.mark.parametrize("n", [1, 2, 7])
def test_decode_inputs_equal_the_general_path(runner, seed, n):
    rng = random.Random(seed)
    seqs = decode_batch(rng, runner.num_blocks, n)
    # The general (prefill) path handles any number of new tokens per
    # sequence; with one each it is the reference for the decode path.
    ref_ids, ref_pos, ref = runner._prepare(seqs, is_prefill=True)
    ids, pos, md = runner._prepare(seqs, is_prefill=False)
    assert torch.equal(ids, ref_ids), seed
    assert torch.equal(ids, torch.tensor([s.output_token_ids[-1] for s in seqs])), seed
    assert torch.equal(pos, ref_pos), seed
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        got, want = getattr(md, name), getattr(ref, name)
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want), (name, seed)
    for name in ("max_query_len", "max_seq_len", "num_seqs", "num_tokens", "null_block_id"):
        assert getattr(md, name) == getattr(ref, name), (name, seed)
    assert md.is_decode_only and md.num_tokens == n
    # Padding of the block tables points at the null block.
    widths = [len(s.block_table) for s in seqs]
    for row, w in enumerate(widths):
        assert (md.block_tables[row, w:] == runner.num_blocks).all(), seed


def test_decode_steps_reuse_one_query_start_loc_per_batch_size(runner, seed):
    rng = random.Random(seed)
    first = runner._prepare(decode_batch(rng, runner.num_blocks, 3), is_prefill=False)[2]
    second = runner._prepare(decode_batch(rng, runner.num_blocks, 3), is_prefill=False)[2]
    other = runner._prepare(decode_batch(rng, runner.num_blocks, 4), is_prefill=False)[2]
    assert second.query_start_loc is first.query_start_loc
    assert torch.equal(other.query_start_loc, torch.arange(5))


def _seq(rng: random.Random, name: str, params: SamplingParams, num_outputs: int) -> Sequence:
    s = Sequence(name, [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))], params)
    s.output_token_ids = [rng.randrange(3, 500) for _ in range(num_outputs)]
    return s


def _same_metadata(a, b) -> bool:
    tensors = ("temperature", "top_p", "top_k", "min_p")
    flags = ("max_num_logprobs", "all_greedy", "all_random", "no_top_p", "no_top_k", "no_min_p", "banned_token_ids")
    return (all(torch.equal(getattr(a, n), getattr(b, n)) for n in tensors)
            and all(getattr(a, n) == getattr(b, n) for n in flags) and a.has_penalties == b.has_penalties)


def test_sampling_metadata_reused_only_while_it_cannot_change(runner, seed):
    from fp8serve.layers.sampler import SamplingMetadata

    rng = random.Random(seed)
    runner._static_sampling = None
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    hot = SamplingParams(temperature=0.8, top_p=0.9, top_k=rng.randint(2, 50), max_tokens=64)
    seqs = [_seq(rng, "a", greedy, 3), _seq(rng, "b", hot, 5)]
    first = runner._sampling_metadata(seqs, eos_token_id=2)
    fresh = SamplingMetadata.from_params([s.sampling_params for s in seqs], [s.prompt_token_ids for s in seqs],
                                         [s.output_token_ids for s in seqs], 2, runner.device)
    assert _same_metadata(first, fresh), seed
    for s in seqs:
        s.output_token_ids.append(rng.randrange(3, 500))
    assert runner._sampling_metadata(seqs, 2) is first  # same params objects: reused
    # Another row set, order or params object: rebuilt.
    assert runner._sampling_metadata(seqs[::-1], 2) is not first
    swapped = [seqs[0], _seq(rng, "c", SamplingParams(temperature=0.8, max_tokens=64), 1)]
    md = runner._sampling_metadata(swapped, 2)
    assert md is not first and md.no_top_k and md.no_top_p, seed


@pytest.mark.parametrize("kind", ["min_tokens", "seed", "penalty"])
def test_sampling_metadata_that_depends_on_the_step_is_rebuilt(runner, seed, kind):
    rng = random.Random(seed)
    runner._static_sampling = None
    if kind == "min_tokens":
        # One params object for an old request past min_tokens and a new one
        # still under it: the new row's EOS ban must not come from the old row.
        p = SamplingParams(temperature=0.0, min_tokens=4, max_tokens=64)
        old = _seq(rng, "old", p, 6)
        md_old = runner._sampling_metadata([old], 2)
        assert md_old.banned_token_ids is None
        new = _seq(rng, "new", p, 0)
        md_new = runner._sampling_metadata([new], 2)
        assert md_new is not md_old and md_new.banned_token_ids == [[2]], seed
        return
    p = (SamplingParams(temperature=0.9, seed=rng.randrange(1 << 30), max_tokens=64) if kind == "seed"
         else SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=64))
    s = _seq(rng, "x", p, 2)
    first = runner._sampling_metadata([s], 2)
    s.output_token_ids.append(rng.randrange(3, 500))
    second = runner._sampling_metadata([s], 2)
    assert second is not first, seed
    if kind == "seed":  # a per-step stream: the draw differs from the last step's
        assert not torch.equal(torch.rand(4, generator=first.generators[0]),
                               torch.rand(4, generator=second.generators[0])), seed
    else:  # the penalty sees the new token
        assert second.output_token_ids.shape[1] == first.output_token_ids.shape[1] + 1, seed


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "auto"), ("bfloat16", "fp8_e4m3")])
def test_pruned_prefills_generate_what_full_ones_do(tmp_path, seed, dtype, kv_cache_dtype):
    """Prefills run the last layer past attention on each sequence's last token only
    (`prune_last_layer`, the model's head with logits_indices): greedy tokens, their
    logprobs and prompt logprobs agree with an engine that runs every token through it, with
    several prompts per step, chunks of a chunked prefill (rows sampled or not), prefix-cache
    hits, and steps with prompt logprobs (which need every row: those run in full)."""
    from engine_runs import run_requests

    model_dir = write_tiny_llama(tmp_path / "llama", num_layers=3, hidden_size=128, num_heads=4, num_kv_heads=2,
                                 intermediate_size=192)
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(12)]
    requests = []
    for i in range(12):
        # r0 (no prompt logprobs) is at least one 24-token chunk: the first step is one that prunes, whatever
        # the seed (with short prompts every step could hold a request with prompt logprobs, and run in full).
        own = rng.randint(12 if i == 0 else 1, 40)
        prompt = (shared if i % 4 == 0 else []) + [rng.randrange(3, 512) for _ in range(own)]
        requests.append((f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 6), temperature=0.0, logprobs=2,
                                                         ignore_eos=True, prompt_logprobs=2 if i % 3 == 1 else None)))
    heads: dict[str, dict[str, int]] = {}
    outs = {}
    for name in ("full", "pruned"):
        engine = LLMEngine.from_args(str(model_dir), dtype=dtype, kv_cache_dtype=kv_cache_dtype, device="cpu",
                                     block_size=BLOCK_SIZE, kv_cache_memory=1 << 20, max_model_len=64,
                                     max_num_seqs=6, enable_chunked_prefill=True, max_num_batched_tokens=24,
                                     enable_prefix_caching=True)
        runner = engine.model_runner
        assert runner.prune_last_layer, "pruning is on by default"
        runner.prune_last_layer = name == "pruned"
        # Prune whatever the length (chunks here are short), but for steps of 3+ tokens a prompt on average,
        # which run every row and keep the last ones.
        runner.min_mean_tokens_to_prune = 3
        calls = heads[name] = {"pruned": 0, "full": 0}
        captures = runner.prefill_captures

        # Every prefill forward, replayed or eager.
        def counting(input_ids, positions, md, logits_indices=None, _forward=captures.forward, _calls=calls):
            _calls["full" if logits_indices is None else "pruned"] += 1
            return _forward(input_ids, positions, md, logits_indices)

        captures.forward = counting
        outs[name] = run_requests(engine, requests)
    assert heads["full"]["pruned"] == 0 and heads["pruned"]["pruned"] > 0, heads
    assert heads["pruned"]["full"] > 0, f"{heads}: no step with prompt logprobs ran in full"
    # float32: a row through the head alone takes other kernels than in a GEMM of many rows (rounding).
    # bf16 + FP8 KV: the same kernels on the vector path, but tolerance for bf16 rounding on AMX.
    tol = 1e-5 if dtype == "float32" else 2e-2
    for rid, _, _ in requests:
        a, b = outs["pruned"][rid], outs["full"][rid]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"seed={seed} {rid}"
        for t, la, lb in zip(b.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(la[t].logprob - lb[t].logprob) < tol, f"seed={seed} {rid}"
        if b.prompt_logprobs is not None:
            assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
            for t, la, lb in zip(b.prompt_token_ids[1:], a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert abs(la[t].logprob - lb[t].logprob) < tol, f"seed={seed} {rid}"
