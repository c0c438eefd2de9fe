"""The C++ cache write (`reshape_and_cache`, cpu/cache_ops.cpp) against the
torch reference: `quantize_fp8` for FP8 caches (codes bit-identical, compared
as uint8), a plain `.to(storage dtype)` for 16/32-bit caches, and
`dequantize_fp8(codes, 1.0, fmt, dtype)` / `.to(dtype)` for `return_decoded`.

Fresh random data each run (the seed is in every failure message;
FP8SERVE_TEST_SEED replays one): magnitudes from 1e-8 to 1e4 around the
scale, plus the values where rounding is decided (NaN, +-inf, -0.0, FP8
subnormal and normal ties, the saturation edges, float16 overflow ties).
Row widths that are a multiple of 8 (AVX2 path) and that are not (scalar
tail), K/V as views into a wider fused-qkv-like tensor (token stride != row
width), a slot_mapping with a skipped (-1) token, and scales != 1.
"""

from __future__ import annotations


import pytest
import torch

from fp8serve.attention.kv_cache_spec import KV_CACHE_LAYOUTS, as_layer_view, read_slots
from fp8serve.kernels import cpu_ops
from fp8serve.kernels.cpu_ops import KV_FORMATS, KV_STORAGE_DTYPES, reshape_and_cache
from fp8serve.quantization.fp8 import dequantize_fp8, fp8_format, quantize_fp8

INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (num_kv_heads, head_size): row widths 192 (a multiple of 8), 5 (scalar tail
# only), 24 (heads of 12 straddle the 8-lane blocks), 21 (8-lane blocks plus a
# 5-element tail).
ROW_SHAPES = [(3, 64), (1, 5), (2, 12), (3, 7)]
BLOCK_SIZE = 8
NUM_BLOCKS = 9
NUM_TOKENS = 50  # < NUM_BLOCKS * BLOCK_SIZE slots: some slots stay untouched
# k_scale a power of two (the special values below stay exact ties after the
# division), v_scale not.
FP8_K_SCALE, FP8_V_SCALE = 0.5, 2.7

# Values of x / scale where the conversion's rounding decides something.
SPECIALS = [
    float("nan"), float("-nan"), float("inf"), float("-inf"), -0.0, 0.0,
    2.0**-10 * 3, -(2.0**-10) * 3, 2.0**-10 * 5, 2.0**-10 * 7,  # e4m3 subnormal ties (1.5, 2.5, 3.5 steps of 2^-9)
    2.0**-6, 2.0**-6 * (1 - 2.0**-5), 2.0**-6 - 2.0**-10,  # e4m3 min normal and just below (rounds up into it)
    248.0, 240.0, 232.0, -248.0,  # e4m3 normal ties / exact
    448.0, 449.0, 464.0, 465.0, 480.0, -464.0, 1e30, -1e30,  # e4m3 saturation edge
    2.0**-17 * 3, 2.0**-17 * 5, -(2.0**-17) * 3, 2.0**-14 * (1 - 2.0**-4),  # e5m2 subnormal ties, below min normal
    57344.0, 61440.0, 61441.0, -61440.0, 65536.0,  # e5m2 saturation edge
    65504.0, 65519.0, 65520.0, -65520.0, 1 + 2.0**-11, 1 + 3 * 2.0**-11,  # float16 max / overflow tie / ties
    1 + 2.0**-8, 1 + 3 * 2.0**-8, 2.0**-24, 2.0**-25, 3 * 2.0**-26,  # bfloat16 ties, float16 subnormal ties
    1e-45, -1e-45, 1.1754942e-38,  # float32 subnormals
]


# Every test here needs the kernels (the shared `ops` fixture skips without them).
pytestmark = pytest.mark.usefixtures("ops")




def make_kv(seed, dtype, num_kv_heads, head_size, num_tokens, k_scale, v_scale):
    """key, value as [T, H, D] views into one [T, W] tensor (W > 2 * H * D, as
    the model's fused qkv output): magnitudes 1e-8..1e4 times the scale, with
    every special value (times the scale) at random places."""
    g = torch.Generator().manual_seed(seed)
    row = num_kv_heads * head_size
    q_width, pad = 2 * row + 3, 5
    width = q_width + 2 * row + pad
    mags = torch.logspace(-8, 4, width, dtype=torch.float64)[torch.randperm(width, generator=g)]
    wide = torch.randn(num_tokens, width, generator=g, dtype=torch.float64) * mags
    wide[wide == 0] = 1.0  # never an accidental zero
    k_part = wide[:, q_width:q_width + row]
    v_part = wide[:, q_width + row:q_width + 2 * row]
    specials = torch.tensor(SPECIALS, dtype=torch.float64)
    for part, scale in ((k_part, k_scale), (v_part, v_scale)):
        flat_idx = torch.randperm(part.numel(), generator=g)[:min(part.numel(), 2 * len(SPECIALS))]
        vals = specials.repeat(2)[:flat_idx.numel()] * scale
        rows, cols = flat_idx // row, flat_idx % row
        part[rows, cols] = vals
    wide = wide.to(dtype)
    key = wide[:, q_width:q_width + row].view(num_tokens, num_kv_heads, head_size)
    value = wide[:, q_width + row:q_width + 2 * row].view(num_tokens, num_kv_heads, head_size)
    assert not key.is_contiguous() and key.stride(0) == width
    return wide, key, value


def in_layout(cache: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """The [blocks, block_size, kv heads, head_size] cache `cache` as the same
    view over memory in `kv_layout`'s order (a copy)."""
    if kv_layout == "HND":
        return as_layer_view(cache.transpose(1, 2).contiguous(), "HND")
    return cache.contiguous()


def make_caches(seed, kv_format, num_kv_heads, head_size, kv_layout="HND"):
    """Caches pre-filled with random content (FP8: random codes), so that
    writes to the wrong place and writes to skipped slots show."""
    g = torch.Generator().manual_seed(seed + 1)
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_size)
    storage = KV_STORAGE_DTYPES[kv_format]
    if storage == torch.uint8:
        k, v = (torch.randint(0, 256, shape, dtype=torch.uint8, generator=g),
                torch.randint(0, 256, shape, dtype=torch.uint8, generator=g))
    else:
        k, v = torch.randn(shape, generator=g).to(storage), torch.randn(shape, generator=g).to(storage)
    return in_layout(k, kv_layout), in_layout(v, kv_layout)


def make_slots(seed, num_tokens):
    g = torch.Generator().manual_seed(seed + 2)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:num_tokens]
    slots[int(torch.randint(0, num_tokens, (1,), generator=g))] = -1
    return slots


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_values(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Bit-identical except that NaN only has to be NaN (any payload/sign):
    -0.0 must stay -0.0, inf must stay inf."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, (
        f"{what}: {got.dtype}{tuple(got.shape)} vs {ref.dtype}{tuple(ref.shape)}")
    nan_g, nan_r = got.isnan(), ref.isnan()
    same = (int_view(got) == int_view(ref)) | (nan_g & nan_r)
    if not bool(same.all()):
        idx = (~same).nonzero()[:6].tolist()
        examples = [(got[tuple(i)].item(), ref[tuple(i)].item()) for i in idx]
        raise AssertionError(f"{what}: {(~same).sum().item()} of {same.numel()} differ; (got, expected): {examples}")


def reference_store(x: torch.Tensor, kv_format: str, scale: float) -> torch.Tensor:
    if kv_format.startswith("fp8"):
        return quantize_fp8(x, scale, fp8_format(kv_format))
    return x.to(KV_STORAGE_DTYPES[kv_format])


def reference_decode(stored: torch.Tensor, kv_format: str, dtype: torch.dtype) -> torch.Tensor:
    if kv_format.startswith("fp8"):
        return dequantize_fp8(stored, 1.0, fp8_format(kv_format), dtype)
    return stored.to(dtype)


