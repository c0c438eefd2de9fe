"""The C++ paged decode-attention kernel (`paged_attention_decode`) against
float64 references, for every storage format, on fresh random data each run
(the seed is in every failure message; FP8SERVE_TEST_SEED replays one).

Two comparisons per case:
  - with `paged_attention_decode_ref` on the same stored cache: both decode the
    same codes exactly, so only float32 accumulation separates them, whatever
    the format;
  - with float64 attention over the unquantized K/V: the storage format's own
    rounding, at a tolerance per format. This one also checks that the e4m3
    2^8 decode factor and the k/v scales are folded where the contract says.

Every path is checked: the default (the AVX-512 tiles where the build CPU
has AVX-512F), the AVX-512 tiles forced, the AVX2
tiles (what AVX2-only CPUs run) and the portable scalar path (what non-AVX2
builds run), with several threads (contexts split and merged) and with one.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from fp8serve.attention.kv_cache_spec import KV_CACHE_LAYOUTS, as_layer_view, layout_of
from fp8serve.kernels.cpu_ops import (
    E4M3_DECODE_MULTIPLIER,
    KV_FORMATS,
    KV_STORAGE_DTYPES,
    decode_amx_available,
    decode_bf16_dot_available,
    paged_attention_decode,
    paged_attention_decode_ref,
)
from fp8serve.quantization.fp8 import dequantize_fp8, fp8_format, quantize_fp8


def in_memory_order(cache: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """A contiguous copy of a [blocks, block_size, kv heads, head_size] cache in
    `kv_layout`'s memory order (HND: [blocks, kv heads, block_size, head_size])."""
    return cache.transpose(1, 2).contiguous() if kv_layout == "HND" else cache.contiguous()


# Max |kernel - reference| / max |reference|, same stored codes: float32 sums
# over head_size and up to a few hundred tokens (observed ~1e-6).
TOL_SAME_CODES = {fmt: 2e-5 for fmt in KV_FORMATS}
# Against the K/V before they were stored, two exact checks instead of one
# tolerance on the attention: the kernel against float64 attention over the
# stored values as torch's own casts decode them (TOL_SAME_CODES), and every
# stored FP8 value within half a step of its original (the format's rounding:
# 2^(e - mantissa bits - 1) for an exponent e, at least the smallest normal
# one). A tolerance on the attention itself (0.3 for e5m2, "about three times
# what was observed") failed for a seed at 0.37: the softmax can amplify the
# format's error past any fixed share.
FP8_MANTISSA_BITS = {"fp8_e4m3": 3, "fp8_e5m2": 2}
FP8_MIN_NORMAL_EXPONENT = {"fp8_e4m3": -6, "fp8_e5m2": -14}
# Storage scales != 1 (FP8 only: 16/32-bit caches store values as they are).
K_SCALE, V_SCALE = 0.05, 0.03
# Sequence lengths: length 1, partial last blocks, one exactly full block, a long one.
SEQ_LENS = [1, 37, 16, 5, 300, 130, 2]




