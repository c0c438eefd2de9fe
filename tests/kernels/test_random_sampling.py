"""The C++ random-sampling kernel (cpu/random_sampling.cpp) against the
sampler's torch path (layers/sampler.py: sort-based top-k/top-p, softmax,
min-p): for every row, the token the kernel draws at a uniform u is the
inverse CDF, in index order, of the torch path's kept probabilities. Fresh
random logits each run (the seed is in every failure message)."""

from __future__ import annotations

import itertools

import pytest
import torch

from fp8serve.kernels import cpu_ops
from fp8serve.layers.sampler import Sampler, SamplingMetadata
from fp8serve.sampling_params import SamplingParams


def _metadata(params: list[SamplingParams]) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_params(params, [[1]] * n, [[]] * n, None, "cpu")


def _reference_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The torch path's distribution per row (float64, normalized over the kept tokens)."""
    probs = Sampler.random_probs(logits.clone(), md).double()
    return probs / probs.sum(dim=-1, keepdim=True)


def _draw(logits, md, u):
    return cpu_ops.sample_tokens(logits, md.temperature, md.top_k, md.top_p, md.min_p, u)


# Relative width of a near-tie at a filter's cutoff: float32 probabilities (and their float32
# prefix sums in top-p) cannot order tokens closer than this, so either side may be kept.
_TIE_REL = 1e-5
# Absolute probability mass within which the top-p cutoff is a near-tie: the torch path compares
# a float32 softmax's tail sum with 1 - p (seed 288570289: the exact mass of the 45154 top tokens
# of 49152 was 2.9e-8 short of p, and the torch path kept 45154 where exact maths keeps 45155).
_TOP_P_MASS_TOL = 1e-6


def _kept_set_alternatives(logits_row, param, ref_row):
    """The reference distribution and, where the torch path's kept set ends in a near-tie,
    the distributions with the cutoff on the tie's other sides: the kernel and the torch
    path round differently, so any of them is a correct draw there. Two kinds of tie:
    kept and dropped tokens whose probabilities are within _TIE_REL of each other at the
    cutoff, and a top-p cutoff whose kept mass is within _TOP_P_MASS_TOL of p."""
    kept = ref_row > 0
    if bool(kept.all()):
        return [ref_row]
    full = torch.softmax(logits_row.double() / max(param.temperature, 1e-5), dim=-1)
    out = [ref_row]
    for mask in _probability_tie_masks(full, kept) + _top_p_mass_tie_masks(logits_row, param, kept):
        alt = torch.where(mask, full, torch.zeros_like(full))
        out.append(alt / alt.sum())
    return out


def _probability_tie_masks(full, kept):
    boundary = float(full[kept].min())
    tied = torch.nonzero((full - boundary).abs() <= _TIE_REL * boundary).flatten()
    if tied.numel() < 2 or tied.numel() > 6:
        return []
    n_kept = int(kept[tied].sum())
    masks = []
    for size in {max(n_kept - 1, 0), n_kept, n_kept + 1}:
        for chosen in itertools.combinations(tied.tolist(), size):
            mask = kept.clone()
            mask[tied] = False
            mask[list(chosen)] = True
            if not bool(torch.equal(mask, kept)) and bool(mask.any()):
                masks.append(mask)
    return masks


