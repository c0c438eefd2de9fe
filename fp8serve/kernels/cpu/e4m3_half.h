// e4m3 codes as fp16 bit patterns, for F16C to widen: the pattern
// (sign << 15) | ((code & 0x7f) << 7) is worth value * 2^-8 for normal and
// subnormal codes alike, and F16C converts it to float32 exactly; callers
// fold the 2^8 into their per-row scale (kE4M3HalfMultiplier). The NaN codes
// (0x7f, 0xff) decode as +-480: loaders reject them. Shared by the FP8 GEMV
// (fp8_gemm.cpp) and the tiled FP8 GEMM (fp8_tiled_gemm.cpp).
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif

namespace fp8serve_e4m3 {

constexpr float kE4M3HalfMultiplier = 256.f;  // 2^8: half_bits(code) is worth value * 2^-8

inline uint16_t e4m3_to_half_bits(uint8_t code) {
  return static_cast<uint16_t>(((code & 0x80u) << 8) | ((code & 0x7fu) << 7));
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// 8 codes -> 8 floats (value * 2^-8), in order. With AVX2 the pattern comes
// from a sign-extending widen: int16(int8(code)) << 7 has the sign in bits 15
// and 14 and the magnitude in bits 13..7; clearing bit 14 gives it.
inline __m256 half_decode8(const uint8_t* w) {
  __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
  h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(static_cast<int16_t>(0xbfff)));
  return _mm256_cvtph_ps(h);
}
#endif

}  // namespace fp8serve_e4m3
