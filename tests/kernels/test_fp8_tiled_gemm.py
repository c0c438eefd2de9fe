"""The tiled FP8-weight GEMM (cpu/fp8_tiled_gemm.cpp) against a float64
reference, and where fp8_linear_ops sends float32 activations. Data is fresh
on every run; a failure prints its seed."""

from __future__ import annotations

import pytest
import torch

from fp8_weight_cases import assert_close, fresh_seed, make_case
from fp8serve.errors import ConfigError
from fp8serve.kernels import fp8_linear_ops
from fp8serve.kernels.cpu_ops import load_cpu_ops

ops = load_cpu_ops()
pytestmark = pytest.mark.skipif(
    ops is None or not hasattr(ops, "fp8_tiled_gemm_available") or not ops.fp8_tiled_gemm_available(),
    reason="fp8_tiled_gemm needs the C++ kernels built with AVX2, FMA and F16C")


# (M, N, K): M past and short of whole 6-row tiles and of a 144-row block;
# N a multiple of 16 and not (a partial last panel, N < 16); K a multiple of
# 8 and not, K < 8, and K past one 640-column block (two and three blocks).
CASES = [(1, 16, 64), (6, 48, 8), (7, 37, 203), (25, 101, 200), (33, 5, 3), (145, 64, 96), (300, 19, 1037),
         (64, 130, 1300), (13, 1, 1)]


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m, n, k", CASES)
def test_matches_float64_reference(m, n, k, with_bias):
    seed = fresh_seed()
    x, w, scale, bias = make_case(m, n, k, torch.float32, with_bias, seed)
    assert_close(ops.fp8_tiled_gemm(x, w, scale, bias), x, w, scale, bias, seed, f"M={m} N={n} K={k}")


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("m, n", [(200, 512), (500, 20), (2, 40)])  # panels split; rows split; few of both
def test_any_thread_count_gives_the_same_bits(m, n, threads):
    """Threads split the panels (wide N) or the row tiles (narrow N); each
    output's sums run in the same order either way."""
    seed = fresh_seed()
    x, w, scale, bias = make_case(m, n, 700, torch.float32, True, seed)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.fp8_tiled_gemm(x, w, scale, bias)
        torch.set_num_threads(threads)
        many = ops.fp8_tiled_gemm(x, w, scale, bias)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many), f"seed={seed}: {threads} threads differ from one"
    assert_close(many, x, w, scale, bias, seed, f"{threads} threads")


def test_empty_inputs():
    w = torch.zeros(24, 10, dtype=torch.uint8)
    assert ops.fp8_tiled_gemm(torch.randn(0, 10), w, torch.ones(24), None).shape == (0, 24)
    bias = torch.randn(24)
    out = ops.fp8_tiled_gemm(torch.randn(3, 0), torch.zeros(24, 0, dtype=torch.uint8), torch.ones(24), bias)
    assert torch.equal(out, bias.expand(3, 24))


@pytest.mark.parametrize("case, message", [
    ("x_bf16", "x must be a contiguous float32"),
    ("w_float", "w must be contiguous uint8"),
    ("k_mismatch", "K must match"),
    ("scale_short", "scale must be a contiguous float32 \\[N\\] tensor, N = 24"),
    ("bias_bf16", "bias must be a contiguous float32 \\[N\\] tensor"),
])
def test_rejects_bad_inputs(case, message):
    x, w, scale, bias = torch.randn(5, 16), torch.zeros(24, 16, dtype=torch.uint8), torch.ones(24), None
    if case == "x_bf16":
        x = x.bfloat16()
    elif case == "w_float":
        w = w.float()
    elif case == "k_mismatch":
        x = torch.randn(5, 17)
    elif case == "scale_short":
        scale = torch.ones(23)
    elif case == "bias_bf16":
        bias = torch.ones(24, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        ops.fp8_tiled_gemm(x, w, scale, bias)


@pytest.fixture
def tiled_switch(monkeypatch):
    """Set FP8SERVE_FP8_TILED_GEMM for one test (the choice is cached per process)."""
    def set_to(value: str) -> None:
        monkeypatch.setenv(fp8_linear_ops.TILED_GEMM_ENV, value)
        fp8_linear_ops.tiled_gemm_enabled.cache_clear()
        fp8_linear_ops._fused_rows_by_dtype.cache_clear()
    yield set_to
    monkeypatch.delenv(fp8_linear_ops.TILED_GEMM_ENV, raising=False)
    fp8_linear_ops.tiled_gemm_enabled.cache_clear()
    fp8_linear_ops._fused_rows_by_dtype.cache_clear()


def test_default_follows_the_build():
    """On by default where the build has no AVX-512 (oneDNN's 16-lane kernels
    are faster there); then the fused kernel keeps 24 rows instead of 32."""
    fp8_linear_ops.tiled_gemm_enabled.cache_clear()
    on = fp8_linear_ops.tiled_gemm_enabled()
    assert on == (not ops.fp8_gemm_has_avx512())
    assert fp8_linear_ops.max_fused_rows(torch.float32) == (24 if on else 32)


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_fp8_linear_routes_float32_rows_past_24_to_the_tiled_gemm(tiled_switch, with_bias):
    """With the switch on, 24 rows stay on the fused kernel and 25 or more run
    the tiled GEMM: its bits, and float64's answer. bf16 activations never do."""
    tiled_switch("1")
    assert fp8_linear_ops.max_fused_rows(torch.float32) == 24
    for m, tiled in [(24, False), (25, True), (300, True)]:
        seed = fresh_seed()
        x, w, scale, bias = make_case(m, 40, 96, torch.float32, with_bias, seed)
        for out in (fp8_linear_ops.fp8_linear(x, w, scale, bias), fp8_linear_ops.fp8_linear_loaded(x, w, scale, bias)):
            assert_close(out, x, w, scale, bias, seed, f"M={m}")
            if tiled:
                assert torch.equal(out, ops.fp8_tiled_gemm(x, w, scale, bias)), f"seed={seed} M={m}"
            else:
                assert torch.equal(out, ops.fp8_linear(x, w, scale, bias)), f"seed={seed} M={m}"
    seed = fresh_seed()
    x, w, scale, bias = make_case(40, 40, 96, torch.bfloat16, with_bias, seed)
    assert_close(fp8_linear_ops.fp8_linear(x, w, scale, bias), x, w, scale, bias, seed, "bf16 x, 40 rows")


def test_switched_off_keeps_dequantize_and_onednn(tiled_switch):
    tiled_switch("0")
    assert not fp8_linear_ops.tiled_gemm_enabled()
    assert fp8_linear_ops.max_fused_rows(torch.float32) == 32
    seed = fresh_seed()
    x, w, scale, bias = make_case(40, 40, 96, torch.float32, True, seed)
    out = fp8_linear_ops.fp8_linear(x, w, scale, bias)
    assert torch.equal(out, fp8_linear_ops._dequantize_and_matmul(ops, x, w, scale, bias))
    assert_close(out, x, w, scale, bias, seed, "switched off")


def test_bad_switch_value_is_a_clear_error(tiled_switch):
    tiled_switch("sometimes")
    with pytest.raises(ConfigError, match="FP8SERVE_FP8_TILED_GEMM='sometimes': expected auto, 1 or 0"):
        fp8_linear_ops.tiled_gemm_enabled()
