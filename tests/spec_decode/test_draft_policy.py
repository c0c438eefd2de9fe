"""The goodput draft policy: the pass cost model fitted from step times, each sequence's
acceptance estimate, and the choice of drafts against a brute-force search of every choice."""

import itertools
import random

import numpy as np
import pytest

from fp8serve.engine.sequence import Sequence
from fp8serve.sampling_params import SamplingParams
from fp8serve.spec_decode.draft_policy import (
    ACCEPTANCE_DECAY,
    COST_WINDOW,
    INITIAL_ACCEPTANCE,
    PRIOR_WEIGHT,
    AcceptanceEstimate,
    GoodputDraftPolicy,
    PassCostModel,
    choose_num_drafts,
    draft_gain,
)


def pinned_cost(a: float, b: float, c: float = 0.0) -> PassCostModel:
    cost = PassCostModel()
    cost.coef = np.array([a, b, c])
    return cost


# ------------------------------------------------------------------------------- cost model


def test_cost_model_recovers_a_linear_cost_from_noisy_passes(seed):
    rng = np.random.default_rng(seed)
    a, b, c = rng.uniform(0.005, 0.02), rng.uniform(2e-4, 1e-3), rng.uniform(1e-7, 1e-6)
    cost = PassCostModel()
    for _ in range(COST_WINDOW):
        rows = int(rng.integers(1, 80))
        context = rows * int(rng.integers(50, 2000))
        cost.observe(rows, context, (a + b * rows + c * context) * rng.uniform(0.98, 1.02))
    fa, fb, fc = cost.coef
    assert fa == pytest.approx(a, rel=0.15) and fb == pytest.approx(b, rel=0.15) and fc == pytest.approx(c, rel=0.15)
    assert cost.row_cost(1000) == pytest.approx(fb + fc * 1000)
    assert cost.predict(10, 5000) == pytest.approx(fa + 10 * fb + 5000 * fc)


def reference_fit(samples, max_rows, max_context):
    """The same ridge least squares in numpy, from the samples themselves."""
    data = np.array(samples, dtype=np.float64)
    scale = np.array([1.0, max_rows, max_context])
    x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]]) / scale
    penalty = np.diag([0.0, 1e-3, 1e-3]) * len(data)
    coef = np.linalg.solve(x.T @ x + penalty, x.T @ data[:, 2]) / scale
    return coef[0], max(coef[1], 0.0), max(coef[2], 0.0)


def test_cost_model_running_sums_match_a_least_squares_over_the_window(seed):
    """After many more passes than the window (sums added and subtracted, and rebuilt every
    `window` passes), the fit is numpy's ridge least squares over the last `window` passes."""
    rng = np.random.default_rng(seed)
    cost = PassCostModel()
    seen = []
    for i in range(5 * COST_WINDOW + int(rng.integers(0, COST_WINDOW))):
        rows = int(rng.integers(1, 100))
        context = rows * int(rng.integers(10, 3000))
        cost.observe(rows, context, 0.01 + 5e-4 * rows + 3e-7 * context + rng.normal(0, 1e-3))
        seen.append((rows, context))
    assert cost.num_outliers == 0 and len(cost.samples) == COST_WINDOW
    want = reference_fit(list(cost.samples), max(r for r, _ in seen), max(c for _, c in seen))
    assert cost.coef == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_solve3_matches_numpy(seed):
    from fp8serve.spec_decode.draft_policy import _solve3

    rng = np.random.default_rng(seed)
    for _ in range(50):
        m = rng.normal(size=(3, 3))
        a = m @ m.T + 1e-3 * np.eye(3)
        b = rng.normal(size=3)
        assert _solve3(a.tolist(), b.tolist()) == pytest.approx(np.linalg.solve(a, b), rel=1e-6, abs=1e-9)
    # Singular: the second unknown is a copy of the first; it stays 0 and the first takes it all.
    singular = [[2.0, 2.0, 0.0], [2.0, 2.0, 0.0], [0.0, 0.0, 1.0]]
    assert _solve3(singular, [4.0, 4.0, 3.0]) == pytest.approx([2.0, 0.0, 3.0])


