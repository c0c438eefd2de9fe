"""The exact greedy LM head (kernels/screened_argmax.py): the token it finds
must be the full head's greedy token, ties and near-ties included, and its
candidates must be a screen (few rows), not the vocabulary. Fresh random
data each run (the seed is in every failure message)."""

from __future__ import annotations

import pytest
import torch

from fp8serve.errors import ConfigError
from fp8serve.kernels import cpu_ops, screened_argmax
from fp8serve.kernels.screened_argmax import (
    build_screen,
    greedy_tokens,
    screened_candidates,
    screened_candidates_ref,
    screened_logits_ref,
    x_levels_for,
)


def full_tokens(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the sampler picks from the full head's logits."""
    return cpu_ops.greedy_argmax(cpu_ops.dense_gemv(x, w).float())


def head(g: torch.Generator, vocab: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    # Rows of different norms, like an embedding table's.
    w = torch.randn(vocab, hidden, generator=g) * torch.rand(vocab, 1, generator=g).add_(0.2) * 0.05
    return w.to(dtype).contiguous()


def outlier_rows(g: torch.Generator, m: int, hidden: int) -> torch.Tensor:
    """Rows with a few channels 100-1000x the rest (as Llama's residual stream
    has): the integer step of x is set by those, the other channels keep a
    few bits, and the bound must still hold."""
    x = torch.randn(m, hidden, generator=g)
    for r in range(m):
        cols = torch.randperm(hidden, generator=g)[:3]
        x[r, cols] *= float(torch.randint(100, 1000, (1,), generator=g))
    return x


def test_slack_bounds_the_screened_logits_error(seed):
    """|a - l| <= |x| slack for every row, a the screen's logits as the
    kernel forms them (x quantized to its integers; the kernel's own rounding
    is inside slack's rounding term) and l the full head's float32 logits;
    plain rows and rows with outlier channels."""
    g = torch.Generator().manual_seed(seed)
    w = head(g, 777, 96, torch.float32)
    screen = build_screen(w)
    assert screen.codes.dtype == torch.int8 and screen.codes.abs().max() <= 127, seed
    for x in (torch.randn(4, 96, generator=g) * 4, outlier_rows(g, 4, 96)):
        full = cpu_ops.dense_gemv(x, w).double()
        approx = screened_logits_ref(x, screen)
        bound = x.double().norm(dim=1, keepdim=True) * screen.slack.double()
        assert ((approx - full).abs() <= bound).all(), seed
    # ...and is not vacuous: the copy's own error dominates it, ~1% of |x| |w|.
    ratio = screen.slack.double() / w.double().norm(dim=1)
    assert ratio.max() < 0.05, (ratio.max().item(), seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 49, 64), (3, 1001, 72), (8, 2048, 100), (5, 4096, 576)])
def test_greedy_tokens_equal_the_full_heads(ops, seed, dtype, shape):
    """Rows 1-8, odd vocabularies, hidden sizes with a tail past the 8-lane
    loop, float32, bf16 and fp16 heads."""
    m, vocab, hidden = shape
    g = torch.Generator().manual_seed(seed)
    w = head(g, vocab, hidden, dtype)
    screen = build_screen(w)
    for trial in range(5):
        x = torch.randn(m, hidden, generator=g) * (0.5 + 4 * trial)
        got = greedy_tokens(x, w, screen)
        assert got is not None and got.dtype == torch.int64, seed
        assert torch.equal(got, full_tokens(x, w)), (trial, seed)


def test_ties_keep_the_first_index(ops, seed):
    """Copies of one row at several places: the full head's logits tie
    exactly there, and the sampler's rule (first index of the maximum) must
    survive the screen."""
    g = torch.Generator().manual_seed(seed)
    vocab, hidden = 3000, 64
    w = head(g, vocab, hidden, torch.float32)
    x = torch.randn(2, hidden, generator=g)
    winner = w[int(full_tokens(x[:1], w))].clone() * 1.5  # beats every other row for x[0]
    places = sorted(torch.randperm(vocab, generator=g)[:4].tolist())
    for p in places:
        w[p] = winner
    screen = build_screen(w)
    got = greedy_tokens(x, w, screen)
    want = full_tokens(x, w)
    assert int(want[0]) == places[0], seed
    assert torch.equal(got, want), (got, want, seed)


