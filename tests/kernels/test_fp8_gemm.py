"""FP8-weight linear on CPU (cpu/fp8_gemm.cpp through fp8_linear_ops) against
a float64 reference: weights decoded with `dequantize_fp8`, matmul in float64.
Data is fresh on every run; a failure prints its seed."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from fp8_weight_cases import assert_close, fresh_seed, make_case, random_codes, reference
from fp8serve.kernels import fp8_linear_ops
from fp8serve.kernels.cpu_ops import load_cpu_ops
from fp8serve.quantization.fp8 import FP8_E4M3, dequantize_fp8

pytestmark = pytest.mark.skipif(not fp8_linear_ops.is_available(), reason="C++ CPU kernels unavailable")

ROWS = [1, 2, 7, 16, 33, 300]
# (N, K): odd N; K a multiple of 16, of 8 only, of neither; K past one column block.
SHAPES = [(37, 64), (101, 200), (19, 203), (9, 1037)]


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m", ROWS)
def test_fp8_linear_matches_float64_reference(m, with_bias, x_dtype):
    ops = load_cpu_ops()
    for n, k in SHAPES:
        seed = fresh_seed()
        x, w, scale, bias = make_case(m, n, k, x_dtype, with_bias, seed)
        what = f"M={m} N={n} K={k} {x_dtype} bias={with_bias}"
        # The engine's entry point, whichever way it picks for this M, and each way on its own.
        assert_close(fp8_linear_ops.fp8_linear(x, w, scale, bias), x, w, scale, bias, seed, f"auto {what}")
        assert_close(ops.fp8_linear(x, w, scale, bias), x, w, scale, bias, seed, f"fused {what}")
        # The 8-lane loops alone (AVX2-only CPUs; fp8_linear runs 16 lanes first on AVX-512 builds).
        assert_close(ops.fp8_linear_avx2(x, w, scale, bias), x, w, scale, bias, seed, f"fused AVX2 {what}")
        dq = fp8_linear_ops._dequantize_and_matmul(ops, x, w, scale, bias)
        assert_close(dq, x, w, scale, bias, seed, f"dequant+GEMM {what}")


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m", [1, 2])  # the sequential walk takes 1-2 rows
@pytest.mark.parametrize("wide", [True, False], ids=["wide", "avx2"])
@pytest.mark.parametrize("walk", ["interleaved", "sequential"])
def test_each_row_walk_matches_float64_reference(walk, wide, m, x_dtype):
    """Both row walks on every CPU, whichever one the engine's calls take here."""
    ops = load_cpu_ops()
    code = {"interleaved": 1, "sequential": 2}[walk]
    for n, k in SHAPES:
        seed = fresh_seed()
        x, w, scale, bias = make_case(m, n, k, x_dtype, True, seed)
        out = ops.fp8_linear_walk(x, w, scale, bias, wide, code)
        assert_close(out, x, w, scale, bias, seed, f"{walk} wide={wide} M={m} N={n} K={k} {x_dtype}")