def _top_p_mass_tie_masks(logits_row, param, kept, most=9):
    """Kept sets for top-p at every p' within _TOP_P_MASS_TOL of p (exact float64 maths over
    the top-k survivors, then min-p), at most `most` of them nearest the exact cutoff."""
    if param.top_p >= 1.0:
        return []
    x = logits_row.double() / max(param.temperature, 1e-5)
    vocab = x.numel()
    if 0 < param.top_k < vocab:
        x = x.masked_fill(logits_row < torch.topk(logits_row, param.top_k).values[-1], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    ordered, order = probs.sort(descending=True, stable=True)
    cum = ordered.cumsum(0)
    p = float(torch.tensor(param.top_p, dtype=torch.float32))  # the kernel's and torch's p

    def size(mass):  # the smallest kept set that reaches `mass`
        return min(int((cum < mass).sum()) + 1, vocab)

    exact = size(p)
    lo = max(size(p - _TOP_P_MASS_TOL), exact - most // 2)
    hi = min(size(p + _TOP_P_MASS_TOL), exact + most // 2)
    masks = []
    for s in range(lo, hi + 1):
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[order[:s]] = True
        if param.min_p > 0:
            top = float(probs[mask].max())
            mask &= probs >= param.min_p * top
        if not bool(torch.equal(mask, kept)) and bool(mask.any()):
            masks.append(mask)
    return masks


def _check_inverse_cdf(ops, logits, params, seed, points=64):
    """At the midpoint of each kept token's interval of the reference CDF (and at
    `points` evenly spread u's) the kernel returns that token. Where the reference's
    kept set ends in a near-tie, the draws must match one of the equally valid kept
    sets (`_kept_set_alternatives`) in full."""
    md = _metadata(params)
    ref_all = _reference_probs(logits, md)
    rows, vocab = logits.shape
    for r in range(rows):
        failures = []
        sample_seed = int(torch.randint(0, 2**31, ()))  # the same sample for every alternative
        for ref in _kept_set_alternatives(logits[r], params[r], ref_all[r]):
            got, want = _draws_at_interval_midpoints(logits[r], params[r], ref, points, sample_seed)
            if got == want:
                break
            failures.append((got, want))
        else:
            got, want = failures[0]
            assert got == want, f"seed={seed} row={r} params={params[r]} ({len(failures)} kept set(s) tried)"


def _draws_at_interval_midpoints(logits_row, param, ref, points, sample_seed):
    vocab = ref.numel()
    cdf = ref.cumsum(dim=-1)
    lower = cdf - ref
    kept = torch.nonzero(ref > 0).flatten()
    # Midpoints of the kept tokens' intervals (a sample of them for big kept sets), where the
    # interval is wide enough (1e-5) that float32 rounding of the kernel's weights (~1e-7 of the
    # total) cannot move the midpoint out of it ...
    wide = kept[ref[kept] >= 1e-5]
    assert wide.numel() > 0
    g = torch.Generator().manual_seed(sample_seed)
    pick = wide if wide.numel() <= points else wide[torch.randperm(wide.numel(), generator=g)[:points]]
    mids = ((lower[pick] + cdf[pick]) / 2).tolist()
    want = pick.tolist()
    # ... and a stratified grid of u, where the intervals are wide enough to be unambiguous.
    for i in range(points):
        u = (i + 0.5) / points
        tok = int(torch.searchsorted(cdf, torch.tensor(u, dtype=torch.float64), right=True))
        tok = min(tok, vocab - 1)
        if ref[tok] > 1e-4 and min(u - lower[tok].item(), cdf[tok].item() - u) > 1e-5:
            mids.append(u)
            want.append(tok)
    one = logits_row.unsqueeze(0).expand(len(mids), vocab).contiguous()
    md_r = _metadata([param] * len(mids))
    got = _draw(one, md_r, torch.tensor(mids, dtype=torch.float64))
    return got.tolist(), want


@pytest.mark.parametrize("vocab", [7, 1001, 49152])
def test_draws_follow_the_torch_paths_distribution(ops, seed, vocab):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp)
              for t, k, p, mp in [(1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (0.5, 50, 1.0, 0.0),
                                  (1.3, 20, 0.8, 0.0), (0.9, 0, 1.0, 0.1), (0.8, 0, 0.95, 0.05),
                                  (2.0, 3, 0.5, 0.2), (1.0, 0, 0.01, 0.0), (0.3, 0, 0.999, 0.0)]]
    # Peaked rows like a model's (a few large logits over a wide low tail), and flat ones.
    logits = torch.randn(len(params), vocab, generator=g) * 2
    logits[:, torch.randint(0, vocab, (5,), generator=g)] += 6
    logits[len(params) // 2:] *= 0.1
    _check_inverse_cdf(ops, logits, params, seed)


def test_banned_tokens_and_underflow_are_never_drawn(ops, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3000, generator=g)
    logits[:, ::3] = float("-inf")  # banned (min_tokens, logit_bias -inf)
    logits[1, 10] = 200.0  # every other token below exp's floor at temperature 1
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)]
    _check_inverse_cdf(ops, logits, params, seed)
    u = torch.linspace(0, 1 - 2**-40, 4001, dtype=torch.float64)
    for r, p in enumerate(params):
        got = _draw(logits[r:r + 1].expand(len(u), -1).contiguous(), _metadata([p] * len(u)), u)
        assert bool(torch.isfinite(logits[r, got]).all()), seed
    assert set(got.tolist()) == {10}


def test_rows_for_the_torch_path_and_greedy_rows(ops):
    logits = torch.randn(5, 100)
    logits[0, 7] = float("nan")
    logits[1] = float("-inf")
    logits[2, 3] = float("inf")
    params = [SamplingParams(temperature=1.0)] * 3 + [SamplingParams(temperature=0.0), SamplingParams(top_p=0.5)]
    got = _draw(logits, _metadata(params), torch.full((5,), 0.5, dtype=torch.float64))
    assert got[:3].tolist() == [-1, -1, -1]
    assert got[3].item() == -2
    assert 0 <= got[4].item() < 100


def test_bad_inputs_are_rejected(ops):
    md = _metadata([SamplingParams()] * 2)
    u = torch.rand(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float32"):
        _draw(torch.randn(2, 10, dtype=torch.float64), md, u)
    with pytest.raises(RuntimeError, match="temperature must be"):
        cpu_ops.sample_tokens(torch.randn(3, 10), md.temperature, md.top_k, md.top_p, md.min_p, u)
    # Parameters in other dtypes or layouts are converted, not refused.
    logits = torch.randn(2, 10)
    strided = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)[::2]
    out = cpu_ops.sample_tokens(logits, strided, md.top_k.int(), md.top_p.double(), md.min_p, u.float())
    assert out.shape == (2,) and bool(((out >= 0) & (out < 10)).all())


def test_sampler_falls_back_to_the_torch_path_for_nan_rows(ops):
    logits = torch.randn(3, 50)
    logits[1, 4] = float("nan")
    md = _metadata([SamplingParams(temperature=1.0)] * 3)
    calls = []
    real = Sampler.random_probs
    Sampler.random_probs = staticmethod(lambda lg, m: calls.append(lg.shape[0]) or real(lg, m))
    try:
        fast = Sampler()(logits, md).sampled_token_ids
    finally:
        Sampler.random_probs = staticmethod(real)
    slow = Sampler(use_kernel=False)(logits, md).sampled_token_ids
    assert calls == [3]  # the whole batch went the torch way
    # The torch path's NaN semantics (a NaN row's softmax is all NaN; the first NaN wins the race).
    assert fast[1].item() == slow[1].item() == 0
    assert 0 <= fast[0].item() < 50 and 0 <= fast[2].item() < 50


def test_seeded_rows_draw_from_their_own_generator(ops):
    logits = torch.randn(1, 500).expand(4, 500).contiguous()
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=8)]
    out = [Sampler()(logits, _metadata(params)).sampled_token_ids for _ in range(3)]
    assert all(o[0] == o[2] == out[0][0] for o in out)  # same seed, same position: same token
    alone = Sampler()(logits[:1], _metadata(params[:1])).sampled_token_ids
    assert alone.item() == out[0][0].item()


