"""The tiled FP8-weight GEMM (cpu/fp8_tiled_gemm.cpp) against a float64
reference, and where fp8_linear_ops sends float32 activations. Data is fresh
on every run; a failure prints its seed."""

from __future__ import annotations

import pytest
import torch

import gated_reference
from fp8_weight_cases import assert_close, fresh_seed, make_case, reference
from gated_reference import SAME_BITS_AS_TWO_STEPS
from thread_counts import at_one_and
from fp8serve.errors import ConfigError
from fp8serve.kernels import cpu_ops, fp8_linear_ops
from fp8serve.kernels.cpu_ops import load_cpu_ops
from fp8serve.quantization.fp8 import FP8_E4M3

ops = load_cpu_ops()
pytestmark = pytest.mark.skipif(
    ops is None or not hasattr(ops, "fp8_tiled_gemm_available") or not ops.fp8_tiled_gemm_available(),
    reason="fp8_tiled_gemm needs the C++ kernels built with AVX2, FMA and F16C")


# (M, N, K): M past and short of whole 6-row tiles and of a 144-row block,
# with last tiles of every height (1-3 rows take more accumulator sets, with
# k left over where K is not a multiple of their count); N a multiple of 16
# and not (a partial last panel, N < 16); K a multiple of 8 and not, K < 8,
# and K past one 640-column block (two and three blocks).
CASES = [(1, 16, 64), (6, 48, 8), (7, 37, 203), (25, 101, 200), (33, 5, 3), (145, 64, 96), (300, 19, 1037),
         (64, 130, 1300), (13, 1, 1), (14, 40, 101), (9, 16, 1300), (4, 17, 66)]


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
    one, many = at_one_and(threads, lambda: ops.fp8_tiled_gemm(x, w, scale, bias))
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


# The gated form (fp8_tiled_gemm_silu_and_mul): the two steps' bits where silu_and_mul runs its 8-lane loop
# (gated_reference.SAME_BITS_AS_TWO_STEPS), float64's answer everywhere.


def two_steps(x, w, scale, bias):
    return cpu_ops.silu_and_mul(ops.fp8_tiled_gemm(x, w, scale, bias))


def assert_gated_close(out, x, w, scale, bias, seed, what):
    """Against float64 silu(g) * u, with g and u's float32 error bounds (assert_close's) carried
    through."""
    gated_reference.assert_gated_close(out, *reference(x, w, scale, bias), seed, what)


# (M, d, K): d = n / 2 whole panels (the fused loop) up to the default model's 1536 (K = 576), past
# one block of packed rows (144 rows), K not a multiple of 8; K past one K block (640): two blocks,
# three with rows past a block of packed rows, three of odd size; d not a multiple of 16 (the two
# steps in the op).
GATED_CASES = [(1, 16, 8), (25, 32, 64), (7, 48, 203), (64, 1536, 576), (300, 64, 100), (30, 16, 700),
               (150, 48, 1500), (9, 32, 1283), (13, 24, 96), (5, 3, 8)]


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m, d, k", GATED_CASES)
def test_gated_form_is_the_gemm_then_silu_and_mul(m, d, k, with_bias):
    seed = fresh_seed()
    x, w, scale, bias = make_case(m, 2 * d, k, torch.float32, with_bias, seed)
    if bias is not None:
        bias[: d : 5] -= 100.0  # gates below -80: silu_and_mul's exact branch for their 8-lane groups
    out = ops.fp8_tiled_gemm_silu_and_mul(x, w, scale, bias)
    assert_gated_close(out, x, w, scale, bias, seed, f"M={m} d={d} K={k}")
    gated_reference.assert_two_steps_result(out, two_steps(x, w, scale, bias), seed, f"M={m} d={d} K={k}")


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("m, d, k", [(40, 256, 320), (200, 16, 320), (2, 48, 320), (40, 64, 1000)],
                         ids=["pairs-split", "rows-split", "few-of-both", "two-k-blocks"])
def test_gated_form_any_thread_count_gives_the_same_bits(m, d, k, threads):
    seed = fresh_seed()
    x, w, scale, bias = make_case(m, 2 * d, k, torch.float32, True, seed)
    one, many = at_one_and(threads, lambda: ops.fp8_tiled_gemm_silu_and_mul(x, w, scale, bias))
    assert torch.equal(one, many), f"seed={seed}: {threads} threads differ from one"


