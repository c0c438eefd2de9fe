"""The fused C++ layer kernels (cpu/layer_ops.cpp) against the layers' torch
paths: RMSNorm.forward_cpu vs forward_native (with and without the fused
residual add), SiluAndMul's C++ path vs forward_native, RotaryEmbedding's
in-place C++ path vs forward_native, for float32 / bfloat16 / float16, widths
that are and are not multiples of the 8-lane blocks. Plus float64 sanity
checks of the float32 kernels.

Fresh random data each run; the seed is in every failure message
(FP8SERVE_TEST_SEED replays one).

Measured here before choosing the bounds (AVX2 build, 128 x {4096, 1000, 13,
3} rows, 3 seeds):
  - RMSNorm 16-bit: the normalised value differs from torch's by at most 1
    ulp on <= 3e-4 of the elements (float32 sums in another order; the
    weight multiply can then make that 2 ulps of the output); float32: at
    most 6 ulps, relative error <= 4.1e-7.
  - residual sums: bit-identical.
  - SiluAndMul 16-bit: bit-identical over all 65536 gate values except
    bf16 gate -88.5 (see test_silu_exp_overflow_band); float32: relative
    error <= 2.4e-7 (the kernel's exp is a polynomial).
  - RoPE 16-bit: bit-identical. float32: ~24% of elements differ by up to
    2^-23 of |x1 cos| + |x2 sin| (see test_rope_float32_bit_identical).
"""

from __future__ import annotations


import pytest
import torch

from fp8serve.config import RopeConfig
from fp8serve.kernels import cpu_ops
from fp8serve.layers.activation import SiluAndMul
from fp8serve.layers.layernorm import RMSNorm
from fp8serve.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# multiple of 8; 16-lane pairs + an 8-lane block; pairs + a 16-lane block + tail; tail-heavy; tail only
HIDDEN = [4096, 1000, 1021, 13, 3]
NUM_TOKENS = 64
# 16-bit RMSNorm: share of output elements allowed to differ from torch at all
# (measured <= 3e-4).
NORM_MAX_DIFF_FRACTION = 2e-3
# ... counted over at least this many elements: over 64 rows of 13 (832
# elements) two differing elements already exceed the share (CI seed
# 751104956, float16), a sample too small for the bound to mean anything.
NORM_MIN_ELEMENTS = 32768


