"""The FP8-weight AMX linear kernel (cpu/amx_fp8_linear.cpp) against a float64
reference: 1-64 rows (partial blocks of 16 x rows), weight row counts that are
not multiples of 16, K of one and of many groups of 64 columns, strided
activation rows, every e4m3 code (subnormals and -0 included), bias or none,
any thread count. Skipped where the CPU, build or process has no AMX tiles or
AVX512-VBMI. Fresh random data each run (the seed is in every failure message)."""

from __future__ import annotations

import pytest
import torch

from fp8_weight_cases import fresh_seed, random_codes, reference
from thread_counts import at_one_and
from fp8serve.kernels import amx_linear_ops


@pytest.fixture(scope="module", autouse=True)
def amx_fp8():
    if not amx_linear_ops.fp8_is_available():
        pytest.skip("no AMX tiles or AVX512-VBMI on this CPU / build / process")


def make(m: int, n: int, k: int, with_bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(m, k + 64, generator=g).bfloat16()
    x = wide[:, 32:32 + k]  # rows strided, as a view of a fused projection's output is
    w = random_codes(n, k, g)
    scale = torch.rand(n, generator=g) * 1e-2 + 1e-4
    bias = torch.randn(n, generator=g) if with_bias else None
    return x, w, scale, bias


def assert_one_rounding(out, x, w, scale, bias, seed, what):
    """Products exact, sums in float32, one rounding to bf16: within half a bf16 spacing (2^-8 of
    the value) plus float32's summation error (a few ulps of sum |x| |w|)."""
    ref, magnitude = reference(x, w, scale, bias)
    bound = 2.0**-8 * ref.abs() + 1e-5 * magnitude + 1e-6
    err = (out.double() - ref).abs()
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape, f"{what}: {out.dtype} {tuple(out.shape)}"
    assert bool((err <= bound).all()), (
        f"{what}: seed={seed} max error {err.max().item():.3g}, worst error/bound {(err / bound).max().item():.3g}")


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 50, 64])
@pytest.mark.parametrize("n, k", [(16, 64), (37, 128), (960, 576), (50, 1536), (3, 192)])
def test_matches_float64(m, n, k, with_bias):
    seed = fresh_seed()
    x, w, scale, bias = make(m, n, k, with_bias, seed)
    assert_one_rounding(amx_linear_ops.amx_fp8_linear(x, w, scale, bias), x, w, scale, bias, seed,
                        f"M={m} N={n} K={k}")


@pytest.mark.parametrize("m", [3, 4, 5, 16, 19, 20, 36])
def test_rows_packed_together_give_the_bits_of_rows_alone(m):
    """Blocks of 4+ activation rows are packed by a register transpose, smaller ones by scatters
    (transpose16.h): a row's output must not depend on which (nor on its neighbours)."""
    seed = fresh_seed()
    x, w, scale, bias = make(m, 80, 1536, True, seed)
    together = amx_linear_ops.amx_fp8_linear(x, w, scale, bias)
    alone = torch.cat([amx_linear_ops.amx_fp8_linear(x[i:i + 1], w, scale, bias) for i in range(m)])
    assert torch.equal(together, alone), f"seed={seed} m={m}"


def test_every_code_decodes_exactly():
    """Each of the 254 non-NaN codes (subnormals, both zeros) as the only nonzero weight of a row
    against x = 1 in that column: the output is the code's value times the scale, rounded once."""
    codes = torch.tensor([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=torch.uint8)
    n, k = codes.numel(), 64
    w = torch.zeros(n, k, dtype=torch.uint8)
    w[torch.arange(n), torch.arange(n) % k] = codes
    x = torch.ones(5, k).bfloat16()
    scale = torch.full((n,), 0.5)
    out = amx_linear_ops.amx_fp8_linear(x, w, scale)
    ref, _ = reference(x, w, scale, None)
    assert torch.equal(out, ref.to(torch.bfloat16)), (out.float() - ref.float()).abs().max()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("m, n", [(8, 1000), (64, 200), (20, 17)])
def test_any_thread_count_gives_the_same_bits(m, n, threads):
    """Threads split the blocks of 16 weight rows; each output is summed by one tile either way."""
    seed = fresh_seed()
    x, w, scale, bias = make(m, n, 576, True, seed)
    one, many = at_one_and(threads, lambda: amx_linear_ops.amx_fp8_linear(x, w, scale, bias))
    assert torch.equal(one, many), f"seed={seed}: {threads} threads differ from one"


@pytest.mark.parametrize("case, message", [
    ("k_not_64", "K must be a positive multiple of 64, got 96"),
    ("too_many_rows", "1 to 64 rows, got 65"),
    ("float_x", "x must be bf16"),
    ("bf16_w", "w must be uint8 e4m3 codes"),
    ("scale_shape", "scale must be a contiguous float32 \\[16\\] tensor"),
    ("bias_shape", "bias must be \\[16\\]"),
    ("k_mismatch", "x has 64 columns, w 128"),
])
def test_rejects_bad_inputs(case, message):
    x, w, scale, bias = torch.randn(4, 64).bfloat16(), torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16), None
    if case == "k_not_64":
        x, w = torch.randn(4, 96).bfloat16(), torch.zeros(16, 96, dtype=torch.uint8)
    elif case == "too_many_rows":
        x = torch.randn(65, 64).bfloat16()
    elif case == "float_x":
        x = x.float()
    elif case == "bf16_w":
        w = w.bfloat16()
    elif case == "scale_shape":
        scale = torch.ones(15)
    elif case == "bias_shape":
        bias = torch.ones(8)
    elif case == "k_mismatch":
        w = torch.zeros(16, 128, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=message):
        amx_linear_ops.amx_fp8_linear(x, w, scale, bias)


def test_fp8_applies_bounds():
    """The rows and shapes fp8_linear_ops sends to the kernel."""
    w = torch.zeros(32, 128, dtype=torch.uint8)
    lo = amx_linear_ops.MIN_FP8_ROWS
    for m, expect in [(lo - 1, False), (lo, True), (64, True), (65, False)]:
        assert amx_linear_ops.fp8_applies(torch.zeros(m, 128).bfloat16(), w) is expect, m
    assert not amx_linear_ops.fp8_applies(torch.zeros(8, 128), w)  # float32 x: the fused kernel's
    assert not amx_linear_ops.fp8_applies(torch.zeros(8, 96).bfloat16(), torch.zeros(32, 96, dtype=torch.uint8))


def test_out_form_writes_what_the_op_returns():
    """`amx_fp8_linear_out` (what static decode plans call) fills a given tensor with exactly the op's
    result, whatever it held before, and refuses an out of another shape or dtype."""
    from fp8serve.kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    seed = fresh_seed()
    for with_bias in (False, True):
        x, w, scale, bias = make(7, 40, 128, with_bias, seed)
        out = torch.full((7, 40), float("nan")).bfloat16()
        ops.amx_fp8_linear_out(out, x, w, scale, bias)
        assert torch.equal(out, ops.amx_fp8_linear(x, w, scale, bias)), f"seed={seed}"
    with pytest.raises(RuntimeError, match="out must be a contiguous bf16 \\[7, 40\\] tensor"):
        ops.amx_fp8_linear_out(torch.empty(7, 40), x, w, scale, None)