@pytest.mark.parametrize("kv_layout", KV_CACHE_LAYOUTS)
@pytest.mark.parametrize("num_kv_heads,head_size", ROW_SHAPES)
@pytest.mark.parametrize("kv_format", list(KV_FORMATS))
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_reshape_and_cache_matches_torch(seed, dtype, kv_format, num_kv_heads, head_size, kv_layout):
    is_fp8 = kv_format.startswith("fp8")
    k_scale, v_scale = (FP8_K_SCALE, FP8_V_SCALE) if is_fp8 else (1.0, 1.0)
    wide, key, value = make_kv(seed, dtype, num_kv_heads, head_size, NUM_TOKENS, k_scale, v_scale)
    wide_before = wide.clone()
    key_cache, value_cache = make_caches(seed, kv_format, num_kv_heads, head_size, kv_layout)
    k_before, v_before = key_cache.clone(), value_cache.clone()
    slots = make_slots(seed, NUM_TOKENS)
    ctx = f"seed={seed} dtype={dtype} kv_format={kv_format} rows=({num_kv_heads}, {head_size}) {kv_layout}"

    decoded = reshape_and_cache(key, value, key_cache, value_cache, slots, kv_format, k_scale, v_scale,
                                return_decoded=True)
    assert torch.equal(bits(wide), bits(wide_before)), f"{ctx}: the input was modified"
    assert decoded is not None
    key_out, value_out = decoded

    written = slots >= 0
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots[written]] = False
    for name, x, cache, before, scale, out in (("key", key, key_cache, k_before, k_scale, key_out),
                                               ("value", value, value_cache, v_before, v_scale, value_out)):
        rows = cache.reshape(-1, num_kv_heads, head_size)  # slot order, whatever the layout
        ref = reference_store(x, kv_format, scale)
        if is_fp8:  # codes: bit for bit, NaN codes included
            assert torch.equal(bits(rows[slots[written]]), bits(ref[written])), (
                f"{ctx}: {name} codes differ from quantize_fp8 at "
                f"{(bits(rows[slots[written]]) != bits(ref[written])).nonzero()[:6].tolist()}")
        else:
            assert_same_values(rows[slots[written]], ref[written], f"{ctx}: stored {name}")
        assert torch.equal(bits(rows[untouched]), bits(before.reshape(-1, num_kv_heads, head_size)[untouched])), (
            f"{ctx}: {name} slots not in slot_mapping (or skipped with -1) were modified")
        # The decoded values of the written tokens: what a read of the cache
        # returns at scale 1. (Rows of skipped tokens are left unwritten:
        # key_out/value_out come from torch.empty, so they are not compared.)
        assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous(), f"{ctx}: {name}_out layout"
        assert_same_values(out[written], reference_decode(ref[written], kv_format, dtype), f"{ctx}: decoded {name}")


@pytest.mark.parametrize("kv_format", list(KV_FORMATS))
def test_without_return_decoded_same_cache(seed, kv_format):
    """The plain write stores exactly what the return_decoded write stores."""
    is_fp8 = kv_format.startswith("fp8")
    k_scale, v_scale = (0.37, 1.9) if is_fp8 else (1.0, 1.0)
    _, key, value = make_kv(seed, torch.bfloat16, 2, 12, NUM_TOKENS, k_scale, v_scale)
    slots = make_slots(seed, NUM_TOKENS)
    kc1, vc1 = make_caches(seed, kv_format, 2, 12)
    kc2, vc2 = kc1.clone(), vc1.clone()
    assert reshape_and_cache(key, value, kc1, vc1, slots, kv_format, k_scale, v_scale) is None
    reshape_and_cache(key, value, kc2, vc2, slots, kv_format, k_scale, v_scale, return_decoded=True)
    assert torch.equal(bits(kc1), bits(kc2)) and torch.equal(bits(vc1), bits(vc2)), f"seed={seed} {kv_format}"