def norm_rows(hidden: int) -> int:
    return max(NUM_TOKENS, -(-NORM_MIN_ELEMENTS // hidden))
# float32 RMSNorm vs torch (measured <= 4.1e-7).
NORM_RTOL_F32 = 1e-6
MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11}
MIN_NORMAL_EXP = {torch.bfloat16: -126, torch.float16: -14}


# Every test here needs the kernels (the shared `ops` fixture skips without them).
pytestmark = pytest.mark.usefixtures("ops")




def int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bit_identical(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape, f"{what}: {got.dtype}{tuple(got.shape)}"
    same = (int_view(got) == int_view(ref)) | (got.isnan() & ref.isnan())
    if not bool(same.all()):
        idx = (~same).nonzero()[:5].tolist()
        ex = [(got[tuple(i)].item(), ref[tuple(i)].item()) for i in idx]
        raise AssertionError(f"{what}: {(~same).sum().item()} of {same.numel()} elements differ; (got, ref): {ex}")


def ulp16(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` (bf16/fp16) at |v| (float64), subnormals included."""
    _, e = torch.frexp(v.abs().double())
    e = torch.clamp(e - 1, min=MIN_NORMAL_EXP[dtype])
    return torch.pow(2.0, (e - (MANTISSA_BITS[dtype] - 1)).double())


def max_relative_error(got: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    """Largest |got - ref| / |ref| over the elements with ref != 0; where the
    float64 reference is exactly 0 (torch.randn does return exact zeros) the
    kernel must give exactly 0 too, instead of the 0/0 that read as NaN."""
    zero = ref == 0
    assert bool((got[zero] == 0).all()), f"{what}: nonzero output where the float64 reference is 0"
    nz = ~zero
    return ((got.double()[nz] - ref[nz]).abs() / ref[nz].abs()).max().item()


def random_rows(g, num_tokens, hidden, dtype):
    # Rows from 1e-3 to 1e3 in scale: the norm is scale-free, the rounding is not.
    x = torch.randn(num_tokens, hidden, generator=g) * torch.logspace(-3, 3, num_tokens)[:, None]
    x[x == 0] = 1.0
    return x.to(dtype)


def random_weight(g, hidden, dtype, powers_of_two=False):
    sign = torch.randint(0, 2, (hidden,), generator=g) * 2 - 1
    if powers_of_two:  # w * n exact: output ulps == normalised-value ulps
        return (sign * torch.pow(2.0, torch.randint(-2, 3, (hidden,), generator=g).float())).to(dtype)
    return (sign * (torch.rand(hidden, generator=g) * 1.5 + 0.5)).to(dtype)


def assert_norm_close(got, ref, weight, ctx):
    """16-bit: the kernel's normalised value n' is within 1 ulp of torch's n,
    so |w n' - w n| <= |w| ulp(n) before the final rounding; each output adds
    at most half an ulp of itself. float32: relative NORM_RTOL_F32."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert bool(got.isfinite().all()), f"{ctx}: non-finite output"
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=NORM_RTOL_F32, atol=0.0, msg=lambda m: f"{ctx}: {m}")
        return
    dt = got.dtype
    w = weight.double().expand_as(ref)
    n = ref.double() / w
    bound = w.abs() * 2 * ulp16(n, dt) + ulp16(ref.double(), dt)
    err = (got.double() - ref.double()).abs()
    assert bool((err <= bound).all()), (
        f"{ctx}: max error/bound {(err / bound).max().item():.3g} at {(err > bound).nonzero()[:5].tolist()}")
    frac = (err > 0).double().mean().item()
    assert frac <= NORM_MAX_DIFF_FRACTION, f"{ctx}: {frac:.2e} of the elements differ from torch"


# ----------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_native(seed, dtype, hidden):
    g = torch.Generator().manual_seed(seed)
    ctx = f"seed={seed} dtype={dtype} hidden={hidden}"
    norm = RMSNorm(hidden, eps=1e-6, dtype=dtype)
    norm.weight.data = random_weight(g, hidden, dtype)
    x = random_rows(g, norm_rows(hidden), hidden, dtype)
    x_before = x.clone()
    ref = norm.forward_native(x)
    got = norm.forward_cpu(x)
    assert torch.equal(int_view(x), int_view(x_before)), f"{ctx}: forward_cpu without residual modified x"
    assert got.data_ptr() != x.data_ptr()
    assert_norm_close(got, ref, norm.weight, ctx)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_forward_dispatches_to_cpp(seed, dtype, monkeypatch):
    """forward() takes the C++ ops for 2-D CPU input, the torch path for 3-D."""
    calls = []
    for name in ("rms_norm", "fused_add_rms_norm"):
        real = getattr(cpu_ops, name)
        monkeypatch.setattr(cpu_ops, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(40, dtype=dtype)
    norm.weight.data = random_weight(g, 40, dtype)
    x, r = random_rows(g, 5, 40, dtype), random_rows(g, 5, 40, dtype)
    assert torch.equal(int_view(norm(x)), int_view(cpu_ops.rms_norm(x, norm.weight, norm.eps)))
    norm(x.clone(), r.clone())
    assert calls == ["rms_norm", "rms_norm", "fused_add_rms_norm"], calls
    norm(x.view(1, 5, 40))
    assert len(calls) == 3, "3-D input should take forward_native"


@pytest.mark.parametrize("hidden", [4096, 1000, 13])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_16bit_within_one_ulp(seed, dtype, hidden):
    """With power-of-two weights the output's ulps are the normalised
    value's: at most 1 ulp from torch, on a small share of elements."""
    g = torch.Generator().manual_seed(seed)
    ctx = f"seed={seed} dtype={dtype} hidden={hidden}"
    norm = RMSNorm(hidden, eps=1e-6, dtype=dtype)
    norm.weight.data = random_weight(g, hidden, dtype, powers_of_two=True)
    x = random_rows(g, norm_rows(hidden), hidden, dtype)
    ref, got = norm.forward_native(x), norm.forward_cpu(x)
    assert bool((got.sign() == ref.sign()).all()), f"{ctx}: sign differs"
    dist = (int_view(got).int() - int_view(ref).int()).abs()
    assert dist.max().item() <= 1, f"{ctx}: {dist.max().item()} ulps apart at {(dist > 1).nonzero()[:5].tolist()}"
    frac = (dist > 0).double().mean().item()
    assert frac <= NORM_MAX_DIFF_FRACTION, f"{ctx}: {frac:.2e} of the elements differ"


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_native(seed, dtype, hidden):
    g = torch.Generator().manual_seed(seed)
    ctx = f"seed={seed} dtype={dtype} hidden={hidden}"
    norm = RMSNorm(hidden, eps=1e-5, dtype=dtype)
    norm.weight.data = random_weight(g, hidden, dtype)
    x = random_rows(g, norm_rows(hidden), hidden, dtype)
    residual = random_rows(g, norm_rows(hidden), hidden, dtype)
    ref_out, ref_res = norm.forward_native(x, residual)
    x_ptr, r_ptr = x.data_ptr(), residual.data_ptr()
    out, res = norm.forward_cpu(x, residual)
    # In place: x holds the output, residual the sum.
    assert out is x and res is residual and x.data_ptr() == x_ptr and residual.data_ptr() == r_ptr, ctx
    assert_bit_identical(res, ref_res, f"{ctx}: residual sum")
    assert_norm_close(out, ref_out, norm.weight, ctx)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows(seed, dtype):
    """Rows of a wider tensor (token stride != hidden): both ops read and write
    only their own columns."""
    g = torch.Generator().manual_seed(seed)
    hidden, width = 1000, 1037
    ctx = f"seed={seed} dtype={dtype}"
    norm = RMSNorm(hidden, eps=1e-6, dtype=dtype)
    norm.weight.data = random_weight(g, hidden, dtype)
    wide_x = random_rows(g, NUM_TOKENS, width, dtype)
    wide_r = random_rows(g, NUM_TOKENS, width, dtype)
    x, r = wide_x[:, 17:17 + hidden], wide_r[:, 3:3 + hidden]
    x_c, r_c = x.clone(), r.clone()
    assert_norm_close(norm.forward_cpu(x), norm.forward_native(x_c), norm.weight, ctx + " no residual")
    keep_x = torch.cat([wide_x[:, :17], wide_x[:, 17 + hidden:]], 1).clone()
    keep_r = torch.cat([wide_r[:, :3], wide_r[:, 3 + hidden:]], 1).clone()
    ref_out, ref_res = norm.forward_native(x_c, r_c)
    out, res = norm.forward_cpu(x, r)
    assert_bit_identical(res, ref_res, f"{ctx}: strided residual sum")
    assert_norm_close(out, ref_out, norm.weight, ctx + " strided fused add")
    assert torch.equal(torch.cat([wide_x[:, :17], wide_x[:, 17 + hidden:]], 1), keep_x), f"{ctx}: x padding written"
    assert torch.equal(torch.cat([wide_r[:, :3], wide_r[:, 3 + hidden:]], 1), keep_r), (
        f"{ctx}: residual padding written")


def test_rms_norm_float32_vs_float64(seed):
    g = torch.Generator().manual_seed(seed)
    for hidden in (4096, 13):
        x = random_rows(g, NUM_TOKENS, hidden, torch.float32)
        w = random_weight(g, hidden, torch.float32)
        eps = 1e-6
        x64 = x.double()
        ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()
        got = cpu_ops.rms_norm(x, w, eps)
        rel = max_relative_error(got, ref, f"seed={seed} hidden={hidden}")
        assert rel <= 1e-6, f"seed={seed} hidden={hidden}: max relative error {rel:.3g} vs float64"


def test_rms_norm_errors():
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_ops.rms_norm(x, torch.ones(15), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_ops.rms_norm(x, torch.ones(16, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="residual must match"):
        cpu_ops.fused_add_rms_norm(x, torch.randn(4, 15), torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        cpu_ops.rms_norm(x.t().contiguous().t(), torch.ones(16), 1e-6)


# -------------------------------------------------------------- SiluAndMul

# The kernel's exp (scalar_convert.h exp_f32, vec8.h exp) overflows to inf for
# x in [127.5 / log2(e), 88.7] = [88.376, 88.7] (n rounds to 128, 2^128 is
# built as inf) although exp(x) < FLT_MAX there, so silu(g) for g in about
# [-88.72, -88.376] is -0.0 instead of g / (1 + exp(-g)) ~ -3e-37.
# Band: 127.5 / log2(e) = 88.3762 (n = 128) up to log(FLT_MAX) = 88.7228.
EXP_OVERFLOW_BAND = (-88.7229, -88.3762)


@pytest.mark.parametrize("d", [4096, 1000, 13, 8, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_native(seed, dtype, d, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    ctx = f"seed={seed} dtype={dtype} d={d}"
    x = (torch.randn(NUM_TOKENS, 2 * d, generator=g) * 6).to(dtype)
    layer = SiluAndMul()
    calls = []
    real = cpu_ops.silu_and_mul
    monkeypatch.setattr(cpu_ops, "silu_and_mul", lambda t: calls.append(1) or real(t))
    got = layer(x)
    assert calls, f"{ctx}: SiluAndMul.forward did not take the C++ path"
    ref = layer.forward_native(x)
    assert got.shape == (NUM_TOKENS, d) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-37, msg=lambda m: f"{ctx}: {m}")
    else:
        assert_bit_identical(got, ref, ctx)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_strided_rows(seed, dtype):
    """x as rows of a wider tensor (token stride > 2d)."""
    g = torch.Generator().manual_seed(seed)
    d = 37
    wide = (torch.randn(NUM_TOKENS, 2 * d + 9, generator=g) * 6).to(dtype)
    x = wide[:, 5:5 + 2 * d]
    got = cpu_ops.silu_and_mul(x)
    ref = SiluAndMul().forward_native(x.contiguous())
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-37)
    else:
        assert_bit_identical(got, ref, f"seed={seed} dtype={dtype} strided")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_every_16bit_gate(seed, dtype):
    """Every bf16 / fp16 bit pattern as the gate (NaN, +-inf, subnormals
    included), random `up`: bit-identical to torch, the exp-overflow band
    included (exp(x) for x in (88.38, 88.72] once overflowed in the kernel)."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    gate = gate[torch.randperm(gate.numel(), generator=g)].view(256, 256)
    up = (torch.randn(256, 256, generator=g) * 3).to(dtype)
    x = torch.cat([gate, up], 1)
    got = cpu_ops.silu_and_mul(x)
    ref = SiluAndMul().forward_native(x)
    assert_bit_identical(got, ref, f"seed={seed} dtype={dtype} all gates")


@pytest.mark.parametrize("width", [16, 3])  # 8-lane path, scalar tail
def test_silu_exp_overflow_band(width):
    gate = torch.linspace(-88.7, -88.38, width)
    x = torch.cat([gate[None], torch.ones(1, width)], 1)
    got = cpu_ops.silu_and_mul(x)
    ref = SiluAndMul().forward_native(x)
    assert bool((got != 0).all()), f"silu of {gate.tolist()} gave {got.tolist()}"
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0.0)


def test_silu_and_mul_float32_vs_float64(seed):
    g = torch.Generator().manual_seed(seed)
    d = 1003
    # |gate| up to ~60: silu(gate) stays a float32 normal (below ~-87 float32
    # underflows where float64 does not, for torch as for the kernel).
    x = torch.randn(NUM_TOKENS, 2 * d, generator=g) * torch.logspace(-4, 1, NUM_TOKENS)[:, None]
    gate, up = x[:, :d].double(), x[:, d:].double()
    ref = gate / (1 + torch.exp(-gate)) * up
    got = cpu_ops.silu_and_mul(x)
    rel = max_relative_error(got, ref, f"seed={seed}")
    # silu in float32 (a ~2 ulp exp, a division) then one multiply: a few 2^-24.
    assert rel <= 1e-6, f"seed={seed}: max relative error {rel:.3g} vs float64"


def test_silu_and_mul_float32_special_and_mixed_vectors(seed):
    """float32 vectors take a fast path (FMA exp, reciprocal) unless a lane's
    gate is below -80; vectors mixing both sides of -80, inf, -inf and NaN
    gates must still agree with torch (NaN where torch gives NaN)."""
    g = torch.Generator().manual_seed(seed)
    d = 16 * 6 + 5  # whole 16-lane vectors and a tail
    gate = torch.randn(NUM_TOKENS, d, generator=g) * 30
    gate[0, :16] = torch.linspace(-88.7, -70.0, 16)  # one vector straddling -80
    gate[1, 16:32] = torch.linspace(-79.9, 60.0, 16)  # fast path from -79.9 up
    gate[2, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0])
    gate[3, 32:48] = torch.linspace(-87.0, 87.0, 16)
    up = torch.randn(NUM_TOKENS, d, generator=g) * 3
    x = torch.cat([gate, up], 1)
    got = cpu_ops.silu_and_mul(x)
    ref = SiluAndMul().forward_native(x)
    ctx = f"seed={seed}"
    assert torch.equal(got.isnan(), ref.isnan()), f"{ctx}: NaN positions differ"
    ok = ~ref.isnan()
    torch.testing.assert_close(got[ok], ref[ok], rtol=1e-6, atol=1e-37, msg=lambda m: f"{ctx}: {m}")


def test_silu_and_mul_errors():
    with pytest.raises(RuntimeError):
        cpu_ops.load_cpu_ops().silu_and_mul(torch.empty(4, 3), torch.randn(4, 7))  # odd width
    with pytest.raises(RuntimeError):
        cpu_ops.load_cpu_ops().silu_and_mul(torch.empty(4, 4, dtype=torch.float16), torch.randn(4, 8))


# -------------------------------------------------------------------- RoPE

MAX_POSITION = 4096
ROPES = {"default": RopeConfig("default", 10000.0),
         "llama3": RopeConfig("llama3", 500000.0, 8.0, 1.0, 4.0, 8192)}


def make_qkv(g, dtype, num_tokens, num_heads, num_kv_heads, head_size):
    """q, k as [T, H, D] views into one fused [T, (H + 2 Hkv) D + pad] tensor."""
    width = (num_heads + 2 * num_kv_heads) * head_size + 3
    qkv = (torch.randn(num_tokens, width, generator=g) * 3).to(dtype)
    q = qkv[:, :num_heads * head_size].view(num_tokens, num_heads, head_size)
    k = qkv[:, num_heads * head_size:(num_heads + num_kv_heads) * head_size].view(num_tokens, num_kv_heads, head_size)
    return qkv, q, k


def random_positions(g, num_tokens):
    pos = torch.randint(0, MAX_POSITION, (num_tokens,), generator=g)
    pos[0], pos[-1] = MAX_POSITION - 1, 0
    return pos


def run_rope(seed, dtype, head_size, rope_name, monkeypatch=None, num_tokens=33):
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(head_size, MAX_POSITION, ROPES[rope_name], dtype)
    num_heads, num_kv_heads = 4, 2
    qkv, q, k = make_qkv(g, dtype, num_tokens, num_heads, num_kv_heads, head_size)
    positions = random_positions(g, num_tokens)
    ref_q, ref_k = rope.forward_native(positions, q.clone(), k.clone())
    rest = qkv[:, (num_heads + num_kv_heads) * head_size:].clone()
    q_ptr, k_ptr = q.data_ptr(), k.data_ptr()
    calls = []
    if monkeypatch is not None:
        real = cpu_ops.rotary_embedding
        monkeypatch.setattr(cpu_ops, "rotary_embedding", lambda *a: calls.append(1) or real(*a))
    out_q, out_k = rope(positions, q, k)
    if monkeypatch is not None:
        assert calls, "RotaryEmbedding.forward did not take the C++ path"
    # In place on the views of the fused tensor; V and the padding untouched.
    assert out_q.data_ptr() == q_ptr and out_k.data_ptr() == k_ptr
    assert torch.equal(int_view(qkv[:, (num_heads + num_kv_heads) * head_size:]), int_view(rest)), "V/padding written"
    qkv_q = qkv[:, :num_heads * head_size].view_as(q)
    assert torch.equal(int_view(qkv_q), int_view(out_q))
    return out_q, out_k, ref_q, ref_k, positions, rope


@pytest.mark.parametrize("rope_name", list(ROPES))
# halves 32, 64, 10 (8 + 2 tail), 17 (16 + 1), 24 (a 16-lane and an 8-lane step on AVX-512 builds)
@pytest.mark.parametrize("head_size", [64, 128, 20, 34, 48])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_16bit_bit_identical(seed, dtype, head_size, rope_name, monkeypatch):
    out_q, out_k, ref_q, ref_k, _, _ = run_rope(seed, dtype, head_size, rope_name, monkeypatch)
    ctx = f"seed={seed} dtype={dtype} head_size={head_size} rope={rope_name}"
    assert_bit_identical(out_q, ref_q, ctx + " q")
    assert_bit_identical(out_k, ref_k, ctx + " k")


@pytest.mark.parametrize("head_size", [64, 128, 20])
def test_rope_float32_close(seed, head_size, monkeypatch):
    """float32: within one float32 rounding of each product of torch's result
    (a bound that also holds if a compiler fused a multiply into the add)."""
    out_q, out_k, ref_q, ref_k, positions, rope = run_rope(seed, torch.float32, head_size, "default", monkeypatch)
    cos = rope.cos[positions].unsqueeze(1).double()
    sin = rope.sin[positions].unsqueeze(1).double()
    half = head_size // 2
    for name, out, ref in (("q", out_q, ref_q), ("k", out_k, ref_k)):
        # |x1 cos| + |x2 sin| per output element, from the rotated values' inputs
        # (|x1|, |x2| are preserved by the rotation up to rounding: use ref's norm pairs).
        a, b = ref[..., :half].double(), ref[..., half:].double()
        r = torch.sqrt(a * a + b * b)
        mag = torch.cat([r, r], -1) * (cos.abs() + sin.abs()).repeat(1, 1, 2)
        err = (out.double() - ref.double()).abs()
        bound = 2.0**-22 * mag + 1e-30
        assert bool((err <= bound).all()), (
            f"seed={seed} head_size={head_size} {name}: max error/bound {(err / bound).max().item():.3g}")


def test_rope_float32_bit_identical(seed):
    out_q, out_k, ref_q, ref_k, _, _ = run_rope(seed, torch.float32, 64, "default")
    assert_bit_identical(out_q, ref_q, f"seed={seed} float32 q")
    assert_bit_identical(out_k, ref_k, f"seed={seed} float32 k")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [MAX_POSITION, MAX_POSITION + 100, -1])
def test_rope_out_of_range_position_raises(seed, dtype, bad):
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(64, MAX_POSITION, ROPES["default"], dtype)
    qkv, q, k = make_qkv(g, dtype, 9, 4, 2, 64)
    before = qkv.clone()
    positions = random_positions(g, 9)
    positions[4] = bad
    with pytest.raises(RuntimeError, match="outside"):
        rope(positions, q, k)
    assert torch.equal(int_view(qkv), int_view(before)), "a rejected call modified q/k"


def test_rope_errors():
    rope_cos = torch.randn(16, 32)
    q, k = torch.randn(3, 2, 64), torch.randn(3, 1, 64)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_ops.rotary_embedding(torch.tensor([0, 1, 2], dtype=torch.int32), q, k, rope_cos, rope_cos)
    with pytest.raises(RuntimeError, match="num_tokens"):
        cpu_ops.rotary_embedding(torch.tensor([0, 1]), q, k, rope_cos, rope_cos)
    with pytest.raises(RuntimeError, match="cos/sin"):
        cpu_ops.rotary_embedding(torch.tensor([0, 1, 2]), q, k, rope_cos.bfloat16(), rope_cos.bfloat16())
    with pytest.raises(RuntimeError, match="even"):
        cpu_ops.rotary_embedding(torch.tensor([0, 1, 2]), torch.randn(3, 2, 5), torch.randn(3, 1, 5),
                                 torch.randn(16, 2), torch.randn(16, 2))


def test_rope_non_multiple_of_8_half_tail_only(seed):
    """head_size 6 (half 3): only the scalar tail runs."""
    for dtype in (torch.bfloat16, torch.float16):
        out_q, out_k, ref_q, ref_k, _, _ = run_rope(seed, dtype, 6, "default")
        assert_bit_identical(out_q, ref_q, f"seed={seed} {dtype} head_size 6 q")
        assert_bit_identical(out_k, ref_k, f"seed={seed} {dtype} head_size 6 k")