def subnormal_codes(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Codes with a zero exponent field only (e4m3 subnormals and +-0)."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    return (codes & 0x07) | ((codes & 0x08) << 4)


@pytest.mark.parametrize("flush_denormal", [False, True], ids=["denormals", "flush_denormal"])
@pytest.mark.parametrize("m", [1, 2])
def test_sequential_walk_keeps_subnormal_codes_exact(m, flush_denormal):
    """The sequential walk decodes codes straight to float32 bits, where e4m3
    subnormals become float32 denormals: still exact, and with
    torch.set_flush_denormal(True) (DAZ/FTZ) it keeps to the F16C decode
    instead of reading them as zero."""
    ops = load_cpu_ops()
    if flush_denormal and not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for n, k in [(37, 64), (19, 203), (9, 1037)]:
            seed = fresh_seed()
            gen = torch.Generator().manual_seed(seed)
            x, _, scale, bias = make_case(m, n, k, torch.float32, True, seed)
            w = subnormal_codes(n, k, gen)
            out = ops.fp8_linear_walk(x, w, scale, bias, True, 2)
            assert_close(out, x, w, scale, bias, seed, f"subnormal codes M={m} N={n} K={k}")
            # Every code subnormal and x of one sign: a flushed decode would lose the whole dot product.
            x_pos = x.abs() + 0.5
            assert_close(ops.fp8_linear_walk(x_pos, w, scale, None, True, 2), x_pos, w, scale, None, seed,
                         f"subnormal codes, positive x, M={m} N={n} K={k}")
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("exponent", [-60, -20, 0, 40])
def test_sequential_walk_at_any_activation_scale(m, exponent):
    """The sequential walk's direct decode works in units of 2^-120 of a code,
    where small sums would be float32 denormals; it scales the activations by
    a power of two first, so tiny and large activations alike keep float32's
    relative accuracy."""
    ops = load_cpu_ops()
    for n, k in [(37, 64), (19, 203), (9, 1037)]:
        seed = fresh_seed()
        x, w, scale, _ = make_case(m, n, k, torch.float32, False, seed)
        x = x * 2.0**exponent
        out = ops.fp8_linear_walk(x, w, scale, None, True, 2)
        ref, magnitude = reference(x, w, scale, None)
        bound = 1e-5 * (magnitude + ref.abs())  # no absolute slack: it would hide a lost tiny result
        err = (out.double() - ref).abs()
        assert bool((err <= bound).all()), (
            f"seed={seed} M={m} N={n} K={k} x*2^{exponent}: worst error/bound {(err / bound).max():.3g}"
        )


def test_auto_walk_follows_the_cpu_vendor():
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    walk = 2 if "AuthenticAMD" in cpuinfo else 1
    ops = load_cpu_ops()
    assert [ops.fp8_linear_auto_walk(m) for m in (1, 2, 3, 8)] == [walk, walk, 1, 1]


def test_bad_walks_are_refused():
    ops = load_cpu_ops()
    x, w, scale, bias = make_case(3, 37, 64, torch.float32, False, 0)
    with pytest.raises(RuntimeError, match="at most 2 rows, got 3"):
        ops.fp8_linear_walk(x, w, scale, None, True, 2)
    with pytest.raises(RuntimeError, match="walk must be 0, 1 or 2, got 5"):
        ops.fp8_linear_walk(x[:1], w, scale, None, True, 5)


# 203 = 6 x 32 + 11: the 32-code loop and the scalar tail; 213 = 6 x 32 + 16 + 5
# also runs the 16-code loop after the 32-code one (AVX-512 builds).
@pytest.mark.parametrize("k", [203, 213])
def test_fp8_dequantize_is_exact_in_float32(k):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    w = random_codes(45, k, gen)
    scale = torch.rand(45, generator=gen) + 0.5
    out = torch.empty(45, k)
    load_cpu_ops().fp8_dequantize(out, w, scale)
    # decoded value and scale are exact in float32; the product is rounded once.
    expected = (dequantize_fp8(w, 1.0, FP8_E4M3).double() * scale.double()[:, None]).float()
    assert torch.equal(out, expected), f"seed={seed}"
    # bf16 rows (vector body and scalar tail alike): that float32 value rounded once, to nearest even.
    out_bf16 = torch.empty(45, k, dtype=torch.bfloat16)
    load_cpu_ops().fp8_dequantize(out_bf16, w, scale)
    assert torch.equal(out_bf16, expected.to(torch.bfloat16)), f"seed={seed}"


def test_empty_batch():
    w = random_codes(5, 16, torch.Generator().manual_seed(0))
    out = fp8_linear_ops.fp8_linear(torch.empty(0, 16), w, torch.ones(5))
    assert out.shape == (0, 5)


@pytest.mark.parametrize("case", ["x_1d", "x_f16", "w_f32", "k_mismatch", "scale_per_shard", "scale_f64", "bias_len"])
def test_wrapper_rejects_bad_inputs(case):
    x, w, scale, bias = torch.randn(2, 16), random_codes(5, 16, torch.Generator().manual_seed(0)), torch.ones(5), None
    if case == "x_1d":
        x = x[0]
    elif case == "x_f16":
        x = x.half()
    elif case == "w_f32":
        w = w.float()
    elif case == "k_mismatch":
        x = torch.randn(2, 24)
    elif case == "scale_per_shard":
        scale = torch.ones(2)
    elif case == "scale_f64":
        scale = scale.double()
    elif case == "bias_len":
        bias = torch.zeros(4)
    with pytest.raises(ValueError):
        fp8_linear_ops.fp8_linear(x, w, scale, bias)


def test_kernel_rejects_non_contiguous_weight():
    w = random_codes(16, 10, torch.Generator().manual_seed(0)).t()  # [10, 16], strided
    with pytest.raises(RuntimeError, match="contiguous"):
        load_cpu_ops().fp8_linear(torch.randn(1, 16), w, torch.ones(10), None)


def _scalar_build():
    """fp8_gemm.cpp built for baseline x86-64 (no AVX2/FMA/F16C), registered
    under torch.ops.fp8serve_scalar: the path AVX2-less CPUs run."""
    from torch.utils.cpp_extension import load

    from fp8serve.default_model import cache_dir

    src = fp8_linear_ops.__file__.replace("fp8_linear_ops.py", "cpu/fp8_gemm.cpp")
    h = hashlib.sha256(open(src, "rb").read() + torch.__version__.encode()).hexdigest()[:16]
    build = cache_dir() / "kernels" / f"fp8_gemm_scalar_{h}"
    build.mkdir(parents=True, exist_ok=True)
    load(name="fp8serve_fp8_gemm_scalar", sources=[src], build_directory=str(build), is_python_module=False,
         extra_cflags=["-O2", "-DFP8SERVE_GEMM_NS=fp8serve_scalar"])
    return torch.ops.fp8serve_scalar


def test_scalar_fallback_matches_reference():
    ops = _scalar_build()
    assert not ops.fp8_gemm_has_avx2()
    for m in (1, 7, 16):
        for n, k in SHAPES[:3]:
            seed = fresh_seed()
            x, w, scale, bias = make_case(m, n, k, torch.float32, True, seed)
            assert_close(ops.fp8_linear(x, w, scale, bias), x, w, scale, bias, seed, f"scalar M={m} N={n} K={k}")
            out = torch.empty(n, k)
            ops.fp8_dequantize(out, w, scale)
            assert torch.equal(out, (dequantize_fp8(w, 1.0, FP8_E4M3).double() * scale.double()[:, None]).float())


def build_fp8_qkv(activation_scheme: str, params_dtype: torch.dtype, seed: int):
    """A fused q/k/v MergedLinear loaded shard by shard from an FP8 checkpoint
    whose shards have different weight scales; also returns the float64 weight
    and bias it stands for."""
    from fp8serve.layers.linear import MergedLinear
    from fp8serve.quantization.fp8 import quantize_fp8
    from fp8serve.quantization.fp8_linear import Fp8Config

    gen = torch.Generator().manual_seed(seed)
    hidden, sizes = 72, {"q": 48, "k": 24, "v": 24}
    layer = MergedLinear(hidden, list(sizes.values()), bias=True, quant_config=Fp8Config(activation_scheme, []),
                         prefix="model.layers.0.self_attn.qkv_proj", params_dtype=params_dtype,
                         shard_names=tuple(sizes))
    weights, biases = [], []
    for (shard, rows), magnitude in zip(sizes.items(), (0.02, 0.5, 3.0)):
        w = torch.randn(rows, hidden, generator=gen) * magnitude
        # A float32 number, as checkpoints store it.
        scale = float(torch.tensor(float(w.abs().max()) / FP8_E4M3.max_finite, dtype=torch.float32))
        codes = quantize_fp8(w, scale, FP8_E4M3)
        b = torch.randn(rows, generator=gen).to(params_dtype)
        layer.weight.weight_loader(layer.weight, codes.view(torch.float8_e4m3fn), shard)
        layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor(scale), shard)
        if activation_scheme == "static":
            layer.input_scale.weight_loader(layer.input_scale, torch.tensor(0.05), shard)
        layer.bias.weight_loader(layer.bias, b, shard)
        weights.append(dequantize_fp8(codes, 1.0, FP8_E4M3).double() * scale)
        biases.append(b.double())
    layer.quant_method.process_weights_after_loading(layer)
    return layer, torch.cat(weights), torch.cat(biases)


