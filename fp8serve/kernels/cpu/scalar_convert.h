// Branch-free scalar conversions between float32 and the storage formats
// (bf16, fp16, fp8 e4m3 / e5m2), written so that GCC/Clang vectorize the
// loops that call them (`#pragma omp simd`, -fopenmp-simd): only integer and
// float arithmetic plus selects, no table lookups on the encode side.
//
// The elementwise kernels (cache write, RMSNorm, SiluAndMul, RoPE) are memory
// bound; what matters is one pass over memory with the conversion done in
// registers, not hand-written intrinsics.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fp8serve_cvt {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bfloat16 <-> float: a bf16 is the top half of a float; rounding to nearest,
// ties to even, as torch's `.to(torch.bfloat16)`; NaN stays a quiet NaN.
inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
}

// IEEE half <-> float by bit manipulation (normals, subnormals, inf, NaN),
// round to nearest even on the way down, as torch's cast.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  // Normal: rebias 15 -> 127. Subnormal: man * 2^-24 exactly in float.
  const float sub = static_cast<float>(man) * 5.9604644775390625e-08f;
  const uint32_t normal = ((exp + 112u) << 23) | (man << 13);
  const uint32_t infnan = 0x7f800000u | (man << 13);
  const uint32_t mag = exp == 0 ? f32_bits(sub) : (exp == 31 ? infnan : normal);
  return bits_f32(sign | mag);
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  const float af = bits_f32(a);
  // Subnormal half (|f| < 2^-14): round(|f| * 2^24) by the magic-add trick.
  const uint32_t sub = f32_bits(af * 16777216.0f + 8388608.0f) - 0x4b000000u;
  // Normal: round the mantissa to 10 bits, then rebias 127 -> 15.
  const uint32_t normal = ((a + 0xfffu + ((a >> 13) & 1u)) >> 13) - (112u << 10);
  uint32_t mag = a < 0x38800000u ? sub : normal;
  mag = a >= 0x477ff000u ? 0x7c00u : mag;  // rounds past 65504: inf
  mag = a > 0x7f800000u ? (0x7e00u | ((a >> 13) & 0x3ffu)) : mag;
  return static_cast<uint16_t>(sign | mag);
}

// float -> fp8 code of x / scale: saturating (finite values and +-inf map to
// +-max), round to nearest even, NaN -> 0x7f with the sign, exactly what
// `quantization.fp8.quantize_fp8` returns (division, not a reciprocal
// multiply, so the results are bit-identical).
inline uint8_t f32_to_e4m3(float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  const float af = bits_f32(a) < 448.0f ? bits_f32(a) : 448.0f;  // NaN handled below
  const uint32_t ac = f32_bits(af);
  // |x| < 2^-6: subnormal steps of 2^-9; code 8 (2^-6) comes out right too.
  const uint32_t sub = f32_bits(af * 512.0f + 8388608.0f) - 0x4b000000u;
  const uint32_t normal = ((ac + 0x7ffffu + ((ac >> 20) & 1u)) >> 20) - (120u << 3);
  uint32_t code = ac < 0x3c800000u ? sub : normal;
  code = a > 0x7f800000u ? 0x7fu : code;
  return static_cast<uint8_t>(sign | code);
}

inline uint8_t f32_to_e5m2(float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  const float af = bits_f32(a) < 57344.0f ? bits_f32(a) : 57344.0f;
  const uint32_t ac = f32_bits(af);
  // |x| < 2^-14: subnormal steps of 2^-16.
  const uint32_t sub = f32_bits(af * 65536.0f + 8388608.0f) - 0x4b000000u;
  const uint32_t normal = ((ac + 0xfffffu + ((ac >> 21) & 1u)) >> 21) - (112u << 2);
  uint32_t code = ac < 0x38800000u ? sub : normal;
  code = a > 0x7f800000u ? 0x7fu : code;
  return static_cast<uint8_t>(sign | code);
}

// fp8 code -> float (scale 1). e5m2 is the top byte of a half; e4m3 (bias 7,
// no infinities, 0x7f/0xff NaN) is rebuilt from its fields.
inline float e5m2_to_f32(uint8_t c) { return f16_to_f32(static_cast<uint16_t>(c) << 8); }

inline float e4m3_to_f32(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t exp = (c >> 3) & 0xfu, man = c & 0x7u;
  const float sub = static_cast<float>(man) * 0.001953125f;  // man * 2^-9
  const uint32_t normal = ((exp + 120u) << 23) | (man << 20);
  uint32_t mag = exp == 0 ? f32_bits(sub) : normal;
  mag = (c & 0x7fu) == 0x7fu ? 0x7fc00000u : mag;
  return bits_f32(sign | mag);
}

// exp(x) in float to ~2 ulp, branch-free (NaN in gives a number out: callers
// never pass NaN through it unchecked); exp(x > 88.72) is inf (Cody-Waite range reduction and a
// degree-6 polynomial); inputs below -87.3 give ~0, above 88.7 give inf.
inline float exp_f32(float x) {
  const bool overflow = x > 88.72283935546875f;  // ln(FLT_MAX): inf above, as expf
  x = x < 88.7f ? x : 88.7f;
  x = x > -87.3f ? x : -87.3f;
  // Round to nearest even by adding and removing 1.5 * 2^23 (|x * log2e| < 2^22).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n in two factors: n reaches 128 for x in (88.38, 88.7], where exp(x)
  // is still finite but 2^128 alone is not.
  const int32_t n1 = static_cast<int32_t>(n) / 2, n2 = static_cast<int32_t>(n) - n1;
  const float y = p * bits_f32(static_cast<uint32_t>(n1 + 127) << 23) * bits_f32(static_cast<uint32_t>(n2 + 127) << 23);
  return overflow ? bits_f32(0x7f800000u) : y;
}

// Element i of a row in storage format T (0 float32, 1 bf16, 2 fp16), the
// tags every elementwise kernel uses, as float32 and back.
template <int T>
inline float load_as_f32(const void* p, int64_t i) {
  if constexpr (T == 0) return static_cast<const float*>(p)[i];
  if constexpr (T == 1) return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

template <int T>
inline void store_from_f32(void* p, int64_t i, float v) {
  if constexpr (T == 0) static_cast<float*>(p)[i] = v;
  if constexpr (T == 1) static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  if constexpr (T == 2) static_cast<uint16_t*>(p)[i] = f32_to_f16(v);
}

// Round a float to storage format T and back.
template <int T>
inline float round_to(float v) {
  if constexpr (T == 0) return v;
  if constexpr (T == 1) return bf16_to_f32(f32_to_bf16(v));
  return f16_to_f32(f32_to_f16(v));
}

}  // namespace fp8serve_cvt
