// silu(g) * u for one float32 row: what silu_and_mul (layer_ops.cpp) runs on
// float32 rows (after its 16-lane loop on AVX-512 builds), and what the tiled
// GEMMs' gated forms (bf16_tiled_gemm.cpp, fp8_tiled_gemm.cpp) run on whole
// 16-column panels of a row. The 8-lane groups start at multiples of 8 in
// both, so a fused result has the unfused one's bits on builds without
// AVX-512.
#pragma once

#include "scalar_convert.h"
#include "vec8.h"

namespace fp8serve_act {

inline void silu_mul_row(const float* g, const float* u, float* out, int n) {
  int i = 0;
#ifdef FP8SERVE_VEC8
  namespace v8 = fp8serve_vec8;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i), uv = _mm256_loadu_ps(u + i);
    if (!_mm256_movemask_ps(_mm256_cmp_ps(gv, _mm256_set1_ps(-80.f), _CMP_LT_OQ))) {
      _mm256_storeu_ps(out + i, _mm256_mul_ps(v8::silu_f32_fast(gv), uv));
      continue;
    }
    const __m256 neg = _mm256_sub_ps(_mm256_setzero_ps(), gv);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, v8::exp(neg))), uv));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.0f + fp8serve_cvt::exp_f32(-g[i])) * u[i];
}

}  // namespace fp8serve_act
