// What the tiled GEMMs (bf16_tiled_gemm.cpp, fp8_tiled_gemm.cpp) share: how
// one call is split among threads, how rows of x are packed for the register
// tiles, how an 8-lane tile's sums reach the output, and the gated forms'
// fallback. Shared so both kernels cut the same work the same way and write
// the same bits from the same sums (each output's sums run in the same order
// for any thread count either way).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "silu_mul_row.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FP8SERVE_TILE8 1
#endif

namespace fp8serve_tiles {

// One share per thread of `tiles` row tiles x `panels` 16-column panels: a
// range of panels for all rows while each thread gets a few panels (each
// thread then packs the rows itself, which is small beside them), otherwise a
// range of row tiles for all panels. share(t0, t1, p0, p1) runs one share.
template <typename Share>
void for_each_share(int64_t tiles, int64_t panels, const Share& share) {
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), std::max(tiles, panels)));
  const bool by_panels = panels >= 4 * nt || panels >= tiles;
  at::parallel_for(0, nt, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (by_panels) {
        share(0, tiles, panels * i / nt, panels * (i + 1) / nt);
      } else {
        share(tiles * i / nt, tiles * (i + 1) / nt, 0, panels);
      }
    }
  });
}

// packed[t][k][r] = x[m0 + t * kMr + r, k0 + k] (0 past row M) for `tiles`
// tiles of kMr rows, k < kc: each k's broadcasts of a tile are consecutive.
template <int kMr>
void pack_rows(const float* x, int64_t M, int64_t K, int64_t m0, int64_t tiles, int64_t k0, int64_t kc,
               float* packed) {
  for (int64_t t = 0; t < tiles; ++t) {
    float* d = packed + t * kc * kMr;
    for (int r = 0; r < kMr; ++r) {
      const int64_t m = m0 + t * kMr + r;
      if (m < M) {
        const float* src = x + m * K + k0;
        for (int64_t k = 0; k < kc; ++k) d[k * kMr + r] = src[k];
      } else {
        for (int64_t k = 0; k < kc; ++k) d[k * kMr + r] = 0.f;
      }
    }
  }
}

#ifdef FP8SERVE_TILE8
// The end of an R x 16 tile kept on 8 lanes (lo: columns 0-7, hi: 8-15) in
// kSets accumulator sets: the sets added in a fixed order (set 0 first), then
// out = sums (+ what out holds, with `accumulate`: a later K block) (+ bias),
// in that order; nvalid < 16: only the first nvalid columns (the last panel
// of an N that is not a multiple of 16), the same additions element by
// element. The bias is read in the stores, not added to the accumulators
// first: that (through a zero-padded copy of it) made GCC's code 1.28x slower
// (bf16_tiled_gemm, ABBA).
template <int R, int kSets>
__attribute__((always_inline)) inline void finish_tile8(__m256 (&lo)[kSets][R], __m256 (&hi)[kSets][R], float* c,
                                                        int64_t ldc, bool accumulate, const float* bias,
                                                        int nvalid) {
  constexpr int kNr = 16;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int s = 1; s < kSets; ++s) {
      lo[0][r] = _mm256_add_ps(lo[0][r], lo[s][r]);
      hi[0][r] = _mm256_add_ps(hi[0][r], hi[s][r]);
    }
  }
  if (nvalid == kNr) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float* cr = c + r * ldc;
      if (accumulate) {
        lo[0][r] = _mm256_add_ps(lo[0][r], _mm256_loadu_ps(cr));
        hi[0][r] = _mm256_add_ps(hi[0][r], _mm256_loadu_ps(cr + 8));
      }
      if (bias) {
        lo[0][r] = _mm256_add_ps(lo[0][r], _mm256_loadu_ps(bias));
        hi[0][r] = _mm256_add_ps(hi[0][r], _mm256_loadu_ps(bias + 8));
      }
      _mm256_storeu_ps(cr, lo[0][r]);
      _mm256_storeu_ps(cr + 8, hi[0][r]);
    }
    return;
  }
  alignas(32) float t[R][kNr];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(t[r], lo[0][r]);
    _mm256_store_ps(t[r] + 8, hi[0][r]);
  }
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * ldc;
    for (int j = 0; j < nvalid; ++j) {
      const float v = accumulate ? t[r][j] + cr[j] : t[r][j];
      cr[j] = bias ? v + bias[j] : v;
    }
  }
}
#endif  // FP8SERVE_TILE8

// out [M, d] = silu(gate_up[:, :d]) * gate_up[:, d:], gate_up [M, 2d]: the
// gated forms' two steps where their fused loop does not apply.
inline void silu_mul_rows(const float* gate_up, float* out, int64_t M, int64_t d) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      fp8serve_act::silu_mul_row(gate_up + m * 2 * d, gate_up + m * 2 * d + d, out + m * d, static_cast<int>(d));
  });
}

}  // namespace fp8serve_tiles
