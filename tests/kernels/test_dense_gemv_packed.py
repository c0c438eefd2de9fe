"""`dense_gemv_packed` (bf16 decode GEMV on pair-interleaved 16-row blocks)
against a float64 reference on fresh random data, exactly on integer data,
and its input checks."""

from __future__ import annotations

import pytest
import torch
from gated_reference import record_rows

from fp8serve.kernels import cpu_ops
from fp8serve.kernels.gemv_packing import pack_gemv_weight

_ops = cpu_ops.load_cpu_ops()
pytestmark = pytest.mark.skipif(_ops is None or not bool(_ops.dense_gemv_has_packed()),
                                reason="dense_gemv_packed needs the C++ kernels built for AVX512-BF16")


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 13, 16, 24, 32, 61, 200])  # every tile height, 1-25 tiles
@pytest.mark.parametrize("n,k", [(167, 576), (16, 1536), (50, 64), (17, 6), (3, 2)])  # full/partial last blocks
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_matches_float64(seed, m, n, k, bias_dtype):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).to(bias_dtype) if bias_dtype is not None else None
    out = _ops.dense_gemv_packed(x, pack_gemv_weight(w), n, bias)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    xd, wd = x.double(), w.double()
    ref = xd @ wd.t() + (bias.double() if bias is not None else 0)
    # Products are exact in float32; the float32 sum along k (two products per
    # vdpbf16ps) and the bias add are at most k + 1 roundings of relative size
    # 2^-24 each on partial sums bounded by sum |x w| + |bias|; then one
    # rounding to bf16 (2^-8 relative).
    magnitude = xd.abs() @ wd.abs().t() + (bias.double().abs() if bias is not None else 0)
    sum_err = (k + 1) * 2.0**-24 * magnitude * (1 + 1e-6)
    bound = sum_err + 2.0**-8 * (ref.abs() + sum_err)
    excess = ((out.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"seed={seed}: error exceeds the bound by {excess:.3e}"


@pytest.mark.parametrize("m", [1, 4, 8, 11, 32, 70])
def test_exact_on_integer_data(seed, m):
    """Small integers: every product and partial sum is exact in float32 and
    the result (|y| < 256) exact in bf16, so any mixed-up row, pair or block
    shows as a wrong value."""
    g = torch.Generator().manual_seed(seed)
    n, k = 83, 40
    w = torch.randint(-3, 4, (n, k), generator=g).bfloat16()
    x = torch.randint(-2, 3, (m, k), generator=g).bfloat16()
    bias = torch.randint(-5, 6, (n,), generator=g).float()
    out = _ops.dense_gemv_packed(x, pack_gemv_weight(w), n, bias)
    ref = x.double() @ w.double().t() + bias.double()
    assert ref.abs().max() < 256
    assert torch.equal(out.double(), ref), f"seed={seed}"


def test_rounds_like_torch(seed):
    """The float32 sum is rounded to bf16 as torch rounds (nearest even), NaN
    stays NaN, and a single-term sum (K = 2 with one zero) is the product
    exactly: compare with torch's own float32 -> bf16 of the float64 result."""
    g = torch.Generator().manual_seed(seed)
    n = 48
    w = torch.zeros(n, 2)
    w[:, 0] = torch.randn(n, generator=g)
    x = torch.tensor([[1.0, 0.0], [float("nan"), 0.0]])
    out = _ops.dense_gemv_packed(x.bfloat16(), pack_gemv_weight(w.bfloat16()), n, None)
    assert torch.equal(out[0], w[:, 0].bfloat16())
    assert torch.isnan(out[1]).all()
    # A sum that needs rounding: 1 + 2^-8 + 2^-16 (ties and above) in float32, then bf16.
    w2 = torch.tensor([[1.0, 2.0**-8], [1.0, 2.0**-8 + 2.0**-15]] + [[0.0, 0.0]] * 14)
    x2 = torch.ones(1, 2)
    out2 = _ops.dense_gemv_packed(x2.bfloat16(), pack_gemv_weight(w2.bfloat16()), 16, None)
    expect = (x2.double() @ w2.bfloat16().double().t()).float().bfloat16()
    assert torch.equal(out2, expect)


@pytest.mark.parametrize("m", [1, 13, 40])
def test_float_out_is_the_bf16_result_widened(seed, m):
    """float_out returns float32 holding exactly the bf16-rounded results
    (what `.float()` of the bf16 output gives), the LM head's logits."""
    g = torch.Generator().manual_seed(seed)
    n, k = 83, 96
    w = pack_gemv_weight(torch.randn(n, k, generator=g).bfloat16())
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    out = cpu_ops.dense_gemv_packed(x, w, n, bias, float_out=True)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert torch.equal(out, cpu_ops.dense_gemv_packed(x, w, n, bias).float()), f"seed={seed}"


def test_rejects_bad_input():
    w = pack_gemv_weight(torch.randn(20, 8).bfloat16())
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a \\[M, K\\] bf16 CPU tensor"):
        _ops.dense_gemv_packed(x.float(), w, 20, None)
    with pytest.raises(RuntimeError, match="takes 1 to 512 rows, got 513"):
        _ops.dense_gemv_packed(torch.randn(513, 8).bfloat16(), w, 20, None)
    with pytest.raises(RuntimeError, match="K must be even, got 7"):
        _ops.dense_gemv_packed(torch.randn(2, 7).bfloat16(), w, 20, None)
    with pytest.raises(RuntimeError, match=r"w_packed must be a contiguous bf16 \[ceil\(N/16\), K/2, 16, 2\]"):
        _ops.dense_gemv_packed(torch.randn(2, 10).bfloat16(), w, 20, None)
    with pytest.raises(RuntimeError, match="n = 40 does not fit 2 blocks of 16 rows"):
        _ops.dense_gemv_packed(x, w, 40, None)
    with pytest.raises(RuntimeError, match="n = 16 does not fit 2 blocks"):
        _ops.dense_gemv_packed(x, w, 16, None)
    with pytest.raises(RuntimeError, match=r"bias must be \[20\]"):
        _ops.dense_gemv_packed(x, w, 20, torch.zeros(16))


def test_applies_to_bf16_batches_of_13_to_256_rows():
    packed = pack_gemv_weight(torch.randn(40, 64).bfloat16())
    for m, wanted in ((1, False), (12, False), (13, True), (64, True), (256, True), (257, False)):
        assert cpu_ops.dense_gemv_packed_applies(torch.randn(m, 64).bfloat16(), packed) is wanted, m
    assert not cpu_ops.dense_gemv_packed_applies(torch.randn(20, 64), packed)  # float32 x
    assert not cpu_ops.dense_gemv_packed_applies(torch.randn(2, 10, 64).bfloat16(), packed)  # not [M, K]
    assert not cpu_ops.dense_gemv_packed_applies(torch.randn(20, 64).bfloat16(), None)  # no packed copy
    # The LM head's threshold: from one row.
    assert cpu_ops.dense_gemv_packed_applies(torch.randn(1, 64).bfloat16(), packed, cpu_ops.LM_HEAD_PACKED_MIN_ROWS)



# ------------------------------------------------------------- the gated form
@pytest.mark.parametrize("m", [1, 3, 8, 9, 13, 16, 24, 61, 200])  # every tile height, 1-25 tiles
@pytest.mark.parametrize("d,k", [(16, 6), (48, 64), (80, 576), (1536, 576)])  # 1, 3, 5 and 96 gate blocks
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_gated_form_has_the_two_steps_bits(seed, m, d, k, bias_dtype):
    """dense_gemv_packed_silu_and_mul == silu_and_mul(dense_gemv_packed(...)) bit for bit: the gate
    and up rounded to bf16 as the projection stores them, silu from the same table, the product
    rounded as silu_and_mul rounds it. Gates with a spread of ~8 (silu's negative tail and its
    near-identity range), ups of both signs."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(2 * d, k, generator=g) / k**0.5
    w[:d] *= 8  # gates several times larger than the ups
    w = w.bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(2 * d, generator=g).to(bias_dtype) if bias_dtype is not None else None
    packed = pack_gemv_weight(w)
    out = _ops.dense_gemv_packed_silu_and_mul(x, packed, 2 * d, bias)
    proj = _ops.dense_gemv_packed(x, packed, 2 * d, bias)
    two_steps = torch.empty(m, d, dtype=torch.bfloat16)
    _ops.silu_and_mul(two_steps, proj)
    assert out.shape == (m, d) and out.dtype == torch.bfloat16
    assert torch.equal(out, two_steps), f"seed={seed}: {(out.float() - two_steps.float()).abs().max().item():.3g}"
    gate = proj[:, :d].float()
    if m * d >= 64:
        assert (gate < -4).any() and (gate > 4).any(), "the gates should reach both of silu's regimes"


def test_gated_form_on_integer_data_is_exact(seed):
    """Small integers: gate and up exact in bf16, so out = bf16(bf16(silu(g)) * u) from float64:
    a gate paired with another row's up, or a block read from the wrong half, shows."""
    g = torch.Generator().manual_seed(seed)
    d, k, m = 32, 24, 11
    w = torch.randint(-2, 3, (2 * d, k), generator=g).bfloat16()
    x = torch.randint(-2, 3, (m, k), generator=g).bfloat16()
    out = _ops.dense_gemv_packed_silu_and_mul(x, pack_gemv_weight(w), 2 * d, None)
    ref = x.double() @ w.double().t()
    gate, up = ref[:, :d], ref[:, d:]
    silu = (gate * torch.sigmoid(gate)).float().bfloat16().double()
    assert torch.equal(out, (silu * up).float().bfloat16()), f"seed={seed}"


def test_gated_form_rejects_a_half_that_is_not_whole_blocks():
    w = pack_gemv_weight(torch.randn(48, 8).bfloat16())  # d = 24
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="takes n = 2d with d a multiple of 16, got n = 48"):
        _ops.dense_gemv_packed_silu_and_mul(x, w, 48, None)
    w64 = pack_gemv_weight(torch.randn(64, 8).bfloat16())
    with pytest.raises(RuntimeError, match=r"bias must be \[64\]"):
        _ops.dense_gemv_packed_silu_and_mul(x, w64, 64, torch.zeros(32))
    with pytest.raises(RuntimeError, match="x must be a \\[M, K\\] bf16 CPU tensor"):
        _ops.dense_gemv_packed_silu_and_mul(x.float(), w64, 64, None)


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_an_mlp_gate_up_takes_the_gated_form_where_the_gemv_would_run(monkeypatch, seed, with_bias):
    """SiluAndMul.of_projection on a bf16 [gate, up] layer with the packed copy under bf16
    compute: rows that dense_gemv_packed serves run its gated form with the two steps' bits;
    fewer rows, and a layer whose halves are not whole blocks, the layer and then the activation."""
    from fp8serve.kernels import gemv_packing
    from fp8serve.layers.activation import SiluAndMul
    from fp8serve.layers.linear import MergedLinear

    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    g = torch.Generator().manual_seed(seed)

    def layer_of(d, k):
        layer = MergedLinear(k, [d, d], bias=with_bias, params_dtype=torch.bfloat16)
        layer.weight = torch.nn.Parameter((torch.randn(2 * d, k, generator=g) / k**0.5).bfloat16(),
                                          requires_grad=False)
        if with_bias:
            layer.bias = torch.nn.Parameter(torch.randn(2 * d, generator=g).bfloat16(), requires_grad=False)
        return layer

    act = SiluAndMul()
    whole, partial = layer_of(48, 64), layer_of(24, 64)
    assert gemv_packing.pack_gemv_weights(torch.nn.Sequential(whole, partial), torch.bfloat16) > 0
    assert whole.weight_gemv_packed is not None and partial.weight_gemv_packed is not None
    calls = record_rows(monkeypatch, cpu_ops, "dense_gemv_packed_silu_and_mul")
    lo = cpu_ops.GEMV_PACKED_MIN_ROWS
    for m in (lo - 1, lo, 100):
        x = torch.randn(m, 64, generator=g).bfloat16()
        assert torch.equal(act.of_projection(whole, x), act(whole(x))), f"seed={seed} M={m}"
        assert torch.equal(act.of_projection(partial, x), act(partial(x))), f"seed={seed} M={m}"
    assert calls == [lo, 100]


# ---------------------------------------------------------------- FP8 weights
_fp8 = pytest.mark.skipif(_ops is None or not bool(_ops.fp8_gemv_has_packed()),
                          reason="fp8_gemv_packed needs the C++ kernels built for AVX512-BF16 and AVX512-VBMI")


def _random_codes(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Every e4m3 code but the two NaNs (0x7F, 0xFF), subnormals and zeros included."""
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int64).to(torch.uint8)
    return torch.where((codes & 0x7F) == 0x7F, torch.zeros_like(codes), codes)


@_fp8
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16, 33, 100])
@pytest.mark.parametrize("n,k", [(167, 576), (16, 1536), (35, 8), (1, 4)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_matches_float64(seed, m, n, k, with_bias):
    from fp8serve.kernels.gemv_packing import pack_fp8_gemv_weight
    from fp8serve.quantization.fp8 import FP8_E4M3, dequantize_fp8

    g = torch.Generator().manual_seed(seed)
    codes = _random_codes(n, k, g)
    scale = torch.rand(n, generator=g) * 0.02 + 1e-3
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g) if with_bias else None
    packed, packed_scale = pack_fp8_gemv_weight(codes, scale)
    out = cpu_ops.fp8_gemv_packed(x, packed, packed_scale, n, bias)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    w = dequantize_fp8(codes, 1.0, FP8_E4M3, torch.float64)  # the codes' values, exact
    xd, sd = x.double(), scale.double()
    ref = (xd @ w.t()) * sd + (bias.double() if with_bias else 0)
    # The decode is exact and products exact in float32: k roundings of the
    # float32 sum (bounded by sum |x w|), one of the scale product, one of the
    # bias add, then the bf16 rounding.
    magnitude = (xd.abs() @ w.abs().t()) * sd + (bias.double().abs() if with_bias else 0)
    sum_err = (k + 2) * 2.0**-24 * magnitude * (1 + 1e-6)
    bound = sum_err + 2.0**-8 * (ref.abs() + sum_err)
    excess = ((out.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"seed={seed}: error exceeds the bound by {excess:.3e}"


@_fp8
@pytest.mark.parametrize("m", [1, 8, 13, 40])
def test_fp8_exact_on_integer_data(seed, m):
    """Codes of small integers with scale 1: any mixed-up row, k or block is a wrong value."""
    from fp8serve.kernels.gemv_packing import pack_fp8_gemv_weight
    from fp8serve.quantization.fp8 import FP8_E4M3, quantize_fp8

    g = torch.Generator().manual_seed(seed)
    n, k = 83, 40
    w = torch.randint(-4, 5, (n, k), generator=g).float()
    codes = quantize_fp8(w, 1.0, FP8_E4M3)
    x = torch.randint(-2, 3, (m, k), generator=g).bfloat16()
    packed, scale = pack_fp8_gemv_weight(codes, torch.ones(n))
    out = cpu_ops.fp8_gemv_packed(x, packed, scale, n, None)
    ref = x.double() @ w.double().t()
    assert ref.abs().max() < 256
    assert torch.equal(out.double(), ref), f"seed={seed}"


@_fp8
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_out_writes_what_fp8_gemv_packed_returns(seed, m, with_bias):
    """`fp8_gemv_packed_out` (what decode plans call) fills a given tensor with
    exactly fp8_gemv_packed's result, whatever it held before; a wrong output
    tensor is an error."""
    from fp8serve.kernels.gemv_packing import pack_fp8_gemv_weight

    g = torch.Generator().manual_seed(seed)
    n, k = 167, 576
    packed, scale = pack_fp8_gemv_weight(_random_codes(n, k, g), torch.rand(n, generator=g) * 0.02 + 1e-3)
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g) if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    _ops.fp8_gemv_packed_out(out, x, packed, scale, n, bias)
    assert torch.equal(out, _ops.fp8_gemv_packed(x, packed, scale, n, bias)), f"seed={seed}"
    for bad in (torch.empty(m, n - 1, dtype=torch.bfloat16), torch.empty(m, n),
                torch.empty(m, 2 * n, dtype=torch.bfloat16)[:, ::2]):
        with pytest.raises(RuntimeError, match=rf"out must be a contiguous \[{m}, {n}\] CPU tensor of x's dtype"):
            _ops.fp8_gemv_packed_out(bad, x, packed, scale, n, bias)


@_fp8
def test_fp8_rejects_bad_input():
    from fp8serve.kernels.gemv_packing import pack_fp8_gemv_weight

    packed, scale = pack_fp8_gemv_weight(torch.zeros(20, 8, dtype=torch.uint8), torch.ones(20))
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a \\[M, K\\] bf16 CPU tensor"):
        _ops.fp8_gemv_packed(x.float(), packed, scale, 20, None)
    with pytest.raises(RuntimeError, match="takes 1 to 512 rows, got 513"):
        _ops.fp8_gemv_packed(torch.randn(513, 8).bfloat16(), packed, scale, 20, None)
    with pytest.raises(RuntimeError, match="K must be a multiple of 4, got 6"):
        _ops.fp8_gemv_packed(torch.randn(2, 6).bfloat16(), packed, scale, 20, None)
    with pytest.raises(RuntimeError, match=r"codes_packed must be a contiguous uint8 \[ceil\(N/16\), K/4, 64\]"):
        _ops.fp8_gemv_packed(torch.randn(2, 12).bfloat16(), packed, scale, 20, None)
    with pytest.raises(RuntimeError, match="n = 33 does not fit 2 blocks of 16 rows"):
        _ops.fp8_gemv_packed(x, packed, scale, 33, None)
    with pytest.raises(RuntimeError, match=r"scale must be a contiguous float32 \[32\] tensor"):
        _ops.fp8_gemv_packed(x, packed, scale[:20], 20, None)
    with pytest.raises(RuntimeError, match=r"bias must be \[20\]"):
        _ops.fp8_gemv_packed(x, packed, scale, 20, torch.zeros(16))


def test_fp8_applies_to_bf16_batches_of_1_to_512_rows():
    packed = torch.zeros(1, 2, 64, dtype=torch.uint8)
    for m, wanted in ((1, True), (512, True), (513, False)):
        assert cpu_ops.fp8_gemv_packed_applies(torch.randn(m, 8).bfloat16(), packed) is wanted, m
    assert not cpu_ops.fp8_gemv_packed_applies(torch.randn(4, 8), packed)  # float32 x
    assert not cpu_ops.fp8_gemv_packed_applies(torch.randn(4, 8).bfloat16(), None)
