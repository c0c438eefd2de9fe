// Eight floats at a time (AVX2 + FMA + F16C) for the elementwise kernels:
// loads and stores of float32 / bf16 / fp16 rows, rounding to a storage type
// in registers, FP8 encode/decode, exp. GCC 12 does not vectorize the scalar
// conversions in scalar_convert.h (it keeps their selects as branches), so
// the hot loops use these and leave only their tails to the scalar code.
// Every function here gives bit-identical results to its scalar twin.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FP8SERVE_VEC8 1
#include <immintrin.h>

#include <cstdint>

namespace fp8serve_vec8 {

// Storage tags: 0 float32, 1 bf16, 2 fp16.
template <int T>
inline __m256 load(const void* base, int64_t i) {
  if constexpr (T == 0) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (T == 1) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
  }
}

// float -> bf16 bits in the low half of each 32-bit lane (round to nearest
// even; NaN stays a quiet NaN).
inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), nan));
}

// Narrow eight 32-bit lanes holding values < 2^16 to eight uint16.
inline __m128i pack_u16(__m256i v) {
  return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

template <int T>
inline void store(void* base, int64_t i, __m256 v) {
  if constexpr (T == 0) {
    _mm256_storeu_ps(static_cast<float*>(base) + i, v);
  } else {
    __m128i h;
    if constexpr (T == 1) h = pack_u16(bf16_bits(v));
    else h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i), h);
  }
}

// Round to the storage type and back.
template <int T>
inline __m256 round_to(__m256 v) {
  if constexpr (T == 0) return v;
  if constexpr (T == 1) return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Saturating, nearest-even FP8 encode of eight floats (see scalar_convert.h);
// result codes in the low byte of each 32-bit lane.
template <bool E4M3>
inline __m256i fp8_codes(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256 af = _mm256_min_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(E4M3 ? 448.0f : 57344.0f));
  const __m256i ac = _mm256_castps_si256(af);
  const __m256 sub_mult = _mm256_set1_ps(E4M3 ? 512.0f : 65536.0f);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_mul_ps(af, sub_mult), _mm256_set1_ps(8388608.0f))),
      _mm256_set1_epi32(0x4b000000));
  constexpr int shift = E4M3 ? 20 : 21;
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(ac, shift), _mm256_set1_epi32(1));
  const __m256i half_ulp = _mm256_set1_epi32((1 << (shift - 1)) - 1);
  const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(ac, _mm256_add_epi32(half_ulp, lsb)), shift),
                                          _mm256_set1_epi32(E4M3 ? (120 << 3) : (112 << 2)));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(E4M3 ? 0x3c800000 : 0x38800000), ac);
  __m256i code = _mm256_blendv_epi8(normal, sub, is_sub);
  const __m256i is_nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), is_nan);
  return _mm256_or_si256(sign, code);
}

// Store the low bytes of eight 32-bit lanes.
inline void store_bytes(uint8_t* p, __m256i codes) {
  const __m128i w = pack_u16(codes);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
}

// Eight FP8 codes -> floats (scale 1), exact: e5m2 is the top byte of a
// half; e4m3 placed as (sign << 15) | ((code & 0x7f) << 7) is a half worth
// value * 2^-8. NaN codes decode to NaN.
template <bool E4M3>
inline __m256 fp8_decode(const uint8_t* p) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if constexpr (!E4M3) {
    return _mm256_cvtph_ps(pack_u16(_mm256_slli_epi32(c, 8)));
  } else {
    const __m256i h = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 8),
                                      _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x7f)), 7));
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(pack_u16(h)), _mm256_set1_ps(256.0f));
    const __m256i is_nan = _mm256_cmpeq_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x7f)), _mm256_set1_epi32(0x7f));
    return _mm256_blendv_ps(v, _mm256_set1_ps(__builtin_nanf("")), _mm256_castsi256_ps(is_nan));
  }
}

// exp(x), same algorithm and constants as scalar_convert.h's exp_f32.
inline __m256 exp(__m256 x) {
  const __m256 overflow = _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.7f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
  // 2^n as 2^n1 * 2^n2 (see exp_f32), n1 = n / 2 rounded toward zero.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(_mm256_add_epi32(ni, _mm256_srli_epi32(ni, 31)), 1);
  const __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 e2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_blendv_ps(_mm256_mul_ps(_mm256_mul_ps(p, e1), e2), _mm256_set1_ps(__builtin_inff()), overflow);
}

// exp(x) for x <= 88 where nothing has to match a scalar twin bit for bit
// (so not covered by the bit-identity promise above): the reduction and
// polynomial of exp with FMAs, 2^n built in the exponent field (~17
// instructions against ~30 for exp above). Inputs below -87.3 give
// exp(-87.3); a NaN input gives exp(-87.3) too (vmaxps returns its second
// operand for NaN), so callers must keep NaN another way. Used by the
// float32-only paths: random sampling's exponentials and silu_f32_fast;
// vec16.h exp_fma is the 16-lane twin.
inline __m256 exp_fma(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// silu(g) = g / (1 + exp(-g)) for float32 results, vec16.h silu_f32_fast on
// 8 lanes: exp_fma and a reciprocal (vrcpps, 12 bits, and one Newton step:
// ~2^-23) instead of exp and a vdivps. Valid for g >= -80 (callers take the
// exact path for vectors with a lane below -80); NaN stays NaN (g * inv).
inline __m256 silu_f32_fast(__m256 g) {
  const __m256 den = _mm256_add_ps(exp_fma(_mm256_sub_ps(_mm256_setzero_ps(), g)), _mm256_set1_ps(1.f));
  __m256 inv = _mm256_rcp_ps(den);  // den in [1, e^80 + 1]
  inv = _mm256_fmadd_ps(inv, _mm256_fnmadd_ps(den, inv, _mm256_set1_ps(1.f)), inv);
  return _mm256_mul_ps(g, inv);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace fp8serve_vec8
#endif
