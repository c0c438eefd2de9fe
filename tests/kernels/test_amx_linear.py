"""The AMX bf16 linear kernel (cpu/amx_linear.cpp) against a float64
reference and torch's F.linear: 1-64 rows, partial row blocks, weight row
counts that are not multiples of 16, strided activation rows, bias. Skipped
where the CPU, build or process has no AMX tiles. Fresh random data each run
(the seed is in every failure message)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8serve.kernels import amx_linear_ops


@pytest.fixture(scope="module", autouse=True)
def amx():
    if not amx_linear_ops.is_available():
        pytest.skip("no AMX tiles on this CPU / build / process")


def _bf16_close(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst error in units of the reference's bf16 spacing (2^-8 relative), with a floor for values near 0."""
    return ((out.double() - ref).abs() / (ref.abs() * 2**-8 + 1e-3)).max().item()


@pytest.mark.parametrize("m", [1, 7, 16, 17, 33, 50, 64])
@pytest.mark.parametrize("k,n", [(32, 16), (576, 960), (1536, 50), (64, 3000)])
def test_matches_float64_and_torch(seed, m, k, n):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(m, k + 64, generator=g).bfloat16()
    x = wide[:, 32:32 + k]  # rows strided as a view of a fused output is
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    out = amx_linear_ops.amx_linear(x, w, bias)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    ref = x.double() @ w.double().t() + bias.double()
    # One bf16 rounding of a float32 sum: within one spacing of the exact value.
    assert _bf16_close(out, ref) <= 1.0, f"seed={seed}"
    assert _bf16_close(out, F.linear(x, w, bias).double()) <= 2.0, f"seed={seed}: differs from torch's by > 1 ulp"


@pytest.mark.parametrize("m", [3, 4, 5, 16, 19, 20, 36])
def test_rows_packed_together_give_the_bits_of_rows_alone(seed, m):
    """Blocks of 4+ activation rows are packed by a register transpose, smaller ones by scatters
    (transpose16.h): a row's output must not depend on which (nor on its neighbours)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 1536, generator=g).bfloat16()
    w = (torch.randn(80, 1536, generator=g) * 0.05).bfloat16()
    together = amx_linear_ops.amx_linear(x, w)
    alone = torch.cat([amx_linear_ops.amx_linear(x[i:i + 1], w) for i in range(m)])
    assert torch.equal(together, alone), f"seed={seed} m={m}"


def test_without_bias_and_with_float32_bias(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 96, generator=g).bfloat16()
    w = torch.randn(40, 96, generator=g).bfloat16()
    b32 = torch.randn(40, generator=g)
    ref = x.double() @ w.double().t()
    assert _bf16_close(amx_linear_ops.amx_linear(x, w), ref) <= 1.0, f"seed={seed}"
    assert _bf16_close(amx_linear_ops.amx_linear(x, w, b32), ref + b32.double()) <= 1.0, f"seed={seed}"


def test_rejects_what_it_cannot_run():
    x = torch.randn(4, 64).bfloat16()
    w = torch.randn(16, 64).bfloat16()
    with pytest.raises(RuntimeError, match="1 to 64 rows"):
        amx_linear_ops.amx_linear(torch.randn(65, 64).bfloat16(), w)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        amx_linear_ops.amx_linear(torch.randn(4, 48).bfloat16(), torch.randn(16, 48).bfloat16())
    with pytest.raises(RuntimeError, match="bf16"):
        amx_linear_ops.amx_linear(x.float(), w)
    with pytest.raises(RuntimeError, match="columns"):
        amx_linear_ops.amx_linear(x, torch.randn(16, 32).bfloat16())


def test_linear_layers_use_it_for_8_to_64_bf16_rows(seed, monkeypatch):
    from fp8serve.quantization.unquantized import UnquantizedLinearMethod

    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(64, 128, generator=g) * 0.1).bfloat16(), requires_grad=False)
    # What a LinearBase holds besides its weight: no packed copies (65 rows ask for them).
    layer.register_buffer("weight_gemv_packed", None, persistent=False)
    layer.register_buffer("weight_packed", None, persistent=False)
    calls = []
    real = amx_linear_ops.amx_linear
    monkeypatch.setattr(amx_linear_ops, "amx_linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for m in (4, 8, 64, 65):
        x = torch.randn(m, 128, generator=g).bfloat16()
        out = UnquantizedLinearMethod().apply(layer, x, None)
        assert _bf16_close(out, x.double() @ layer.weight.double().t()) <= 1.0, f"seed={seed} m={m}"
    assert calls == [8, 64]


def test_linear_layers_with_a_packed_copy_use_it_for_8_to_32_bf16_rows(seed, monkeypatch):
    """With oneDNN's packed bf16 copy (faster past 32 rows) amx_linear keeps 8-32
    rows and the packed GEMM takes 33 on; both within bf16 rounding of float64."""
    from fp8serve.kernels import onednn_linear
    from fp8serve.quantization.unquantized import UnquantizedLinearMethod

    if not onednn_linear.packing_available(torch.bfloat16):
        pytest.skip("this torch cannot pack bf16 weights for oneDNN")
    limit = amx_linear_ops.MAX_ROWS_WITH_PACKED
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(64, 128, generator=g) * 0.1).bfloat16(), requires_grad=False)
    layer.register_buffer("weight_gemv_packed", None, persistent=False)
    layer.register_buffer("weight_packed", onednn_linear.pack_weight(layer.weight), persistent=False)
    calls = []
    real = amx_linear_ops.amx_linear
    monkeypatch.setattr(amx_linear_ops, "amx_linear", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for m in (8, limit, limit + 1, 64):
        x = torch.randn(m, 128, generator=g).bfloat16()
        out = UnquantizedLinearMethod().apply(layer, x, None)
        assert _bf16_close(out, x.double() @ layer.weight.double().t()) <= 1.0, f"seed={seed} m={m}"
        if m > limit:
            assert torch.equal(out, torch.ops.mkldnn._linear_pointwise(x, layer.weight_packed, None, "none", [], ""))
    assert calls == [8, limit]
    assert limit + 1 in UnquantizedLinearMethod().row_breakpoints(layer, torch.bfloat16)
    # A float32 copy (of a 16-bit weight under float32 compute) leaves bf16 calls to amx_linear up to 64 rows.
    x = torch.randn(64, 128, generator=g).bfloat16()
    assert amx_linear_ops.applies(x, layer.weight, onednn_linear.pack_weight(layer.weight.float()))
    assert not amx_linear_ops.applies(x, layer.weight, layer.weight_packed)


@pytest.mark.parametrize("m", [8, 16, 17, 50, 64])
@pytest.mark.parametrize("n", [16, 37, 49152])
def test_float_out_is_the_bf16_result_widened(seed, m, n):
    """float_out (the LM head's logits) writes float32 in the kernel's pass,
    holding exactly what .float() of the bf16 result holds, bias or not,
    partial weight row blocks included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 576, generator=g).bfloat16()
    w = (torch.randn(n, 576, generator=g) * 0.05).bfloat16()
    for bias in (None, torch.randn(n, generator=g).bfloat16()):
        widened = amx_linear_ops.amx_linear(x, w, bias).float()
        out = amx_linear_ops.amx_linear(x, w, bias, float_out=True)
        assert out.dtype == torch.float32 and out.shape == (m, n)
        assert torch.equal(out, widened), f"seed={seed}"
