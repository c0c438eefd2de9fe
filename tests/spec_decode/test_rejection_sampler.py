"""rejection_sample: greedy verification against a float64 reference, the output
distribution of speculative sampling against the target distribution, seeded
reproducibility and input validation."""

import math
import random
from collections import Counter

import pytest
import torch

from fp8serve.layers.sampler import Sampler, SamplingMetadata
from fp8serve.sampling_params import SamplingParams
from fp8serve.spec_decode.rejection_sampler import VerifyResult, rejection_sample

EOS = 2
GREEDY = SamplingParams(temperature=0)


# ---------------------------------------------------------------- helpers


def build(seqs, eos=EOS):
    """seqs: (params, prompt, outputs, drafts, logits [len(drafts) + 1, vocab]) per
    sequence. Row j of a sequence counts drafts[:j] as generated tokens.
    Returns (logits, metadata, drafts)."""
    params, prompts, outputs, rows, drafts = [], [], [], [], []
    for p, prompt, out, d, logits in seqs:
        assert logits.shape[0] == len(d) + 1
        for j in range(len(d) + 1):
            params.append(p)
            prompts.append(list(prompt))
            outputs.append(list(out) + list(d[:j]))
        rows.append(logits)
        drafts.append(list(d))
    metadata = SamplingMetadata.from_params(params, prompts, outputs, eos, "cpu")
    return torch.cat(rows).float(), metadata, drafts


def run(seqs, eos=EOS) -> VerifyResult:
    logits, metadata, drafts = build(seqs, eos)
    result = rejection_sample(logits, metadata, drafts)
    assert len(result.token_ids) == len(seqs)
    assert result.row_token_ids.shape == (logits.shape[0],)
    assert result.row_token_ids.dtype == torch.int64
    return result


def ref_processed(logits_row, params, prompt, outputs, eos=EOS):
    """Independent float64 logit processing, in the sampler's documented order:
    logit_bias, repetition penalty (prompt + output tokens), frequency and
    presence penalties (output tokens), then the min_tokens bans."""
    x = [float(v) for v in logits_row.double()]
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    seen = set(prompt) | set(outputs)
    for t in seen:
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, c in Counter(outputs).items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    if len(outputs) < params.min_tokens:
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos or eos is None else [eos])
        for t in banned:
            x[t] = -math.inf
    return x


def first_argmax(values):
    best = max(values)
    return values.index(best)


def ref_greedy(logits, params, prompt, outputs, drafts, eos=EOS):
    """Greedy verification by definition: keep drafts while each equals the
    argmax of its row's processed logits, then emit that row's argmax."""
    kept = []
    for j in range(len(drafts) + 1):
        top = first_argmax(ref_processed(logits[j], params, prompt, list(outputs) + list(drafts[:j]), eos))
        if j < len(drafts) and drafts[j] == top:
            kept.append(drafts[j])
            continue
        return kept + [top]
    raise AssertionError("unreachable")


def make_greedy_drafts(rng, logits, params, prompt, outputs, num_drafts, reject_at, vocab):
    """Drafts that equal the reference argmax before `reject_at` and differ from it there."""
    drafts = []
    for j in range(num_drafts):
        top = first_argmax(ref_processed(logits[j], params, prompt, list(outputs) + drafts))
        if j < reject_at:
            drafts.append(top)
        elif j == reject_at:
            drafts.append(rng.choice([t for t in range(vocab) if t != top]))
        else:
            drafts.append(rng.randrange(vocab))
    return drafts


def check_row_tokens(result, seqs):
    """Rows before the emitted token hold the kept drafts, the emitted row holds
    the emitted token, later rows that have a draft hold it."""
    rows = result.row_token_ids.tolist()
    start = 0
    for out, (_, _, _, drafts, _) in zip(result.token_ids, seqs):
        kept = len(out) - 1
        assert out[:kept] == list(drafts[:kept])
        assert rows[start:start + kept + 1] == out
        assert rows[start + kept + 1:start + len(drafts)] == list(drafts[kept + 1:])
        start += len(drafts) + 1
    assert start == len(rows)


