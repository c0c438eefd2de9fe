// Sixteen floats at a time (AVX-512F) for the elementwise kernels, where the
// build CPU has AVX-512: vec8.h's loads, stores, rounding to a storage type
// and exp, lane for lane the same operations, so results are bit-identical to
// vec8.h and to the scalar code. The 16-bit paths (bf16 compute is only
// picked on AMX / AVX512-BF16 CPUs, which all have AVX-512) spent most of
// their time emulating round-to-nearest-even in integer lanes; twice the lanes
// halve that, and AVX512-BF16 does it in one instruction (bf16_packed; see
// layer_ops.cpp for the measurements).
#pragma once

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__F16C__)
#define FP8SERVE_VEC16 1
#include <immintrin.h>

#include <cstdint>

namespace fp8serve_vec16 {

// Storage tags: 0 float32, 1 bf16, 2 fp16.
template <int T>
inline __m512 load(const void* base, int64_t i) {
  if constexpr (T == 0) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (T == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }
}

// float -> bf16 bits in the low half of each 32-bit lane (round to nearest
// even; NaN stays a quiet NaN), as fp8serve_vec8::bf16_bits.
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, rounded, quiet);
}

// The 16 bf16 values of float lanes, packed. Where the CPU converts in one
// instruction (AVX512-BF16 vcvtneps2bf16: round to nearest even, NaN quieted
// as bf16_bits does) that instruction does it, except that it flushes float32
// denormal inputs to zero: lanes holding one (rare: |x| < 2^-126) take the
// integer path, so the bits stay those of bf16_bits (the every-bf16-gate
// SiluAndMul test covers them). Gains in layer_ops.cpp's header.
inline __m256i bf16_packed(__m512 v) {
#ifdef __AVX512BF16__
  const __m256bh h = _mm512_cvtneps_pbh(v);
  const __m256i hw = reinterpret_cast<const __m256i&>(h);
  const __mmask16 denormal = _mm512_fpclass_ps_mask(v, 0x20);
  if (__builtin_expect(denormal == 0, 1)) return hw;
  return _mm256_mask_blend_epi16(denormal, hw, _mm512_cvtepi32_epi16(bf16_bits(v)));
#else
  return _mm512_cvtepi32_epi16(bf16_bits(v));  // values < 2^16: truncation is exact
#endif
}

template <int T>
inline void store(void* base, int64_t i, __m512 v) {
  if constexpr (T == 0) {
    _mm512_storeu_ps(static_cast<float*>(base) + i, v);
  } else {
    __m256i h;
    if constexpr (T == 1) h = bf16_packed(v);
    else h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i), h);
  }
}

// Round to the storage type and back.
template <int T>
inline __m512 round_to(__m512 v) {
  if constexpr (T == 0) return v;
  if constexpr (T == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_packed(v)), 16));
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp(x), fp8serve_vec8::exp on 16 lanes (no FMAs: the scalar twin has none).
inline __m512 exp(__m512 x) {
  const __mmask16 overflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72283935546875f), _CMP_GT_OQ);
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
  const __m512i ni = _mm512_cvtps_epi32(n);
  const __m512i n1 = _mm512_srai_epi32(_mm512_add_epi32(ni, _mm512_srli_epi32(ni, 31)), 1);
  const __m512i n2 = _mm512_sub_epi32(ni, n1);
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
  const __m512 e2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
  return _mm512_mask_blend_ps(overflow, _mm512_mul_ps(_mm512_mul_ps(p, e1), e2), _mm512_set1_ps(__builtin_inff()));
}

// exp(x) for x <= 88 where nothing has to match a scalar twin bit for bit:
// exp's reduction and polynomial with FMAs, and vscalefps for p * 2^n
// (~15 instructions against ~35 for exp above, which must match its scalar
// twin and so avoids FMAs and handles overflow). Inputs below -87.3 give
// exp(-87.3); NaN stays NaN. Used by float32-only paths: the AMX prefill
// attention's softmax (x <= 0) and silu_f32_fast (the vector prefill
// attention uses its own 2^x, prefill_attention.cpp exp2_le0_16).
inline __m512 exp_fma(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// silu(g) = g / (1 + exp(-g)) for float32 results, where nothing has to
// match torch bit for bit: exp_fma and a reciprocal (vrcp14ps and one Newton
// step, ~1 ulp) instead of the FMA-free exp and a vdivps, which alone costs
// ~16 cycles per vector. Relative error a few 2^-24 (tests: <= 1e-6 against
// float64 and torch). Valid for g >= -80 (exp(-g) finite); NaN stays NaN.
// Callers take the exact path for vectors with a lane below -80.
inline __m512 silu_f32_fast(__m512 g) {
  const __m512 den = _mm512_add_ps(exp_fma(_mm512_sub_ps(_mm512_setzero_ps(), g)), _mm512_set1_ps(1.f));
  __m512 inv = _mm512_rcp14_ps(den);  // den in [1, e^80 + 1]
  inv = _mm512_fmadd_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(1.f)), inv);
  return _mm512_mul_ps(g, inv);
}

// Saturating, nearest-even FP8 encode of 16 floats, fp8serve_vec8::fp8_codes
// lane for lane (same operations, masks instead of blends); the 16 codes
// packed into bytes.
template <bool E4M3>
inline __m128i fp8_codes(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  // min_ps returns its second operand for a NaN lane: 448 / 57344, as the scalar select does.
  const __m512 af = _mm512_min_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(E4M3 ? 448.0f : 57344.0f));
  const __m512i ac = _mm512_castps_si512(af);
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(af, _mm512_set1_ps(E4M3 ? 512.0f : 65536.0f)),
                                        _mm512_set1_ps(8388608.0f))),
      _mm512_set1_epi32(0x4b000000));
  constexpr int shift = E4M3 ? 20 : 21;
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ac, shift), _mm512_set1_epi32(1));
  const __m512i half_ulp = _mm512_set1_epi32((1 << (shift - 1)) - 1);
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(ac, _mm512_add_epi32(half_ulp, lsb)), shift),
                                          _mm512_set1_epi32(E4M3 ? (120 << 3) : (112 << 2)));
  const __mmask16 is_sub = _mm512_cmplt_epi32_mask(ac, _mm512_set1_epi32(E4M3 ? 0x3c800000 : 0x38800000));
  __m512i code = _mm512_mask_blend_epi32(is_sub, normal, sub);
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7f800000));
  code = _mm512_mask_blend_epi32(is_nan, code, _mm512_set1_epi32(0x7f));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(sign, code));  // every lane < 256
}

// 16 FP8 codes -> floats (scale 1), fp8serve_vec8::fp8_decode lane for lane.
template <bool E4M3>
inline __m512 fp8_decode(const uint8_t* p) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if constexpr (!E4M3) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_slli_epi32(c, 8)));
  } else {
    const __m512i h = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 8),
                                      _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x7f)), 7));
    const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)), _mm512_set1_ps(256.0f));
    const __mmask16 is_nan =
        _mm512_cmpeq_epi32_mask(_mm512_and_si512(c, _mm512_set1_epi32(0x7f)), _mm512_set1_epi32(0x7f));
    return _mm512_mask_blend_ps(is_nan, v, _mm512_set1_ps(__builtin_nanf("")));
  }
}

}  // namespace fp8serve_vec16
#endif
