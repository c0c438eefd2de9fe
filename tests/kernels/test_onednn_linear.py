"""`onednn_linear` (float32 GEMM through oneDNN) against a float64 reference on
fresh random data, where it runs, and that the layers route their large
float32 calls through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiny_layers import tiny_bf16_model

from fp8serve.kernels import onednn_linear
from fp8serve.utils import weight_copies

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
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_matches_float64(seed, shape, k, n, with_bias, packed):
    """The plain weight, and the weight packed once (`pack_weight`)."""
    if packed and not onednn_linear.packing_available(torch.float32):
        pytest.skip("this torch cannot pack float32 weights for oneDNN")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.1
    bias = torch.randn(n, generator=g) if with_bias else None
    if packed:
        wp = onednn_linear.pack_weight(w)
        assert wp.is_mkldnn and wp.dtype == torch.float32
        out = onednn_linear.linear(x, w, bias, packed=wp)
    else:
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_is_available_per_dtype_says_whether_the_op_runs(seed, dtype):
    """oneDNN has no bf16 inner product on a CPU without AVX-512 (an AVX2-only
    Zen 3 refuses to create the primitive): `is_available(dtype)` must say so
    rather than let a caller crash, and where it says yes the op must give
    F.linear's result; packing a dtype needs the op for it."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(5, 24, generator=g).to(dtype), torch.randn(7, 24, generator=g).to(dtype)
    if onednn_linear.is_available(dtype):
        out = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        torch.testing.assert_close(out.float(), F.linear(x, w).float(), rtol=2 ** -7, atol=1e-3)
    else:
        assert not onednn_linear.packing_available(dtype)
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            with pytest.raises(RuntimeError):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


# ------------------------------------------------------------------ packed weights
needs_packing = pytest.mark.skipif(not onednn_linear.packing_available(),
                                   reason="this torch cannot pack bf16 weights for oneDNN")


