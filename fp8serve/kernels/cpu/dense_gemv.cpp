// Linear layers with float32 or bf16 weights for a few activation rows
// (decode at small batch): out[m, n] = sum_k w[n, k] * x[m, k] (+ bias[n]).
//
// At M = 1..16 a linear layer reads its whole weight to do 2 * M flops per
// weight element: it is bound by memory. torch's CPU GEMV for bf16 weights
// reached ~8 GB/s here (a 2-vCPU Xeon whose read bandwidth is ~20 GB/s); this
// kernel streams each weight row once, converts bf16 to float32 with one shift
// and feeds every activation row from the same registers. Accumulation is in
// float32, the result rounded once to x's dtype, as torch's linear does
// (the summation order differs, so 16-bit outputs may differ by one ulp).
//
// Threads: rows of w are split over torch's thread pool (at::parallel_for).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "float_staging.h"
#include "scalar_convert.h"
#include "vec8.h"

namespace {

using namespace fp8serve_cvt;

constexpr int64_t kMaxRows = 16;      // activation rows per call
constexpr int64_t kTileRows = 8;      // activation rows per register tile
// Weight rows per pass over the activation tiles: their bytes (64 * K * 2 or
// 4) stay in L2 while each tile of 8 activation rows re-reads them, so the
// weight comes from memory once per call whatever M.
constexpr int64_t kRowBlock = 64;
constexpr int64_t kMinRowsPerTask = 32;  // weight rows per thread task, at least

// WT: 0 float32 weights, 1 bf16 weights (the storage tags of scalar_convert.h).
// dots[r * MT + m] = sum_k w[r][k] * x[m][k] for R weight rows, MT activation rows.
// Each 64 bytes of a row also prefetch the same columns `prefetch_ahead` bytes
// further on (two tiles of rows ahead): rows are short, so the hardware
// prefetchers barely ramp up before a stream ends (see fp8_gemm.cpp, where
// this doubled the batch-1 read rate).
template <int WT, int R, int MT>
inline void dot_tile(const char* w, int64_t w_row_bytes, const float* x, int64_t K, float* dots,
                     int64_t prefetch_ahead) {
  int64_t k = 0;
#ifdef FP8SERVE_VEC8
  namespace v8 = fp8serve_vec8;
  constexpr int64_t kElemBytes = WT == 0 ? 4 : 2;
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    if (((k * kElemBytes) & 63) == 0) {
      for (int r = 0; r < R; ++r) _mm_prefetch(w + r * w_row_bytes + k * kElemBytes + prefetch_ahead, _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 wv = v8::load<WT>(w + r * w_row_bytes, k);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) dots[r * MT + m] = v8::hsum(acc[r][m]);
#else
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) dots[r * MT + m] = 0.f;
#endif
  for (; k < K; ++k) {
    for (int r = 0; r < R; ++r) {
      const float wv = load_as_f32<WT>(w + r * w_row_bytes, k);
      for (int m = 0; m < MT; ++m) dots[r * MT + m] += wv * x[m * K + k];
    }
  }
}

template <int WT, int MT>
void rows(float* out, const float* x, const char* w, int64_t w_row_bytes, const float* bias, int64_t N, int64_t K,
          int64_t n_begin, int64_t n_end) {
  // R * MT <= 8 accumulators leave registers for the weight vectors.
  constexpr int R = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;
  float dots[R * MT];
  int64_t n = n_begin;
  const auto emit = [&](int64_t n0, int rr) {
    for (int r = 0; r < rr; ++r) {
      const float b = bias ? bias[n0 + r] : 0.f;
      for (int m = 0; m < MT; ++m) out[m * N + n0 + r] = dots[r * MT + m] + b;
    }
  };
  for (; n + R <= n_end; n += R) {
    dot_tile<WT, R, MT>(w + n * w_row_bytes, w_row_bytes, x, K, dots, 2 * R * w_row_bytes);
    emit(n, R);
  }
  for (; n < n_end; ++n) {
    dot_tile<WT, 1, MT>(w + n * w_row_bytes, w_row_bytes, x, K, dots, 2 * w_row_bytes);
    emit(n, 1);
  }
}

template <int WT>
void rows_any(int64_t mt, float* out, const float* x, const char* w, int64_t wrb, const float* bias, int64_t N,
              int64_t K, int64_t b, int64_t e) {
  switch (mt) {
#define FP8SERVE_CASE(T) \
  case T: rows<WT, T>(out, x, w, wrb, bias, N, K, b, e); break;
    FP8SERVE_CASE(1) FP8SERVE_CASE(2) FP8SERVE_CASE(3) FP8SERVE_CASE(4)
    FP8SERVE_CASE(5) FP8SERVE_CASE(6) FP8SERVE_CASE(7) FP8SERVE_CASE(8)
#undef FP8SERVE_CASE
    default: TORCH_CHECK(false, "bad activation tile ", mt);
  }
}

}  // namespace

// x: [M, K] float32 or bf16 (rows contiguous), M <= 16; w: [N, K] contiguous,
// float32 or bf16; bias: [N] or none. Returns [M, N] in x's dtype.
at::Tensor dense_gemv(at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && w.device().is_cpu(), "x must be a [M, K] CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bf16");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "w must be a contiguous [N, K] float32 or bf16 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "w has ", w.size(1), " columns, x has ", K);
  TORCH_CHECK(M <= kMaxRows, "dense_gemv takes at most ", kMaxRows, " rows, got ", M);
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const fp8serve_staging::Float32Staging io(xc, out);
  const float* xp = io.x;
  float* op = io.out;
  const char* wp = static_cast<const char*>(w.data_ptr());
  const int64_t wrb = K * w.element_size();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  const bool wbf16 = w.scalar_type() == at::kBFloat16;
  at::parallel_for(0, N, kMinRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kRowBlock) {
      const int64_t n1 = std::min(end, n0 + kRowBlock);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int64_t mt = std::min(kTileRows, M - m0);
        if (wbf16) rows_any<1>(mt, op + m0 * N, xp + m0 * K, wp, wrb, bp, N, K, n0, n1);
        else rows_any<0>(mt, op + m0 * N, xp + m0 * K, wp, wrb, bp, N, K, n0, n1);
      }
    }
    io.narrow(M, begin, end);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(fp8serve, m) {
  m.def("dense_gemv", &dense_gemv);
}
