// e4m3 codes straight to float32 bits (AVX2), for the FP8 GEMV's sequential
// walk (fp8_gemm.cpp) and the AVX2 decode-attention tiles on AMD CPUs
// (paged_attention.cpp). The other decode (fp16 bit patterns and F16C, see
// those files) needs two unpacks or a widen, shifts, masks and two
// conversions per 16 codes; the conversions are two uops each on Zen 3.
//
// A sign-extending widen of the code to 32 bits, shifted left by 20, puts the
// sign in bit 31 and the exponent and mantissa in the low four bits of
// float32's exponent and the top three of its mantissa: masked with
// 0x87f00000 that is the float32 worth value * 2^-120 (float32's exponent
// bias, 127, minus e4m3's, 7), for normal and subnormal codes alike. Subnormal
// codes become float32 denormals, which costs nothing on AMD CPUs but is read
// as zero by a thread that flushes denormals: callers check denormals_kept()
// and keep the F16C decode otherwise. Callers also keep their sums away from
// the denormal range (each says how) and undo the 2^-120 by a power of two.
// The NaN codes (0x7f, 0xff) decode to +-480 * 2^-120, as the F16C decode
// gives +-480: loaders and the cache write never store them.
#pragma once

#include <cstdint>

namespace fp8serve_e4m3 {

// x[0, n) * factor in the order direct16_deinterleaved gives codes: each whole
// 16 its even elements, then its odd ones; a tail of fewer than 16 in order.
// For the other operand of a dot product over such codes (factor: a power of
// two in callers, so exact).
inline void deinterleave16(const float* x, int64_t n, float factor, float* out) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    for (int64_t e = 0; e < 8; ++e) {
      out[j + e] = x[j + 2 * e] * factor;
      out[j + 8 + e] = x[j + 2 * e + 1] * factor;
    }
  }
  for (; j < n; ++j) out[j] = x[j] * factor;
}

}  // namespace fp8serve_e4m3

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace fp8serve_e4m3 {

// 8 codes -> 8 floats worth value * 2^-120, in order.
inline __m256 direct8(const uint8_t* codes) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  return _mm256_castsi256_ps(
      _mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32(static_cast<int>(0x87f00000u))));
}

// 16 codes -> the same floats, deinterleaved: `even` holds codes 0, 2, ..,
// 14 and `odd` codes 1, 3, .., 15. One sign-extending widen to 16-bit lanes
// (vpmovsxbw) serves both halves, where direct8 takes one widen per 8 codes:
// a 32-bit lane then holds code 2i in its low half and code 2i + 1 in its
// high half, both sign-extended. Shifted left 20, the low half lands where
// direct8 puts a code (the high half shifts out); shifted left 4, the high
// half does, with the low half's top four bits (copies of its sign) in bits
// 16-19, which the mask clears. Five instructions per 16 codes against
// direct8's six: one widen (a cross-lane shuffle) instead of two.
// Callers whose sums run over the elements in any order (dot products:
// the other operand stored in the same order) or element by element (the
// order restored once at the end) can take it.
inline void direct16_deinterleaved(const uint8_t* codes, __m256& even, __m256& odd) {
  const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0x87f00000u));
  even = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 20), mask));
  odd = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 4), mask));
}

// Whether this thread computes with denormals: neither DAZ (bit 6) nor FTZ
// (bit 15) is set in its MXCSR, e.g. by torch.set_flush_denormal(True).
inline bool denormals_kept() { return (_mm_getcsr() & 0x8040u) == 0; }

}  // namespace fp8serve_e4m3

#endif
