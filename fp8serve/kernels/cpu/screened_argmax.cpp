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
// where a = (scale[v] * sx_m) * (xq_m . codes[v]), xq_m = x_m quantized to
// integers in [-x_levels, x_levels] with step sx_m (the dot product exact in
// int32, the two multiplies in float32), and logit is the full head's float32
// result; slack[v] (the caller's, in float64, rounded up: build_screen)
// covers the copy's error |w_v - scale_v codes_v|_2, the full head's float32
// rounding, x's quantization and the screen's three roundings. The
// comparisons below are in float32 with an absolute margin that covers their
// own rounding (see `margin`).
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

// dots[m] = sum_k codes[k] * xq[m][k] for MT activation rows, in int32: exact
// in any order, as every partial sum is within 127 K x_levels < 2^31 (the
// caller's check). Integer multiply-adds (vpmaddwd: 16 codes in 3
// instructions) instead of float32 FMAs (8 codes in 3: widen, convert, FMA):
// the float32 form ran below the memory's read rate on an AVX2-only EPYC.
// KS independent accumulator sets along k, so one row's short dot product
// does not wait on a single chain's latency.
template <int MT>
inline void screen_row(const int16_t* xq, int64_t K, const int8_t* codes, int32_t* dots) {
  int64_t k = 0;
#ifdef __AVX2__
  constexpr int KS = MT == 1 ? 4 : MT == 2 ? 2 : 1;
  __m256i acc[KS][MT];
  for (int s = 0; s < KS; ++s)
    for (int m = 0; m < MT; ++m) acc[s][m] = _mm256_setzero_si256();
  const auto step = [&](int s, int64_t kk) {
    const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + kk)));
    for (int m = 0; m < MT; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + kk));
      acc[s][m] = _mm256_add_epi32(acc[s][m], _mm256_madd_epi16(c, xv));
    }
  };
  for (; k + 16 * KS <= K; k += 16 * KS)
    for (int s = 0; s < KS; ++s) step(s, k + 16 * s);
  for (; k + 16 <= K; k += 16) step(0, k);
  for (int s = 1; s < KS; ++s)
    for (int m = 0; m < MT; ++m) acc[0][m] = _mm256_add_epi32(acc[0][m], acc[s][m]);
  for (int m = 0; m < MT; ++m) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc[0][m]), _mm256_extracti128_si256(acc[0][m], 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    dots[m] = _mm_cvtsi128_si32(h);
  }
#else
  for (int m = 0; m < MT; ++m) dots[m] = 0;
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MT; ++m) dots[m] += static_cast<int32_t>(codes[k]) * xq[m * K + k];
}

// Each row's lower and upper bound terms as a row of the copy is screened:
// lo = max over v of a - |x| slack, big = max of |a| + |x| slack (see margin).
struct Extremes {
  float lo[kMaxRows], big[kMaxRows];
};

// a[m][v] = (scale[v] * sx[m]) * dots[m] in float32 (the rounding of both
// multiplies and of the conversion is inside slack: build_screen).
template <int MT>
void screen_rows(const int16_t* xq, const float* sx, int64_t K, const int8_t* codes, const float* scale,
                 const float* slack, const float* norm, int64_t V, int64_t begin, int64_t end, float* a,
                 Extremes& ex) {
  int32_t dots[MT];
  for (int64_t v = begin; v < end; ++v) {
    if (v + kPrefetchRows < end) {
      const int8_t* ahead = codes + (v + kPrefetchRows) * K;
      for (int64_t off = 0; off < K; off += 64) fp8serve_prefetch::line<fp8serve_prefetch::kL2>(ahead + off);
    }
    screen_row<MT>(xq, K, codes + v * K, dots);
    for (int m = 0; m < MT; ++m) {
      const float av = (scale[v] * sx[m]) * static_cast<float>(dots[m]);
      const float b = norm[m] * slack[v];
      a[m * V + v] = av;
      ex.lo[m] = std::max(ex.lo[m], av - b);
      ex.big[m] = std::max(ex.big[m], std::fabs(av) + b);
    }
  }
}

void screen_rows_any(int64_t M, const int16_t* xq, const float* sx, int64_t K, const int8_t* codes,
                     const float* scale, const float* slack, const float* norm, int64_t V, int64_t begin,
                     int64_t end, float* a, Extremes& ex) {
  switch (M) {
#define FP8SERVE_CASE(T) \
  case T: screen_rows<T>(xq, sx, K, codes, scale, slack, norm, V, begin, end, a, ex); break;
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
                               double logit_rel_gap, double flushed_weight_max, int64_t x_levels) {
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
  TORCH_CHECK(x_levels >= 1 && x_levels <= 32767 && 127 * K * x_levels <= std::numeric_limits<int32_t>::max(),
              "screened_candidates: x_levels must be in [1, 32767] with 127 * K * x_levels < 2^31 (K = ", K,
              "), got ", x_levels);
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

  // Each row of x as integers in [-x_levels, x_levels]: xq = round(x / sx),
  // sx = max|x| / x_levels, all in float32 as screened_logits_ref repeats them
  // (|x - sx xq| <= (1/2 + 2^-8) sx: build_screen's bound).
  float sx[kMaxRows];
  std::vector<int16_t> xq(M * K);
  const float levels = static_cast<float>(x_levels);
  for (int64_t m = 0; m < M; ++m) {
    float xmax = 0.f;
    for (int64_t k = 0; k < K; ++k) xmax = std::max(xmax, std::fabs(xp[m * K + k]));
    sx[m] = xmax > 0.f ? xmax / levels : 1.f;
    // A subnormal step would break the relative rounding bounds: the full head decides.
    if (sx[m] < std::numeric_limits<float>::min()) return at::empty({0}, at::kLong);
    const float inv = 1.f / sx[m];
    for (int64_t k = 0; k < K; ++k) {
      const float q = std::nearbyint(xp[m * K + k] * inv);
      xq[m * K + k] = static_cast<int16_t>(std::min(levels, std::max(-levels, q)));
    }
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
    screen_rows_any(M, xq.data(), sx, K, cp, sp, lp, norm, V, begin, end, a.data(), t.ex);
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
