"""`onednn_linear` (float32 GEMM through oneDNN) against a float64 reference on
fresh random data, where it runs, and that the layers route their large
float32 calls through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8serve.kernels import onednn_linear

needs_onednn = pytest.mark.skipif(not onednn_linear.is_available(), reason="torch built without oneDNN")


def _float32_sum_error(out, x, w, bias, ref) -> float:
    """The largest error of `out` against float64 `ref`, as a fraction of the
    bound any float32 sum of the K + 1 products and bias meets, whatever its
    order: (K + 1) * 2^-24 * sum |x_k w_k| (+ |bias|), plus one rounding of the
    result. <= 1 for a float32 GEMM (oneDNN: ~0.002 here); bf16 inputs gave 5.4
    at K = 1536."""
    k = x.shape[-1]
    scale = x.double().abs() @ w.double().abs().t() + (bias.double().abs() if bias is not None else 0)
    bound = (k + 2) * 2.0 ** -24 * scale + 2.0 ** -149
    return ((out.double() - ref).abs() / bound).max().item()


@needs_onednn
@pytest.mark.parametrize("shape", [(1,), (33,), (129,), (3, 41)])  # leading dims of x
@pytest.mark.parametrize("k,n", [(576, 960), (37, 167), (1536, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64(seed, shape, k, n, with_bias):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.1
    bias = torch.randn(n, generator=g) if with_bias else None
    out = onednn_linear.onednn_linear(x, w, bias)
    assert out.shape == (*shape, n) and out.dtype == torch.float32
    ref = x.double() @ w.double().t() + (bias.double() if with_bias else 0)
    assert _float32_sum_error(out, x, w, bias, ref) <= 1.0, f"seed={seed}"


@needs_onednn
def test_non_contiguous_inputs_match_float64(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 96, generator=g).t()  # [96, 40] view with strides (1, 96)
    w = torch.randn(50, 40, generator=g)[::2]  # every other row
    out = onednn_linear.onednn_linear(x, w)
    assert _float32_sum_error(out, x, w, None, x.double() @ w.double().t()) <= 1.0, f"seed={seed}"


@needs_onednn
def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="float32.*bfloat16"):
        onednn_linear.onednn_linear(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(3, 8))
    with pytest.raises(ValueError, match=r"\[\.\.\., K\] and \[N, K\]"):
        onednn_linear.onednn_linear(torch.ones(2, 8), torch.ones(3, 9))
    with pytest.raises(ValueError, match="bias torch.float16"):
        onednn_linear.onednn_linear(torch.ones(2, 8), torch.ones(3, 8), torch.ones(3, dtype=torch.float16))


@pytest.mark.parametrize("amd", [True, False])
def test_applies_only_to_float32_on_amd(monkeypatch, amd):
    # Measured faster on an AMD Zen 4 (benchmarks/results/linear_backends_2026-11-30_zen4.md); Intel keeps F.linear.
    monkeypatch.setattr(onednn_linear, "is_amd_cpu", lambda: amd)
    f32 = torch.empty(16, 8)
    expected = amd and onednn_linear.is_available()
    assert onednn_linear.applies(torch.empty(64, 8), f32) == expected
    assert onednn_linear.applies(torch.empty(2, 5, 8), f32) == expected
    assert not onednn_linear.applies(torch.empty(64, 8, dtype=torch.bfloat16), f32.bfloat16())
    assert not onednn_linear.applies(torch.empty(64, 8), f32.bfloat16())
    assert not onednn_linear.applies(torch.empty(64, 8, dtype=torch.float16), f32.half())


@needs_onednn
@pytest.mark.parametrize("amd", [True, False])
def test_linear_routes_by_applies(monkeypatch, seed, amd):
    """`linear` gives oneDNN's result bit for bit where it applies, F.linear's elsewhere."""
    monkeypatch.setattr(onednn_linear, "is_amd_cpu", lambda: amd)
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(300, 576, generator=g), torch.randn(3072, 576, generator=g), torch.randn(3072, generator=g)
    expected = onednn_linear.onednn_linear(x, w, b) if amd else F.linear(x, w, b)
    assert torch.equal(onednn_linear.linear(x, w, b), expected)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(onednn_linear.linear(xb, wb), F.linear(xb, wb))  # bf16: F.linear in both cases


@needs_onednn
def test_linear_layer_uses_it_for_many_float32_rows(monkeypatch, seed):
    """The unquantized linear method sends a 64-row float32 call to
    `onednn_linear.linear` (a 1-row call goes to dense_gemv where built)."""
    from fp8serve.layers.linear import Linear

    monkeypatch.setattr(onednn_linear, "is_amd_cpu", lambda: True)
    g = torch.Generator().manual_seed(seed)
    layer = Linear(64, 48, params_dtype=torch.float32)
    layer.weight.data.copy_(torch.randn(48, 64, generator=g))
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(onednn_linear.torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(a[0].shape) or real(*a), raising=False)
    x = torch.randn(64, 64, generator=g)
    out = layer(x)
    assert calls == [torch.Size([64, 64])]
    ref = x.double() @ layer.weight.double().t()
    assert _float32_sum_error(out, x, layer.weight, None, ref) <= 1.0, f"seed={seed}"
