// FP8 codes -> bf16 in registers by two byte-table lookups (AVX512-VBMI
// vpermi2b), shared by the decode attention's bf16 dot-product tiles
// (paged_attention.cpp) and the FP8 weights' packed GEMV (dense_gemv_packed.cpp).
//
// Every code of e4m3 / e5m2 is a bf16 exactly (3 or 2 mantissa bits fit in
// 7), subnormals included, and stays a normal bf16 in this scale, which
// vdpbf16ps needs (it reads bf16 denormals as 0): e4m3 decodes to value *
// 2^-8, e5m2 to the value. Callers fold the 2^8 into a scale.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#define FP8SERVE_FP8_BF16_LUT 1

namespace fp8serve_fp8bf16 {

// The formats, numbered as the kernels' KV formats (KV_FORMATS in cpu_ops.py).
constexpr int64_t kE4M3 = 3;
constexpr int64_t kE5M2 = 4;

// bf16 bits of the code with magnitude `mag` (the sign bit apart), in the
// scale above: e4m3 value * 2^-8, e5m2 the value (the NaN/inf codes decode as
// the finite pattern their bits give, as the attention's float32 tiles do).
template <int64_t F>
constexpr uint16_t bf16_of_magnitude(int mag) {
  if constexpr (F == kE4M3) {
    // Subnormals m * 2^-9 * 2^-8 = m * 2^-17 (exponent 0, no implicit one).
    constexpr uint16_t sub[8] = {0, 0x3700, 0x3780, 0x37C0, 0x3800, 0x3820, 0x3840, 0x3860};
    return (mag >> 3) == 0 ? sub[mag] : static_cast<uint16_t>((mag << 4) | 0x3800);
  } else {
    constexpr uint16_t sub[4] = {0, 0x3780, 0x3800, 0x3840};  // m * 2^-16
    return (mag >> 2) == 0 ? sub[mag] : static_cast<uint16_t>((mag << 5) + 0x3800);
  }
}

// The decode as two 128-entry byte tables (low and high byte of the bf16
// bits by magnitude), the operands of vpermi2b.
template <int64_t F>
struct Bf16ByteTables {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  constexpr Bf16ByteTables() : lo(), hi() {
    for (int m = 0; m < 128; ++m) {
      lo[m] = static_cast<uint8_t>(bf16_of_magnitude<F>(m) & 0xff);
      hi[m] = static_cast<uint8_t>(bf16_of_magnitude<F>(m) >> 8);
    }
  }
};
template <int64_t F>
inline constexpr Bf16ByteTables<F> kBf16ByteTables{};

struct ByteLut {
  __m512i lo0, lo1, hi0, hi1;
};
template <int64_t F>
inline ByteLut load_byte_lut() {
  const auto& t = kBf16ByteTables<F>;
  return {_mm512_load_si512(t.lo), _mm512_load_si512(t.lo + 64), _mm512_load_si512(t.hi), _mm512_load_si512(t.hi + 64)};
}

// 64 FP8 codes -> 64 bf16 in two vectors, by table: vpermi2b looks up the low
// and the high byte of each code's bf16 by its 7-bit magnitude (subnormals
// included, no special case), the sign goes back into the high byte, and two
// byte unpacks make the 16-bit lanes. Five instructions per 64 codes where
// rebasing the exponent and fixing subnormals took twelve. The unpacks work
// within 128-bit lanes, so lane k of `a` holds code 16 (k / 8) + k % 8 and
// lane k of `b` code 16 (k / 8) + 8 + k % 8.
inline void bf16_from_codes64(__m512i codes, const ByteLut& t, __m512i& a, __m512i& b) {
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, codes, t.lo1);
  __m512i hi = _mm512_permutex2var_epi8(t.hi0, codes, t.hi1);
  hi = _mm512_ternarylogic_epi32(hi, codes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // hi | sign
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}

}  // namespace fp8serve_fp8bf16

#endif