@pytest.mark.parametrize("vocab", [7, 3001])
def test_draws_without_an_excluded_token(ops, seed, vocab):
    """sample_tokens_excluding: the excluded token's probability under the torch
    path's kept distribution, and draws by the inverse CDF of the kept tokens
    without it (speculative decoding's rejection step)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.5, top_k=5, min_p=0.02)]
    logits = torch.randn(len(params), vocab, generator=g) * 2
    md = _metadata(params)
    ref = _reference_probs(logits, md)
    for r, p in enumerate(params):
        kept = torch.nonzero(ref[r] > 0).flatten()
        ex = int(kept[torch.randint(0, kept.numel(), (1,), generator=g)])
        # Where the torch path's kept set ends in a near-tie, the kernel may keep the other side
        # (_kept_set_alternatives): its draws must then match that kept set in full.
        failures = []
        for kept_probs in _kept_set_alternatives(logits[r], p, ref[r]):
            got, p_ex, want = _draws_without(logits[r], p, kept_probs, ex)
            if got == want and torch.allclose(p_ex, torch.full_like(p_ex, kept_probs[ex].item()), rtol=1e-5,
                                              atol=1e-12):
                break
            failures.append((got, want, p_ex, kept_probs[ex].item()))
        else:
            got, want, p_ex, p_want = failures[0]
            bad = [(t, g_) for t, g_ in zip(want, got) if t != g_]
            assert got == want, f"seed={seed} row={r}: (token, got) {bad[:5]} ({len(failures)} kept set(s) tried)"
            assert torch.allclose(p_ex, torch.full_like(p_ex, p_want), rtol=1e-5, atol=1e-12), seed
    # A token outside the kept set: probability 0, the plain draw; the only kept token: itself, probability 1.
    row = logits[:1].contiguous()
    md1 = _metadata([SamplingParams(temperature=1.0, top_k=1)])
    top = int(row.argmax())
    other = (top + 1) % vocab
    u = torch.tensor([0.3], dtype=torch.float64)
    got, p_ex = cpu_ops.sample_tokens_excluding(row, md1.temperature, md1.top_k, md1.top_p, md1.min_p, u,
                                                torch.tensor([other]))
    assert (got.item(), p_ex.item()) == (top, 0.0)
    got, p_ex = cpu_ops.sample_tokens_excluding(row, md1.temperature, md1.top_k, md1.top_p, md1.min_p, u,
                                                torch.tensor([top]))
    assert (got.item(), p_ex.item()) == (top, 1.0)


def _draws_without(logits_row, param, kept_probs, ex):
    """sample_tokens_excluding at the midpoints of the wide intervals of `kept_probs` without
    token `ex`: (drawn tokens, the kernel's probabilities of `ex`, the tokens expected)."""
    vocab = kept_probs.numel()
    rest = kept_probs.clone()
    rest[ex] = 0
    rest /= rest.sum()
    cdf = rest.cumsum(0)
    lower = cdf - rest
    others = torch.nonzero(rest >= 1e-5).flatten()  # wide intervals only (see _check_inverse_cdf)
    mids = (lower[others] + cdf[others]) / 2
    n = len(mids)
    one = logits_row.unsqueeze(0).expand(n, vocab).contiguous()
    md_r = _metadata([param] * n)
    got, p_ex = cpu_ops.sample_tokens_excluding(one, md_r.temperature, md_r.top_k, md_r.top_p, md_r.min_p, mids,
                                                torch.full((n,), ex, dtype=torch.int64))
    return got.tolist(), p_ex, others.tolist()
