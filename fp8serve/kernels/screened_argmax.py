"""The exact greedy LM head: the argmax of each row's logits without reading
the whole head.

A greedy step with nothing applied to its logits (no penalties, bias, bans
or logprobs) needs one index per row: the first index of the largest logit.
At decode batch 1 the LM head is the largest single read of a step (the
default model's tied float32 head: 113 MB of 538). An int8 copy of the head
(`GreedyScreen`: one scale per row, a quarter of float32's bytes) screens the
vocabulary: every row's screened logit, widened by a proven bound on its
error, either can or cannot reach the best screened lower bound. The rows
that can (the candidates; on the default model a median of 6 of 49152) get
their logits from the same kernel, with the same arithmetic per row, as the
full head would give them, and the token is their argmax. So the token is
the one greedy sampling of the full logits picks, ties and all: the row with
the largest float32 logit is always a candidate (proof at `build_screen`), and
so is every row tied with it.

Where it serves (`LMHead.greedy_tokens`): CPU; float32 activations with a
float32 head at 1-8 rows or a bf16 one at 1-4, whose full path is
dense_gemv; bf16 activations (bf16 compute) with a bf16 head, whose full path
is dense_gemv_packed or dense_gemv: bf16 dot products (vdpbf16ps, denormals
read as zero) and logits rounded to bf16, which the screen's test covers with
two more terms (`screened_candidates`). `engine_rows` says at how many rows.
FP8SERVE_SCREENED_ARGMAX=0 turns it off (the engine then computes every
logit, as before); auto (the default) or 1 leaves it on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8serve.kernels import cpu_ops
from fp8serve.utils.env_switch import env_switch
from fp8serve.utils.huge_pages import HugePageArena
from fp8serve.utils.weight_copies import copy_fits

logger = logging.getLogger(__name__)

# Activation rows per screened call (the C++ screen's register tiles).
MAX_ROWS = 8
# Rows the engine screens, by the head's dtype: where the screen beat the full
# head alone (cold, decode rows of the default model, AMD Zen 3 EPYC, three
# runs: benchmarks/results/greedy_head_2026-12-02_zen3.md). A float32 head
# reads 4x the screen's bytes: 2.9-3.6x at 1 row, 1.3-1.7x at 8. A bf16 head
# reads 2x: 1.6-2.1x at 1 row, 1.1-1.7x at 4, 0.9-0.96x at 8, where the
# screen's conversions and FMAs, not its bytes, set its time. An fp16 head
# (a 16-bit checkpoint kept at 16 bits: quantization/narrow_weights.py) reads
# the same bytes as a bf16 one and takes its rows (not measured apart).
# Those runs timed the float32-FMA screen; the integer one (stop 65, AVX2-only
# Zen 2 EPYC, two runs: benchmarks/results/greedy_head_int_screen_2026-12-06_zen2.md)
# ran 1.07-1.14x as fast at 1 row, 1.36-1.43x at 2, 1.68-1.71x at 4 and
# 1.14-1.64x at 8.
_ENGINE_ROWS = {torch.float32: MAX_ROWS, torch.bfloat16: 4, torch.float16: 4}
# bf16 compute (a bf16 head, bf16 activations; on AMD CPUs with AVX512-BF16
# its full path is dense_gemv_packed, 28-30 GB/s from memory): measured on a
# Zen 5 EPYC (2 vCPUs, the default model and its FP8 checkpoint, the 16-lane
# screen; benchmarks/results/greedy_head_bf16_2026-12-03_zen5.md), the head
# alone, cold: 1.53-1.70x at 1 row, 1.46-1.68x at 2, 0.91-0.96x at 4.
_BF16_COMPUTE_ROWS = 2
_SCREENED_DTYPES = tuple(_ENGINE_ROWS)
# The relative width of a bf16 rounding interval is at most 2^-7 of the value
# (8 significant bits); twice that leaves room for the bound on |logit| the
# kernel uses (`big`, itself within its float32 margin).
BF16_LOGIT_REL_GAP = 2.0**-6


def engine_rows(head_dtype: torch.dtype, compute_dtype: torch.dtype = torch.float32) -> int:
    """The most rows the engine screens for a head stored in `head_dtype`
    under `compute_dtype` activations (0: none)."""
    if compute_dtype == torch.bfloat16:
        return _BF16_COMPUTE_ROWS if head_dtype == torch.bfloat16 else 0
    if compute_dtype != torch.float32:
        return 0
    return _ENGINE_ROWS.get(head_dtype, 0)


# Vocabulary rows converted to float64 at a time while a screen is built.
_BUILD_ROWS = 4096


@dataclass(frozen=True)
class GreedyScreen:
    """An int8 copy of a [V, K] head and each row's error bound."""

    codes: torch.Tensor  # [V, K] int8
    scale: torch.Tensor  # [V] float32: row v ~ scale[v] * codes[v]
    slack: torch.Tensor  # [V] float32: |screened - full logit| <= |x|_2 * slack[v]
    weight_abs_max: float  # max |w| of the head (the flush term of a bf16 head's test)
    x_levels: int  # activations are screened as integers in [-x_levels, x_levels] (x_levels_for)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.slack))