def tv_bound(n, k, delta=1e-7):
    """t such that the empirical distribution of n i.i.d. draws over k outcomes
    is farther than t in total variation from the true one with probability at
    most delta: P(||p_hat - p||_1 >= eps) <= (2^k - 2) exp(-n eps^2 / 2)
    (Weissman et al. 2003), with eps = 2t."""
    return math.sqrt((math.log(2 ** k - 2) + math.log(1 / delta)) / (2 * n))


def hoeffding_bound(n, delta=1e-7):
    """t with P(|mean - p| >= t) <= delta for n Bernoulli(p) draws."""
    return math.sqrt(math.log(2 / delta) / (2 * n))


def tv(counts, probs):
    n = sum(counts)
    return 0.5 * sum(abs(c / n - p) for c, p in zip(counts, probs))


def softmax64(values, temperature=1.0):
    x = torch.tensor(values, dtype=torch.float64) / temperature
    return torch.softmax(x, 0).tolist()


def counts_of(tokens, vocab):
    c = Counter(tokens)
    return [c.get(t, 0) for t in range(vocab)]


# ---------------------------------------------------------------- greedy


def test_greedy_cases_in_one_batch(seed):
    """0 drafts, all kept, the first rejected, one in the middle rejected."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = 16
    cases = [(0, 0), (3, 3), (4, 0), (5, 2), (1, 1), (1, 0), (6, 5)]  # (num drafts, first rejected)
    seqs = []
    for num_drafts, reject_at in cases:
        logits = torch.randn(num_drafts + 1, vocab, generator=gen) * 3
        drafts = make_greedy_drafts(rng, logits, GREEDY, [1], [], num_drafts, reject_at, vocab)
        seqs.append((GREEDY, [1], [], drafts, logits))
    result = run(seqs)
    for (num_drafts, reject_at), out, (p, prompt, outs, drafts, logits) in zip(cases, result.token_ids, seqs):
        assert len(out) == min(reject_at, num_drafts) + 1
        assert out[:-1] == drafts[:len(out) - 1]
        assert out == ref_greedy(logits, p, prompt, outs, drafts)
        assert out[-1] == int(logits[len(out) - 1].argmax())
    check_row_tokens(result, seqs)


def test_greedy_does_not_modify_logits(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 10, generator=gen)
    _, metadata, _ = build([(GREEDY, [1], [], [4, 5], logits)])
    before = logits.clone()
    rejection_sample(logits, metadata, [[4, 5]])
    assert torch.equal(logits, before)


def random_params(rng, vocab):
    kind = rng.choice(["plain", "bias", "repetition", "freq_presence", "min_tokens", "mixed"])
    kw = {}
    if kind in ("bias", "mixed"):
        kw["logit_bias"] = {t: rng.uniform(-6, 6) for t in rng.sample(range(vocab), 4)}
    if kind in ("repetition", "mixed"):
        kw["repetition_penalty"] = rng.choice([0.5, 1.3, 2.0, 4.0])
    if kind in ("freq_presence", "mixed"):
        kw["frequency_penalty"] = rng.uniform(-2, 2)
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if kind in ("min_tokens", "mixed"):
        kw["min_tokens"] = rng.randint(1, 6)
        kw["stop_token_ids"] = rng.sample(range(vocab), 2)
        kw["ignore_eos"] = rng.random() < 0.2
    return SamplingParams(temperature=0, **kw)


def test_greedy_with_logit_processing_matches_reference(seed):
    """logit_bias, penalties and min_tokens bans, each row processed with the
    drafts before it counted as output."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = 12
    for _ in range(6):
        seqs, kept = [], []
        for _ in range(8):
            params = random_params(rng, vocab)
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            outputs = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
            num_drafts = rng.randint(0, 5)
            reject_at = rng.randint(0, num_drafts)
            logits = torch.randn(num_drafts + 1, vocab, generator=gen) * 2
            drafts = make_greedy_drafts(rng, logits, params, prompt, outputs, num_drafts, reject_at, vocab)
            seqs.append((params, prompt, outputs, drafts, logits))
            kept.append(reject_at)
        result = run(seqs)
        for out, (params, prompt, outputs, drafts, logits) in zip(result.token_ids, seqs):
            want = ref_greedy(logits, params, prompt, outputs, drafts)
            assert out == want, (seed, params, prompt, outputs, drafts)
        assert [len(o) - 1 for o in result.token_ids] == kept
        check_row_tokens(result, seqs)