class Case:
    """A paged cache holding `seq_lens` sequences in scattered blocks (an odd
    number of them, block tables padded past each sequence's last block), the
    unquantized K/V it was written from, and the kernel's inputs."""

    def __init__(self, seed: int, kv_format: str, head_size: int, num_kv_heads: int, group: int,
                 seq_lens: list[int], block_size: int = 16, kv_layout: str = "HND") -> None:
        g = torch.Generator().manual_seed(seed)
        blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 4
        num_blocks += 1 - num_blocks % 2  # odd
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        self.key = torch.randn(shape, generator=g, dtype=torch.float64) * 2
        self.value = torch.randn(shape, generator=g, dtype=torch.float64) * 2
        is_fp8 = kv_format.startswith("fp8")
        k_scale, v_scale = (K_SCALE, V_SCALE) if is_fp8 else (1.0, 1.0)
        if is_fp8:
            fmt = fp8_format(kv_format)
            self.key_cache = quantize_fp8(self.key, k_scale, fmt)
            self.value_cache = quantize_fp8(self.value, v_scale, fmt)
        else:
            self.key_cache = self.key.to(KV_STORAGE_DTYPES[kv_format])
            self.value_cache = self.value.to(KV_STORAGE_DTYPES[kv_format])
        # The same codes in the layout's memory order, seen as [blocks, block_size, kv heads, head_size].
        self.key_cache = as_layer_view(in_memory_order(self.key_cache, kv_layout), kv_layout)
        self.value_cache = as_layer_view(in_memory_order(self.value_cache, kv_layout), kv_layout)
        assert layout_of(self.key_cache) == kv_layout or min(block_size, num_kv_heads) == 1
        ids = torch.randperm(num_blocks, generator=g).tolist()
        max_blocks = max(blocks_per_seq) + 1
        self.block_tables = torch.full((len(seq_lens), max_blocks), num_blocks - 1, dtype=torch.int64)
        start = 0
        for i, n in enumerate(blocks_per_seq):
            self.block_tables[i, :n] = torch.tensor(ids[start:start + n])
            start += n
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int64)
        self.q = torch.randn(len(seq_lens), num_kv_heads * group, head_size, generator=g, dtype=torch.float64)
        self.softmax_scale = head_size ** -0.5
        mult = E4M3_DECODE_MULTIPLIER if kv_format == "fp8_e4m3" else 1.0
        self.kernel_query = (self.q * (self.softmax_scale * k_scale * mult)).float()
        self.out_scale = v_scale * mult
        self.kv_format = kv_format
        self.block_size = block_size

    def run(self, path: str = "best") -> torch.Tensor:
        return paged_attention_decode(self.kernel_query, self.key_cache, self.value_cache, self.block_tables,
                                      self.seq_lens, self.kv_format, self.out_scale, path=path)

    def reference_same_codes(self) -> torch.Tensor:
        return paged_attention_decode_ref(self.kernel_query, self.key_cache, self.value_cache, self.block_tables,
                                          self.seq_lens, self.kv_format, self.out_scale)

    def stored_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 [blocks, block_size, kv heads, head_size] K and V as stored, decoded by torch's own
        casts (not the library's tables) and scaled back: what the kernel should attend to."""
        if not self.kv_format.startswith("fp8"):
            return self.key_cache.double(), self.value_cache.double()
        dtype = fp8_format(self.kv_format).torch_dtype
        return (self.key_cache.contiguous().view(dtype).double() * K_SCALE,
                self.value_cache.contiguous().view(dtype).double() * V_SCALE)

    def reference_stored(self) -> torch.Tensor:
        """float64 attention, from the float64 query, over the K/V as stored (`stored_values`)."""
        key, value = self.stored_values()
        num_seqs, num_heads, head_size = self.q.shape
        num_kv_heads = key.shape[2]
        out = torch.empty(num_seqs, num_heads, head_size, dtype=torch.float64)
        for b, n in enumerate(self.seq_lens.tolist()):
            pos = torch.arange(n)
            slots = self.block_tables[b, pos // self.block_size] * self.block_size + pos % self.block_size
            k = key.reshape(-1, num_kv_heads, head_size)[slots].repeat_interleave(num_heads // num_kv_heads, 1)
            v = value.reshape(-1, num_kv_heads, head_size)[slots].repeat_interleave(num_heads // num_kv_heads, 1)
            p = (torch.einsum("hd,nhd->hn", self.q[b], k) * self.softmax_scale).softmax(-1)
            out[b] = torch.einsum("hn,nhd->hd", p, v)
        return out

    def assert_stored_within_half_a_step(self) -> None:
        """Every stored FP8 value within half a step of the format's grid around its original (the
        division by the scale in float32 adds ~2^-24 relative); 16/32-bit caches are plain casts."""
        if not self.kv_format.startswith("fp8"):
            return
        for original, stored, scale in zip((self.key, self.value), self.stored_values(), (K_SCALE, V_SCALE)):
            y = original / scale
            e = torch.floor(torch.log2(y.abs())).clamp(min=FP8_MIN_NORMAL_EXPONENT[self.kv_format])
            half_step = torch.exp2(e - FP8_MANTISSA_BITS[self.kv_format] - 1)
            err = (stored / scale - y).abs()
            assert bool((err <= half_step * (1 + 2**-20) + y.abs() * 2**-23).all()), \
                f"{self.kv_format}: a stored value {(err / half_step).max().item() / 2:.3f} steps from its original"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("kv_layout", KV_CACHE_LAYOUTS)
@pytest.mark.parametrize("path", ["best", "avx512", "avx2", "scalar"])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("kv_format", list(KV_FORMATS))
def test_matches_references(ops, seed, kv_format, head_size, group, path, kv_layout):
    if path == "avx512" and not ops.has_avx512():
        pytest.skip("this build has no AVX-512 tiles")
    case = Case(seed, kv_format, head_size, num_kv_heads=2, group=group, seq_lens=SEQ_LENS, kv_layout=kv_layout)
    out = case.run(path)
    assert out.shape == case.q.shape and out.dtype == torch.float32
    err = rel_err(out, case.reference_same_codes())
    assert err < TOL_SAME_CODES[kv_format], f"seed={seed}: {err:.2e} from the reference on the same codes"
    err = rel_err(out, case.reference_stored())
    assert err < TOL_SAME_CODES[kv_format], f"seed={seed}: {err:.2e} from float64 attention over the stored K/V"
    case.assert_stored_within_half_a_step()


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("kv_format", ["bfloat16", "fp8_e4m3"])
def test_thread_counts_and_context_splits(ops, seed, kv_format, num_threads):
    """One long sequence (split across threads, then merged), and a batch of
    more sequences than it takes to split none."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for seq_lens in ([1000], [3, 200, 17] * 6):
            case = Case(seed, kv_format, 64, num_kv_heads=3, group=3, seq_lens=seq_lens)
            err = rel_err(case.run(), case.reference_same_codes())
            assert err < TOL_SAME_CODES[kv_format], f"seed={seed} lens={seq_lens[:3]}..: {err:.2e}"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("head_size,num_heads,num_kv_heads,block_size",
                         [(72, 6, 2, 16), (40, 24, 2, 5), (80, 10, 2, 1), (36, 4, 4, 16)])
def test_unusual_shapes(ops, seed, head_size, num_heads, num_kv_heads, block_size):
    """Head sizes off the 16-element step (72, 40, 80) or off the vector path
    altogether (36), GQA groups above 8 (12) and odd (5), blocks of 5 and 1 token. e4m3 too: on AMD
    CPUs its tiles read a query and keep a weighted V whose order depends on the head size's 16s
    and on the size of each slice of the group (paged_attention.cpp, e4m3_direct8)."""
    for kv_format in ("float32", "fp8_e5m2", "fp8_e4m3"):
        case = Case(seed, kv_format, head_size, num_kv_heads, num_heads // num_kv_heads, [1, 23, 70], block_size)
        err = rel_err(case.run(), case.reference_same_codes())
        assert err < TOL_SAME_CODES[kv_format], f"seed={seed} {kv_format}: {err:.2e}"


def test_vector_path_is_built_where_the_cpu_has_it(ops):
    from fp8serve.utils.platform import cpu_flags

    if os.environ.get("FP8SERVE_CPU_MARCH") or not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("not an AVX2/FMA/F16C build")
    assert ops.has_avx2()


def test_avx512_tiles_are_built_where_the_cpu_has_them(ops):
    from fp8serve.utils.platform import cpu_flags

    if os.environ.get("FP8SERVE_CPU_MARCH") or "avx512f" not in cpu_flags() or not ops.has_avx2():
        pytest.skip("not a native AVX-512F build")
    assert ops.has_avx512()


def test_prefetch_level_follows_the_cpu_vendor(ops):
    """Software prefetches (K/V rows, dense_gemv's weights) go to L2 on AMD and to L1
    elsewhere (prefetch_level.h)."""
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert ops.prefetch_level() == (2 if "AuthenticAMD" in cpuinfo else 1)


@pytest.mark.parametrize("kv_format", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_large_call_matches_the_forced_paths(ops, seed, kv_format):
    """A call over more than 8192 context tokens (long items, split contexts):
    the default path, the forced AVX2 tiles and, on AVX-512 builds, the
    AVX-512 tiles agree up to float32 summation order."""
    case = Case(seed, kv_format, 64, num_kv_heads=2, group=3, seq_lens=[4100, 4093, 33])
    ref = case.reference_same_codes()
    for path in ("best", "avx2") + (("avx512",) if ops.has_avx512() else ()):
        err = rel_err(case.run(path), ref)
        assert err < TOL_SAME_CODES[kv_format], f"seed={seed} path={path}: {err:.2e}"


@pytest.mark.parametrize("flush_denormal", [False, True], ids=["denormals", "flush_denormal"])
@pytest.mark.parametrize("head_size", [64, 72])
def test_e4m3_subnormal_codes_on_every_path(ops, seed, head_size, flush_denormal):
    """Half the K codes and every V code subnormal (zero exponent field): the
    AVX2 tiles on AMD CPUs decode e4m3 straight to float32 bits, where
    subnormal codes are float32 denormals, so a decode that flushed them (or a
    thread with DAZ/FTZ set, which must fall back to the F16C decode) would
    lose part of every score and all of the output. Head size 72 also runs the
    8-lane tail."""
    case = Case(seed, "fp8_e4m3", head_size, num_kv_heads=2, group=3, seq_lens=[1, 37, 300])
    g = torch.Generator().manual_seed(seed + 1)
    for cache, share in ((case.key_cache, 0.5), (case.value_cache, 1.0)):
        codes = cache.view(torch.uint8)
        subnormal = torch.rand(codes.shape, generator=g) < share
        codes[subnormal] &= 0x87
    if flush_denormal and not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        ref = case.reference_same_codes()
        for path in ("best", "avx2", "scalar") + (("avx512",) if ops.has_avx512() else ()):
            err = rel_err(case.run(path), ref)
            assert err < TOL_SAME_CODES["fp8_e4m3"], f"seed={seed} path={path}: {err:.2e}"
    finally:
        torch.set_flush_denormal(False)


def test_unknown_path_is_rejected(ops, seed):
    case = Case(seed, "bfloat16", 64, num_kv_heads=2, group=3, seq_lens=[5])
    with pytest.raises(ValueError, match="path"):
        case.run("avx1024")


def test_wrapper_rejects_bad_inputs(ops, seed):
    case = Case(seed, "fp8_e4m3", 64, num_kv_heads=2, group=3, seq_lens=[5, 20])
    q, k, v, bt, sl = case.kernel_query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens

    def call(q=q, k=k, v=v, bt=bt, sl=sl, fmt="fp8_e4m3"):
        return paged_attention_decode(q, k, v, bt, sl, fmt, 1.0)

    with pytest.raises(ValueError, match="kv_format"):
        call(fmt="fp8")
    with pytest.raises(TypeError, match="stored as"):
        call(fmt="bfloat16")
    with pytest.raises(TypeError, match="stored as"):
        call(k=k.float(), v=v.float())
    with pytest.raises(ValueError, match="shapes"):
        call(v=v[:-1])
    with pytest.raises(ValueError, match="shapes"):
        call(q=q[0])
    with pytest.raises(ValueError, match="do not match the cache"):
        call(q=q[:, :, :32].contiguous())
    with pytest.raises(ValueError, match="do not match the cache"):
        call(q=q[:, :5].contiguous())
    with pytest.raises(ValueError, match="sequences"):
        call(bt=bt[:1])
    with pytest.raises(ValueError, match="sequences"):
        call(sl=sl[:1])
    with pytest.raises(TypeError, match="int64"):
        call(sl=sl.int())
    # Neither HND nor NHD memory: rows padded to twice head_size.
    padded_k = torch.zeros(*k.shape[:3], 2 * k.shape[3], dtype=k.dtype)[..., :k.shape[3]]
    with pytest.raises(ValueError, match="laid out as HND"):
        call(k=padded_k, v=padded_k)
    with pytest.raises(ValueError, match="one layout"):  # K in NHD memory, V in HND
        call(k=in_memory_order(k, "NHD"))
    with pytest.raises(RuntimeError, match="laid out as HND"):  # the op checks it too
        ops.paged_attention_decode(torch.empty_like(q), q, padded_k, padded_k, bt, sl, KV_FORMATS["fp8_e4m3"], 1.0)
    # Checked in C++, where the kernel would otherwise read out of bounds.
    with pytest.raises(RuntimeError, match="seq_lens"):
        call(sl=torch.tensor([0, 20]))
    with pytest.raises(RuntimeError, match="seq_lens"):
        call(sl=torch.tensor([5, bt.shape[1] * case.block_size + 1]))
    bad = bt.clone()
    bad[1, 0] = k.shape[0]
    with pytest.raises(RuntimeError, match="block id"):
        call(bt=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_format", ["bfloat16", "fp8_e4m3"])
def test_fused_entry_scales_and_converts(ops, seed, kv_format, dtype):
    """`paged_attention_decode_fused` (what the cpu_paged backend calls) takes
    the unscaled query in the compute dtype as a strided view of a fused qkv
    row, scales it, and returns the output in that dtype: the same as scaling
    in float32, running the float32 entry and rounding once."""
    case = Case(seed, kv_format, 64, num_kv_heads=2, group=3, seq_lens=[1, 37, 130])
    n, h, d = case.q.shape
    q_scale = case.softmax_scale * (K_SCALE * E4M3_DECODE_MULTIPLIER if kv_format == "fp8_e4m3" else 1.0)
    qkv = torch.randn(n, h * d + 2 * 2 * d, dtype=torch.float64)
    qkv[:, : h * d] = case.q.reshape(n, -1)
    qkv = qkv.to(dtype)
    query = qkv[:, : h * d].view(n, h, d)  # row stride h * d + 4 * d: not contiguous
    assert not query.is_contiguous()
    out = ops.paged_attention_decode_fused(query, case.key_cache, case.value_cache, case.block_tables,
                                           case.seq_lens, KV_FORMATS[kv_format], q_scale, case.out_scale)
    # A bf16 query on an FP8 cache takes the AMX tiles, else the bf16 dot-product tiles (where built).
    path = "best"
    if dtype == torch.bfloat16 and kv_format.startswith("fp8") and decode_bf16_dot_available():
        path = "amx" if decode_amx_available() else "bf16dot"
    expected = paged_attention_decode(query.float() * q_scale, case.key_cache, case.value_cache,
                                      case.block_tables, case.seq_lens, kv_format, case.out_scale, path=path)
    assert out.dtype == dtype and out.shape == (n, h, d)
    if dtype == torch.float32:
        assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6), f"seed={seed}"
    else:
        assert torch.equal(out, expected.to(dtype)), f"seed={seed}"
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        ops.paged_attention_decode_fused(query.transpose(1, 2), case.key_cache, case.value_cache,
                                         case.block_tables, case.seq_lens, KV_FORMATS[kv_format], 1.0, 1.0)
    # The _out entry (decode plans) writes the same result into a given tensor.
    into = torch.full((n, h, d), float("nan"), dtype=dtype)
    ops.paged_attention_decode_fused_out(into, query, case.key_cache, case.value_cache, case.block_tables,
                                         case.seq_lens, KV_FORMATS[kv_format], q_scale, case.out_scale)
    assert torch.equal(into, out), f"seed={seed}"
    for bad in (torch.empty(n, h, d + 1, dtype=dtype), torch.empty(n, h, d, dtype=torch.float64),
                torch.empty(n, d, h, dtype=dtype).transpose(1, 2)):
        with pytest.raises(RuntimeError, match=f"out must be a contiguous \\[{n}, {h}, {d}\\] CPU tensor"):
            ops.paged_attention_decode_fused_out(bad, query, case.key_cache, case.value_cache, case.block_tables,
                                                 case.seq_lens, KV_FORMATS[kv_format], q_scale, case.out_scale)


# ------------------------------------------------------------ bf16 dot-product tiles

needs_bf16_dot = pytest.mark.skipif(not decode_bf16_dot_available(), reason="built without AVX512-BF16/VBMI")
# The tiles that take bf16 weights for V: vdpbf16ps, or AMX tiles (same decode, same roundings).
DOT_PATHS = ["bf16dot",
             pytest.param("amx", marks=pytest.mark.skipif(not decode_amx_available(), reason="no AMX decode tiles"))]
FP8_FORMATS = ["fp8_e4m3", "fp8_e5m2"]
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # 8 significant bits, round to nearest even


def fp8_decoded(case: Case, which: str) -> torch.Tensor:
    """The cache's K or V codes as the kernel's contract reads them (float64)."""
    codes = case.key_cache if which == "k" else case.value_cache
    v = dequantize_fp8(codes, 1.0, fp8_format(case.kv_format), torch.float64)
    return v / E4M3_DECODE_MULTIPLIER if case.kv_format == "fp8_e4m3" else v


def bf16_dot_bounds(case: Case) -> tuple[float, float]:
    """Bounds on max |bf16dot - reference| for the reference on the same codes
    with the query rounded to bf16 first, and with the exact query.

    Rounding the query (unit roundoff u = 2^-8) moves each score by at most
    u * S, S = sum_d |q_d k_d|; rounding each softmax weight moves it by at
    most a factor (1 + u), and the weights' sum is taken over the rounded
    weights. With every log-weight moved by at most eta, the normalized weights
    move by at most a factor e^(2 eta) each, so the output moves by at most
    (e^(2 eta) - 1) * max |v| (times out_scale). Products of bf16 values are
    exact in float32; float32 sums add the same-codes tolerance."""
    q = case.kernel_query.double()
    k = fp8_decoded(case, "k").abs()
    num_kv_heads, head_size = k.shape[2], k.shape[3]
    group = q.shape[1] // num_kv_heads
    s_max = 0.0
    for b, n in enumerate(case.seq_lens.tolist()):
        pos = torch.arange(n)
        slots = case.block_tables[b, pos // case.block_size] * case.block_size + pos % case.block_size
        kb = k.reshape(-1, num_kv_heads, head_size)[slots].repeat_interleave(group, 1)  # [n, h, d]
        s_max = max(s_max, torch.einsum("hd,nhd->hn", q[b].abs(), kb).max().item())
    v_max = fp8_decoded(case, "v").abs().max().item() * case.out_scale
    eta_p = BF16_UNIT_ROUNDOFF * 1.01  # the weight's rounding, with room for exp's float32 error
    rounded_q = (math.exp(2 * eta_p) - 1) * v_max
    exact_q = (math.exp(2 * (eta_p + BF16_UNIT_ROUNDOFF * s_max)) - 1) * v_max
    return rounded_q, exact_q


@needs_bf16_dot
@pytest.mark.parametrize("kv_format", FP8_FORMATS)
def test_bf16_dot_decodes_every_code_exactly(ops, kv_format):
    """Every finite code through the tiles' FP8 -> bf16 decode (normals by their
    exponent, subnormals by the table), against the float64 dequantization."""
    fmt = fp8_format(kv_format)
    codes = torch.arange(256, dtype=torch.uint8)
    ref = dequantize_fp8(codes, 1.0, fmt, torch.float64)
    finite = ref.isfinite()
    codes, ref = codes[finite], ref[finite]
    if kv_format == "fp8_e4m3":
        ref = ref / E4M3_DECODE_MULTIPLIER
    # Shuffled and more than 64 codes, so every lane position and the tail see every kind.
    order = torch.randperm(len(codes), generator=torch.Generator().manual_seed(0))
    out = ops.fp8_codes_to_bf16(codes[order].contiguous(), KV_FORMATS[kv_format])
    assert out.dtype == torch.bfloat16
    bad = (out.double() != ref[order]).nonzero().flatten()
    assert len(bad) == 0, [(int(codes[order][i]), out[i].item(), ref[order][i].item()) for i in bad[:5]]
    # Both zeros and every subnormal (7 or 3 mantissas, both signs) were among them:
    # the smallest normal is 2^-14 in the tiles' scale for either format.
    subnormals = ((ref != 0) & (ref.abs() < 2.0 ** -14)).sum().item()
    assert (ref == 0).sum() == 2 and subnormals == (14 if kv_format == "fp8_e4m3" else 6)


@needs_bf16_dot
@pytest.mark.parametrize("path", DOT_PATHS)
@pytest.mark.parametrize("kv_layout", KV_CACHE_LAYOUTS)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8, 12])  # 4: Llama-3-8B, Mixtral; 12: slices of 8 and 4 heads
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("kv_format", FP8_FORMATS)
def test_bf16_dot_within_its_rounding_of_the_reference(ops, seed, kv_format, head_size, group, kv_layout, path):
    """The bf16 tiles (vdpbf16ps or AMX) against the float64 reference on the
    same codes: within the bound of bf16_dot_bounds, with the query rounded to
    bf16 in the reference (only the weights' rounding left) and with the exact
    query."""
    case = Case(seed, kv_format, head_size, num_kv_heads=2, group=group, seq_lens=SEQ_LENS, kv_layout=kv_layout)
    out = case.run(path).double()
    ref = case.reference_same_codes().double()
    ref_rounded_q = paged_attention_decode_ref(case.kernel_query.bfloat16().float(), case.key_cache,
                                               case.value_cache, case.block_tables, case.seq_lens,
                                               kv_format, case.out_scale).double()
    bound_rounded_q, bound_exact_q = bf16_dot_bounds(case)
    slack = TOL_SAME_CODES[kv_format] * ref.abs().max().item()
    err_rounded_q = (out - ref_rounded_q).abs().max().item()
    err_exact_q = (out - ref).abs().max().item()
    assert err_rounded_q <= bound_rounded_q + slack, f"seed={seed}: {err_rounded_q:.2e} > {bound_rounded_q:.2e}"
    assert err_exact_q <= bound_exact_q + slack, f"seed={seed}: {err_exact_q:.2e} > {bound_exact_q:.2e}"
    # And far from the float32 tiles' agreement only by bf16's rounding: not by a broken lane.
    assert err_rounded_q > 0


@needs_bf16_dot
@pytest.mark.parametrize("path", DOT_PATHS)
@pytest.mark.parametrize("kv_format", FP8_FORMATS)
def test_bf16_dot_single_token_returns_its_value_row(ops, seed, kv_format, path):
    """With one token the weight is exactly 1: the output is the decoded V row
    times out_scale, exactly (checks the V interleave and its un-permuting)."""
    case = Case(seed, kv_format, 64, num_kv_heads=3, group=3, seq_lens=[1] * 5)
    out = case.run(path)
    slots = case.block_tables[:, 0] * case.block_size  # token 0 of each sequence's first block
    v = fp8_decoded(case, "v").reshape(-1, 3, 64)[slots].repeat_interleave(3, 1)  # [5, 9, 64], exact in float32
    expected = v.float() * torch.tensor(case.out_scale, dtype=torch.float32)  # the kernel's one rounding
    assert torch.equal(out, expected), f"seed={seed}"


@needs_bf16_dot
@pytest.mark.parametrize("path", DOT_PATHS)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_bf16_dot_context_splits_and_long_calls(ops, seed, num_threads, path):
    """Split contexts (merged afterwards), tiles of 64 tokens ending inside a
    block, and a call over 8192 tokens, on one thread and two."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for seq_lens in ([1000], [3, 200, 17] * 6, [4100, 4093, 33]):
            case = Case(seed, "fp8_e4m3", 64, num_kv_heads=3, group=3, seq_lens=seq_lens)
            err = (case.run(path).double() - case.reference_same_codes().double()).abs().max().item()
            bound = bf16_dot_bounds(case)[1] + TOL_SAME_CODES["fp8_e4m3"]
            assert err <= bound, f"seed={seed} lens={seq_lens[:3]}..: {err:.2e} > {bound:.2e}"
    finally:
        torch.set_num_threads(before)


E4M3_ONE_TO_FOUR = torch.tensor([0x38, 0x40, 0x44, 0x48], dtype=torch.uint8)  # 1.0, 2.0, 3.0, 4.0


@needs_bf16_dot
@pytest.mark.parametrize("num_threads", [2, 3])
def test_bf16_dot_thread_pieces_cut_across_sequences(ops, seed, num_threads):
    """Few sequences on the bf16 dot-product tiles: the batch's tokens in one
    piece per thread, cut inside a sequence wherever a piece ends (a short
    sequence whole inside a piece, one cut twice, a piece ending on a sequence's
    last token), alone and beside a shared prefix (cascade)."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for seq_lens in ([5, 700, 64, 1, 1300], [2], [65], [999, 1, 1, 1000], [64, 64, 64]):
            case = Case(seed, "fp8_e4m3", 64, num_kv_heads=3, group=3, seq_lens=seq_lens)
            err = (case.run("bf16dot").double() - case.reference_same_codes().double()).abs().max().item()
            bound = bf16_dot_bounds(case)[1] + TOL_SAME_CODES["fp8_e4m3"]
            assert err <= bound, f"seed={seed} lens={seq_lens}: {err:.2e} > {bound:.2e}"
            # Every token once: K codes 0 make every weight 1, and V values of 1-4 make
            # every sum exact, so the output is V's mean to float32 rounding; a token
            # missed or counted twice where a piece ends moves it by ~1/len.
            case.key_cache.view(torch.uint8).zero_()
            g = torch.Generator().manual_seed(seed)
            picks = torch.randint(0, 4, case.value_cache.shape, generator=g)
            case.value_cache.view(torch.uint8).copy_(E4M3_ONE_TO_FOUR[picks])
            err = rel_err(case.run("bf16dot"), case.reference_same_codes())
            assert err < 1e-6, f"seed={seed} lens={seq_lens}: uniform weights {err:.2e} from V's mean"
        case = Case(seed, "fp8_e4m3", 64, num_kv_heads=3, group=3, seq_lens=[700, 740, 705, 33])
        share_blocks(case, [0, 1, 2], 40)  # 640 tokens attended once, the rest split in pieces
        out = paged_attention_decode(case.kernel_query, case.key_cache, case.value_cache, case.block_tables,
                                     case.seq_lens, "fp8_e4m3", case.out_scale, path="bf16dot", cascade="always")
        err = (out.double() - case.reference_same_codes().double()).abs().max().item()
        bound = bf16_dot_bounds(case)[1] + TOL_SAME_CODES["fp8_e4m3"]
        assert err <= bound, f"seed={seed} (cascade): {err:.2e} > {bound:.2e}"
    finally:
        torch.set_num_threads(before)


@needs_bf16_dot
@pytest.mark.parametrize("path", DOT_PATHS)
def test_bf16_dot_path_leaves_what_it_does_not_cover_to_the_float32_tiles(ops, seed, path):
    """16/32-bit caches and head sizes other than 64 and 128 run the float32
    tiles on the "bf16dot" and "amx" paths: the same result as "best", bit for bit."""
    for kv_format, head_size in (("bfloat16", 64), ("float32", 64), ("fp8_e4m3", 80), ("fp8_e5m2", 48),
                                 ("fp8_e4m3", 32)):
        case = Case(seed, kv_format, head_size, num_kv_heads=2, group=3, seq_lens=[1, 37, 130])
        assert torch.equal(case.run(path), case.run("best")), f"{kv_format} head_size={head_size}"


@pytest.mark.skipif(not decode_amx_available(), reason="no AMX decode tiles")
@pytest.mark.parametrize("kv_format", FP8_FORMATS)
def test_amx_tiles_agree_with_the_bf16_dot_tiles(ops, seed, kv_format):
    """The AMX tiles round the query and the weights as the vdpbf16ps tiles do;
    only the float32 sums' order differs, so the two differ by at most the
    weights' rounding (bf16_dot_bounds with the rounded query), at every tile
    edge (15-17, 63-65 tokens) and for 8 heads in one slice."""
    for group in (3, 8):
        case = Case(seed, kv_format, 128, num_kv_heads=2, group=group, seq_lens=[1, 15, 16, 17, 63, 64, 65, 200])
        amx, dot = case.run("amx").double(), case.run("bf16dot").double()
        bound_rounded_q, _ = bf16_dot_bounds(case)
        slack = TOL_SAME_CODES[kv_format] * dot.abs().max().item()
        err = (amx - dot).abs().max().item()
        assert err <= bound_rounded_q + slack, f"seed={seed} group={group}: {err:.2e} > {bound_rounded_q:.2e}"


def test_amx_availability_follows_the_cpu(ops):
    from fp8serve.utils.platform import cpu_flags

    if os.environ.get("FP8SERVE_CPU_MARCH") or not ops.has_avx512():
        pytest.skip("not a native AVX-512 build")
    # Where the OS grants the tile state (Linux 5.16+), as on every AMX machine these kernels ran on.
    expected = {"amx_bf16", "amx_tile", "avx512_bf16", "avx512vbmi"} <= cpu_flags()
    assert decode_amx_available() == expected
    if not expected:
        case = Case(0, "fp8_e4m3", 64, num_kv_heads=1, group=1, seq_lens=[3])
        with pytest.raises(RuntimeError, match="no AMX decode tiles"):
            case.run("amx")


def test_bf16_dot_availability_follows_the_cpu(ops):
    from fp8serve.utils.platform import cpu_flags

    if os.environ.get("FP8SERVE_CPU_MARCH") or not ops.has_avx512():
        pytest.skip("not a native AVX-512 build")
    assert decode_bf16_dot_available() == ({"avx512_bf16", "avx512vbmi"} <= cpu_flags())


# ------------------------------------------------------------ cascade attention

CASCADE_PATHS = ["best", "avx512", "avx2", "scalar", "bf16dot", "amx"]


def share_blocks(case: Case, members: list[int], num_blocks: int) -> None:
    """Point the first `num_blocks` blocks of every member's table at the first
    member's (as prefix caching and n > 1 samples do); the references follow."""
    for b in members[1:]:
        case.block_tables[b, :num_blocks] = case.block_tables[members[0], :num_blocks]


def shared_case(seed: int, kv_format: str, head_size: int, group: int, num_kv_heads: int = 2) -> Case:
    """Three groups and two loners: 6 sequences sharing 5 blocks (one ends at
    the last shared token: nothing of its own), 3 sharing 2 blocks of which
    the shortest holds 20 tokens (the group shares 20), 2 sharing 1 block
    (a group of two), and sequences 11 and 12 alone."""
    lens = [80 + n for n in (1, 37, 0, 16, 5, 50)] + [20, 45, 33] + [17, 30] + [7, 90]
    case = Case(seed, kv_format, head_size, num_kv_heads=num_kv_heads, group=group, seq_lens=lens)
    share_blocks(case, [0, 1, 2, 3, 4, 5], 5)
    share_blocks(case, [6, 7, 8], 2)
    share_blocks(case, [9, 10], 1)
    return case


def test_shared_prefix_groups_follow_the_block_tables(ops, seed):
    case = shared_case(seed, "bfloat16", 64, 3)
    lengths = ops.shared_prefix_lengths(case.block_tables, case.seq_lens, 16, 2, 1)
    assert lengths.tolist() == [80] * 6 + [20] * 3 + [16] * 2 + [0, 0]
    # The engine's thresholds: members, and members x shared tokens.
    assert ops.shared_prefix_lengths(case.block_tables, case.seq_lens, 16, 3, 1).tolist() == \
        [80] * 6 + [20] * 3 + [0] * 4
    assert ops.shared_prefix_lengths(case.block_tables, case.seq_lens, 16, 2, 61).tolist() == [80] * 6 + [0] * 7
    # Blocks equal past a different first block are not a shared prefix: sequence 1,
    # given loner 11's first block, leaves the first group and shares 11's 7 tokens.
    case.block_tables[1, 0] = case.block_tables[11, 0]
    lengths = ops.shared_prefix_lengths(case.block_tables, case.seq_lens, 16, 2, 1)
    assert lengths.tolist() == [80, 7] + [80] * 4 + [20] * 3 + [16] * 2 + [7, 0]
    with pytest.raises(RuntimeError, match="seq_lens\\[0\\] = 1000 is outside"):
        ops.shared_prefix_lengths(case.block_tables, torch.full_like(case.seq_lens, 1000), 16, 2, 1)


@pytest.mark.parametrize("path", CASCADE_PATHS)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("kv_format", list(KV_FORMATS))
def test_cascade_matches_references(ops, seed, kv_format, head_size, group, path):
    """Cascade attention (each group's shared blocks attended once, by the
    prefill kernel's prefix form, and merged with the rest by log-sum-exp)
    against the same references as the plain kernel, at the same tolerances;
    on the bf16 dot-product tiles, within their rounding bound."""
    if path == "avx512" and not ops.has_avx512():
        pytest.skip("this build has no AVX-512 tiles")
    if path == "bf16dot" and not decode_bf16_dot_available():
        pytest.skip("built without AVX512-BF16/VBMI")
    if path == "amx" and not decode_amx_available():
        pytest.skip("no AMX decode tiles")
    case = shared_case(seed, kv_format, head_size, group)
    calls = ops.cascade_attention_stats()[0]
    out = paged_attention_decode(case.kernel_query, case.key_cache, case.value_cache, case.block_tables,
                                 case.seq_lens, kv_format, case.out_scale, path=path, cascade="always")
    assert ops.cascade_attention_stats()[0] == calls + 1
    assert out.shape == case.q.shape and out.dtype == torch.float32
    ref = case.reference_same_codes()
    if path in ("bf16dot", "amx") and kv_format.startswith("fp8"):
        bound_rounded_q, _ = bf16_dot_bounds(case)
        ref_rounded_q = paged_attention_decode_ref(case.kernel_query.bfloat16().float(), case.key_cache,
                                                   case.value_cache, case.block_tables, case.seq_lens,
                                                   kv_format, case.out_scale).double()
        slack = TOL_SAME_CODES[kv_format] * ref.abs().max().item()
        err = (out.double() - ref_rounded_q).abs().max().item()
        assert err <= bound_rounded_q + slack, f"seed={seed}: {err:.2e} > {bound_rounded_q:.2e}"
        return
    err = rel_err(out, ref)
    assert err < TOL_SAME_CODES[kv_format], f"seed={seed}: {err:.2e} from the reference on the same codes"
    err = rel_err(out, case.reference_stored())
    assert err < TOL_SAME_CODES[kv_format], f"seed={seed}: {err:.2e} from float64 attention over the stored K/V"
    case.assert_stored_within_half_a_step()


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_cascade_with_thread_counts_and_long_prefixes(ops, seed, num_threads):
    """More threads than work, and a prefix long enough for several key blocks
    and packing units of the prefix kernel, beside a loner split over threads."""
    lens = [700 + n for n in (3, 40, 17, 1)] + [900]
    case = Case(seed, "fp8_e4m3", 64, num_kv_heads=3, group=3, seq_lens=lens)
    share_blocks(case, [0, 1, 2, 3], 43)  # 688 tokens
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = paged_attention_decode(case.kernel_query, case.key_cache, case.value_cache, case.block_tables,
                                     case.seq_lens, "fp8_e4m3", case.out_scale, cascade="always")
    finally:
        torch.set_num_threads(before)
    err = rel_err(out, case.reference_same_codes())
    assert err < TOL_SAME_CODES["fp8_e4m3"], f"seed={seed}: {err:.2e}"


def test_cascade_auto_follows_the_measured_rule(ops, seed):
    """'auto' (the engine's entry) runs the prefix phase only on the bf16 dot-product
    tiles and for 16+ sequences x 16384+ shared pairs; elsewhere it is the plain
    kernel, bit for bit."""
    lens = [1024 + 16 + i for i in range(16)]
    case = Case(seed, "fp8_e4m3", 64, num_kv_heads=1, group=3, seq_lens=lens)
    share_blocks(case, list(range(16)), 64)
    assert ops.shared_prefix_lengths(case.block_tables, case.seq_lens, 16, 16, 16384).tolist() == [1024] * 16
    args = (case.key_cache, case.value_cache, case.block_tables, case.seq_lens, "fp8_e4m3", case.out_scale)
    calls = ops.cascade_attention_stats()[0]
    # float32 tiles: never.
    auto = paged_attention_decode(case.kernel_query, *args, cascade="auto")
    assert ops.cascade_attention_stats()[0] == calls
    assert torch.equal(auto, paged_attention_decode(case.kernel_query, *args))
    if not decode_bf16_dot_available():
        return
    out = paged_attention_decode(case.kernel_query, *args, path="bf16dot", cascade="auto")
    assert ops.cascade_attention_stats()[0] == calls + 1
    bound_rounded_q, _ = bf16_dot_bounds(case)
    ref_rounded_q = paged_attention_decode_ref(case.kernel_query.bfloat16().float(), *args).double()
    err = (out.double() - ref_rounded_q).abs().max().item()
    assert err <= bound_rounded_q + TOL_SAME_CODES["fp8_e4m3"] * ref_rounded_q.abs().max().item(), f"seed={seed}"
    # One sequence fewer, or a prefix under 16384 pairs: the plain kernel.
    shorter = case.block_tables.clone()
    shorter[1, 63] = shorter[1, 64]  # 63 blocks shared: 16 x 1008 = 16128 pairs
    for bt, sl in ((case.block_tables[:15], case.seq_lens[:15]), (shorter, case.seq_lens)):
        args2 = (case.key_cache, case.value_cache, bt.contiguous(), sl.contiguous(), "fp8_e4m3", case.out_scale)
        q = case.kernel_query[: len(sl)]
        before = ops.cascade_attention_stats()[0]
        auto = paged_attention_decode(q, *args2, path="bf16dot", cascade="auto")
        assert ops.cascade_attention_stats()[0] == before
        assert torch.equal(auto, paged_attention_decode(q, *args2, path="bf16dot"))


def test_cascade_mode_is_checked(ops, seed):
    case = shared_case(seed, "bfloat16", 64, 3)
    args = (case.kernel_query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, "bfloat16",
            case.out_scale)
    with pytest.raises(ValueError, match="unknown cascade mode 'sometimes'"):
        paged_attention_decode(*args, cascade="sometimes")
    with pytest.raises(RuntimeError, match="cascade must be 0, 1 or 2, got 5"):
        ops.paged_attention_decode_fused_cascade(case.q.float(), case.key_cache, case.value_cache,
                                                 case.block_tables, case.seq_lens, KV_FORMATS["bfloat16"], 1.0, 1.0, 5)
    with pytest.raises(RuntimeError, match="cascade mode must be 0, 1 or 2, got -1"):
        ops.set_cascade_attention(-1)