@needs_packing
@pytest.mark.parametrize("shape", [(1,), (16,), (65,), (3, 41)])  # leading dims of x
@pytest.mark.parametrize("k,n", [(576, 960), (37, 167), (1536, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_matches_float64_and_f_linear(seed, shape, k, n, with_bias):
    """bf16 inputs, float32 sums, a bf16 result: within one bf16 rounding of
    the result (2^-8 relative) plus the float32 sum bound of the exact
    products of bf16 inputs; and as close to F.linear (same inputs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    packed = onednn_linear.pack_weight(w)
    assert packed.is_mkldnn and packed.shape == w.shape
    out = onednn_linear.linear(x, w, bias, packed=packed)
    assert out.shape == (*shape, n) and out.dtype == torch.bfloat16
    ref = x.double() @ w.double().t() + (bias.double() if with_bias else 0)
    scale = x.double().abs() @ w.double().abs().t() + (bias.double().abs() if with_bias else 0)
    bound = 2.0**-8 * ref.abs() + (k + 2) * 2.0**-24 * scale + 2.0**-133
    assert bool(((out.double() - ref).abs() <= bound).all()), f"seed={seed}"
    plain = F.linear(x, w, bias)
    assert bool(((out.double() - plain.double()).abs() <= 2 * bound).all()), f"seed={seed}"


@needs_packing
def test_packed_weight_is_used_only_for_inputs_of_its_dtype(seed):
    """A float32 call on a layer holding a packed bf16 copy takes the plain
    path: the weight upcast a slice at a time, as without the copy."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 40, generator=g).bfloat16()
    x = torch.randn(3, 40, generator=g)
    got = onednn_linear.linear(x, w, packed=onednn_linear.pack_weight(w))
    assert got.dtype == torch.float32
    assert torch.equal(got, onednn_linear.linear(x, w)), f"seed={seed}"
    # float32 products and sums of 40 terms (each within 2^-24 of its value), against float64.
    ref = x.double() @ w.double().t()
    bound = (40 + 2) * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    assert bool(((got.double() - ref).abs() <= bound).all()), f"seed={seed}"


def test_pack_weight_rejects_bad_input():
    with pytest.raises(ValueError, match="2-D bf16 or float32 CPU weight, got torch.float16"):
        onednn_linear.pack_weight(torch.ones(3, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"got torch.bfloat16 \(8,\)"):
        onednn_linear.pack_weight(torch.ones(8, dtype=torch.bfloat16))


@needs_packing
@pytest.mark.parametrize("setting, packs", [("1", True), ("0", False), ("off", False)])
def test_pack_weights_follows_the_environment(monkeypatch, setting, packs):
    monkeypatch.setenv(onednn_linear.PACKED_WEIGHTS_ENV, setting)
    model = tiny_bf16_model()
    packed = onednn_linear.pack_weights(model, torch.bfloat16)
    if not packs:
        assert packed == 0 and model.qkv.weight_packed is None and model.head.weight_packed is None
        return
    # bf16 layers only; the tied head and its embedding counted once.
    assert packed == model.qkv.weight.nbytes + model.embed.weight.nbytes
    assert model.qkv.weight_packed.is_mkldnn and model.f32.weight_packed is None
    assert model.head.weight_packed.is_mkldnn and model.head.weight is model.embed.weight
    x = torch.randn(40, 32).bfloat16()
    torch.testing.assert_close(model.qkv(x).float(), F.linear(x, model.qkv.weight).float(), rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(model.head(x), F.linear(x, model.embed.weight).float(), rtol=2**-7, atol=1e-2)


@needs_packing
def test_float32_compute_packs_only_float32_weights(monkeypatch):
    """A float32 model may keep a bf16 LM head (FP8 checkpoints): its float32
    activations never read a packed bf16 copy, so none is made; float32
    weights are packed and used."""
    if not onednn_linear.packing_available(torch.float32):
        pytest.skip("this torch cannot pack float32 weights for oneDNN")
    monkeypatch.setenv(onednn_linear.PACKED_WEIGHTS_ENV, "1")
    model = tiny_bf16_model()
    assert onednn_linear.pack_weights(model, torch.float32) == model.f32.weight.nbytes
    assert model.qkv.weight_packed is None and model.head.weight_packed is None
    assert model.f32.weight_packed.is_mkldnn and model.f32.weight_packed.dtype == torch.float32
    x = torch.randn(40, 32)
    out = model.f32(x)
    ref = x.double() @ model.f32.weight.double().t()
    assert _float32_sum_error(out, x, model.f32.weight, None, ref) <= 1.0
    assert onednn_linear.pack_weights(tiny_bf16_model(), torch.float16) == 0  # not a packable dtype


def test_pack_weights_auto_is_every_dtype_on_amd_without_amx_else_16_bit_under_float32_and_bf16_on_amx(monkeypatch):
    from fp8serve.kernels import amx_linear_ops

    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    monkeypatch.delenv(onednn_linear.PACKED_WEIGHTS_ENV, raising=False)
    for amd, amx, everything in ((True, False, True), (True, True, False), (False, False, False),
                                 (False, True, False)):
        monkeypatch.setattr(onednn_linear, "is_amd_cpu", lambda amd=amd: amd)
        monkeypatch.setattr(amx_linear_ops, "is_available", lambda amx=amx: amx)
        expected = (bf16,) if everything or amx else ()  # with AMX: bf16 calls of up to 256 rows
        assert onednn_linear._weight_dtypes_to_pack(bf16, ()) == expected, (amd, amx)
        expected = (f32, bf16) if everything else (bf16,)
        assert onednn_linear._weight_dtypes_to_pack(f32, (bf16,)) == expected, (amd, amx)
        assert onednn_linear._weight_dtypes_to_pack(f32, ()) == ((f32,) if everything else ()), (amd, amx)
    for setting, expected in (("0", ()), ("1", (f32, f16))):
        monkeypatch.setenv(onednn_linear.PACKED_WEIGHTS_ENV, setting)
        assert onednn_linear._weight_dtypes_to_pack(f32, (f16,)) == expected


@needs_onednn
@pytest.mark.parametrize("amx", [True, False])
def test_intel_packs_16_bit_weights_under_float32_and_bf16_with_amx_by_default(monkeypatch, seed, amx):
    """Without the setting, on an Intel CPU: a float32 engine's 16-bit weights
    (held narrow) get float32 packed copies, its float32 weights none; a bf16
    engine's weights get bf16 copies where the CPU has AMX."""
    if not onednn_linear.packing_available(torch.float32):
        pytest.skip("this torch cannot pack float32 weights for oneDNN")
    from fp8serve.kernels import amx_linear_ops
    from fp8serve.layers.linear import Linear

    monkeypatch.delenv(onednn_linear.PACKED_WEIGHTS_ENV, raising=False)
    monkeypatch.setattr(onednn_linear, "is_amd_cpu", lambda: False)
    monkeypatch.setattr(amx_linear_ops, "is_available", lambda: amx)
    model = tiny_bf16_model()
    assert onednn_linear.pack_weights(model, torch.float32) == 0 and model.f32.weight_packed is None
    if amx and onednn_linear.packing_available(torch.bfloat16):
        assert onednn_linear.pack_weights(model, torch.bfloat16) == model.qkv.weight.nbytes + model.head.weight.nbytes
        assert model.qkv.weight_packed.dtype == torch.bfloat16
    else:
        assert onednn_linear.pack_weights(model, torch.bfloat16) == 0 and model.qkv.weight_packed is None
    g = torch.Generator().manual_seed(seed)
    layer = Linear(64, 40, params_dtype=torch.float32)
    layer.weight = torch.nn.Parameter((torch.randn(40, 64, generator=g) * 0.1).to(torch.bfloat16),
                                      requires_grad=False)
    assert onednn_linear.pack_weights(torch.nn.Sequential(layer), torch.float32, widen=(torch.bfloat16,)) == 40 * 64 * 4
    assert layer.weight_packed is not None and layer.weight_packed.dtype == torch.float32


@needs_onednn
@pytest.mark.parametrize("amx", [True, False])
def test_packed_bf16_serves_up_to_256_rows_with_amx(monkeypatch, seed, amx):
    """With AMX a packed bf16 copy serves calls of up to AMX_BF16_PACKED_MAX_ROWS
    rows (the packed GEMM's bits) and F.linear on the plain weight the rest;
    without AMX the copy serves every call. A float32 copy of a 16-bit weight
    serves every call either way."""
    if not onednn_linear.packing_available(torch.bfloat16):
        pytest.skip("this torch cannot pack bf16 weights for oneDNN")
    monkeypatch.setattr(onednn_linear, "_amx_linear_available", lambda: amx)
    limit = onednn_linear.AMX_BF16_PACKED_MAX_ROWS
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    bias = torch.randn(96, generator=g).bfloat16()
    packed = onednn_linear.pack_weight(w)
    for shape in ((limit, 64), (limit + 1, 64), (2, (limit + 1) // 2, 64), (3, 64)):
        x = torch.randn(*shape, generator=g).bfloat16()
        rows = x.numel() // 64
        out = onednn_linear.linear(x, w, bias, packed=packed)
        by_packed = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        expected = by_packed if (rows <= limit or not amx) else F.linear(x, w, bias)
        assert torch.equal(out, expected), (shape, amx)
        ref = x.double() @ w.double().t() + bias.double()
        torch.testing.assert_close(out.double(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())
    wide = onednn_linear.pack_weight(w.float())
    x = torch.randn(limit + 5, 64, generator=g)
    assert torch.equal(onednn_linear.linear(x, w, packed=wide),
                       torch.ops.mkldnn._linear_pointwise(x, wide, None, "none", [], ""))


def test_row_breakpoints_include_the_packed_bf16_limit():
    """Both linear methods that can reach `onednn_linear.linear` with a packed
    copy list the row count where its choice changes (prefill recordings must
    not serve both sides of it)."""
    from fp8serve.layers.linear import Linear
    from fp8serve.quantization.fp8_linear import Fp8LinearMethod

    layer = Linear(64, 32, params_dtype=torch.bfloat16)
    assert onednn_linear.AMX_BF16_PACKED_MAX_ROWS + 1 in layer.quant_method.row_breakpoints(layer, torch.bfloat16)
    assert onednn_linear.AMX_BF16_PACKED_MAX_ROWS + 1 in Fp8LinearMethod.row_breakpoints(None, layer, torch.bfloat16)


def test_pack_weights_bad_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(onednn_linear.PACKED_WEIGHTS_ENV, "sometimes")
    from fp8serve.errors import ConfigError

    with pytest.raises(ConfigError, match="FP8SERVE_ONEDNN_PACKED_WEIGHTS='sometimes': expected auto, 1 or 0"):
        onednn_linear.pack_weights(tiny_bf16_model(), torch.bfloat16)


@needs_packing
def test_pack_weights_skips_when_the_copy_does_not_fit(monkeypatch, caplog):
    monkeypatch.setenv(onednn_linear.PACKED_WEIGHTS_ENV, "1")
    model = tiny_bf16_model()
    monkeypatch.setattr(weight_copies, "available_memory_bytes", lambda: 4 * model.embed.weight.nbytes)
    with caplog.at_level("INFO", logger="fp8serve.kernels.onednn_linear"):
        assert onednn_linear.pack_weights(model, torch.bfloat16) == 0
    assert model.qkv.weight_packed is None
    assert "oneDNN: bfloat16 weights not packed: the copy needs" in caplog.text


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(1,), (40,), (3, 17)])
def test_narrower_weight_without_packed_copy_is_upcast_exactly(seed, monkeypatch, shape, with_bias):
    """A bf16 weight under float32 activations with no packed copy: the same
    values as the GEMM on its float32 upcast (each output column's sum does
    not depend on which slice of rows it ran in), in slices of UPCAST_ROWS
    rows (lowered here so that the last slice is partial)."""
    monkeypatch.setattr(onednn_linear, "UPCAST_ROWS", 24)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, 96, generator=g)
    w = (torch.randn(61, 96, generator=g) * 0.1).to(torch.bfloat16)
    bias = torch.randn(61, generator=g) if with_bias else None
    out = onednn_linear.linear(x, w, bias)
    assert out.shape == (*shape, 61) and out.dtype == torch.float32
    ref = x.double() @ w.double().t() + (bias.double() if with_bias else 0)
    assert _float32_sum_error(out, x, w.float(), bias, ref) <= 1.0, f"seed={seed}"
    whole = onednn_linear.linear(x, w.float(), bias)
    torch.testing.assert_close(out, whole, rtol=0, atol=0)


@needs_onednn
def test_pack_weights_widens_bf16_weights_when_asked(seed, monkeypatch):
    """`widen=(bf16,)` packs a float32 model's bf16 linear weights as float32
    (exact: the packed GEMM equals the one on the float32 upcast, bit for
    bit); without it they are left alone."""
    if not onednn_linear.packing_available(torch.float32):
        pytest.skip("this torch cannot pack float32 weights for oneDNN")
    from fp8serve.layers.linear import Linear

    monkeypatch.setenv(onednn_linear.PACKED_WEIGHTS_ENV, "1")
    g = torch.Generator().manual_seed(seed)
    layer = Linear(80, 48, params_dtype=torch.float32)
    layer.weight = torch.nn.Parameter((torch.randn(48, 80, generator=g) * 0.1).to(torch.bfloat16),
                                      requires_grad=False)
    model = torch.nn.Sequential(layer)
    assert onednn_linear.pack_weights(model, torch.float32) == 0 and layer.weight_packed is None
    assert onednn_linear.pack_weights(model, torch.float32, widen=(torch.bfloat16,)) == 48 * 80 * 4
    assert layer.weight_packed.dtype == torch.float32 and layer.weight.dtype == torch.bfloat16
    x = torch.randn(50, 80, generator=g)
    expected = onednn_linear.linear(x, layer.weight.float(), packed=onednn_linear.pack_weight(layer.weight.float()))
    torch.testing.assert_close(onednn_linear.linear(x, layer.weight, packed=layer.weight_packed), expected,
                               rtol=0, atol=0)