def test_greedy_agrees_with_sampler_process_logits(seed):
    """A cross-check of the float64 reference itself: it agrees with
    Sampler.process_logits row by row."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = 12
    for _ in range(20):
        params = random_params(rng, vocab)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        outputs = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        row = torch.randn(1, vocab, generator=gen) * 2
        md = SamplingMetadata.from_params([params], [prompt], [outputs], EOS, "cpu")
        got = Sampler.process_logits(row, md)[0].double()
        want = torch.tensor(ref_processed(row[0], params, prompt, outputs), dtype=torch.float64)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = ~torch.isinf(want)
        assert torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


def test_greedy_banned_eos_draft_is_rejected_until_min_tokens():
    vocab = 8
    logits = torch.zeros(3, vocab)
    logits[:, EOS] = 5.0  # EOS is the raw argmax of every row
    logits[:, 6] = 3.0
    logits[:, 4] = 1.0
    params = SamplingParams(temperature=0, min_tokens=2)
    # outputs [7]: row 0 has 1 output (EOS banned), row 1 has 2 (EOS allowed).
    result = run([
        (params, [1], [7], [EOS, EOS], logits),  # EOS draft at row 0 is banned
        (params, [1], [7], [6, EOS], logits),  # 6 is row 0's argmax once EOS is banned; EOS allowed at row 1
        (params, [1], [], [6, EOS], logits),  # no outputs: EOS banned at rows 0 and 1
        (SamplingParams(temperature=0, min_tokens=2, ignore_eos=True), [1], [], [EOS], logits[:2]),
    ])
    assert result.token_ids == [[6], [6, EOS, EOS], [6, 6], [EOS, EOS]]


def test_greedy_stop_token_ids_banned_until_min_tokens():
    vocab = 8
    logits = torch.zeros(2, vocab)
    logits[:, 5] = 4.0
    logits[:, 3] = 2.0
    params = SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[5])
    result = run([(params, [1], [], [5], logits), (params, [1], [], [3], logits)])
    assert result.token_ids == [[3], [3, 5]]


def test_greedy_repetition_penalty_counts_drafts():
    """Row 1 sees draft 0 as an output: a repetition penalty on it flips the argmax."""
    logits = torch.tensor([[0.0, 4.0, 3.0, 0.0, 0.0, 0.0]] * 3)
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    # Row 0: 1 is unseen (prompt [0]) so it wins; row 1: 1 was drafted, 4 / 2 = 2 < 3;
    # row 2: 2 was drafted too, 3 / 2 = 1.5 < 2.
    result = run([(params, [0], [], [1, 1], logits), (params, [0], [], [1, 2], logits)])
    assert result.token_ids == [[1, 2], [1, 2, 1]]
    # Without the penalty the drafts of the first sequence are plain greedy's.
    assert run([(GREEDY, [0], [], [1, 1], logits)]).token_ids == [[1, 1, 1]]
    assert result.token_ids[0] == ref_greedy(logits, params, [0], [], [1, 1])
    assert result.token_ids[1] == ref_greedy(logits, params, [0], [], [1, 2])


def test_greedy_logit_bias():
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0, logit_bias={1: 1.5, 3: -3.0})
    result = run([(params, [0], [], [1], logits), (params, [0], [], [0], logits)])
    # Row 0: 1 + 1.5 beats 2; row 1: 3 (2 - 3) loses to 1 (0 + 1.5) and 2 (1).
    assert result.token_ids == [[1, 1], [1]]


def test_greedy_rows_in_a_mixed_batch(seed):
    """Greedy sequences verified next to random ones still follow the greedy reference."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    vocab = 10
    seqs, greedy_idx = [], []
    for i in range(12):
        num_drafts = rng.randint(0, 4)
        logits = torch.randn(num_drafts + 1, vocab, generator=gen) * 2
        if i % 2 == 0:
            params = random_params(rng, vocab)
            drafts = make_greedy_drafts(rng, logits, params, [1], [], num_drafts, rng.randint(0, num_drafts), vocab)
            greedy_idx.append(i)
        else:
            params = SamplingParams(temperature=rng.choice([0.5, 1.0, 1.5]), top_k=rng.choice([0, 3]))
            drafts = [rng.randrange(vocab) for _ in range(num_drafts)]
        seqs.append((params, [1], [], drafts, logits))
    result = run(seqs)
    for i in greedy_idx:
        p, prompt, outputs, drafts, logits = seqs[i]
        assert result.token_ids[i] == ref_greedy(logits, p, prompt, outputs, drafts)
    check_row_tokens(result, seqs)


