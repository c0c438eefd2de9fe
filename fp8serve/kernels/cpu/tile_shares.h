// How the tiled GEMMs (bf16_tiled_gemm.cpp, fp8_tiled_gemm.cpp) split one
// call among threads, and the gated forms' fallback: shared so both kernels
// cut the same work the same way (each output's sums run in the same order
// for any thread count either way).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "silu_mul_row.h"

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

// out [M, d] = silu(gate_up[:, :d]) * gate_up[:, d:], gate_up [M, 2d]: the
// gated forms' two steps where their fused loop does not apply.
inline void silu_mul_rows(const float* gate_up, float* out, int64_t M, int64_t d) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      fp8serve_act::silu_mul_row(gate_up + m * 2 * d, gate_up + m * 2 * d + d, out + m * d, static_cast<int>(d));
  });
}

}  // namespace fp8serve_tiles