def test_near_ties_follow_the_float32_logits(ops, seed):
    """Rows one ulp apart from the best one: their logits differ in the last
    bits, below the copy's resolution, so the exact candidate pass decides."""
    g = torch.Generator().manual_seed(seed)
    vocab, hidden = 2000, 128
    w = head(g, vocab, hidden, torch.float32)
    x = torch.randn(1, hidden, generator=g)
    best = w[int(full_tokens(x, w))].clone() * 1.5
    rows = torch.randperm(vocab, generator=g)[:16]
    for i, r in enumerate(rows.tolist()):
        nudged = best.clone()
        j = i % hidden
        direction = float("inf") if (i % 2) else float("-inf")
        nudged[j] = torch.nextafter(nudged[j], torch.tensor(direction))
        w[r] = nudged
    screen = build_screen(w)
    assert screened_candidates(x, screen).numel() >= 16, seed  # all near-ties stay candidates
    assert torch.equal(greedy_tokens(x, w, screen), full_tokens(x, w)), seed


def bf16_full_head(x: torch.Tensor, w: torch.Tensor):
    """The full bf16-compute head (LMHead.forward on bf16 rows, no AMX):
    the packed kernel where this build has it, else dense_gemv; float32
    logits holding bf16 values. Returns (logits, candidate_logits)."""
    if cpu_ops.load_cpu_ops().dense_gemv_has_packed():
        from fp8serve.kernels.gemv_packing import pack_gemv_weight

        def run(rows_w: torch.Tensor) -> torch.Tensor:
            return cpu_ops.dense_gemv_packed(x, pack_gemv_weight(rows_w, huge_pages=False), rows_w.shape[0],
                                             float_out=True)
    else:
        def run(rows_w: torch.Tensor) -> torch.Tensor:
            return cpu_ops.dense_gemv(x, rows_w).float()
    return run(w), lambda rows: run(w.index_select(0, rows))


@pytest.mark.parametrize("shape", [(1, 49, 64), (3, 1001, 72), (4, 2048, 100), (2, 4096, 576)])
def test_bf16_rows_get_the_bf16_heads_tokens(ops, seed, shape):
    """bf16 compute: bf16 rows against a bf16 head, whose logits are bf16
    dot products rounded to bf16 (many exact ties): the screen's token is
    still the full head's first maximum."""
    m, vocab, hidden = shape
    g = torch.Generator().manual_seed(seed)
    w = head(g, vocab, hidden, torch.bfloat16)
    screen = build_screen(w)
    for trial in range(5):
        x = (torch.randn(m, hidden, generator=g) * (0.5 + 4 * trial)).bfloat16()
        logits, candidate_logits = bf16_full_head(x, w)
        got = greedy_tokens(x, w, screen, candidate_logits)
        assert got is not None, seed
        assert torch.equal(got, cpu_ops.greedy_argmax(logits)), (trial, seed)


def test_bf16_rounding_ties_keep_the_first_index(ops, seed):
    """Rows just below the best one, placed before it: their float32 sums are
    smaller, but they round to the same bf16 logit, and then the first of them
    is the full head's token. The rows are exact multiples of their int8
    scale, so the copy's own error (slack) is ~1e-4 of a logit, far below a
    bf16 step: only the rounding-gap term keeps them candidates."""
    g = torch.Generator().manual_seed(seed)
    vocab, hidden = 3000, 64
    w = head(g, vocab, hidden, torch.bfloat16)
    x = torch.randn(1, hidden, generator=g).bfloat16()
    # The winner: codes * 2^-7 with the signs of x (its logit beats every
    # other row's), one code 127 (so the copy's scale is exactly 2^-7).
    codes = torch.randint(40, 127, (hidden,), generator=g) * torch.where(x[0] >= 0, 1, -1)
    top = int(torch.argmax(x[0].float().abs()))
    codes[top] = 127 if x[0, top] >= 0 else -127
    # Lower the code at the largest positive x but one: the sum drops by
    # x_j * 2^-7 (~0.01-0.02), well past the screen's float32 error and
    # mostly inside a bf16 step (0.125-0.25 at these logits).
    pos = torch.where(x[0].float() > 0, x[0].float(), torch.full((hidden,), float("-inf")))
    pos[top] = float("-inf")
    j = int(torch.argmax(pos))
    nudged = codes.clone()
    nudged[j] -= 1
    places = sorted(torch.randperm(vocab, generator=g)[:9].tolist())
    for p in places[:-1]:
        w[p] = (nudged.float() * 2**-7).bfloat16()
    w[places[-1]] = (codes.float() * 2**-7).bfloat16()
    screen = build_screen(w)
    logits, candidate_logits = bf16_full_head(x, w)
    want = cpu_ops.greedy_argmax(logits)
    exact = (x.double() @ w.double().T)[0]
    assert exact[places[0]] < exact[places[-1]], seed  # the nudged rows are below the winner...
    if logits[0, places[0]] == logits[0, places[-1]]:  # ...and tie with it after rounding (~90% of seeds)
        assert int(want[0]) == places[0], seed
    assert set(places) <= set(screened_candidates(x, screen).tolist()), seed
    assert torch.equal(greedy_tokens(x, w, screen, candidate_logits), want), seed