# ---------------------------------------------------------------- distribution

TEMPERATURE = 0.7
ROW_LOGITS = [
    [1.0, 0.2, -0.5, 0.6, -1.2, 0.0],
    [-0.3, 0.9, 0.4, -1.0, 0.1, 0.5],
    [0.2, -0.4, 1.1, 0.3, 0.0, -0.8],
]


def run_identical(n, params, logits, drafts, prompt=(1,), outputs=()):
    """n copies of one sequence in one batch (rows are independent draws)."""
    logits = torch.as_tensor(logits, dtype=torch.float32)
    seqs = [(params, prompt, outputs, drafts, logits)] * n
    return run(seqs).token_ids


def test_speculative_sampling_keeps_the_target_distribution(seed):
    """Two drafts: the first token is distributed as p_0 = softmax(row 0 / T);
    given draft 0 kept, the second token as p_1; given both kept, the third as p_2.
    Drafts are accepted at rate p_j(d_j), and a rejected draft is never emitted."""
    torch.manual_seed(seed)
    n, vocab = 50_000, 6
    drafts = [0, 1]
    params = SamplingParams(temperature=TEMPERATURE)
    p = [softmax64(row, TEMPERATURE) for row in ROW_LOGITS]
    # The check has power: T matters (TV(softmax(l / T), softmax(l)) is far above the bounds).
    assert 0.5 * sum(abs(a - b) for a, b in zip(p[0], softmax64(ROW_LOGITS[0]))) > 0.05

    outs = run_identical(n, params, ROW_LOGITS, drafts)
    assert all(1 <= len(o) <= 3 and o[:len(o) - 1] == drafts[:len(o) - 1] for o in outs)

    first = [o[0] for o in outs]
    assert tv(counts_of(first, vocab), p[0]) < tv_bound(n, vocab)

    kept0 = [o for o in outs if len(o) >= 2]
    assert abs(len(kept0) / n - p[0][drafts[0]]) < hoeffding_bound(n)
    rejected0 = [o[0] for o in outs if len(o) == 1]
    assert drafts[0] not in rejected0
    # Rejected: the emitted token follows p_0 without the draft, renormalized.
    residual = [0.0 if t == drafts[0] else q / (1 - p[0][drafts[0]]) for t, q in enumerate(p[0])]
    assert tv(counts_of(rejected0, vocab), residual) < tv_bound(len(rejected0), vocab)

    second = [o[1] for o in kept0]
    assert tv(counts_of(second, vocab), p[1]) < tv_bound(len(second), vocab)
    kept1 = [o for o in kept0 if len(o) == 3]
    assert abs(len(kept1) / len(kept0) - p[1][drafts[1]]) < hoeffding_bound(len(kept0))
    assert drafts[1] not in [o[1] for o in kept0 if len(o) == 2]

    third = [o[2] for o in kept1]
    assert tv(counts_of(third, vocab), p[2]) < tv_bound(len(third), vocab)


def test_sampling_without_drafts_follows_the_target(seed):
    torch.manual_seed(seed)
    n, vocab = 20_000, 6
    outs = run_identical(n, SamplingParams(temperature=TEMPERATURE), ROW_LOGITS[:1], [])
    assert all(len(o) == 1 for o in outs)
    assert tv(counts_of([o[0] for o in outs], vocab), softmax64(ROW_LOGITS[0], TEMPERATURE)) < tv_bound(n, vocab)