def test_cost_model_prices_rows_it_never_saw_vary_at_zero():
    """One stream without drafts: every pass has one row. Nothing tells what a row costs, so the
    ridge keeps it at ~0 (drafts get tried) and the intercept carries the time."""
    cost = PassCostModel()
    for i in range(40):
        cost.observe(1, 100 + i, 0.010)
    assert cost.coef[1] < 1e-4 and cost.predict(1, 120) == pytest.approx(0.010, rel=0.05)


def test_cost_model_without_passes_prices_everything_at_zero():
    cost = PassCostModel()
    assert cost.row_cost(500) == 0 and cost.predict(4, 100) > 0
    assert choose_num_drafts(4, [10] * 4, [(5, 0.01, 0.01, 10)] * 2, cost) == [5, 5]


def test_cost_model_never_has_negative_slopes():
    """Passes that got faster with more rows (the machine's load fell): slopes clamp at 0."""
    cost = PassCostModel()
    for i in range(30):
        rows = 1 + i
        cost.observe(rows, rows * 100, 0.05 - 0.001 * rows)
    assert cost.coef[1] == 0 and cost.coef[2] == 0


def test_cost_model_skips_outliers_and_forgets_old_passes():
    cost = PassCostModel()
    for i in range(COST_WINDOW):
        cost.observe(1 + i % 8, 100, 0.010 + 0.001 * (1 + i % 8))
    b = cost.coef[1]
    cost.observe(4, 100, 1.0)  # a recording or a stall: 70x the prediction
    assert cost.num_outliers == 1 and cost.coef[1] == pytest.approx(b)
    for i in range(COST_WINDOW):  # the machine got twice as slow per row
        cost.observe(1 + i % 8, 100, 0.010 + 0.002 * (1 + i % 8))
    assert cost.coef[1] == pytest.approx(0.002, rel=0.05)


# ------------------------------------------------------------------------------- acceptance


def test_acceptance_estimate_counts_first_drafts_and_the_drafts_after_kept_ones():
    est = AcceptanceEstimate()
    assert est.rates((0.3, 0.6)) == pytest.approx((0.3, 0.6))
    est.update(4, 4)  # first kept; drafts 2-4 checked after a kept one, all kept
    assert (est.first_checked, est.first_kept, est.next_checked, est.next_kept) == (1, 1, 3, 3)
    est.update(4, 2)  # first kept; the 2nd kept, the 3rd rejected: two checked after a kept one, one kept
    d = ACCEPTANCE_DECAY
    assert (est.first_checked, est.first_kept) == pytest.approx((d + 1, d + 1))
    assert (est.next_checked, est.next_kept) == pytest.approx((3 * d + 2, 3 * d + 1))
    est.update(3, 0)  # the first rejected: nothing after it was checked
    assert (est.first_checked, est.first_kept) == pytest.approx((d * d + d + 1, d * d + d))
    assert (est.next_checked, est.next_kept) == pytest.approx(((3 * d + 2) * d, (3 * d + 1) * d))
    prior = (0.5, 0.7)
    assert est.rates(prior) == pytest.approx(
        ((est.first_kept + PRIOR_WEIGHT * 0.5) / (est.first_checked + PRIOR_WEIGHT),
         (est.next_kept + PRIOR_WEIGHT * 0.7) / (est.next_checked + PRIOR_WEIGHT)))
    assert est.num_scored == 3


def test_acceptance_of_a_run_drafter_converges(seed):
    """Drafts whose first is kept with probability f and each later one, after a kept one, with
    probability q: with the prior at the truth the rates stay there on average; from a coin-toss
    prior the first-draft rate settles where ~1 / (1 - decay) passes of evidence outweigh the
    prior's PRIOR_WEIGHT (a sequence's estimate leans on the overall rate by design)."""
    rng = random.Random(seed)
    f, q = rng.uniform(0.1, 0.9), rng.uniform(0.2, 0.95)
    est = AcceptanceEstimate()
    at_truth, from_coin = [], []
    for _ in range(4000):
        k = 4
        kept = 0
        while kept < k and rng.random() < (f if kept == 0 else q):
            kept += 1
        est.update(k, kept)
        at_truth.append(est.rates((f, q)))
        from_coin.append(est.rates((0.5, 0.5)))
    first, after = np.mean(at_truth[500:], axis=0)
    assert first == pytest.approx(f, abs=0.04) and after == pytest.approx(q, abs=0.04)
    n = 1 / (1 - ACCEPTANCE_DECAY)
    assert np.mean(from_coin[500:], axis=0)[0] == pytest.approx((n * f + PRIOR_WEIGHT * 0.5) / (n + PRIOR_WEIGHT),
                                                                abs=0.04)