@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("activation_scheme", ["dynamic", "static"])
def test_fp8_merged_linear_with_per_shard_scales(activation_scheme, params_dtype):
    seed = fresh_seed()
    layer, w_ref, b_ref = build_fp8_qkv(activation_scheme, params_dtype, seed)
    # Weights stay one byte each; one scale per output row, per shard.
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == w_ref.shape
    assert layer.weight_scale.shape == (w_ref.shape[0],)
    assert len(set(layer.weight_scale.tolist())) == 3
    gen = torch.Generator().manual_seed(seed + 1)
    for m in (1, 5, 64):
        x = torch.randn(2, m, w_ref.shape[1], generator=gen).to(params_dtype)  # leading dims pass through
        out = layer(x)
        ref = x.double() @ w_ref.t() + b_ref  # static input_scale is not applied on CPU
        magnitude = x.double().abs() @ w_ref.abs().t() + b_ref.abs()
        rel = 1e-5 if params_dtype == torch.float32 else 2.0**-7
        err = (out.double() - ref).abs()
        assert out.dtype == params_dtype and out.shape == ref.shape
        assert bool((err <= rel * (magnitude + ref.abs()) + 1e-6).all()), f"seed={seed} M={m} max error {err.max():.3g}"


def test_fp8_linear_falls_back_to_dequantized_weights(monkeypatch):
    """Without the kernels the layer decodes weights at load, as before, and
    gives the same output."""
    seed = fresh_seed()
    layer, _, _ = build_fp8_qkv("dynamic", torch.float32, seed)
    monkeypatch.setattr(fp8_linear_ops, "is_available", lambda: False)
    fallback, w_ref, _ = build_fp8_qkv("dynamic", torch.float32, seed)
    assert fallback.weight.dtype == torch.float32
    assert torch.equal(fallback.weight, w_ref.float())
    x = torch.randn(3, w_ref.shape[1])
    torch.testing.assert_close(layer(x), fallback(x), rtol=1e-5, atol=1e-5, msg=f"seed={seed}")