SCREENED_ARGMAX_ENV = "FP8SERVE_SCREENED_ARGMAX"


def enabled() -> bool:
    """FP8SERVE_SCREENED_ARGMAX: auto (the default) and 1 build the screen
    where it serves, 0 never; anything else is a ConfigError."""
    return env_switch(SCREENED_ARGMAX_ENV) is not False


def x_levels_for(k: int) -> int:
    """The integer range [-L, L] an activation row of K values is screened in:
    as fine as int16 allows, and coarse enough that the int8 x int16 dot
    product of K terms cannot leave int32 in any order (127 K L < 2^31);
    0 where K is too large for that."""
    return min(32767, (2**31 - 1) // (127 * k))


def build_screen(weight: torch.Tensor) -> GreedyScreen | None:
    """The screen of a [V, K] float32, bf16 or fp16 head, or None where its values
    are not all finite.

    Why the candidates hold the argmax. For an activation row x (float32) and
    vocabulary row v, let l_v be the full head's float32 logit and a_v the
    screen's. The screen takes x as integers: xq = round(x / sx) with the
    float32 step sx = max|x| / L (L = x_levels_for(K)), every operation in
    float32, so |x - sx xq| <= (1/2 + 2^-8) sx per element (x / sx is off by
    at most 2^-8 after its two roundings, as |x / sx| <= ~L < 2^15) and
    sx <= (1 + u) max|x| / L (u = 2^-24). Then a_v = fl(fl(scale_v * sx) *
    fl(D)) with D = xq . codes_v exact in int32. With w~_v = scale_v codes_v:
      - |l_v - x . w_v| <= gamma_K |x|_2 |w_v|_2 (the full head's float32 dot
        product; gamma_K = K u / (1 - K u), |sum x_k w_k| <= |x|_2 |w|_2);
      - |x . (w_v - w~_v)| <= |x|_2 |w_v - w~_v|_2 (the copy's error);
      - |w~_v . (x - sx xq)| <= (1/2 + 2^-7) / L * scale_v |codes_v|_1 |x|_2
        (max|x| <= |x|_2);
      - |a_v - w~_v . sx xq| <= 4u |w~_v|_2 |sx xq|_2 (three roundings), and
        |sx xq|_2 <= |x|_2 (1 + sqrt(K) / L).
    So |a_v - l_v| <= |x|_2 c_v with c_v the sum of those four factors of
    |x|_2. Take slack_v >= c_v (computed here in float64, widened by 2^-10 and
    rounded up). If l_* is the largest logit, then for every row u:
    a_* + |x| slack_* >= l_* >= l_u >= a_u - |x| slack_u, so the argmax, and
    every row tied with it, passes the screen's test (the C++ comparisons
    carry a margin for their own float32 rounding)."""
    if weight.dim() != 2 or weight.dtype not in _SCREENED_DTYPES:
        raise ValueError(f"build_screen takes a [V, K] float32, bf16 or fp16 head, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    num_rows, k = weight.shape
    levels = x_levels_for(k)
    if levels < 1:
        raise ValueError(f"build_screen: a hidden size of {k} is too large for the screen's int32 sums")
    u = 2.0 ** -24
    gamma_k = k * u / (1 - k * u)
    rounding = 4 * u * (1 + k ** 0.5 / levels)
    quantized_x = (0.5 + 2.0 ** -7) / levels
    # Read whole at every greedy step of 1-8 rows: on 2 MiB pages (28 MB made
    # with torch.empty came from reused 4 KiB pages; see HugePageArena).
    arena = HugePageArena.allocate(HugePageArena.span(num_rows * k))
    codes = arena.empty((num_rows, k), torch.int8) if arena else torch.empty(num_rows, k, dtype=torch.int8)
    scale = torch.empty(num_rows, dtype=torch.float32)
    slack = torch.empty(num_rows, dtype=torch.float32)
    weight_abs_max = 0.0
    for start in range(0, num_rows, _BUILD_ROWS):
        w = weight[start:start + _BUILD_ROWS].double()
        if not torch.isfinite(w).all():
            return None
        amax = w.abs().amax(dim=1)
        weight_abs_max = max(weight_abs_max, float(amax.max()))
        # The float32 scale the kernel multiplies by; an all-zero row gets 1.
        s = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).float()
        q = torch.round(w / s.double().unsqueeze(1)).clamp_(-127, 127)
        approx = q * s.double().unsqueeze(1)
        c = ((w - approx).norm(dim=1) + gamma_k * w.norm(dim=1) + rounding * approx.norm(dim=1)
             + quantized_x * s.double() * q.abs().sum(dim=1)) * (1 + 2.0 ** -10)
        c32 = c.float()
        c32 = torch.where(c32.double() < c, torch.nextafter(c32, torch.full_like(c32, float("inf"))), c32)
        codes[start:start + _BUILD_ROWS] = q.to(torch.int8)
        scale[start:start + _BUILD_ROWS] = s
        slack[start:start + _BUILD_ROWS] = c32
    if not torch.isfinite(slack).all():
        return None
    return GreedyScreen(codes, scale, slack, weight_abs_max, levels)


def _full_head_terms(x: torch.Tensor, screen: GreedyScreen) -> tuple[float, float]:
    """(logit_rel_gap, flushed_weight_max) of the full head that rows of x's
    dtype meet (screened_argmax.cpp): float32 rows, plain float32 dot
    products (none); bf16 rows, bf16 dot products with denormals flushed and
    logits rounded to bf16."""
    if x.dtype == torch.bfloat16:
        return BF16_LOGIT_REL_GAP, screen.weight_abs_max
    return 0.0, -1.0


def screened_candidates(x: torch.Tensor, screen: GreedyScreen) -> torch.Tensor:
    """Sorted vocabulary rows that may hold some row of x's largest logit
    (int64 [C]); empty when x is not finite. x: [M, K] float32 or bf16 (the
    activations the full head takes; see _full_head_terms), 1 <= M <= MAX_ROWS."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16) or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"screened_candidates takes [1..{MAX_ROWS}, K] float32 or bf16 rows, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if x.shape[1] != screen.codes.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns, the screen {screen.codes.shape[1]}")
    ops = cpu_ops.load_cpu_ops()
    if ops is None:
        return screened_candidates_ref(x, screen)
    gap, flushed = _full_head_terms(x, screen)
    return ops.screened_candidates(x.float(), screen.codes, screen.scale, screen.slack, gap, flushed,
                                   screen.x_levels)


def screened_logits_ref(x: torch.Tensor, screen: GreedyScreen) -> torch.Tensor | None:
    """The screen's logits [M, V] in float64 as the kernel forms them: x's rows
    quantized with the kernel's float32 operations (same integers), the dot
    products exact, (scale * sx) rounded to float32 and the final product
    exact (the kernel rounds it: within its margin). None where the kernel
    leaves the rows to the full head (x not finite, or a subnormal step)."""
    xf = x.float()
    if not torch.isfinite(xf).all():
        return None
    levels = float(screen.x_levels)
    xmax = xf.abs().amax(dim=1, keepdim=True)
    # Tensor by tensor: a division by a Python scalar may run as a multiply by its reciprocal.
    sx = torch.where(xmax > 0, xmax / torch.full_like(xmax, levels), torch.ones_like(xmax))
    if (sx < torch.finfo(torch.float32).tiny).any():
        return None
    xq = torch.round(xf * (torch.ones_like(sx) / sx)).clamp_(-levels, levels)
    return (xq.double() @ screen.codes.double().T) * (screen.scale.unsqueeze(0) * sx).double()


def screened_candidates_ref(x: torch.Tensor, screen: GreedyScreen) -> torch.Tensor:
    """The reference the kernel is tested against: the same test in float64
    (a superset of the kernel's candidates up to its float32 margin)."""
    gap, flushed = _full_head_terms(x, screen)
    x64 = x.double()
    norm = x64.norm(dim=1, keepdim=True)
    a = screened_logits_ref(x, screen)
    if a is None or not torch.isfinite(norm).all():
        return torch.empty(0, dtype=torch.int64)
    bound = norm * screen.slack.double()
    best = (a - bound).max(dim=1, keepdim=True).values
    extra = torch.zeros_like(best)
    if gap > 0:
        extra += gap * (a.abs() + bound).max(dim=1, keepdim=True).values + 2.0**-120
    if flushed >= 0:
        extra += 2 * x.shape[1] * 2.0**-126 * (flushed + x64.abs().max(dim=1, keepdim=True).values + 1)
    return torch.nonzero((a + bound + extra >= best).any(dim=0)).flatten()


def greedy_tokens(x: torch.Tensor, weight: torch.Tensor, screen: GreedyScreen,
                  candidate_logits: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | None:
    """int64 [M]: for each row of x, the first index of the largest logit of
    the full head, found from the screen; None when x is not finite (the
    caller computes the logits). candidate_logits(rows) gives the float32
    logits [M, len(rows)] of the head's rows `rows` exactly as the full head
    computes them (default: dense_gemv(x, weight) on the gathered rows, whose
    arithmetic per (row, vocabulary row) depends only on M and the CPU, so
    they are the full head's values bit for bit). The candidates are sorted,
    so the first maximum among them is the first in the vocabulary."""
    candidates = screened_candidates(x, screen)
    if candidates.numel() == 0:
        return None
    if candidate_logits is None:
        logits = cpu_ops.dense_gemv(x, weight.index_select(0, candidates)).float()
    else:
        logits = candidate_logits(candidates)
    return candidates[cpu_ops.greedy_argmax(logits)]


def attach_screens(model: torch.nn.Module, compute_dtype: torch.dtype) -> int:
    """Give the model's LM heads (modules with a `greedy_screen` slot) their
    screen, on CPU, where some row count is screened (`engine_rows`: float32
    compute, or a bf16 head under bf16 compute), when FP8SERVE_SCREENED_ARGMAX
    allows and the copy fits in memory. Returns the bytes added."""
    if not enabled() or compute_dtype not in (torch.float32, torch.bfloat16) or cpu_ops.load_cpu_ops() is None:
        return 0
    total = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not hasattr(m, "greedy_screen") or not isinstance(w, torch.Tensor) or w.device.type != "cpu":
            continue
        if w.dim() != 2 or w.dtype not in _SCREENED_DTYPES or engine_rows(w.dtype, compute_dtype) == 0:
            continue
        if not copy_fits(w.shape[0] * (w.shape[1] + 8), "greedy LM head: int8 screen", logger):
            continue
        screen = build_screen(w)
        if screen is None:
            logger.info("greedy LM head: the head has non-finite values; no screen")
            continue
        m.greedy_screen = screen
        total += screen.nbytes
        logger.info("greedy LM head: int8 screen of the %s head (%.0f MiB); plain greedy steps read it and a few "
                    "exact rows instead of all %.0f MiB (FP8SERVE_SCREENED_ARGMAX=0: off)",
                    str(w.dtype).removeprefix("torch."), screen.nbytes / 2**20, w.numel() * w.element_size() / 2**20)
    return total
