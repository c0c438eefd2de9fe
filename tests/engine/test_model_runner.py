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
