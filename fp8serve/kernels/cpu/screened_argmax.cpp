// The screen of the exact greedy LM head (kernels/screened_argmax.py): which
// vocabulary rows can hold a row of x's largest logit, found from an int8 copy
// of the head instead of the head itself.
//
// Why: at decode batch 1 the LM head is the largest single read of a step
// (the default model's tied 49152 x 576 float32 head: 113 MB of 538), and a
// greedy step only needs the index of the largest logit. The int8 copy
// (one scale per row) is a quarter of a float32 head's bytes; every row whose
// screened logit, widened by a bound on its error, can reach the best
// screened lower bound is a candidate; the caller computes the candidates'
// logits exactly as the full head would and takes their argmax. On the
// default model, 1024 positions of English text left a median of 6
// candidates per row (mean 13, max 426).
//
// The bound, per row v and activation row m:
//   |a[m][v] - logit[m][v]| <= |x_m|_2 * slack[v]
// where a = scale[v] * (x_m . codes[v]) in float32 and logit is the full
// head's float32 result; slack[v] (the caller's, in float64, rounded up)
// covers the copy's error |w_v - scale_v codes_v|_2 and the float32 rounding
// of both dot products (gamma_K |x| |w| each). The comparisons below are in
// float32 with an absolute margin that covers their own rounding (see
// `margin`).
//
// Two more terms serve a full head that is not a plain float32 dot product
// (a bf16 head under bf16 compute: vdpbf16ps sums, logits rounded to bf16):
//   - logit_rel_gap: the full head rounds each float32 sum to a narrower
//     format whose rounding interval at y is at most logit_rel_gap * |y| wide.
//     Rows whose sums round to the same value as the largest one tie with
//     it, and the first index of a tie wins, so each candidate test is
//     widened by that width at the largest |logit| (`big` below bounds it).
//   - flushed_weight_max >= 0: the full head reads denormal inputs as zero
//     and flushes denormal results (vdpbf16ps), each change below 2^-126 in
//     a product or a sum: K * 2^-126 * (max|w| + max|x_m| + 1), doubled,
//     bounds them all; < 0: no such head.
//
// Returns the sorted union over the rows of x of their candidates (int64), or
// an empty tensor when x is not finite (the caller then runs the full head,
// which keeps NaN semantics).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "prefetch_level.h"
#include "vec16.h"
#include "vec8.h"

namespace {

constexpr int64_t kMaxRows = 8;           // activation rows per call
constexpr int64_t kMinRowsPerTask = 512;  // vocabulary rows per thread task, at least
// Rows of the copy prefetched ahead (into L2). A row of int8 codes is a few
// lines and dozens of instructions per line, so the out-of-order window
// alone keeps too few lines in flight: on the AVX2 Zen 3 EPYC (the default
// model's 49152 x 576 copy, cold, one row of x, 12 alternating rounds, two
// runs) 8 rows ahead ran 1.16-1.26x as fast as none; 2-4 rows 1.14-1.19x,
// 12-16 1.16-1.23x, a prefetch 1-4 KiB ahead every 64 bytes 1.05-1.21x.
constexpr int64_t kPrefetchRows = 8;

// a[m] = scale * sum_k x[m][k] * codes[k] for MT activation rows, float32
// FMAs with KS independent accumulator sets along k (one row of the copy is
// a short dot product: a single FMA chain would wait on its own latency).
template <int MT>
inline void screen_row(const float* x, int64_t K, const int8_t* codes, float scale, float* a) {
  constexpr int KS = MT == 1 ? 4 : MT == 2 ? 2 : 1;
  int64_t k = 0;
  float dots[MT];
#ifdef FP8SERVE_VEC16
  // 16 codes per step: half the converts and FMAs of the 8-lane loop (the
  // order of the sums differs; slack's gamma terms bound any order).
  __m512 acc[KS][MT];
  for (int s = 0; s < KS; ++s)
    for (int m = 0; m < MT; ++m) acc[s][m] = _mm512_setzero_ps();
  const auto step = [&](int s, int64_t kk) {
    const __m128i c16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + kk));
    const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c16));
    for (int m = 0; m < MT; ++m) acc[s][m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * K + kk), acc[s][m]);
  };
  for (; k + 16 * KS <= K; k += 16 * KS)
    for (int s = 0; s < KS; ++s) step(s, k + 16 * s);
  for (; k + 16 <= K; k += 16) step(0, k);
  for (int s = 1; s < KS; ++s)
    for (int m = 0; m < MT; ++m) acc[0][m] = _mm512_add_ps(acc[0][m], acc[s][m]);
  for (int m = 0; m < MT; ++m) dots[m] = _mm512_reduce_add_ps(acc[0][m]);