def test_bf16_candidates_match_the_float64_test(ops, seed):
    """The kernel's bf16 terms (rounding gap, flush) against the float64
    reference's, as for float32 rows below."""
    g = torch.Generator().manual_seed(seed)
    w = head(g, 4096, 128, torch.bfloat16)
    screen = build_screen(w)
    x = (torch.randn(2, 128, generator=g) * 3).bfloat16()
    got = set(screened_candidates(x, screen).tolist())
    ref = set(screened_candidates_ref(x, screen).tolist())
    assert len(got ^ ref) <= 2, (sorted(got ^ ref), seed)
    assert got >= set(screened_candidates(x.float(), screen).tolist()), seed  # wider than float32's test
    assert len(got) < 4096 // 10, (len(got), seed)


def test_candidates_are_a_screen_and_match_the_float64_test(ops, seed):
    """The kernel keeps every row the float64 reference keeps except, at
    most, rows on the boundary (within float32 rounding of it); and a head
    whose rows point different ways leaves few candidates."""
    g = torch.Generator().manual_seed(seed)
    w = head(g, 8192, 256, torch.float32)
    screen = build_screen(w)
    x = torch.randn(3, 256, generator=g) * 3
    got = set(screened_candidates(x, screen).tolist())
    ref = set(screened_candidates_ref(x, screen).tolist())
    x64 = x.double()
    a = screened_logits_ref(x, screen)
    bound = x64.norm(dim=1, keepdim=True) * screen.slack.double()
    best = (a - bound).max(dim=1, keepdim=True).values
    gap = ((a + bound) - best).max(dim=0).values  # >= 0 exactly for the reference's rows
    scale = float((a.abs() + bound).max())
    for v in got ^ ref:
        assert abs(float(gap[v])) <= 1e-5 * scale, (v, float(gap[v]), seed)
    assert len(got) < 8192 // 20, (len(got), seed)


def test_x_levels_keep_every_int32_sum_exact():
    """As fine as int16 allows where K is small, and never a range whose
    127 K L could reach 2^31 (Llama-3-8B's 4096, 70B's 8192 included)."""
    for k in (1, 64, 576, 2048, 4096, 8192, 16384, 65536):
        levels = x_levels_for(k)
        assert 1 <= levels <= 32767 and 127 * k * levels < 2**31, k
        assert levels == 32767 or 127 * k * (levels + 1) >= 2**31, k
    assert x_levels_for(576) == 29356 and x_levels_for(64) == 32767


@pytest.mark.parametrize("shape", [(1, 4096, 576), (4, 2048, 100), (8, 1001, 72)])
def test_outlier_activations_get_the_full_heads_tokens(ops, seed, shape):
    """Rows whose few huge channels set the integer step (outlier_rows): the
    quantization error is in slack, so the tokens stay the full head's."""
    m, vocab, hidden = shape
    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.bfloat16):
        w = head(g, vocab, hidden, dtype)
        screen = build_screen(w)
        for trial in range(3):
            x = outlier_rows(g, m, hidden)
            got = greedy_tokens(x, w, screen)
            assert got is not None and torch.equal(got, full_tokens(x, w)), (dtype, trial, seed)


def test_tiny_rows_go_to_the_full_head(ops):
    """A row so small that its integer step would be subnormal: no screen
    (the full head decides), in the kernel and its reference alike."""
    w = torch.randn(300, 64)
    screen = build_screen(w)
    x = torch.full((1, 64), 1e-40)
    assert screened_candidates(x, screen).numel() == 0
    assert screened_candidates_ref(x, screen).numel() == 0
    assert greedy_tokens(x, w, screen) is None