def test_fp8_linear_rejects_nan_weight_codes():
    from fp8serve.errors import ConfigError
    from fp8serve.layers.linear import Linear
    from fp8serve.quantization.fp8_linear import Fp8Config

    layer = Linear(16, 4, quant_config=Fp8Config("dynamic", []), prefix="mlp.down_proj")
    codes = torch.zeros(4, 16, dtype=torch.uint8)
    codes[2, 3] = 0xFF
    layer.weight.weight_loader(layer.weight, codes.view(torch.float8_e4m3fn))
    layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor(1.0))
    with pytest.raises(ConfigError, match="NaN"):
        layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_dequantize_and_matmul_in_several_tiles(monkeypatch, x_dtype):
    """Weights taller than one dequantization tile (128 rows at the smallest
    tile budget): 300 rows go in tiles of 128, 128 and 44, each written into
    its columns of the [M, N] result."""
    monkeypatch.setattr(fp8_linear_ops, "_DEQUANT_BYTES", 1)
    assert fp8_linear_ops._dequant_rows(200, x_dtype) == 128
    seed = fresh_seed()
    x, w, scale, bias = make_case(40, 300, 200, x_dtype, True, seed)
    out = fp8_linear_ops._dequantize_and_matmul(load_cpu_ops(), x, w, scale, bias)
    assert_close(out, x, w, scale, bias, seed, f"3 tiles {x_dtype}")


