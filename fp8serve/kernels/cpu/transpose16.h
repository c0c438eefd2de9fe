// A 16 x 16 transpose of 32-bit elements in AVX-512 registers, for packing
// activation rows into AMX B tiles (amx_linear.cpp, amx_fp8_linear.cpp).
//
// Why: those kernels put each row's 16 bf16 pairs of a 32-element chunk down
// one column of a tile with a scatter. On the 2-vCPU Xeon with AMX a 16-lane
// scatter took ~10 ns (amx_linear with K = 1536, N = 16, hot: 4.6 us at 1 row,
// 11.8 at 16, 23.7 at 32), and the packing runs on one thread before the
// weight blocks are split: at 16 rows about 0.5 ms of a default-model decode
// step. The transpose is 64 shuffles for all 16 rows, so it pays from a few
// rows on; callers keep the scatter for blocks of fewer rows.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

namespace fp8serve_transpose {

// Blocks of at least this many rows take the transpose, fewer the scatters
// (a scatter per row against 64 shuffles per block: about even at 2-3 rows).
constexpr int64_t kTransposeMinRows = 4;

// r[i] = row i of a 16 x 16 matrix of 32-bit elements -> r[j] = its column j.
inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16];
  // Pairs of rows interleaved: per 128-bit lane L, t[2i] holds columns
  // 4L, 4L + 1 of rows 2i, 2i + 1 and t[2i + 1] columns 4L + 2, 4L + 3.
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // Quads: per lane L, r[4i + j] holds column 4L + j of rows 4i .. 4i + 3.
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // Lanes: column 4L + j is lane L of r[j], r[4 + j], r[8 + j], r[12 + j].
  for (int j = 0; j < 4; ++j) {
    const __m512i a = _mm512_shuffle_i32x4(r[j], r[4 + j], _MM_SHUFFLE(2, 0, 2, 0));  // lanes 0, 2
    const __m512i b = _mm512_shuffle_i32x4(r[j], r[4 + j], _MM_SHUFFLE(3, 1, 3, 1));  // lanes 1, 3
    const __m512i c = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i d = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], _MM_SHUFFLE(3, 1, 3, 1));
    t[j] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(2, 0, 2, 0));       // lane 0: column j
    t[8 + j] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(3, 1, 3, 1));   // lane 2: column 8 + j
    t[4 + j] = _mm512_shuffle_i32x4(b, d, _MM_SHUFFLE(2, 0, 2, 0));   // lane 1: column 4 + j
    t[12 + j] = _mm512_shuffle_i32x4(b, d, _MM_SHUFFLE(3, 1, 3, 1));  // lane 3: column 12 + j
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

}  // namespace fp8serve_transpose

#endif
