"""`dense_gemv` (float32 / bf16 weights, M <= 16 activation rows) against a
float64 reference on fresh random data, and where the layers use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8serve.kernels import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops.load_cpu_ops() is None, reason="C++ CPU kernels unavailable")


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 11, 16, 17, 27, 32])  # 11, 16: two activation tiles; 17-32: three or four
# 576, 96, 37, 8: vector bodies (multiples of 32 take bf16 dots), tails; 1024 and 2051: K in
# slices of 512 at 5+ rows (kKChunk), whole and with a short last slice.
@pytest.mark.parametrize("k", [2051, 1024, 576, 96, 37, 8])
@pytest.mark.parametrize("w_dtype,x_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("path", ["best", "fma"])  # best: AVX512-BF16 dots for bf16 x bf16 where built
def test_matches_float64(seed, m, k, w_dtype, x_dtype, with_bias, path):
    g = torch.Generator().manual_seed(seed)
    n = 167  # not a multiple of the 4-row weight tile; > 64 rows per thread: several weight row blocks
    w = (torch.randn(n, k, generator=g) * 0.1).to(w_dtype)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    bias = torch.randn(n, generator=g).to(x_dtype) if with_bias else None
    out = cpu_ops.dense_gemv(x, w, bias, path=path)
    assert out.shape == (m, n) and out.dtype == x_dtype
    ref = x.double() @ w.double().t() + (bias.double() if with_bias else 0)
    # float32 accumulation, then one rounding to x's dtype.
    tol = 1e-5 if x_dtype == torch.float32 else 2 ** -8  # float32: K-term float32 sums
    err = ((out.double() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
    assert err < tol, f"seed={seed}: {err:.2e}"


@pytest.mark.parametrize("m", [1, 3, 8, 16, 32])
@pytest.mark.parametrize("k", [576, 2051])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_rows_result_does_not_depend_on_the_other_rows(seed, m, k, w_dtype):
    """Each output is the same bit for bit whatever other weight rows share the
    call (the exact greedy head recomputes its candidates' logits that way:
    kernels/screened_argmax.py), with K in slices too."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(301, k, generator=g) * 0.1).to(w_dtype)
    x = torch.randn(m, k, generator=g)
    rows = torch.randperm(301, generator=g)[:7]
    full = cpu_ops.dense_gemv(x, w)
    assert torch.equal(cpu_ops.dense_gemv(x, w[rows].contiguous()), full[:, rows]), seed


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 32])
@pytest.mark.parametrize("k", [2051, 576, 37])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("walk", ["auto", "interleaved"])
def test_16bit_weights_give_their_float32_upcasts_result(seed, m, k, w_dtype, walk):
    """float32 x on 16-bit weights: the float32 loop on the converted values,
    bit for bit what the float32 upcast of the weight gives (the engine keeps
    16-bit checkpoints' weights at 16 bits on that: quantization/narrow_weights.py)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(131, k, generator=g) * 0.1).to(w_dtype)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(131, generator=g)
    assert torch.equal(cpu_ops.dense_gemv(x, w, bias, walk=walk), cpu_ops.dense_gemv(x, w.float(), bias, walk=walk)), seed


@pytest.mark.parametrize("m", [1, 2])  # the sequential walk takes 1-2 rows
@pytest.mark.parametrize("k", [576, 160, 40, 37, 8])  # two accumulator sets along k, then tails
@pytest.mark.parametrize("w_dtype,x_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
@pytest.mark.parametrize("path", ["best", "fma"])
@pytest.mark.parametrize("walk", ["interleaved", "sequential"])
def test_each_row_walk_matches_float64(seed, m, k, w_dtype, x_dtype, path, walk):
    """Both row walks on every CPU, whichever one `auto` picks here."""
    g = torch.Generator().manual_seed(seed)
    n = 163  # odd: interleaved leaves a remainder of weight rows
    w = (torch.randn(n, k, generator=g) * 0.1).to(w_dtype)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    bias = torch.randn(n, generator=g).to(x_dtype)
    out = cpu_ops.dense_gemv(x, w, bias, path=path, walk=walk)
    ref = x.double() @ w.double().t() + bias.double()
    tol = 1e-5 if x_dtype == torch.float32 else 2 ** -8
    err = ((out.double() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
    assert err < tol, f"seed={seed}: {err:.2e}"


def test_auto_walk_follows_the_cpu_vendor():
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    amd = "AuthenticAMD" in cpuinfo
    for m in (1, 2):
        assert cpu_ops.dense_gemv_auto_walk(m) == ("sequential" if amd else "interleaved")
    for m in (3, 8, 16):
        assert cpu_ops.dense_gemv_auto_walk(m) == "interleaved"


def test_bad_walks_are_refused():
    w = torch.randn(40, 64)
    with pytest.raises(ValueError, match="unknown walk 'rows'"):
        cpu_ops.dense_gemv(torch.randn(1, 64), w, walk="rows")
    with pytest.raises(ValueError, match="at most 2 rows, got 3"):
        cpu_ops.dense_gemv(torch.randn(3, 64), w, walk="sequential")
    with pytest.raises(RuntimeError, match="at most 2 rows, got 4"):  # the op checks too
        cpu_ops.load_cpu_ops().dense_gemv_walk(torch.randn(4, 64), w, None, True, 2)
    with pytest.raises(RuntimeError, match="walk must be 0, 1 or 2, got 7"):
        cpu_ops.load_cpu_ops().dense_gemv_walk(torch.randn(1, 64), w, None, True, 7)


def test_strided_x_rows_and_limits(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(40, 64, generator=g)
    wide = torch.randn(3, 100, generator=g)
    x = wide[:, 10:74]  # rows not contiguous in memory
    torch.testing.assert_close(cpu_ops.dense_gemv(x, w), F.linear(x.contiguous(), w), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="at most 32"):
        cpu_ops.dense_gemv(torch.randn(33, 64), w)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_ops.dense_gemv(torch.randn(1, 63), w)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_ops.dense_gemv(torch.randn(1, 40), w.t())
    with pytest.raises(ValueError, match="unknown path"):
        cpu_ops.dense_gemv(torch.randn(1, 64), w, path="amx")


def test_applies_only_where_measured_faster():
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    amd = "AuthenticAMD" in cpuinfo
    bf = torch.empty(16, 8, dtype=torch.bfloat16)
    f32 = torch.empty(16, 8)
    # Where it was measured faster (benchmarks/results/dense_gemv_2026-11-30.md):
    # bf16 x bf16 up to 8 rows; float32 weights up to 16, or 32 on AMD (dense_gemv_2026-11-30_stop20_zen4.md).
    f32_rows = 32 if amd else 16
    for m in (1, 2, 4, 8):
        assert cpu_ops.dense_gemv_applies(torch.empty(m, 8, dtype=torch.bfloat16), bf)
    for m in (1, 2, 4, 8, 12, 16, f32_rows):
        assert cpu_ops.dense_gemv_applies(torch.empty(m, 8), f32)
    # bf16 x bf16 where the build has AVX512-BF16 dot products: up to 12 rows with AMX (torch's GEMM
    # uses it), else 32 on AMD and 16 elsewhere; without the dot products 8.
    from fp8serve.kernels import amx_linear_ops

    if cpu_ops.load_cpu_ops().dense_gemv_has_bf16_dot():
        bf16_rows = 12 if amx_linear_ops.is_available() else 32 if amd else 16
    else:
        bf16_rows = 8
    assert cpu_ops.dense_gemv_applies(torch.empty(bf16_rows, 8, dtype=torch.bfloat16), bf)
    assert not cpu_ops.dense_gemv_applies(torch.empty(bf16_rows + 1, 8, dtype=torch.bfloat16), bf)
    assert not cpu_ops.dense_gemv_applies(torch.empty(33, 8, dtype=torch.bfloat16), bf)
    # float32 x on bf16 weights: the float32 loop, float32 weights' rows (the alternative is an upcast;
    # benchmarks/results/lm_head_2026-12-02_zen3.md).
    assert cpu_ops.dense_gemv_max_rows(torch.float32, torch.bfloat16) == f32_rows
    assert cpu_ops.dense_gemv_applies(torch.empty(f32_rows, 8), bf)
    assert not cpu_ops.dense_gemv_applies(torch.empty(f32_rows + 1, 8), bf)
    assert cpu_ops.dense_gemv_max_rows(torch.float32, torch.float16) == f32_rows  # fp16 weights likewise
    assert cpu_ops.dense_gemv_max_rows(torch.bfloat16, torch.float16) == 0
    assert cpu_ops.dense_gemv_max_rows(torch.bfloat16, torch.float32) == 0
    assert not cpu_ops.dense_gemv_applies(torch.empty(f32_rows + 1, 8), f32)
    assert not cpu_ops.dense_gemv_applies(torch.empty(0, 8), f32)
    assert not cpu_ops.dense_gemv_applies(torch.empty(4, 8), f32.t().contiguous().t())  # non-contiguous weight
    assert not cpu_ops.dense_gemv_applies(torch.empty(1, 8, dtype=torch.float16), torch.empty(16, 8, dtype=torch.float16))


def test_linear_layer_uses_it_at_batch_one(monkeypatch):
    """The unquantized linear method routes a bf16 single-row call through
    dense_gemv and a 64-row call through F.linear, with the same result."""
    from fp8serve.layers.linear import Linear

    layer = Linear(32, 24, params_dtype=torch.bfloat16)
    layer.weight.data.copy_(torch.randn(24, 32).bfloat16())
    calls = []
    real = cpu_ops.dense_gemv
    monkeypatch.setattr(cpu_ops, "dense_gemv", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(1, 32).bfloat16()
    out = layer(x)
    assert calls == [torch.Size([1, 32])]
    ref = F.linear(x.float(), layer.weight.float())
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=1e-2)
    layer(torch.randn(64, 32).bfloat16())
    assert len(calls) == 1


def test_bf16_dot_path_is_built_where_the_cpu_has_it():
    import os

    from fp8serve.utils.platform import cpu_flags

    ops = cpu_ops.load_cpu_ops()
    if os.environ.get("FP8SERVE_CPU_MARCH") or "avx512_bf16" not in cpu_flags():
        pytest.skip("not a native AVX512-BF16 build")
    assert ops.dense_gemv_has_bf16_dot()


@pytest.mark.parametrize("m", [1, 2, 5, 17])
@pytest.mark.parametrize("w_dtype,x_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_gemv_out_writes_what_dense_gemv_returns(seed, m, w_dtype, x_dtype, with_bias):
    """`dense_gemv_out` (what decode plans call) fills a given tensor with
    exactly dense_gemv's result, whatever it held before."""
    ops = cpu_ops.load_cpu_ops()
    g = torch.Generator().manual_seed(seed)
    for k in (576, 1024, 37):
        w = (torch.randn(167, k, generator=g) * 0.1).to(w_dtype)
        x = torch.randn(m, k, generator=g).to(x_dtype)
        bias = torch.randn(167, generator=g).to(x_dtype) if with_bias else None
        out = torch.full((m, 167), float("nan"), dtype=x_dtype)
        ops.dense_gemv_out(out, x, w, bias)
        assert torch.equal(out, ops.dense_gemv(x, w, bias)), f"seed={seed} k={k}"


def test_dense_gemv_out_rejects_a_wrong_output(seed):
    ops = cpu_ops.load_cpu_ops()
    x, w = torch.randn(3, 64), torch.randn(10, 64)
    for bad in (torch.empty(3, 11), torch.empty(3, 10, dtype=torch.bfloat16), torch.empty(10, 3).t()):
        with pytest.raises(RuntimeError, match=r"out must be a contiguous \[3, 10\] CPU tensor of x's dtype"):
            ops.dense_gemv_out(bad, x, w, None)