@pytest.mark.parametrize("m", [1, 5, 40])
def test_fp8_linear_loaded_matches_checked_entry(m):
    """The layer's entry (no Python checks) gives the checked entry's result,
    and the C++ op still refuses what the checks would have refused."""
    seed = fresh_seed()
    x, w, scale, bias = make_case(m, 101, 200, torch.bfloat16, True, seed)
    assert torch.equal(fp8_linear_ops.fp8_linear_loaded(x, w, scale, bias), fp8_linear_ops.fp8_linear(x, w, scale, bias))
    with pytest.raises(RuntimeError, match="columns"):
        fp8_linear_ops.fp8_linear_loaded(x[:1, :100].contiguous(), w, scale)


def test_wide_loops_are_built_where_the_cpu_has_them():
    from fp8serve.utils.platform import cpu_flags

    if os.environ.get("FP8SERVE_CPU_MARCH") or not {"avx512f", "avx512bw"} <= cpu_flags():
        pytest.skip("not a native AVX-512 build")
    assert load_cpu_ops().fp8_gemm_has_avx512()


def _rows_by_dtype_as_now(monkeypatch):
    """fp8_linear_ops asks its row bounds once per process: ask again under a test's monkeypatches."""
    monkeypatch.setattr(fp8_linear_ops, "_fused_rows_by_dtype",
                        lambda: {dt: fp8_linear_ops.max_fused_rows(dt) for dt in (torch.float32, torch.bfloat16)})


@pytest.mark.skipif(not fp8_linear_ops.amx_linear_ops.fp8_is_available(),
                    reason="no AMX tiles or AVX512-VBMI in this build/CPU/process")
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_bf16_decode_batches_of_3_to_64_rows_run_amx_fp8_linear(monkeypatch, with_bias):
    """With the FP8 AMX kernel, bf16 batches of MIN_FP8_ROWS-64 rows run it on the codes (K a multiple
    of 64); fewer stay on the fused kernel, 65 go to dequantize + GEMM, and K = 96 (not a multiple of
    64) to the dequantize + amx_linear path. Results match float64 either way."""
    amx = fp8_linear_ops.amx_linear_ops
    calls = []
    real = amx.amx_fp8_linear

    def spy(x, w, scale, bias=None):
        calls.append((x.shape[0], w.shape[0], bias is not None))
        return real(x, w, scale, bias)

    monkeypatch.setattr(amx, "amx_fp8_linear", spy)
    lo = amx.MIN_FP8_ROWS
    assert fp8_linear_ops.max_fused_rows(torch.bfloat16) == lo - 1 and lo >= 2
    for m, k, expect in [(lo - 1, 192, False), (lo, 192, True), (13, 192, True), (64, 192, True), (65, 192, False),
                         (20, 96, False)]:
        seed = fresh_seed()
        x, w, scale, bias = make_case(m, 101, k, torch.bfloat16, with_bias, seed)
        calls.clear()
        assert_close(fp8_linear_ops.fp8_linear(x, w, scale, bias), x, w, scale, bias, seed, f"M={m} K={k}")
        assert calls == ([(m, 101, with_bias)] if expect else []), (m, k, calls)
        # A loaded layer's call takes the op directly (no Python checks): the same result.
        direct = fp8_linear_ops.fp8_linear_loaded(x, w, scale, bias)
        assert_close(direct, x, w, scale, bias, seed, f"loaded M={m} K={k}")
        if expect:
            assert torch.equal(direct, real(x, w, scale, bias)), f"seed={seed} M={m}"