def ref_filtered(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Independent top-k -> top-p -> min-p over distinct logits, in float64.
    top-k keeps the k largest logits; top-p keeps, from the most likely down,
    each token whose more-likely tokens hold less than p of the (top-k
    renormalized) mass; min-p keeps tokens with probability >= min_p times the
    largest; the kept probabilities are renormalized."""
    vocab = len(logits)
    order = sorted(range(vocab), key=lambda t: -logits[t])
    keep = set(order[:top_k] if top_k else order)
    probs = softmax64([logits[t] if t in keep else -math.inf for t in range(vocab)], temperature)
    above = 0.0
    kept_p = set()
    for t in order:
        if t in keep and above < top_p:
            kept_p.add(t)
        above += probs[t]
    probs = [probs[t] if t in kept_p else 0.0 for t in range(vocab)]
    total = sum(probs)
    probs = [q / total for q in probs]
    top = max(probs)
    probs = [q if q >= min_p * top else 0.0 for q in probs]
    total = sum(probs)
    return [q / total for q in probs]


FILTER_LOGITS = [2.0, 1.6, -0.4, 1.1, 0.3, -1.5, 0.7, 0.0]
FILTER_T = 1.3
# At T = 1.3 the tokens by probability: 0 (.302), 1 (.222), 3 (.151), 6 (.111),
# 4 (.082), 7 (.065), 2 (.048), 5 (.020). All three filters cut a tail of that
# order, so in each case one of them binds: (filters, binding filter, support).
FILTER_CASES = {
    "top_k": (dict(top_k=3, top_p=0.95, min_p=0.1), [0, 1, 3]),
    # top-p on the top-6 renormalized mass drops 7 (0.931 of the mass lies above
    # it), which top-p on the full distribution (0.868 above) would keep.
    "top_p": (dict(top_k=6, top_p=0.9, min_p=0.2), [0, 1, 3, 4, 6]),
    "min_p": (dict(top_k=6, top_p=0.9, min_p=0.3), [0, 1, 3, 6]),
}
OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}


@pytest.mark.parametrize("binding", list(FILTER_CASES))
def test_filter_reference_sanity(binding):
    """The reference keeps the hand-checked support, and ignoring the binding
    filter changes the target by far more than the sampling tolerance below."""
    filters, support = FILTER_CASES[binding]
    full = ref_filtered(FILTER_LOGITS, FILTER_T, **filters)
    assert [t for t, q in enumerate(full) if q > 0] == support
    assert math.isclose(sum(full), 1.0)
    loose = ref_filtered(FILTER_LOGITS, FILTER_T, **dict(filters, **{binding: OFF[binding]}))
    assert 0.5 * sum(abs(a - b) for a, b in zip(full, loose)) > 2 * tv_bound(20_000, len(FILTER_LOGITS))
    if binding == "top_p":  # top-p measured after top-k's renormalization, not before
        loose = ref_filtered(FILTER_LOGITS, FILTER_T, **dict(filters, top_k=0))
        assert 0.5 * sum(abs(a - b) for a, b in zip(full, loose)) > 2 * tv_bound(20_000, len(FILTER_LOGITS))


@pytest.mark.parametrize("binding,draft", [("top_k", 3), ("top_k", 6), ("top_p", 4), ("top_p", 7),
                                           ("min_p", 0), ("min_p", 4)])
def test_speculative_sampling_with_top_k_top_p_min_p(seed, binding, draft):
    """The first token follows the filtered distribution whether the draft is in
    its support or was filtered out (then it is never kept)."""
    torch.manual_seed(seed)
    filters, support = FILTER_CASES[binding]
    n, vocab = 20_000, len(FILTER_LOGITS)
    params = SamplingParams(temperature=FILTER_T, **filters)
    target = ref_filtered(FILTER_LOGITS, FILTER_T, **filters)
    outs = run_identical(n, params, [FILTER_LOGITS, FILTER_LOGITS[::-1]], [draft])
    first = [o[0] for o in outs]
    assert tv(counts_of(first, vocab), target) < tv_bound(n, vocab)
    assert set(first) <= set(support)  # filtered tokens never come out
    accepted = sum(len(o) == 2 for o in outs)
    assert abs(accepted / n - target[draft]) < hoeffding_bound(n)
    if draft not in support:
        assert accepted == 0
    assert draft not in [o[0] for o in outs if len(o) == 1]
    second = [o[1] for o in outs if len(o) == 2]
    if second:
        target1 = ref_filtered(FILTER_LOGITS[::-1], FILTER_T, **filters)
        assert tv(counts_of(second, vocab), target1) < tv_bound(len(second), vocab)


def test_random_banned_eos_draft_never_kept(seed):
    torch.manual_seed(seed)
    logits = torch.zeros(2, 6)
    logits[:, EOS] = 3.0
    params = SamplingParams(temperature=1.0, min_tokens=1)
    outs = run_identical(2000, params, logits, [EOS])
    assert all(o[0] != EOS and len(o) == 1 for o in outs)
    # Once a token is out, EOS is allowed again: drafting a non-EOS token first.
    outs = run_identical(2000, params, logits, [0])
    assert all(EOS not in o[:1] for o in outs)
    second = [o[1] for o in outs if len(o) == 2]
    assert second and EOS in second


# ---------------------------------------------------------------- seeds


def seeded_batch(seeds, vocab):
    logits = torch.tensor([[0.3, 0.1, 0.0, -0.2, 0.2, -0.1],
                           [0.0, 0.2, -0.1, 0.1, -0.3, 0.3],
                           [0.1, -0.2, 0.3, 0.0, 0.2, -0.1]])[:, :vocab]
    return [(SamplingParams(seed=s, temperature=0.8), [1, 2], [3], [4, 1], logits) for s in seeds]


def test_seeded_rows_reproducible_regardless_of_batch(seed):
    rng = random.Random(seed)
    vocab = 6
    seeds = [rng.randrange(2**31) for _ in range(16)]
    seqs = seeded_batch(seeds, vocab)

    torch.manual_seed(seed)
    alone = run(seqs).token_ids
    torch.manual_seed(seed + 1)
    assert run(seqs).token_ids == alone

    # The same sequences shuffled among unseeded ones with other logits and drafts.
    gen = torch.Generator().manual_seed(seed)
    mixed, where = [], []
    order = list(range(len(seqs)))
    rng.shuffle(order)
    for i in order:
        for _ in range(rng.randint(0, 2)):
            num_drafts = rng.randint(0, 3)
            mixed.append((SamplingParams(temperature=rng.choice([0.0, 0.8, 1.2])), [5], [],
                          [rng.randrange(vocab) for _ in range(num_drafts)],
                          torch.randn(num_drafts + 1, vocab, generator=gen)))
        where.append((i, len(mixed)))
        mixed.append(seqs[i])
    torch.manual_seed(seed + 2)
    result = run(mixed).token_ids
    for i, pos in where:
        assert result[pos] == alone[i]

    # Different seeds do draw differently (so the equalities above are not vacuous).
    assert len({tuple(o) for o in alone}) > 1


def test_seeded_row_without_drafts_samples_like_the_sampler(seed):
    """A seeded sequence without drafts draws what a plain decode step would."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(20):
        params = SamplingParams(seed=rng.randrange(2**31), temperature=1.0)
        logits = torch.randn(1, 8, generator=gen)
        outputs = [rng.randrange(8) for _ in range(rng.randint(0, 3))]
        got = run([(params, [1], outputs, [], logits)]).token_ids[0]
        md = SamplingMetadata.from_params([params], [[1]], [outputs], EOS, "cpu")
        want = Sampler()(logits.clone(), md).sampled_token_ids.tolist()
        assert got == want
        tokens.append(got[0])
    assert len(set(tokens)) > 1


# ---------------------------------------------------------------- validation


def test_wrong_row_counts_raise():
    logits = torch.zeros(3, 5)
    _, md3, _ = build([(GREEDY, [1], [], [1, 2], logits)])
    _, md2, _ = build([(GREEDY, [1], [], [1], logits[:2])])
    with pytest.raises(ValueError):
        rejection_sample(logits[:2], md2, [[1, 2]])  # logits and metadata agree, drafts need 3 rows
    with pytest.raises(ValueError):
        rejection_sample(logits, md2, [[1, 2]])  # metadata short
    with pytest.raises(ValueError):
        rejection_sample(logits[:2], md3, [[1, 2]])  # logits short
    with pytest.raises(ValueError):
        rejection_sample(logits, md3, [[1, 2, 3]])  # drafts need 4 rows
    with pytest.raises(ValueError):
        rejection_sample(logits, md3, [[], []])  # drafts need 2 rows
    with pytest.raises(ValueError):
        rejection_sample(logits, md3, [])
    # Two sequences, [1] and [], also take 3 rows: accepted.
    assert len(rejection_sample(logits, md3, [[1], []]).token_ids) == 2