def test_non_finite_rows_fall_back_to_the_full_head(ops, seed):
    g = torch.Generator().manual_seed(seed)
    w = head(g, 500, 64, torch.float32)
    screen = build_screen(w)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 64, generator=g)
        x[1, 5] = bad
        assert screened_candidates(x, screen).numel() == 0
        assert greedy_tokens(x, w, screen) is None
    assert screened_candidates_ref(x, screen).numel() == 0
    w[3, 0] = float("inf")
    assert build_screen(w) is None


def test_bad_arguments_are_errors(ops):
    w = torch.randn(100, 64)
    screen = build_screen(w)
    with pytest.raises(ValueError, match="float32 or bf16 rows"):
        screened_candidates(torch.randn(9, 64), screen)
    with pytest.raises(ValueError, match="columns"):
        screened_candidates(torch.randn(1, 32), screen)
    with pytest.raises(ValueError, match="float32, bf16 or fp16 head"):
        build_screen(torch.randn(100, 64).double())
    levels = screen.x_levels
    with pytest.raises(RuntimeError, match="int8"):
        ops.screened_candidates(torch.randn(1, 64), screen.codes.to(torch.uint8), screen.scale, screen.slack,
                                0.0, -1.0, levels)
    with pytest.raises(RuntimeError, match=r"\[V\] float32"):
        ops.screened_candidates(torch.randn(1, 64), screen.codes, screen.scale[:5], screen.slack, 0.0, -1.0, levels)
    with pytest.raises(RuntimeError, match="logit_rel_gap"):
        ops.screened_candidates(torch.randn(1, 64), screen.codes, screen.scale, screen.slack, -0.5, -1.0, levels)
    for bad_levels in (0, 32768):
        with pytest.raises(RuntimeError, match="x_levels"):
            ops.screened_candidates(torch.randn(1, 64), screen.codes, screen.scale, screen.slack, 0.0, -1.0,
                                    bad_levels)
    wide = build_screen(torch.randn(10, 1024))
    assert wide.x_levels == x_levels_for(1024) < 32767
    with pytest.raises(RuntimeError, match="2\\^31"):  # sums that could leave int32
        ops.screened_candidates(torch.randn(1, 1024), wide.codes, wide.scale, wide.slack, 0.0, -1.0,
                                wide.x_levels + 1)
    with pytest.raises(ValueError, match="float32 or bf16 rows"):
        screened_candidates(torch.randn(1, 64).half(), screen)


def test_the_switch_reads_auto_1_0_and_rejects_the_rest(monkeypatch):
    monkeypatch.setenv(screened_argmax.SCREENED_ARGMAX_ENV, "0")
    assert not screened_argmax.enabled()
    monkeypatch.setenv(screened_argmax.SCREENED_ARGMAX_ENV, "1")
    assert screened_argmax.enabled()
    monkeypatch.setenv(screened_argmax.SCREENED_ARGMAX_ENV, "fast")
    with pytest.raises(ConfigError, match="FP8SERVE_SCREENED_ARGMAX"):
        screened_argmax.enabled()
    monkeypatch.delenv(screened_argmax.SCREENED_ARGMAX_ENV)
    assert screened_argmax.enabled()


@pytest.mark.parametrize("huge", ["1", "0"])
def test_screen_codes_sit_on_their_own_huge_page_arena(monkeypatch, seed, huge):
    """Read whole at every greedy step of 1-8 rows: from a 2 MiB boundary (an arena) unless huge
    pages are off or refused; the same codes either way."""
    from fp8serve.utils.huge_pages import HugePageArena

    w = torch.randn(300, 64, generator=torch.Generator().manual_seed(seed))
    monkeypatch.setenv("FP8SERVE_WEIGHT_HUGE_PAGES", "0")
    plain = build_screen(w)
    monkeypatch.setenv("FP8SERVE_WEIGHT_HUGE_PAGES", huge)
    screen = build_screen(w)
    assert torch.equal(screen.codes, plain.codes) and screen.codes.dtype == torch.int8
    if huge == "1" and HugePageArena.allocate(64) is None:
        pytest.skip("madvise(MADV_HUGEPAGE) refused here: no arena")
    assert (screen.codes.data_ptr() % (2 * 1024 * 1024) == 0) == (huge == "1")
