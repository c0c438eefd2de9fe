"""Mixtral (top-2 of 4 experts) through the whole engine, against Hugging Face transformers.

Same method as test_llama.py: the logits the sampler receives are recorded at the model's
`compute_logits` (rows mapped to requests through the Sequences `ModelRunner.execute` gets),
for the prefill and every decode step of several prompts batched together, and compared with
transformers in float64.
"""

from __future__ import annotations

import shutil
from collections import defaultdict

import pytest
import torch

from checkpoints import checkpoint_tensor_names, load_hf_model, rewrite_config, write_tiny_mixtral
from engine_runs import assert_greedy_batch_invariant
from fp8serve.entrypoints.llm import LLM
from fp8serve.sampling_params import SamplingParams

ATOL = 1e-3
KV_CACHE_MEMORY = 1 << 20


def record_logits(llm: LLM) -> dict[str, dict[int, torch.Tensor]]:
    """request id -> {token count before the step: the logits row sampled from}. The wrappers
    return the real results; only the first compute_logits call of a step (the sampled rows)
    is recorded, not the prompt-logprob ones. The exact greedy head, which finds greedy tokens
    without the logits, is turned off: every step computes them."""
    runner = llm.llm_engine.model_runner
    rows: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    real_execute, real_compute_logits = runner.execute, runner.model.compute_logits
    pending: list = []

    def compute_logits(hidden_states):
        logits = real_compute_logits(hidden_states)
        if pending:
            seqs = pending.pop()
            assert logits.shape[0] == len(seqs)
            for row, seq in enumerate(seqs):
                assert seq.num_tokens not in rows[seq.request_id], "a position was sampled twice"
                rows[seq.request_id][seq.num_tokens] = logits[row].detach().to("cpu", copy=True)
        return logits

    def execute(seqs, is_prefill, eos_token_id, *args):
        pending[:] = [list(seqs)]
        return real_execute(seqs, is_prefill, eos_token_id, *args)

    runner.model.compute_logits = compute_logits
    runner.model.compute_greedy_tokens = lambda hidden_states: None
    runner.execute = execute
    return rows


@torch.no_grad()
def assert_matches_hf(model_dir, outputs, rows) -> None:
    hf_model = load_hf_model(model_dir, torch.float64)
    for out in outputs:
        prompt, generated = out.prompt_token_ids, out.outputs[0].token_ids
        steps = rows[out.request_id]
        assert sorted(steps) == list(range(len(prompt), len(prompt) + len(generated)))
        ours = torch.stack([steps[n] for n in sorted(steps)]).double()
        # Row i of one causal forward over prompt + generated[:-1], at position len(prompt) - 1 + i,
        # is transformers' next-token logits after prompt + generated[:i].
        ref = hf_model(input_ids=torch.tensor([prompt + generated[:-1]]), use_cache=False).logits[0, len(prompt) - 1:]
        err = (ours - ref).abs().amax(dim=-1)
        assert err.max() <= ATOL, f"{out.request_id}: max |dlogit| per step {err.tolist()}"
        chosen = ref.gather(1, torch.tensor(generated)[:, None]).squeeze(1)
        assert (ref.amax(dim=-1) - chosen).max() <= 2 * ATOL, f"{out.request_id}: not the greedy token"


def _prompts(lengths, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in lengths]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    d = write_tiny_mixtral(tmp_path_factory.mktemp("mixtral"))
    names = checkpoint_tensor_names(d)
    # The on-disk layout the engine must map: per-expert w1/w2/w3 and a router, 4 experts.
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    return d


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_logits_match_transformers_at_every_step(tmp_path, mixtral_dir, kv_heads):
    model_dir = mixtral_dir if kv_heads == 2 else write_tiny_mixtral(tmp_path, num_kv_heads=kv_heads, seed=1)
    lengths, max_tokens = (3, 16, 21), (12, 6, 9)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=KV_CACHE_MEMORY, max_num_seqs=2)
    rows = record_logits(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(_prompts(lengths, seed=2), params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(max_tokens)
    assert_matches_hf(model_dir, outputs, rows)


@pytest.mark.cuda
def test_logits_match_transformers_on_cuda(mixtral_dir):
    """The MoE layers and the rest of the engine on a GPU against transformers
    in float64 on the CPU, every step."""
    lengths, max_tokens = (3, 16, 21), (12, 6, 9)
    llm = LLM(str(mixtral_dir), dtype="float32", kv_cache_memory=KV_CACHE_MEMORY, max_num_seqs=2, device="cuda")
    assert llm.llm_engine.model_runner.device.type == "cuda"
    rows = record_logits(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(_prompts(lengths, seed=2), params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(max_tokens)
    assert_matches_hf(mixtral_dir, outputs, rows)


def test_top_k_matters_in_the_reference(tmp_path, mixtral_dir):
    # Otherwise an engine that ignored num_experts_per_tok (top-1, or a dense sum) could pass above.
    top1 = tmp_path / "top1"
    shutil.copytree(mixtral_dir, top1)
    rewrite_config(top1, num_experts_per_tok=1)
    ids = torch.tensor([_prompts([16], seed=5)[0]["prompt_token_ids"]])
    with torch.no_grad():
        a = load_hf_model(mixtral_dir)(input_ids=ids).logits[0]
        b = load_hf_model(top1)(input_ids=ids).logits[0]
    assert (a - b).abs().max() > 100 * ATOL


def test_greedy_tokens_do_not_depend_on_the_batch(mixtral_dir):
    """Greedy tokens in a batch equal those of each prompt alone, unless the top two candidates
    were within 1e-4 in logprob at the first divergent step (a float tie the batch may flip)."""
    llm = LLM(str(mixtral_dir), dtype="float32", kv_cache_memory=KV_CACHE_MEMORY)
    prompts = _prompts((2, 9, 17, 30), seed=3)
    assert_greedy_batch_invariant(llm, prompts, 20)