def test_gated_form_rejects_bad_inputs():
    x, w, scale = torch.randn(5, 16), torch.zeros(34, 16, dtype=torch.uint8), torch.ones(34)
    with pytest.raises(RuntimeError, match="w has 33 rows: a gate_up projection has an even number of rows"):
        ops.fp8_tiled_gemm_silu_and_mul(x, w[:33].contiguous(), scale[:33].contiguous(), None)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        ops.fp8_tiled_gemm_silu_and_mul(x.double(), w, scale, None)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 \\[N\\] tensor, N = 34"):
        ops.fp8_tiled_gemm_silu_and_mul(x, w, scale, torch.ones(32))
    assert ops.fp8_tiled_gemm_silu_and_mul(torch.randn(0, 16), w, scale, None).shape == (0, 17)


def fp8_gate_up_layer(d: int, k: int, with_bias: bool, seed: int):
    """A CPU MergedLinear [gate, up] loaded with e4m3 shards as an FP8 checkpoint's loader does,
    and its dequantized weight and bias."""
    from fp8serve.layers.linear import MergedLinear
    from fp8serve.quantization.fp8 import quantize_fp8
    from fp8serve.quantization.fp8_linear import Fp8Config

    gen = torch.Generator().manual_seed(seed)
    layer = MergedLinear(k, [d, d], bias=with_bias, quant_config=Fp8Config("dynamic", []),
                         prefix="model.layers.0.mlp.gate_up_proj", params_dtype=torch.float32,
                         shard_names=("gate", "up"))
    for shard in (0, 1):
        w = torch.randn(d, k, generator=gen) * 0.2
        scale = float(torch.tensor(float(w.abs().max()) / FP8_E4M3.max_finite, dtype=torch.float32))
        codes = quantize_fp8(w, scale, FP8_E4M3)
        layer.weight.weight_loader(layer.weight, codes.view(torch.float8_e4m3fn), shard)
        layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor(scale), shard)
        if with_bias:
            layer.bias.weight_loader(layer.bias, torch.randn(d, generator=gen), shard)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.fp8_backend == "cpu_kernel"
    return layer


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_an_fp8_mlp_gate_up_takes_the_gated_form_where_the_gemm_would_run(tiled_switch, monkeypatch, with_bias):
    """SiluAndMul.of_projection on an FP8 [gate, up] layer: float32 rows that fp8_linear sends to
    fp8_tiled_gemm (25 or more) run its gated form (the two steps' bits on AVX2 builds); 24 rows
    and bf16 rows run the layer and then the activation; with the tiled GEMM switched off, always
    the latter."""
    from fp8serve.layers.activation import SiluAndMul

    act = SiluAndMul()
    seed = fresh_seed()
    layer = fp8_gate_up_layer(32, 64, with_bias, seed)
    calls = []

    class CountingOps:
        """The real ops, with the gated form's calls counted."""

        def __getattr__(self, name):
            return getattr(ops, name)

        def fp8_tiled_gemm_silu_and_mul(self, x, w, s, b):
            calls.append(x.shape[0])
            return ops.fp8_tiled_gemm_silu_and_mul(x, w, s, b)

    monkeypatch.setattr(fp8_linear_ops, "load_cpu_ops", CountingOps)
    tiled_switch("1")
    for m in (24, 25, 300):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(seed + m))
        out = act.of_projection(layer, x)
        assert_gated_close(out, x, layer.weight, layer.weight_scale, layer.bias, seed, f"M={m}")
        if SAME_BITS_AS_TWO_STEPS:
            assert torch.equal(out, act(layer(x))), f"seed={seed} M={m}"
    assert calls == [25, 300]
    xb = torch.randn(40, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
    assert layer.quant_method.apply_silu_and_mul(layer, xb, layer.bias) is None
    tiled_switch("0")
    assert layer.quant_method.apply_silu_and_mul(layer, torch.randn(40, 64), layer.bias) is None
    assert calls == [25, 300]