# ------------------------------------------------------------------------------- choice


def ratio(num_seqs, context_lens, drafts, cost, keep, fixed=()):
    chosen = [(d, n) for d, n in zip(drafts, keep)] + [(d, d[0]) for d in fixed]
    tokens = num_seqs + sum(draft_gain(pf, pn, j) for (k, pf, pn, ctx), n in chosen for j in range(1, n + 1))
    seconds = cost.predict(num_seqs, sum(context_lens))
    seconds += sum(cost.row_cost(ctx + j) for (k, pf, pn, ctx), n in chosen for j in range(1, n + 1))
    return tokens / seconds


@pytest.mark.parametrize("trial", range(40))
def test_choice_is_the_best_of_every_choice(trial, seed):
    rng = random.Random(seed * 1000 + trial)
    cost = pinned_cost(rng.uniform(0.005, 0.02), rng.uniform(0, 0.004), rng.uniform(0, 2e-6))
    num_seqs = rng.randint(1, 12)
    context_lens = [rng.randint(10, 2000) for _ in range(num_seqs)]
    drafts = [(rng.randint(0, 4), rng.random(), rng.random(), context_lens[i])
              for i in rng.sample(range(num_seqs), min(3, num_seqs))]
    fixed = [(rng.randint(1, 3), rng.random(), rng.random(), rng.choice(context_lens))] if rng.random() < 0.3 else []
    keep = choose_num_drafts(num_seqs, context_lens, drafts, cost, fixed=fixed)
    assert all(0 <= n <= d[0] for n, d in zip(keep, drafts))
    best = max(ratio(num_seqs, context_lens, drafts, cost, choice, fixed)
               for choice in itertools.product(*[range(d[0] + 1) for d in drafts]))
    assert ratio(num_seqs, context_lens, drafts, cost, keep, fixed) == pytest.approx(best, rel=1e-12)


def test_choice_keeps_likely_drafts_in_small_steps_and_only_sure_ones_in_big_ones():
    """The numbers of the module docstring, 9.5 ms + 0.6 ms per row. One stream (10.1 ms, one
    token) takes a draft while its gain > 10.1 ms / 1 token x 0.6 ms, about 0.06 rising to
    ~0.07 as it adds some; a batch of 64 (47.9 ms, 64 tokens) only while its gain > ~0.80."""
    cost = pinned_cost(0.0095, 0.0006)
    assert choose_num_drafts(1, [300], [(4, 0.1, 0.1, 300)], cost) == [1]  # 0.1; not 0.01
    assert choose_num_drafts(1, [300], [(4, 0.5, 0.5, 300)], cost) == [3]  # 0.5, 0.25, 0.125; not 0.0625
    # A run drafter: rarely right at first, but then mostly right.
    assert choose_num_drafts(1, [300], [(4, 0.3, 0.8, 300)], cost) == [4]  # down to 0.15
    contexts = [300] * 64
    assert choose_num_drafts(64, contexts, [(4, 0.5, 0.9, 300)], cost) == [0]
    assert choose_num_drafts(64, contexts, [(4, 0.9, 0.9, 300)], cost) == [2]  # 0.9, 0.81; not 0.73
    assert choose_num_drafts(64, contexts, [(4, 0.97, 0.97, 300)], cost) == [4]  # down to 0.91


# ------------------------------------------------------------------------------- the policy


def make_seq(name: str, drafts: list[int], seed: int | None = None) -> Sequence:
    seq = Sequence(name, list(range(1, 200)), SamplingParams(max_tokens=None, seed=seed))
    seq.output_token_ids = [5]
    seq.spec_token_ids = list(drafts)
    return seq


