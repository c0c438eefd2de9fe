// silu of every 16-bit gate, already rounded to the storage type: a 16-bit
// gate has only 65536 values, so the exp and the division become one table
// read, and the result is by construction the bits the scalar code gives
// (which equal torch's for every gate: tests). 64K entries of 16 bits (128
// KiB, L2-resident) plus one of padding, because the 16-lane gathers read 32
// bits at an entry's address (silu_bf16_from_table16). Shared by silu_and_mul
// (layer_ops.cpp) and the gated decode GEMV (dense_gemv_packed.cpp), so a
// fused result has the two steps' bits.
#pragma once

#include <cstdint>

#include "scalar_convert.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace fp8serve_act {

template <int T>
struct SiluTable {
  uint16_t bits[65536 + 1] = {};
  SiluTable() {
    using namespace fp8serve_cvt;
    for (uint32_t b = 0; b < 65536; ++b) {
      const uint16_t h = static_cast<uint16_t>(b);
      const float gv = load_as_f32<T>(&h, 0);
      store_from_f32<T>(&bits[b], 0, round_to<T>(gv / (1.0f + exp_f32(-gv))));
    }
  }
};

// The table of storage type T (1 bf16, 2 fp16), built once per type on first use (~1 ms).
template <int T>
const uint16_t* silu_table() {
  static const SiluTable<T> table;
  return table.bits;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// silu of 16 bf16 gates (their bits, one per 32-bit lane's low half) as float32: a table read each.
inline __m512 silu_bf16_from_table16(const uint16_t* table, __m512i gate_bits) {
  const __m512i sb = _mm512_and_si512(_mm512_i32gather_epi32(gate_bits, reinterpret_cast<const int*>(table), 2),
                                      _mm512_set1_epi32(0xffff));
  return _mm512_castsi512_ps(_mm512_slli_epi32(sb, 16));
}
#endif

}  // namespace fp8serve_act