#elif defined(FP8SERVE_VEC8)
  __m256 acc[KS][MT];
  for (int s = 0; s < KS; ++s)
    for (int m = 0; m < MT; ++m) acc[s][m] = _mm256_setzero_ps();
  const auto step = [&](int s, int64_t kk) {
    const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + kk));
    const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8));
    for (int m = 0; m < MT; ++m) acc[s][m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * K + kk), acc[s][m]);
  };
  for (; k + 8 * KS <= K; k += 8 * KS)
    for (int s = 0; s < KS; ++s) step(s, k + 8 * s);
  for (; k + 8 <= K; k += 8) step(0, k);
  for (int s = 1; s < KS; ++s)
    for (int m = 0; m < MT; ++m) acc[0][m] = _mm256_add_ps(acc[0][m], acc[s][m]);
  for (int m = 0; m < MT; ++m) dots[m] = fp8serve_vec8::hsum(acc[0][m]);
#else
  for (int m = 0; m < MT; ++m) dots[m] = 0.f;
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MT; ++m) dots[m] = std::fma(static_cast<float>(codes[k]), x[m * K + k], dots[m]);
  for (int m = 0; m < MT; ++m) a[m] = scale * dots[m];
}

// Each row's lower and upper bound terms as a row of the copy is screened:
// lo = max over v of a - |x| slack, big = max of |a| + |x| slack (see margin).
struct Extremes {
  float lo[kMaxRows], big[kMaxRows];
};

template <int MT>
void screen_rows(const float* x, int64_t K, const int8_t* codes, const float* scale, const float* slack,
                 const float* norm, int64_t V, int64_t begin, int64_t end, float* a, Extremes& ex) {
  float row[MT];
  for (int64_t v = begin; v < end; ++v) {
    if (v + kPrefetchRows < end) {
      const int8_t* ahead = codes + (v + kPrefetchRows) * K;
      for (int64_t off = 0; off < K; off += 64) fp8serve_prefetch::line<fp8serve_prefetch::kL2>(ahead + off);
    }
    screen_row<MT>(x, K, codes + v * K, scale[v], row);
    for (int m = 0; m < MT; ++m) {
      const float b = norm[m] * slack[v];
      a[m * V + v] = row[m];
      ex.lo[m] = std::max(ex.lo[m], row[m] - b);
      ex.big[m] = std::max(ex.big[m], std::fabs(row[m]) + b);
    }
  }
}

void screen_rows_any(int64_t M, const float* x, int64_t K, const int8_t* codes, const float* scale,
                     const float* slack, const float* norm, int64_t V, int64_t begin, int64_t end, float* a,
                     Extremes& ex) {
  switch (M) {
#define FP8SERVE_CASE(T) \
  case T: screen_rows<T>(x, K, codes, scale, slack, norm, V, begin, end, a, ex); break;
    FP8SERVE_CASE(1) FP8SERVE_CASE(2) FP8SERVE_CASE(3) FP8SERVE_CASE(4)
    FP8SERVE_CASE(5) FP8SERVE_CASE(6) FP8SERVE_CASE(7) FP8SERVE_CASE(8)
#undef FP8SERVE_CASE
    default: TORCH_CHECK(false, "screened_candidates: bad row count ", M);
  }
}

}  // namespace