def step(policy, seqs, generated: dict[str, list[int]]) -> None:
    """One engine step after the policy cut the drafts: each sequence generates its next
    tokens (`generated[name]`, one unless its drafts were kept), and its drafts go."""
    for s in seqs:
        s.output_token_ids += generated.get(s.request_id, [7])
        s.spec_token_ids = []


def test_proposals_are_scored_against_the_tokens_generated_after_them():
    """Verified or cut, a proposal counts once its sequence's tokens decide it: kept up to the
    first draft that differs from what was generated (later steps decide cut drafts)."""
    policy = GoodputDraftPolicy()
    policy.cost = pinned_cost(0.0095, 1.0)  # rows cost 100 steps: every draft is cut
    seq = make_seq("s", [11, 12, 13])
    others = [make_seq(f"o{i}", []) for i in range(3)]
    policy([seq, *others])
    assert seq.spec_token_ids == [] and seq.spec_acceptance.pending == [(200, [11, 12, 13])]
    step(policy, [seq, *others], {"s": [11]})  # the first draft's token came: the rest undecided
    seq.spec_token_ids = [12, 13, 99]
    policy([seq, *others])
    assert seq.spec_acceptance.num_scored == 0 and len(seq.spec_acceptance.pending) == 2
    step(policy, [seq, *others], {"s": [12]})
    policy([seq, *others])  # no drafts this step: pending proposals are still scored
    est = seq.spec_acceptance
    assert est.num_scored == 0  # 13 not generated yet
    step(policy, [seq, *others], {"s": [13]})
    policy([seq, *others])
    # [11, 12, 13] all kept; [12, 13, 99]: 12, 13 kept, 99 not decided until the next token.
    assert est.num_scored == 1 and (est.first_kept, est.next_checked, est.next_kept) == (1, 2, 2)
    step(policy, [seq, *others], {"s": [50]})
    policy([seq, *others])
    d = ACCEPTANCE_DECAY
    assert est.num_scored == 2 and est.pending == []
    assert (est.first_checked, est.first_kept) == pytest.approx((d + 1, d + 1))
    assert (est.next_checked, est.next_kept) == pytest.approx((2 * d + 2, 2 * d + 1))
    assert policy.overall.num_scored == 2


def test_policy_cuts_unlikely_drafts_and_leaves_seeded_requests_alone():
    policy = GoodputDraftPolicy()
    policy.cost = pinned_cost(0.0095, 0.0006)
    others = [make_seq(f"s{i}", []) for i in range(60)]
    good, bad, seeded = make_seq("good", []), make_seq("bad", []), make_seq("seeded", [], seed=7)
    seqs = [*others, good, bad, seeded]
    for _ in range(12):  # good's proposals come true, bad's never do
        tok = 1000 + len(good.output_token_ids)
        good.spec_token_ids, bad.spec_token_ids = [tok, tok + 1], [1, 2]
        policy(seqs)
        step(policy, seqs, {"good": [tok, tok + 1], "bad": [3]})
    assert policy.acceptance(good)[0] > 0.8 and policy.acceptance(bad)[0] < 0.3
    good.spec_token_ids, bad.spec_token_ids, seeded.spec_token_ids = [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3]
    policy(seqs)
    assert good.spec_token_ids[:2] == [1, 2] and bad.spec_token_ids == [] and seeded.spec_token_ids == [1, 2, 3]


def test_policy_prior_follows_every_sequence_and_starts_at_a_coin_toss():
    policy = GoodputDraftPolicy()
    fresh = make_seq("fresh", [])
    assert policy.acceptance(fresh) == pytest.approx(INITIAL_ACCEPTANCE)
    other = make_seq("other", [])
    for _ in range(40):  # every proposal of `other` comes true
        tok = 1000 + len(other.output_token_ids)
        other.spec_token_ids = [tok, tok + 1]
        policy([other, fresh])
        step(policy, [other, fresh], {"other": [tok, tok + 1]})
    assert min(policy.acceptance(fresh)) > 0.9  # the prior of a sequence without its own proposals
    for _ in range(30):  # none of `fresh`'s does
        fresh.spec_token_ids = [1, 2]
        policy([fresh])
        step(policy, [fresh], {"fresh": [3]})
    assert policy.acceptance(fresh)[0] < 0.3
