import pytest
import torch

from fp8serve.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_top_k_top_p,
    compute_prompt_logprobs,
)
from fp8serve.sampling_params import SamplingParams

VOCAB = 64
EOS = 3


def metadata_for(params, prompts=None, outputs=None, eos=EOS):
    prompts = prompts if prompts is not None else [[1, 2]] * len(params)
    outputs = outputs if outputs is not None else [[]] * len(params)
    return SamplingMetadata.from_params(params, prompts, outputs, eos, "cpu")


def random_logits(num_seqs, seed=0, vocab=VOCAB):
    return torch.randn(num_seqs, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def sample(logits, params, **kw):
    return Sampler()(logits, metadata_for(params, **kw))


def test_greedy_is_argmax_and_logits_untouched():
    logits = random_logits(4)
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 4)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_logprobs is None
    assert torch.equal(logits, before)


def test_bf16_logits_accepted():
    logits = random_logits(2).bfloat16()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 2)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ties_take_the_first_index(dtype):
    """Greedy must match torch.argmax (first index on ties) on wide bf16 rows,
    where exact ties at the top are common."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(16, 49152, generator=g) * 2).to(dtype)
    top = logits.max(-1).values
    for row in range(16):  # a second and a third copy of the maximum, before and after it
        for col in torch.randint(0, 49152, (2,), generator=g).tolist():
            logits[row, col] = top[row]
    out = sample(logits, [SamplingParams(temperature=0.0)] * 16)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    first = torch.stack([(r == r.max()).nonzero()[0, 0] for r in logits])
    assert torch.equal(out.sampled_token_ids, first)


def test_metadata_flags():
    md = metadata_for([SamplingParams(temperature=0), SamplingParams(top_k=5, seed=3)])
    assert not md.all_greedy and not md.all_random
    assert md.no_top_p and not md.no_top_k and md.no_min_p
    assert md.temperature.tolist() == [0.0, 1.0]
    assert list(md.generators) == [1]
    assert md.max_num_logprobs is None
    assert md.prompt_token_ids is None and md.banned_token_ids is None


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = random_logits(8, seed=1)
    greedy = logits.argmax(-1)
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)):
        for _ in range(5):
            assert torch.equal(sample(logits, [params] * 8).sampled_token_ids, greedy)


def test_mixed_greedy_and_random_rows():
    logits = random_logits(6, seed=2)
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.0)
              for i in range(6)]
    out = sample(logits, params).sampled_token_ids
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))


def test_top_k_restricts_support():
    torch.manual_seed(0)
    logits = random_logits(1, seed=3).expand(2000, VOCAB).contiguous()
    allowed = set(logits[0].topk(4).indices.tolist())
    out = sample(logits, [SamplingParams(temperature=5.0, top_k=4)] * 2000).sampled_token_ids
    assert set(out.tolist()) == allowed


def test_top_p_keeps_smallest_set_reaching_p():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two, 0.85 keeps three.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    for p, kept in ((0.7, 2), (0.79, 2), (0.85, 3), (0.9, 3), (1.0, 4)):
        masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([p]))
        assert torch.isfinite(masked).sum().item() == kept, p


def test_min_p_filters_relative_to_top_prob():
    torch.manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log().expand(3000, 5).contiguous()
    # min_p=0.3 -> threshold 0.12: tokens 0, 1, 2 survive.
    out = sample(logits, [SamplingParams(min_p=0.3)] * 3000).sampled_token_ids
    assert set(out.tolist()) == {0, 1, 2}


def test_seeded_row_independent_of_batch():
    target = SamplingParams(temperature=1.0, seed=1234)
    logits_row = random_logits(1, seed=4)

    def run(others, other_seed, step):
        logits = torch.cat([random_logits(others, seed=other_seed), logits_row, random_logits(2, seed=9)])
        params = [SamplingParams(temperature=0.7)] * others + [target] + [SamplingParams(seed=5), SamplingParams()]
        outputs = [[8]] * others + [[7] * step] + [[], [9, 9]]
        return Sampler()(logits, metadata_for(params, outputs=outputs)).sampled_token_ids[others].item()

    draws = []
    for step in range(20):
        alone = Sampler()(logits_row, SamplingMetadata.from_params([target], [[1]], [[7] * step], EOS, "cpu"))
        torch.manual_seed(step)  # the global RNG must not matter either
        # Different batch compositions for the same (seed, step) must agree.
        assert run(0, 10, step) == run(3, 11, step) == run(5, 12, step) == alone.sampled_token_ids.item()
        draws.append(alone.sampled_token_ids.item())

    other = SamplingParams(temperature=1.0, seed=999)
    other_draws = [Sampler()(logits_row, SamplingMetadata.from_params([other], [[1]], [[7] * s], EOS, "cpu"))
                   .sampled_token_ids.item() for s in range(20)]
    assert draws != other_draws
    assert len(set(draws)) > 1  # the stream advances with the step


def test_temperature_sampling_matches_softmax():
    torch.manual_seed(1234)
    num = 20000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temperature = 0.8
    logits = base.expand(num, -1).contiguous()
    out = sample(logits, [SamplingParams(temperature=temperature)] * num).sampled_token_ids
    observed = torch.bincount(out, minlength=6).double()
    expected = torch.softmax(base.double() / temperature, -1) * num
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    # 5 degrees of freedom; P(chi2 > 20.5) ~ 0.001.
    assert chi2 < 20.5, (observed, expected)


def test_logprobs_and_ranks_from_raw_logits():
    logits = random_logits(3, seed=5)
    params = [SamplingParams(temperature=1.0, logprobs=4, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=2.0)]
    out = sample(logits, params, outputs=[[10, 11], [], [4]])
    raw = torch.log_softmax(logits, -1)
    ids = out.sampled_token_ids
    torch.testing.assert_close(out.logprobs, raw.gather(-1, ids[:, None]).squeeze(-1))
    expected_ranks = (raw > raw.gather(-1, ids[:, None])).sum(-1) + 1
    assert torch.equal(out.ranks, expected_ranks)
    assert out.ranks[1].item() == 1  # the greedy row took the top token
    top = raw.topk(4, -1)
    torch.testing.assert_close(out.top_logprobs, top.values)
    assert torch.equal(out.top_token_ids, top.indices)


def test_compute_prompt_logprobs():
    logits = random_logits(5, seed=6).double()
    targets = torch.tensor([0, 5, 9, 63, 1])
    lp, rank, top_lp, top_ids = compute_prompt_logprobs(logits, targets, 3)
    raw = torch.log_softmax(logits, -1).float()
    torch.testing.assert_close(lp, raw[torch.arange(5), targets])
    order = raw.argsort(-1, descending=True)
    expected = (order == targets[:, None]).int().argmax(-1) + 1
    assert torch.equal(rank, expected)
    assert top_lp.shape == top_ids.shape == (5, 3)
    _, _, top_lp0, top_ids0 = compute_prompt_logprobs(logits, targets, 0)
    assert top_lp0.shape == top_ids0.shape == (5, 0)


def test_repetition_penalty_demotes_seen_tokens():
    logits = torch.zeros(2, 8)
    logits[:, 4] = 2.0  # seen in the prompt, positive
    logits[:, 5] = 1.9  # unseen
    logits[:, 6] = -0.1  # seen in the output, negative: pushed further down
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams(temperature=0.0)]
    md = metadata_for(params, prompts=[[4], [4]], outputs=[[6], [6]])
    assert md.repetition_penalty.tolist() == [2.0, 1.0]
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.tolist() == [5, 4]


def test_frequency_and_presence_penalties():
    logits = torch.zeros(1, 8)
    logits[0, 2] = 1.0
    logits[0, 3] = 0.5
    # Token 2 seen twice in the output: 1.0 - 2*0.2 - 0.3 = 0.3 < 0.5.
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.2, presence_penalty=0.3)]
    out = sample(logits, params, outputs=[[2, 2]])
    assert out.sampled_token_ids.tolist() == [3]
    # Prompt tokens are not subject to presence/frequency penalties.
    out = sample(logits, params, prompts=[[2, 2, 2]], outputs=[[]])
    assert out.sampled_token_ids.tolist() == [2]


@pytest.mark.parametrize("vocab", [8, 3001])
def test_sparse_penalties_equal_the_dense_reference(seed, vocab):
    """apply_penalties touches only the seen (row, token) entries; the result is
    the dense reference's bit for bit: repetition, frequency and presence
    penalties, neutral rows, repeated tokens, rows without output."""
    from fp8serve.layers.sampler import apply_penalties, apply_penalties_dense

    g = torch.Generator().manual_seed(seed)
    rows = 6

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    def rand(lo, hi):
        return lo + (hi - lo) * torch.rand((), generator=g).item()

    params = [SamplingParams(repetition_penalty=rand(0.5, 2.0), frequency_penalty=rand(-1, 1),
                             presence_penalty=rand(-1, 1)) for _ in range(rows - 1)] + [SamplingParams()]
    prompts = [ids(int(torch.randint(1, 40, (), generator=g))) for _ in range(rows)]
    outputs = [ids(int(torch.randint(0, 30, (), generator=g))) for _ in range(rows - 1)] + [[]]
    md = metadata_for(params, prompts=prompts, outputs=outputs)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[0, :4] = torch.tensor([0.0, -0.0, float("-inf"), 1e-30])
    want = apply_penalties_dense(logits.clone(), md)
    got = apply_penalties(logits.clone(), md)
    assert torch.equal(got, want) and torch.equal(got.isnan(), want.isnan()), seed
    assert not torch.equal(got, logits), seed  # something was penalized
    with pytest.raises(ValueError, match="penalty token ids"):
        apply_penalties(logits.clone(), metadata_for(params, prompts=[[vocab]] * rows, outputs=outputs))


def test_min_tokens_bans_eos_and_stop_token_ids():
    logits = torch.zeros(3, 8)
    logits[:, EOS] = 10.0
    logits[:, 6] = 9.0
    logits[:, 1] = 8.0
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6]),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6]),
              SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)]
    md = metadata_for(params, outputs=[[1], [1, 1], []])
    assert md.banned_token_ids == [[6, EOS], [], []]
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1, EOS, EOS]


def test_banned_token_out_of_vocab_rejected():
    md = metadata_for([SamplingParams(temperature=0.0, min_tokens=1)], eos=100)
    with pytest.raises(ValueError, match="banned token ids"):
        Sampler()(torch.zeros(1, 8), md)


def test_metadata_validation():
    md = metadata_for([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="top_p"):
        SamplingMetadata(**{**md.__dict__, "top_p": torch.ones(3)})
    with pytest.raises(ValueError, match="equal lengths"):
        SamplingMetadata.from_params([SamplingParams()], [[1], [2]], [[]], EOS, "cpu")


def test_logit_bias_moves_greedy_and_random_choices_but_not_logprobs():
    logits = random_logits(3, seed=11)
    top = logits.argmax(-1)
    params = [SamplingParams(temperature=0.0, logprobs=1, logit_bias={5: 100.0}),
              SamplingParams(temperature=0.0, logprobs=1, logit_bias={int(top[1]): -100.0}),
              SamplingParams(temperature=0.0, logprobs=1)]
    md = metadata_for(params)
    assert md.logit_bias[0].tolist() == [0, 1] and md.logit_bias[1].tolist() == [5, int(top[1])]
    before = logits.clone()
    out = Sampler()(logits, md)
    biased = logits.clone()
    biased[0, 5] += 100.0
    biased[1, top[1]] -= 100.0
    assert out.sampled_token_ids.tolist() == biased.argmax(-1).tolist()
    assert out.sampled_token_ids[0] == 5 and out.sampled_token_ids[1] != top[1] and out.sampled_token_ids[2] == top[2]
    assert torch.equal(logits, before)
    # Logprobs are the model's (vLLM's raw logprobs), not the biased distribution's.
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, raw.gather(-1, out.sampled_token_ids[:, None]).squeeze(-1))


def test_logit_bias_sampling_matches_the_biased_softmax():
    torch.manual_seed(4321)
    num = 20000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    bias = {0: -2.0, 5: 4.0}
    out = sample(base.expand(num, -1).contiguous(), [SamplingParams(temperature=1.0, logit_bias=bias)] * num)
    observed = torch.bincount(out.sampled_token_ids, minlength=6).double()
    biased = base.double().clone()
    for t, b in bias.items():
        biased[t] += b
    expected = torch.softmax(biased, -1) * num
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5, (observed, expected)  # 5 degrees of freedom; P(chi2 > 20.5) ~ 0.001


def test_logit_bias_comes_before_the_repetition_penalty():
    """vLLM v1's order: the bias is added to the model's logits, the penalty divides the sum."""
    logits = torch.zeros(1, 8)
    logits[0, 4] = 1.0  # seen in the prompt
    logits[0, 5] = 1.4
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={4: 1.5})]
    # (1.0 + 1.5) / 2 = 1.25 < 1.4 -> token 5 (penalty first would give 0.5 + 1.5 = 2.0 -> token 4).
    assert Sampler()(logits.clone(), metadata_for(params, prompts=[[4]])).sampled_token_ids.tolist() == [5]
    # Without the penalty the bias alone lifts token 4 to 2.5.
    params = [SamplingParams(temperature=0.0, logit_bias={4: 1.5})]
    assert Sampler()(logits.clone(), metadata_for(params, prompts=[[4]])).sampled_token_ids.tolist() == [4]


def test_logit_bias_out_of_vocab_rejected():
    md = metadata_for([SamplingParams(temperature=0.0, logit_bias={100: 1.0})])
    with pytest.raises(ValueError, match="logit_bias token ids"):
        Sampler()(torch.zeros(1, 8), md)