@pytest.mark.skipif(not fp8_linear_ops.amx_linear_ops.is_available(), reason="no AMX tiles in this build/CPU/process")
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_bf16_decode_batches_of_13_to_64_rows_run_on_amx(monkeypatch, with_bias):
    """On AMX machines without the FP8 AMX kernel (no AVX512-VBMI) bf16 batches of 13-64 rows
    dequantize and multiply on the AMX kernel (one call per weight tile, bias passed to it); 12 rows
    stay on the fused kernel and 65 on torch's GEMM. Results match float64 either way."""
    amx = fp8_linear_ops.amx_linear_ops
    monkeypatch.setattr(amx, "fp8_is_available", lambda: False)
    _rows_by_dtype_as_now(monkeypatch)
    calls = []
    real = amx.amx_linear

    def spy(x, w, bias=None, **kw):
        calls.append((x.shape[0], w.shape[0], bias is not None))
        return real(x, w, bias, **kw)

    monkeypatch.setattr(amx, "amx_linear", spy)
    assert fp8_linear_ops.max_fused_rows(torch.bfloat16) == 12
    assert fp8_linear_ops.max_fused_rows(torch.float32) == 32
    for m, expect_amx in [(12, False), (13, True), (40, True), (64, True), (65, False)]:
        seed = fresh_seed()
        x, w, scale, bias = make_case(m, 101, 192, torch.bfloat16, with_bias, seed)
        calls.clear()
        for out in (fp8_linear_ops.fp8_linear(x, w, scale, bias), fp8_linear_ops.fp8_linear_loaded(x, w, scale, bias)):
            assert_close(out, x, w, scale, bias, seed, f"M={m}")
        assert calls == ([(m, 101, with_bias)] * 2 if expect_amx else []), (m, calls)
    # Several weight tiles: one AMX call each, the bias sliced to its columns.
    monkeypatch.setattr(fp8_linear_ops, "_DEQUANT_BYTES", 1)
    seed = fresh_seed()
    x, w, scale, bias = make_case(20, 300, 192, torch.bfloat16, with_bias, seed)
    calls.clear()
    assert_close(fp8_linear_ops.fp8_linear(x, w, scale, bias), x, w, scale, bias, seed, "3 AMX tiles")
    assert calls == [(20, 128, with_bias), (20, 128, with_bias), (20, 44, with_bias)]


def test_without_amx_bf16_keeps_the_fused_kernel_to_16_rows(monkeypatch):
    monkeypatch.setattr(fp8_linear_ops.amx_linear_ops, "is_available", lambda: False)
    monkeypatch.setattr(fp8_linear_ops.amx_linear_ops, "fp8_is_available", lambda: False)
    assert fp8_linear_ops.max_fused_rows(torch.bfloat16) == 16
    seed = fresh_seed()
    x, w, scale, bias = make_case(33, 37, 64, torch.bfloat16, True, seed)
    # applies() is false without AMX: the dequantized tile goes through torch's GEMM.
    assert_close(fp8_linear_ops._dequantize_and_matmul(load_cpu_ops(), x, w, scale, bias), x, w, scale, bias, seed,
                 "dequant+GEMM without AMX")


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m", [1, 2, 7, 33])
def test_fp8_linear_out_writes_what_fp8_linear_returns(m, with_bias, x_dtype):
    """`fp8_linear_out` (what decode plans call) fills a given tensor with
    exactly fp8_linear's result, whatever it held before."""
    ops = load_cpu_ops()
    for n, k in SHAPES:
        seed = fresh_seed()
        x, w, scale, bias = make_case(m, n, k, x_dtype, with_bias, seed)
        out = torch.full((m, n), float("nan"), dtype=x_dtype)
        ops.fp8_linear_out(out, x, w, scale, bias)
        assert torch.equal(out, ops.fp8_linear(x, w, scale, bias)), f"seed={seed} n={n} k={k}"


def test_fp8_linear_out_rejects_a_wrong_output():
    ops = load_cpu_ops()
    x, w, scale, _ = make_case(2, 37, 64, torch.float32, False, fresh_seed())
    for bad in (torch.empty(2, 36), torch.empty(2, 37, dtype=torch.bfloat16), torch.empty(37, 2).t()):
        with pytest.raises(RuntimeError, match=r"out must be a contiguous \[2, 37\] CPU tensor of x's dtype"):
            ops.fp8_linear_out(bad, x, w, scale, None)