// x: [M, K] float32, 1 <= M <= 8; codes: [V, K] int8; scale, slack: [V] float32;
// logit_rel_gap >= 0 and flushed_weight_max: see the top of the file.
at::Tensor screened_candidates(at::Tensor x, at::Tensor codes, at::Tensor scale, at::Tensor slack,
                               double logit_rel_gap, double flushed_weight_max) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "screened_candidates: x must be a [M, K] float32 CPU tensor");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "screened_candidates: codes must be a contiguous [V, K] int8 tensor");
  const int64_t M = x.size(0), K = x.size(1), V = codes.size(0);
  TORCH_CHECK(codes.size(1) == K, "screened_candidates: codes have ", codes.size(1), " columns, x has ", K);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "screened_candidates takes 1 to ", kMaxRows, " rows, got ", M);
  TORCH_CHECK(V >= 1, "screened_candidates: empty vocabulary");
  for (const at::Tensor* t : {&scale, &slack})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == V && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "screened_candidates: scale and slack must be contiguous [V] float32 tensors");
  TORCH_CHECK(std::isfinite(logit_rel_gap) && logit_rel_gap >= 0 && logit_rel_gap < 1,
              "screened_candidates: logit_rel_gap must be in [0, 1), got ", logit_rel_gap);
  TORCH_CHECK(std::isfinite(flushed_weight_max), "screened_candidates: flushed_weight_max must be finite");
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* lp = slack.data_ptr<float>();

  // |x_m|_2, computed in double and rounded up to float: a bound, never an
  // underestimate; and the flush term of row m (see the top of the file).
  float norm[kMaxRows];
  double flush[kMaxRows];
  for (int64_t m = 0; m < M; ++m) {
    double s = 0.0, xmax = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      s += static_cast<double>(xp[m * K + k]) * xp[m * K + k];
      xmax = std::max(xmax, std::fabs(static_cast<double>(xp[m * K + k])));
    }
    const double n = std::sqrt(s);
    if (!std::isfinite(n) || n > 1e30) return at::empty({0}, at::kLong);  // the full head decides
    norm[m] = std::nextafter(static_cast<float>(n), std::numeric_limits<float>::infinity());
    flush[m] = flushed_weight_max < 0 ? 0.0 : 2.0 * K * 0x1p-126 * (flushed_weight_max + xmax + 1.0);
  }

  // One pass over the copy (its bytes are the cost), split over the threads;
  // each task keeps its own extremes.
  std::vector<float> a(M * V);
  struct Task {
    Extremes ex;
    std::vector<int64_t> found;
  };
  std::vector<Task> tasks(std::max<int64_t>(1, at::get_num_threads()));
  for (Task& t : tasks) {
    std::fill(t.ex.lo, t.ex.lo + kMaxRows, -std::numeric_limits<float>::infinity());
    std::fill(t.ex.big, t.ex.big + kMaxRows, 0.f);
  }
  at::parallel_for(0, V, kMinRowsPerTask, [&](int64_t begin, int64_t end) {
    Task& t = tasks[at::get_thread_num()];
    screen_rows_any(M, xp, K, cp, sp, lp, norm, V, begin, end, a.data(), t.ex);
  });

  // Row m's best lower bound, and `margin`: every float32 product and sum
  // here is off by at most 2^-24 of |a| + |x| slack; 2^-20 of the largest
  // such value covers them on both sides of the comparison with room to spare.
  // The gap and flush terms join the margin, rounded up to float (tiny
  // against `big` where they are zero: 2^-120 keeps a rounding gap's test
  // wide enough for subnormal logits too).
  float best[kMaxRows], margin[kMaxRows];
  for (int64_t m = 0; m < M; ++m) {
    float lo = -std::numeric_limits<float>::infinity(), big = 0.f;
    for (const Task& t : tasks) lo = std::max(lo, t.ex.lo[m]), big = std::max(big, t.ex.big[m]);
    if (!std::isfinite(lo) || !std::isfinite(big)) return at::empty({0}, at::kLong);
    best[m] = lo;
    const double extra = logit_rel_gap > 0 ? logit_rel_gap * big + 0x1p-120 : 0.0;
    margin[m] = 2.f * big * 0x1p-20f +
                std::nextafter(static_cast<float>(extra + flush[m]), std::numeric_limits<float>::infinity());
    if (!std::isfinite(margin[m])) return at::empty({0}, at::kLong);
  }
  // A row of the head is a candidate when its upper bound a + |x| slack
  // reaches some row m's best lower bound.
  at::parallel_for(0, V, kMinRowsPerTask, [&](int64_t begin, int64_t end) {
    Task& t = tasks[at::get_thread_num()];
    for (int64_t v = begin; v < end; ++v) {
      for (int64_t m = 0; m < M; ++m) {
        if (a[m * V + v] + norm[m] * lp[v] + margin[m] >= best[m]) {
          t.found.push_back(v);
          break;
        }
      }
    }
  });
  std::vector<int64_t> out;  // tasks found disjoint ranges: sorting the union orders it
  for (const Task& t : tasks) out.insert(out.end(), t.found.begin(), t.found.end());
  std::sort(out.begin(), out.end());
  at::Tensor result = at::empty({static_cast<int64_t>(out.size())}, at::kLong);
  std::copy(out.begin(), out.end(), result.data_ptr<int64_t>());
  return result;
}

TORCH_LIBRARY_FRAGMENT(fp8serve, m) { m.def("screened_candidates", &screened_candidates); }