@pytest.mark.parametrize("kv_layout", KV_CACHE_LAYOUTS)
@pytest.mark.parametrize("kv_format", list(KV_FORMATS))
def test_many_tokens_across_threads(seed, kv_format, kv_layout):
    """Enough tokens that the write is split across threads (~64 KiB of input
    per task), every slot written: the whole cache equals the reference."""
    num_kv_heads, head_size, block_size = 2, 64, 16
    num_tokens = 16 * block_size * 4
    g = torch.Generator().manual_seed(seed)
    is_fp8 = kv_format.startswith("fp8")
    k_scale, v_scale = (0.05, 0.03) if is_fp8 else (1.0, 1.0)
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=g) * 4 * k_scale
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=g) * 4 * v_scale
    storage = KV_STORAGE_DTYPES[kv_format]
    shape = (num_tokens // block_size, block_size, num_kv_heads, head_size)
    key_cache = in_layout(torch.zeros(shape, dtype=storage), kv_layout)
    value_cache = in_layout(torch.zeros(shape, dtype=storage), kv_layout)
    perm = torch.randperm(num_tokens, generator=g)
    out = reshape_and_cache(key, value, key_cache, value_cache, perm, kv_format, k_scale, v_scale,
                            return_decoded=True)
    for name, x, cache, scale, decoded in (("key", key, key_cache, k_scale, out[0]),
                                           ("value", value, value_cache, v_scale, out[1])):
        ref = reference_store(x, kv_format, scale)
        expected = torch.empty_like(ref)
        expected[perm] = ref
        assert torch.equal(bits(cache.reshape(-1, num_kv_heads, head_size)), bits(expected)), (
            f"seed={seed} {kv_format}: {name} cache differs")
        assert_same_values(decoded, reference_decode(ref, kv_format, torch.float32), f"seed={seed} decoded {name}")


def test_every_fp8_code_round_trips(seed):
    """Every finite e4m3 / e5m2 value (times a scale) is stored as its own
    code and decodes to itself: the full code table, in both paths."""
    for kv_format in ("fp8_e4m3", "fp8_e5m2"):
        fmt = fp8_format(kv_format)
        codes = torch.arange(256, dtype=torch.uint8)
        values = dequantize_fp8(codes, 1.0, fmt, torch.float32)
        finite = values.isfinite()
        codes, values = codes[finite], values[finite]
        # 8 heads of odd size 31 (248 values: vector + tail), padded by repeating.
        n = 8 * 31
        idx = torch.arange(n) % values.numel()
        scale = 0.125
        key = (values[idx] * scale).view(1, 8, 31)
        kc = torch.zeros(1, 1, 8, 31, dtype=torch.uint8)
        vc = torch.zeros_like(kc)
        k_out, _ = reshape_and_cache(key, key, kc, vc, torch.tensor([0]), kv_format, scale, scale,
                                     return_decoded=True)
        assert torch.equal(kc.view(-1), codes[idx]), (
            f"{kv_format}: codes {kc.view(-1)[kc.view(-1) != codes[idx]][:8].tolist()} "
            f"instead of {codes[idx][kc.view(-1) != codes[idx]][:8].tolist()}")
        assert_same_values(k_out.view(-1), values[idx], f"{kv_format}: decoded code table")


@pytest.mark.parametrize("kv_format", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_cpu_paged_backend_write_matches_torch_sdpa(seed, kv_format):
    """CpuPagedBackend.write_kv_cache (this kernel) stores and returns exactly
    what TorchSDPABackend.write_kv_cache (quantize_fp8 + index_copy_) does."""
    from fp8serve.attention.backends.cpu_paged import CpuPagedBackend
    from fp8serve.attention.backends.torch_sdpa import TorchSDPABackend
    from fp8serve.attention.kv_cache_spec import KVCacheSpec

    num_kv_heads, head_size = 2, 20
    spec = KVCacheSpec(kv_format, BLOCK_SIZE, num_kv_heads, head_size, num_layers=1)
    paged, ref = CpuPagedBackend(spec, torch.float16), TorchSDPABackend(spec, torch.float16)
    k_scale, v_scale = (0.25, 0.6) if kv_format.startswith("fp8") else (1.0, 1.0)
    _, key, value = make_kv(seed, torch.float16, num_kv_heads, head_size, 30, k_scale, v_scale)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=torch.Generator().manual_seed(seed))[:30]
    cache_paged = spec.empty_layer(NUM_BLOCKS).zero_()  # the engine's layout (HND)
    cache_ref = spec.empty_layer(NUM_BLOCKS).zero_()
    got = paged.write_kv_cache(key, value, cache_paged, slots, k_scale, v_scale, return_decoded=True)
    expected = ref.write_kv_cache(key, value, cache_ref, slots, k_scale, v_scale, return_decoded=True)
    if kv_format.startswith("fp8"):
        assert torch.equal(cache_paged, cache_ref), f"seed={seed} {kv_format}: caches differ"
    else:
        assert_same_values(cache_paged, cache_ref, f"seed={seed} {kv_format}: caches")
    for g_, e_, name in zip(got, expected, ("key", "value")):
        assert_same_values(g_, e_, f"seed={seed} {kv_format}: decoded {name}")


# ------------------------------------------------------------------ errors


def _small_case(kv_format="fp8_e4m3", cache_dtype=None):
    key = torch.randn(4, 2, 8)
    value = torch.randn(4, 2, 8)
    storage = cache_dtype or KV_STORAGE_DTYPES[kv_format]
    kc = torch.zeros(2, 4, 2, 8, dtype=storage)
    vc = torch.zeros(2, 4, 2, 8, dtype=storage)
    return key, value, kc, vc, torch.tensor([0, 3, 5, 7])


@pytest.mark.parametrize("kv_format,wrong", [("fp8_e4m3", torch.float16), ("bfloat16", torch.float16),
                                             ("float32", torch.uint8), ("float16", torch.bfloat16)])
def test_wrong_cache_dtype_raises(kv_format, wrong):
    key, value, kc, vc, slots = _small_case(kv_format, wrong)
    with pytest.raises(TypeError, match="stored as"):
        reshape_and_cache(key, value, kc, vc, slots, kv_format)


def test_int32_slot_mapping_raises():
    key, value, kc, vc, slots = _small_case()
    with pytest.raises(TypeError, match="int64"):
        reshape_and_cache(key, value, kc, vc, slots.to(torch.int32), "fp8_e4m3")


def test_unknown_format_raises():
    key, value, kc, vc, slots = _small_case()
    with pytest.raises(ValueError, match="unknown kv_format"):
        reshape_and_cache(key, value, kc, vc, slots, "fp8_e3m4")


@pytest.mark.parametrize("bad_slot", [8, 1000])
def test_slot_past_the_end_raises_and_writes_nothing(bad_slot):
    key, value, kc, vc, slots = _small_case()
    slots[2] = bad_slot  # the cache has 2 * 4 = 8 slots
    with pytest.raises(RuntimeError, match="past the cache"):
        reshape_and_cache(key, value, kc, vc, slots, "fp8_e4m3", return_decoded=True)
    assert not kc.any() and not vc.any(), "a rejected call wrote into the cache"


@pytest.mark.parametrize("kv_format", ["float32", "bfloat16", "float16"])
def test_non_fp8_cache_with_scale_raises(kv_format):
    key, value, kc, vc, slots = _small_case(kv_format)
    with pytest.raises(RuntimeError, match="only FP8 storage takes scales"):
        reshape_and_cache(key, value, kc, vc, slots, kv_format, 0.5, 1.0)
    with pytest.raises(RuntimeError, match="only FP8 storage takes scales"):
        reshape_and_cache(key, value, kc, vc, slots, kv_format, 1.0, 2.0)
    assert not kc.any() and not vc.any()
    reshape_and_cache(key, value, kc, vc, slots, kv_format, 1.0, 1.0)  # scale 1 is fine
    assert kc.any()


@pytest.mark.parametrize("scale", [0.0, -1.0])
def test_non_positive_scale_raises(scale):
    key, value, kc, vc, slots = _small_case()
    with pytest.raises(RuntimeError, match="scales must be > 0"):
        reshape_and_cache(key, value, kc, vc, slots, "fp8_e4m3", scale, 1.0)


def test_bad_layouts_raise():
    key, value, kc, vc, slots = _small_case()
    with pytest.raises(RuntimeError, match="contiguous heads"):  # head_size not innermost
        reshape_and_cache(key.transpose(1, 2).contiguous().transpose(1, 2), value, kc, vc, slots, "fp8_e4m3")
    with pytest.raises(RuntimeError, match="cache rows"):  # head_size mismatch
        reshape_and_cache(key[:, :, :4].contiguous(), value[:, :, :4].contiguous(), kc, vc, slots, "fp8_e4m3")
    with pytest.raises(RuntimeError, match="slot_mapping"):  # one slot too few
        reshape_and_cache(key, value, kc, vc, slots[:3], "fp8_e4m3")
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        reshape_and_cache(key.double(), value.double(), kc, vc, slots, "fp8_e4m3")
    # Caches neither HND nor NHD in memory (rows padded), or K and V in different ones.
    padded = torch.zeros(2, 4, 2, 16, dtype=torch.uint8)[..., :8]
    with pytest.raises(RuntimeError, match="laid out as HND"):
        reshape_and_cache(key, value, padded, padded, slots, "fp8_e4m3")
    with pytest.raises(RuntimeError, match="one layout"):
        reshape_and_cache(key, value, kc, in_layout(vc, "HND"), slots, "fp8_e4m3")
    with pytest.raises(RuntimeError, match="laid out as HND"):
        cpu_ops.gather_cache(padded, slots, "fp8_e4m3", torch.float32)
    assert not kc.any() and not vc.any()


def test_wrapper_without_kernels_raises(monkeypatch):
    monkeypatch.setattr(cpu_ops, "load_cpu_ops", lambda: None)
    key, value, kc, vc, slots = _small_case()
    with pytest.raises(RuntimeError, match="not available"):
        reshape_and_cache(key, value, kc, vc, slots, "fp8_e4m3")


# -------------------------------------------------------------- reading back: gather_cache


@pytest.mark.parametrize("kv_layout", KV_CACHE_LAYOUTS)
@pytest.mark.parametrize("num_kv_heads,head_size", ROW_SHAPES)
@pytest.mark.parametrize("kv_format", list(KV_FORMATS))
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
def test_gather_cache_reads_back_what_the_write_returned(seed, dtype, kv_format, num_kv_heads, head_size,
                                                         kv_layout):
    """Every stored bit pattern of a random cache (all 256 FP8 codes among them) read back at
    scattered slots, repeated slots included: the torch reference decode bit for bit (NaN only
    as NaN), and the values reshape_and_cache's return_decoded gave when they were written."""
    g = torch.Generator().manual_seed(seed)
    storage = KV_STORAGE_DTYPES[kv_format]
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_size)
    if kv_format.startswith("fp8"):
        cache = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        cache.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    else:
        cache = (torch.randn(shape, generator=g) * 100).to(storage)
    cache = in_layout(cache, kv_layout)
    slots = torch.randint(0, NUM_BLOCKS * BLOCK_SIZE, (NUM_TOKENS,), generator=g)
    slots[:3] = torch.tensor([0, 0, NUM_BLOCKS * BLOCK_SIZE - 1])
    got = cpu_ops.gather_cache(cache, slots, kv_format, dtype)
    want = reference_decode(read_slots(cache, slots), kv_format, dtype)
    assert_same_values(got, want, f"seed={seed} {kv_format} -> {dtype} {kv_layout}")

    # Round trip through the writer: what it returned is what reading back gives.
    x = torch.randn(NUM_TOKENS, num_kv_heads, head_size, generator=g).to(dtype)
    k_cache = in_layout(torch.zeros(shape, dtype=storage), kv_layout)
    v_cache = in_layout(torch.zeros(shape, dtype=storage), kv_layout)
    write_slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:NUM_TOKENS]
    fp8 = kv_format.startswith("fp8")
    dk, _ = reshape_and_cache(x, x, k_cache, v_cache, write_slots, kv_format, FP8_K_SCALE if fp8 else 1.0,
                              FP8_V_SCALE if fp8 else 1.0, return_decoded=True)
    assert_same_values(cpu_ops.gather_cache(k_cache, write_slots, kv_format, dtype), dk, f"seed={seed} round trip")


def test_gather_cache_rejects_bad_arguments():
    cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, 8, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"slots\[1\] = 72 is outside the cache's 72 slots"):
        cpu_ops.gather_cache(cache, torch.tensor([0, NUM_BLOCKS * BLOCK_SIZE]), "fp8_e4m3", torch.float32)
    with pytest.raises(RuntimeError, match="outside"):
        cpu_ops.gather_cache(cache, torch.tensor([-1]), "fp8_e4m3", torch.float32)
    with pytest.raises(TypeError, match="stored as torch.bfloat16"):
        cpu_ops.gather_cache(cache, torch.tensor([0]), "bfloat16", torch.float32)
    with pytest.raises(TypeError, match="slots must be int64"):
        cpu_ops.gather_cache(cache, torch.tensor([0], dtype=torch.int32), "fp8_e4m3", torch.float32)
    with pytest.raises(TypeError, match="not torch.float64"):
        cpu_ops.gather_cache(cache, torch.tensor([0]), "fp8_e4m3", torch.float64)
    with pytest.raises(ValueError, match="unknown kv_format"):
        cpu_ops.gather_cache(cache, torch.tensor([0]), "fp4", torch.float32)
