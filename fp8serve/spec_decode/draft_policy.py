"""How many of its drafts each sequence verifies in a step: the drafts that
raise the step's expected output tokens per second ("goodput", the
criterion of SmartSpec, Liu et al. 2024), from a cost model of the pass
learned from the engine's own step times and each sequence's acceptance.

Why not verify every draft: a verify pass runs one row per drafted
position, and on a CPU a row is not free. Measured on this project's
machine (default model, bf16, FP8 KV; benchmarks/spec_decode.py
--verify-cost): 10.3 ms for a decode step of one sequence, 12.3 ms for a
verify pass of 5 rows, 15.4 for 12, 27.4 for 30, 67.5 for 80, i.e. a fixed
~9.5 ms plus 0.5-0.8 ms per row. A draft the model rejects costs its row
and gives nothing, so a draft pays only where its chance of being kept is
worth its row's share of the step: a step's tokens per second E/T rises by
adding a row of cost c that is kept with probability g exactly when
g / c > E / T. One stream (E = 1, T = 10 ms, c = 0.6 ms) keeps every draft
with g > 0.06; a batch of 64 (E ~ 64, T ~ 69 ms, c ~ 0.8 ms) only those with
g > 0.74. The j-th draft of a sequence is kept only if the j - 1 before it
were: its expected gain is p_first * p_next ** (j - 1), with p_first the
chance a pass keeps its first draft and p_next the chance a draft after a
kept one is kept. Two rates, because n-gram drafts come in runs: a match
either continues a passage being copied (then most of the run is right) or
was a coincidence (then its first token is already wrong). Measured on the
free-writing workload (benchmarks/spec_decode.py, one stream): 29% of
drafts kept, yet 2.14 tokens per verify pass; one rate for both verified
153-162 of the 300 drafts and kept 54-62 tokens, where verifying all kept 88.

Both inputs are measured as the engine runs, not fixed for one machine:
  - PassCostModel: least squares of the decode-form passes' times (decode
    steps and verify passes run the same path) on their rows and the
    context tokens those rows attend over, over the last `window` passes;
  - AcceptanceEstimate per sequence: decayed counts of its first drafts and
    of the drafts after a kept one, kept and checked, starting from the
    rates over all sequences; every proposal counts, verified or cut (see
    GoodputDraftPolicy).
Before the model has seen passes of different sizes it prices rows at
zero, so every draft is tried: that is the data it learns from.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

# Passes the cost model fits (a few seconds of decoding: it follows the
# context growing and the machine's load).
COST_WINDOW = 128
# A pass slower than this many times the model's prediction is not a sample
# of the pass's cost (a recording of a new batch size, a page-in, a GC).
OUTLIER_RATIO = 3.0
# Weight of each verify pass's evidence against older ones: a sequence moves
# between copying its prompt and writing freely within a few passes.
ACCEPTANCE_DECAY = 0.8
# The estimate over all sequences (a new one's prior) keeps a longer memory:
# it sees every sequence's passes, tens per step in a batch.
OVERALL_DECAY = 0.98
# How many passes' worth of weight the prior rates have.
PRIOR_WEIGHT = 2.0
# The prior before any draft was checked: a coin toss, for both rates.
INITIAL_ACCEPTANCE = (0.5, 0.5)

class PassCostModel:
    """Seconds of a decode-form pass ~ a + b * rows + c * context_tokens,
    fitted by least squares over the last `window` passes. Rows and
    context tokens grow together in a run, so the fit adds a small ridge
    penalty pulling b and c towards 0 (the optimistic prior: rows it has no
    evidence about look free, get tried, and become evidence); b and c are
    never below 0.

    It runs in every decode step, so it keeps the window's sums (x x^T and
    x y for x = (1, rows, context)) and solves the 3 x 3 system in Python
    only when a step asks for a price after new passes (~0.07 ms per step
    for policy and model together). The first version refitted with numpy
    after every pass: ~0.2 ms, and the engine steps around it ran 0.4-3.6 ms
    slower (float32 single stream, 4 ABBA rounds: numpy's BLAS threads
    beside torch's on 2 cores); one stream of rewriting ran 0.89-0.93x of
    the same drafts verified without a policy."""

    def __init__(self, window: int = COST_WINDOW) -> None:
        self.samples: deque[tuple[float, float, float]] = deque()
        self.window = window
        self._coef = (0.0, 0.0, 0.0)  # a (s), b (s per row), c (s per context token)
        self._stale = False  # passes observed since the last fit
        self._sums = [0.0] * 9  # n, r, c, rr, rc, cc, y, ry, cy over the window
        self._max_rows = self._max_context = 1.0  # column scales of the ridge
        self.num_observed = 0  # passes fitted
        self.num_outliers = 0  # passes left out as not a sample of the cost

    @property
    def coef(self) -> tuple[float, float, float]:
        if self._stale:
            self._fit()
        return self._coef

    @coef.setter
    def coef(self, value) -> None:
        self._coef = tuple(float(v) for v in value)
        self._stale = False

    def observe(self, rows: int, context_tokens: int, seconds: float) -> None:
        if len(self.samples) >= 16 and seconds > OUTLIER_RATIO * self.predict(rows, context_tokens):
            self.num_outliers += 1
            return
        sample = (float(rows), float(context_tokens), float(seconds))
        self.samples.append(sample)
        self._add(sample, 1.0)
        if len(self.samples) > self.window:
            self._add(self.samples.popleft(), -1.0)
        self.num_observed += 1
        if self.num_observed % self.window == 0:  # drop the rounding the subtractions left
            self._sums = [0.0] * 9
            for x in self.samples:
                self._add(x, 1.0)
        self._max_rows = max(self._max_rows, sample[0])
        self._max_context = max(self._max_context, sample[1])
        self._stale = True

    def _add(self, sample: tuple[float, float, float], sign: float) -> None:
        r, c, y = sample
        for i, v in enumerate((1.0, r, c, r * r, r * c, c * c, y, r * y, c * y)):
            self._sums[i] += sign * v

    def _fit(self) -> None:
        n, r, c, rr, rc, cc, y, ry, cy = self._sums
        # Columns scaled by their largest value so one ridge strength suits rows (1-1000) and
        # context tokens (10^2-10^6) alike; the intercept is not penalized.
        sr, sc = self._max_rows, self._max_context
        ridge = 1e-3 * n
        a = [[n, r / sr, c / sc],
             [r / sr, rr / (sr * sr) + ridge, rc / (sr * sc)],
             [c / sc, rc / (sr * sc), cc / (sc * sc) + ridge]]
        coef = _solve3(a, [y, ry / sr, cy / sc])
        self._coef = (coef[0], max(coef[1] / sr, 0.0), max(coef[2] / sc, 0.0))
        self._stale = False

    def predict(self, rows: float, context_tokens: float) -> float:
        a, b, c = self.coef
        return max(a + b * rows + c * context_tokens, 1e-6)

    def row_cost(self, context_len: float) -> float:
        """Seconds one more row attending over `context_len` tokens adds to a pass."""
        _, b, c = self.coef
        return b + c * context_len


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b for a symmetric positive semi-definite 3 x 3 `a`
    (Gaussian elimination with partial pivoting; a zero pivot leaves that
    unknown at 0, where no pass tells it apart from the others)."""
    m = [row[:] + [v] for row, v in zip(a, b)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda i: abs(m[i][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for i in range(col + 1, 3):
            f = m[i][col] / m[col][col]
            for j in range(col, 4):
                m[i][j] -= f * m[col][j]
    x = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        if abs(m[i][i]) >= 1e-300:
            x[i] = (m[i][3] - sum(m[i][j] * x[j] for j in range(i + 1, 3))) / m[i][i]
    return x


@dataclass
class AcceptanceEstimate:
    """Decayed counts of how one sequence's proposals fared: first drafts
    checked (one per proposal) and kept; drafts checked after a kept one, and
    kept. `pending`: proposals (index of the first draft's token, the drafts)
    whose outcome its later tokens have not decided yet."""
    first_checked: float = 0.0
    first_kept: float = 0.0
    next_checked: float = 0.0
    next_kept: float = 0.0
    decay: float = ACCEPTANCE_DECAY
    num_scored: int = 0  # proposals scored
    pending: list[tuple[int, list[int]]] = field(default_factory=list)

    def rates(self, prior: tuple[float, float]) -> tuple[float, float]:
        """(p_first, p_next): the chance its next proposal's first draft is
        kept, and that a draft after a kept one is kept."""
        return ((self.first_kept + PRIOR_WEIGHT * prior[0]) / (self.first_checked + PRIOR_WEIGHT),
                (self.next_kept + PRIOR_WEIGHT * prior[1]) / (self.next_checked + PRIOR_WEIGHT))

    def update(self, num_drafts: int, num_kept: int) -> None:
        # Drafts 2..num_drafts are checked while the one before was kept: num_kept of them
        # (the last one rejected) or all num_drafts - 1 (every draft kept).
        d = self.decay
        self.first_checked = d * self.first_checked + 1
        self.first_kept = d * self.first_kept + (1 if num_kept else 0)
        self.next_checked = d * self.next_checked + (min(num_kept, num_drafts - 1) if num_kept else 0)
        self.next_kept = d * self.next_kept + max(num_kept - 1, 0)
        self.num_scored += 1


class GoodputDraftPolicy:
    """Cuts each decoding sequence's drafts to those that raise the step's
    expected tokens per second (module docstring). The engine reports every
    decode-form pass (`observe_pass`); the scheduler calls it on the step's
    decodes.

    Acceptance is learned from every proposal, verified or not: a proposal's
    drafts are scored against the tokens the sequence then generates (draft
    j is kept iff it and the j - 1 before it equal them). For a greedy
    sequence those are the tokens verification keeps; for a sampled one,
    plain sampling draws a draft with the probability speculative sampling
    keeps it (the model's probability of it), so the score is a fair sample
    either way. Scoring only verified drafts would trap the estimate: cut
    drafts would never show they would have been kept (the first version,
    on batches of 24 rewriting requests: one draft verified per pass,
    though 96% of the verified ones were kept)."""

    def __init__(self) -> None:
        self.cost = PassCostModel()
        self.overall = AcceptanceEstimate(decay=OVERALL_DECAY)  # every sequence's proposals: the prior

    def observe_pass(self, rows: int, context_tokens: int, seconds: float) -> None:
        self.cost.observe(rows, context_tokens, seconds)

    def acceptance(self, seq) -> tuple[float, float]:
        """(p_first, p_next) of `seq` (AcceptanceEstimate.rates)."""
        prior = self.overall.rates(INITIAL_ACCEPTANCE)
        return prior if seq.spec_acceptance is None else seq.spec_acceptance.rates(prior)

    def score(self, seq) -> None:
        """Scores `seq`'s pending proposals that its tokens since decide."""
        est = seq.spec_acceptance
        if est is None or not est.pending:
            return
        out, base, num_tokens = seq.output_token_ids, seq.num_prompt_tokens, seq.num_tokens
        undecided = []
        for start, drafts in est.pending:
            known = min(num_tokens - start, len(drafts))  # drafts whose token is generated by now
            kept = 0
            while kept < known and out[start - base + kept] == drafts[kept]:
                kept += 1
            if kept < known or known == len(drafts):  # a draft rejected, or all of them kept
                est.update(len(drafts), kept)
                self.overall.update(len(drafts), kept)
            else:
                undecided.append((start, drafts))
        est.pending = undecided

    def __call__(self, seqs: list) -> None:
        """Truncates `spec_token_ids` of `seqs` (the step's decoding
        sequences; each also emits its own next token). A request with a
        `seed` keeps all its drafts: which drafts a seeded row verifies
        changes the tokens it draws, and its samples must not depend on the
        other requests in the batch or on how fast the machine ran."""
        for s in seqs:
            self.score(s)
            if s.spec_token_ids:
                if s.spec_acceptance is None:
                    s.spec_acceptance = AcceptanceEstimate()
                # Draft j guesses the token at index num_tokens + j - 1.
                s.spec_acceptance.pending.append((s.num_tokens, list(s.spec_token_ids)))
        cut = [s for s in seqs if s.spec_token_ids and s.sampling_params.seed is None]
        if not cut:
            return
        keep = choose_num_drafts(
            num_seqs=len(seqs),
            context_lens=[s.num_tokens for s in seqs],
            drafts=[(len(s.spec_token_ids), *self.acceptance(s), s.num_tokens) for s in cut],
            cost=self.cost,
            fixed=[(len(s.spec_token_ids), *self.acceptance(s), s.num_tokens)
                   for s in seqs if s.spec_token_ids and s.sampling_params.seed is not None],
        )
        for s, k in zip(cut, keep):
            del s.spec_token_ids[k:]


def draft_gain(p_first: float, p_next: float, j: int) -> float:
    """Expected tokens the j-th draft (from 1) of a sequence adds."""
    return p_first * p_next ** (j - 1)


def choose_num_drafts(num_seqs: int, context_lens: list[int], drafts: list[tuple[int, float, float, int]],
                      cost: PassCostModel, fixed: list[tuple[int, float, float, int]] = ()) -> list[int]:
    """For each (num_drafts, p_first, p_next, context_len) in `drafts`, how
    many leading drafts to verify in a pass over `num_seqs` sequences (their
    contexts `context_lens`; `fixed`: drafts verified in any case) so that
    expected tokens / predicted time is largest. The j-th draft of a sequence gains draft_gain(...) tokens and
    costs one row over context_len + j tokens; the best set takes drafts in
    order of gain per cost while that exceeds the running ratio (each
    sequence's gains fall and costs rise with j, so its drafts come in
    order)."""
    tokens = float(num_seqs)
    seconds = cost.predict(num_seqs, sum(context_lens))

    def add(k, p_first, p_next, ctx, upto: int) -> None:
        nonlocal tokens, seconds
        for j in range(1, upto + 1):
            tokens += draft_gain(p_first, p_next, j)
            seconds += cost.row_cost(ctx + j)

    for d in fixed:
        add(*d, upto=d[0])
    keep = [0] * len(drafts)
    heap: list[tuple[float, int, int, float]] = []  # (-gain per second, seq, j, gain)

    def push(i: int, j: int) -> None:
        k, p_first, p_next, ctx = drafts[i]
        if j <= k:
            gain = draft_gain(p_first, p_next, j)
            row = cost.row_cost(ctx + j)
            ratio = gain / row if row > 0 else (float("inf") if gain > 0 else 0.0)
            heapq.heappush(heap, (-ratio, i, j, gain))

    for i in range(len(drafts)):
        push(i, keep[i] + 1)
    while heap:
        neg_ratio, i, j, gain = heapq.heappop(heap)
        if -neg_ratio <= tokens / seconds:
            break
        tokens += gain
        seconds += cost.row_cost(drafts[i][3] + j)
        keep[i] = j
        push(i, j + 1)
    return keep
