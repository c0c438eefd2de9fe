// Linear layers over FP8 (e4m3) weights kept as one byte per element:
//   out[m, n] = scale[n] * sum_k e4m3(w[n, k]) * x[m, k] + bias[n]
//
// fp8_linear decodes the weights in registers and multiplies them with a few
// activation rows at once (decode, small M): the weight matrix is read from
// memory once per call, at one byte per element instead of four (float32) or
// two (bf16). fp8_dequantize writes decoded rows to a float buffer for the
// large-M path, where a float GEMM library is faster than these FMA loops
// (bf16 activations, and float32 on AVX-512 builds: AVX2-only builds run
// float32 activations on fp8_tiled_gemm.cpp, which decodes as it goes).
//
// e4m3 -> fp16 bits (see paged_attention.cpp): the fp16 pattern
// (sign << 15) | ((code & 0x7f) << 7) is worth value * 2^-8 for normals and
// subnormals alike; F16C converts it to float32 exactly. The 2^8 is folded into
// the per-row scale. The NaN codes (0x7f, 0xff) would decode as +-480: callers
// reject them when weights are loaded.
//
// With AVX2 the pattern comes from a sign-extending widen: int16(int8(code)) << 7
// has the sign in bits 15 and 14 and the magnitude in bits 13..7; clearing bit
// 14 gives the fp16 pattern in three integer instructions per 16 codes.
//
// On builds for AVX-512 CPUs the dot products run 32 codes at a time in
// 16-lane vectors first (same decode, half the instructions per code).
// Measured on the default model's 120 decode linears, 2-vCPU Xeon, weights on
// 2 MiB pages: 1.26x / 1.08x at M = 1 (bf16 / float32 activations), 1.0-1.11x
// at M = 2-8, 1.11-1.2x at M = 16; in a whole batch-1 engine step the
// difference was within the machine's noise (~1 ms of ~20).
//
// Threads: rows of w are split over torch's thread pool (at::parallel_for).
//
// Row walk at M = 1-2 (`Walk`, as in dense_gemv.cpp). Interleaved, the Xeon's
// best: R = 4 weight rows per tile and a software prefetch two tiles ahead. On
// AMD Zen 4 (2-vCPU EPYC guest) one row at a time with no software prefetch,
// and each vector loop's two FMAs on separate accumulators, ran the default
// model's 120 decode linears 1.28-1.41x as fast at M = 1 (1.22-1.26x on the
// 16-code AVX2 loop) and 1.07-1.20x at M = 2
// (benchmarks/results/fp8_linear_2026-11-30_zen4.md). AMD CPUs take it at
// M <= 2; Intel CPUs keep the interleaved walk. On AVX2-only builds (Zen 3)
// the sequential walk prefetches 4 KiB down its stream (kSeqPrefetchBytes).
// At M = 1 it also decodes codes straight to float32 bits (e4m3_direct.h,
// on activations scaled by a power of two: DirectX) over four FMA chains:
// the default model's 120 decode linears from memory ran 1.09-1.17x as fast on
// the AVX2-only Zen 3 EPYC (float32 and bf16 activations, two runs of
// benchmarks/fp8_linear.py --baseline-rev against the F16C decode;
// benchmarks/results/fp8_linear_direct_decode_2026-12-02_zen3.md), and
// another 1.08-1.15x with 16 codes per widen (direct16_deinterleaved, on
// activations stored in its order) against 8 (direct8), where the unchanged
// M = 2-16 gave 0.93-1.03x in the same runs
// (benchmarks/results/fp8_linear_direct_deinterleaved_2026-12-08_zen3.md).

// ATen rather than torch/torch.h: same types, a fraction of the compile time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "e4m3_direct.h"
#include "e4m3_half.h"
#include "row_walk.h"
#include "float_staging.h"
#include "vec16.h"
#include "vec8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FP8SERVE_GEMM_AVX2 1
#endif

// Tests build this file a second time without AVX2 under another namespace to
// check the scalar path on machines that have AVX2.
#ifndef FP8SERVE_GEMM_NS
#define FP8SERVE_GEMM_NS fp8serve
#endif

namespace {

using fp8serve_walk::kAutoWalk;
using fp8serve_walk::kInterleaved;
using fp8serve_walk::kMaxSequentialRows;
using fp8serve_walk::kSequential;

constexpr float kE4M3DecodeMultiplier = fp8serve_e4m3::kE4M3HalfMultiplier;  // 2^8, see header
using fp8serve_e4m3::e4m3_to_half_bits;

inline float half_bits_to_float(uint16_t h) {
#ifdef FP8SERVE_GEMM_AVX2
  return _cvtsh_ss(h);
#else
  // Only the patterns e4m3_to_half_bits makes: no inf/NaN exponents.
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  float v = exp == 0 ? std::ldexp(static_cast<float>(man), -24)
                     : std::ldexp(static_cast<float>(man | 0x400u), static_cast<int>(exp) - 25);
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits |= sign;
  std::memcpy(&v, &bits, 4);
  return v;
#endif
}

// value * 2^-8 of each code, for scalar tails and the scalar build.
struct DecodeTable {
  float v[256];
  DecodeTable() {
    for (int c = 0; c < 256; ++c) v[c] = half_bits_to_float(e4m3_to_half_bits(static_cast<uint8_t>(c)));
  }
};
const DecodeTable& decode_table() {
  static const DecodeTable table;
  return table;
}

#ifdef FP8SERVE_GEMM_AVX2
// 16 codes -> two vectors of 8 floats (value * 2^-8), in order.
inline void decode16(const uint8_t* w, __m256& lo, __m256& hi) {
  const __m256i bit14 = _mm256_set1_epi16(static_cast<int16_t>(0xbfff));
  __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), bit14);
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// 8 codes -> 8 floats (value * 2^-8).
inline __m256 decode8(const uint8_t* w) { return fp8serve_e4m3::half_decode8(w); }

// The direct decode (e4m3_direct.h: value * 2^-120 per code, exact; no F16C
// conversion, 16 codes at a time, deinterleaved), used by the sequential walk
// at one activation row, the only caller, on AMD CPUs. Its sums stay clear of
// float32's denormal range because the walk multiplies the activations by a
// power of two first (DirectX), and a thread that flushes denormals keeps
// decode16 (denormals_kept).
using fp8serve_e4m3::denormals_kept;

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FP8SERVE_GEMM_AVX512 1
// 32 codes -> two vectors of 16 floats (value * 2^-8), in order.
inline void decode32(const uint8_t* w, __m512& lo, __m512& hi) {
  __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  h = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16(static_cast<int16_t>(0xbfff)));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
#endif

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Activations for the direct decode loop: x * 2^shift (exact: a power of two),
// with shift chosen per call so that max |x| * 2^shift is about 2^100, and the
// factor that brings those sums back to the 2^-8 units of the other loops.
// x == nullptr: the loop is not used (no AVX2, x all zero or not finite).
struct DirectX {
  const float* x = nullptr;  // [M, K], row stride K like the caller's x
  float rescale = 1.f;       // 2^(112 - shift)
};

// Dot products of R weight rows with MT activation rows over `len` columns
// (row stride ld for both): dots[r][m] += sum_k decode(w[r * ld + k]) * x[m * ld + k].
// R * MT accumulators stay in registers (at most 8, leaving room for decoded
// weights), so each decoded weight vector feeds MT FMAs and each activation
// load R FMAs.
//
// `prefetch_ahead` (bytes): each 64-byte step also prefetches the same column
// range that many bytes further on. A tile's rows are short (K bytes), so the
// hardware prefetchers barely ramp up before a stream ends: measured on a
// 2-core Xeon at batch 1, one thread read the weights at 3.5 GB/s from memory
// against 13 GB/s from cache, and a plain sum reads 9 GB/s.
//
// kWide: first 32 codes at a time in 16-lane vectors where the build has
// AVX-512 (FP8SERVE_GEMM_AVX512); see the header for what it gains.
// kSplit: the vector loops' two FMAs per row go to two accumulators (the
// sequential walk's single row would otherwise wait on one FMA chain);
// prefetch_ahead 0: no software prefetch.
template <int R, int MT, bool kWide, bool kSplit = false>
inline void dot_tile(const uint8_t* w, const float* x, int64_t ld, int64_t len, float* dots,
                     int64_t prefetch_ahead, const float* x_direct = nullptr, float rescale = 1.f) {
  int64_t k = 0;
#ifdef FP8SERVE_GEMM_AVX2
  __m256 acc[R][MT], acc_hi[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = acc_hi[r][m] = _mm256_setzero_ps();
#ifdef FP8SERVE_GEMM_AVX512
  if constexpr (kWide) {
    __m512 wide[R][MT], wide_hi[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) wide[r][m] = wide_hi[r][m] = _mm512_setzero_ps();
    for (; k + 32 <= len; k += 32) {
      if (prefetch_ahead > 0 && (k & 63) == 0) {
        for (int r = 0; r < R; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(w + r * ld + k + prefetch_ahead), _MM_HINT_T0);
      }
      for (int r = 0; r < R; ++r) {
        __m512 lo, hi;
        decode32(w + r * ld + k, lo, hi);
        for (int m = 0; m < MT; ++m) {
          wide[r][m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + m * ld + k), wide[r][m]);
          const __m512 xh = _mm512_loadu_ps(x + m * ld + k + 16);
          if constexpr (kSplit) wide_hi[r][m] = _mm512_fmadd_ps(hi, xh, wide_hi[r][m]);
          else wide[r][m] = _mm512_fmadd_ps(hi, xh, wide[r][m]);
        }
      }
    }
    if constexpr (kSplit)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MT; ++m) wide[r][m] = _mm512_add_ps(wide[r][m], wide_hi[r][m]);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m)
        acc[r][m] = _mm256_add_ps(_mm512_castps512_ps256(wide[r][m]),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide[r][m]), 1)));
  }
#endif
  if (kSplit && R * MT == 1 && x_direct != nullptr && k == 0) {  // k > 0: the 16-lane loop took the row
    // The sequential walk at one activation row: the direct decode (on
    // x_direct, see DirectX: deinterleaved like the codes) and four FMA chains
    // over 32 codes, so the loop does not wait on FMA latency (two chains: one
    // 4-cycle FMA latency per 16 codes).
    __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
    for (; k + 32 <= len; k += 32) {
      if (prefetch_ahead > 0 && (k & 63) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(w + k + prefetch_ahead), _MM_HINT_T0);
      __m256 even0, odd0, even1, odd1;
      fp8serve_e4m3::direct16_deinterleaved(w + k, even0, odd0);
      fp8serve_e4m3::direct16_deinterleaved(w + k + 16, even1, odd1);
      acc[0][0] = _mm256_fmadd_ps(even0, _mm256_loadu_ps(x_direct + k), acc[0][0]);
      acc_hi[0][0] = _mm256_fmadd_ps(odd0, _mm256_loadu_ps(x_direct + k + 8), acc_hi[0][0]);
      acc2 = _mm256_fmadd_ps(even1, _mm256_loadu_ps(x_direct + k + 16), acc2);
      acc3 = _mm256_fmadd_ps(odd1, _mm256_loadu_ps(x_direct + k + 24), acc3);
    }
    const __m256 back = _mm256_set1_ps(rescale);
    acc[0][0] = _mm256_mul_ps(_mm256_add_ps(acc[0][0], acc2), back);
    acc_hi[0][0] = _mm256_mul_ps(_mm256_add_ps(acc_hi[0][0], acc3), back);
  }
  for (; k + 16 <= len; k += 16) {
    if (prefetch_ahead > 0 && (k & 63) == 0) {
      // Past the end of w this is a no-op: prefetches never fault.
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * ld + k + prefetch_ahead), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      __m256 lo, hi;
      decode16(w + r * ld + k, lo, hi);
      for (int m = 0; m < MT; ++m) {
        acc[r][m] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + m * ld + k), acc[r][m]);
        const __m256 xh = _mm256_loadu_ps(x + m * ld + k + 8);
        if constexpr (kSplit) acc_hi[r][m] = _mm256_fmadd_ps(hi, xh, acc_hi[r][m]);
        else acc[r][m] = _mm256_fmadd_ps(hi, xh, acc[r][m]);
      }
    }
  }
  for (; k + 8 <= len; k += 8) {
    for (int r = 0; r < R; ++r) {
      const __m256 v = decode8(w + r * ld + k);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + m * ld + k), acc[r][m]);
    }
  }
  if constexpr (kSplit)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_add_ps(acc[r][m], acc_hi[r][m]);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) dots[r * MT + m] += hsum(acc[r][m]);
#endif
  const float* table = decode_table().v;
  for (; k < len; ++k) {
    for (int r = 0; r < R; ++r) {
      const float v = table[w[r * ld + k]];
      for (int m = 0; m < MT; ++m) dots[r * MT + m] += v * x[m * ld + k];
    }
  }
}

// Activation columns per pass: a tile of MT rows of this many floats (16 KiB)
// stays in L1 while every weight row of a block passes over it; with whole
// rows of a large K, MT = 8 read its activations from L2 at every FMA.
// Multiple of 16 (the vector step).
template <int MT>
constexpr int64_t kColBlock = (4096 / MT) / 16 * 16;

// How many row tiles ahead dot_tile prefetches (see there).
constexpr int64_t kPrefetchTiles = 2;

// How far ahead (bytes, in the order the sequential walk reads w) that walk
// prefetches. Whole rows (K <= kColBlock) make one stream through w: the
// prefetch goes kSeqPrefetchBytes down it. Column blocks (larger K): the next
// row's same columns. On the AVX2-only Zen 3 EPYC (2 vCPUs, 2026-12-01) the
// default model's 120 decode linears ran 1.09-1.11x as fast at M = 1-2 with
// it in a scan (flat from 2 to 16 KiB ahead, ABBA, 10 rounds) and 1.02-1.09x
// against the build without it (float32 activations, two runs of
// benchmarks/fp8_linear.py --baseline-rev); the sequential walk with it ran
// 1.30x (M = 1) and 1.05x (M = 2) as fast as the interleaved one.
// Builds with AVX-512 (the Zen 4 guest, where this walk was measured best
// without a prefetch, and dense_gemv's prefetch 1-4 rows ahead cost 20-40%)
// keep none: not re-measured there.
#ifdef __AVX512F__
constexpr int64_t kSeqPrefetchBytes = 0;
#else
constexpr int64_t kSeqPrefetchBytes = 4096;
#endif

// Rows [n_begin, n_end) of out (row stride N) for MT activation rows; `dots`
// holds (n_end - n_begin) * MT partial sums across column blocks.
template <int R, int MT, bool kWide, bool kSeq>
void rows_tile(float* out, const float* x, const uint8_t* w, const float* scale, const float* bias, int64_t N,
               int64_t K, int64_t n_begin, int64_t n_end, float* dots, DirectX direct) {
  const int64_t tiles_ahead = kSeq ? 0 : kPrefetchTiles;
#ifdef FP8SERVE_GEMM_AVX512
  constexpr bool kWideLoop = kWide;
#else
  constexpr bool kWideLoop = false;
#endif
#ifdef FP8SERVE_GEMM_AVX2
  // The direct loop is one of the 8-lane loops: where the 16-lane loop runs
  // (AVX-512 builds, kWide) it has already taken the row, in 2^-8 units.
  // denormals_kept per task: MXCSR is per thread.
  if (!kSeq || kWideLoop || !denormals_kept()) direct.x = nullptr;
#endif
  std::fill(dots, dots + (n_end - n_begin) * MT, 0.f);
  for (int64_t k0 = 0; k0 < K; k0 += kColBlock<MT>) {
    const int64_t len = std::min(kColBlock<MT>, K - k0);
    const int64_t seq_ahead = kSeqPrefetchBytes == 0 ? 0 : len == K ? kSeqPrefetchBytes : K;
    const float* xd = direct.x ? direct.x + k0 : nullptr;
    int64_t n = n_begin;
    for (; n + R <= n_end; n += R)
      dot_tile<R, MT, kWide, kSeq>(w + n * K + k0, x + k0, K, len, dots + (n - n_begin) * MT,
                                   kSeq ? seq_ahead : tiles_ahead * R * K, xd, direct.rescale);
    for (; n < n_end; ++n)
      dot_tile<1, MT, kWide, kSeq>(w + n * K + k0, x + k0, K, len, dots + (n - n_begin) * MT,
                                   kSeq ? seq_ahead : tiles_ahead * K, xd, direct.rescale);
  }
  for (int64_t n = n_begin; n < n_end; ++n) {
    const float s = scale[n] * kE4M3DecodeMultiplier, b = bias ? bias[n] : 0.f;
    for (int m = 0; m < MT; ++m) out[m * N + n] = dots[(n - n_begin) * MT + m] * s + b;
  }
}

// MT activation rows at a time; rows per tile keep R * MT <= 8 accumulators
// (interleaved walk), or one row per tile (sequential walk).
template <int MT, bool kWide, bool kSeq>
void rows_mtile(float* out, const float* x, const uint8_t* w, const float* scale, const float* bias, int64_t N,
                int64_t K, int64_t n_begin, int64_t n_end, float* dots, DirectX direct) {
  constexpr int R = kSeq ? 1 : MT <= 2 ? 4 : MT <= 4 ? 2 : 1;
  rows_tile<R, MT, kWide, kSeq>(out, x, w, scale, bias, N, K, n_begin, n_end, dots, direct);
}

template <bool kWide>
void rows_any_m(int64_t mt, bool seq, float* out, const float* x, const uint8_t* w, const float* scale,
                const float* bias, int64_t N, int64_t K, int64_t n_begin, int64_t n_end, float* dots,
                DirectX direct) {
  if (seq) {
    TORCH_CHECK(mt <= kMaxSequentialRows, "the sequential walk takes at most ", kMaxSequentialRows, " rows");
    if (mt == 1) rows_mtile<1, kWide, true>(out, x, w, scale, bias, N, K, n_begin, n_end, dots, direct);
    else rows_mtile<2, kWide, true>(out, x, w, scale, bias, N, K, n_begin, n_end, dots, direct);
    return;
  }
  switch (mt) {
#define FP8SERVE_CASE(T) \
  case T: rows_mtile<T, kWide, false>(out, x, w, scale, bias, N, K, n_begin, n_end, dots, {}); break;
    FP8SERVE_CASE(1) FP8SERVE_CASE(2) FP8SERVE_CASE(3) FP8SERVE_CASE(4)
    FP8SERVE_CASE(5) FP8SERVE_CASE(6) FP8SERVE_CASE(7) FP8SERVE_CASE(8)
#undef FP8SERVE_CASE
    default: TORCH_CHECK(false, "bad activation tile ", mt);
  }
}

// x * 2^shift into buf for the direct decode loop (see DirectX); an empty
// DirectX where that loop is not built or x is all zero or not finite.
DirectX scaled_for_direct_decode(const float* x, int64_t n, std::vector<float>& buf) {
#ifdef FP8SERVE_GEMM_AVX2
  // One pass for max |x| and "any inf or NaN" (|v| !< inf), vectorized: a
  // scalar std::abs/isfinite loop cost as much as the GEMV at M = 2.
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf = _mm256_set1_ps(INFINITY);
  __m256 vmax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
    vmax = _mm256_max_ps(vmax, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float amax = *std::max_element(lanes, lanes + 8);
  bool finite = _mm256_movemask_ps(bad) == 0;
  for (; i < n; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::abs(x[i]));
  }
  if (amax == 0.f || !finite) return {};
  // max |x| * 2^shift in [2^99, 2^100): with weights in [2^-129, 2^-111]
  // the largest product lies in [2^-30, 2^-11], so a sum reaches float32's
  // denormal range (2^-126) only after cancelling 96 binades, where float32
  // has long lost every digit anyway, and never overflows. The loop's sums are
  // then decode16's times 2^(shift - 112), exactly. shift in [0, 112] keeps
  // the rescale a normal float.
  const int shift = std::clamp(99 - std::ilogb(amax), 0, 112);
  buf.resize(n);
  const float factor = std::ldexp(1.f, shift);  // a power of two: x * factor is exact
  // In the order direct16_deinterleaved gives the codes: column blocks start
  // at multiples of 16 (kColBlock), so every block's 16s are these.
  fp8serve_e4m3::deinterleave16(x, n, factor, buf.data());
  return {buf.data(), std::ldexp(1.f, 112 - shift)};
#else
  (void)x, (void)n, (void)buf;
  return {};
#endif
}

constexpr int64_t kMaxTileM = 8;
// Rows of w per task, at least: enough work to pay for waking a thread.
constexpr int64_t kMinRowsPerTask = 16;
// Rows of w per pass over all activation tiles: their codes (64 * K bytes)
// stay in L2 while each tile of 8 activation rows re-reads them.
constexpr int64_t kRowBlock = 64;

void check_weight(const at::Tensor& w, const at::Tensor& scale, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "w must be a contiguous [N, K] uint8 tensor of e4m3 codes");
  TORCH_CHECK(w.size(1) == K, "w has ", w.size(1), " columns, expected K = ", K);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == w.size(0) && scale.scalar_type() == at::kFloat &&
                  scale.is_contiguous(),
              "scale must be a contiguous float32 [N] tensor (one scale per output row)");
  TORCH_CHECK(w.device().is_cpu() && scale.device().is_cpu(), "CPU tensors expected");
}

}  // namespace

// x: [M, K] float32 or bf16, contiguous; w: [N, K] uint8 e4m3 codes,
// contiguous; scale: [N] float32 (true per-row scale); bias: [N] float32 or
// none. Returns [M, N] in x's dtype, accumulated in float32.
// walk: a Walk (kAutoWalk picks by CPU vendor and M; the others force one,
// for tests and benchmarks; kSequential takes M <= 2).
// out_arg: the [M, N] result tensor to write (contiguous, x's dtype), or
// null: a new one.
at::Tensor fp8_linear_impl(at::Tensor x, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias,
                           bool wide, int64_t walk, const at::Tensor* out_arg = nullptr) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "x must be a contiguous [M, K] CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bf16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, scale, K);
  fp8serve_walk::check(walk, M);
  const bool seq = fp8serve_walk::sequential(walk, M);
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(),
                "bias must be a contiguous float32 [N] tensor");
  }
  at::Tensor out = fp8serve_staging::result_tensor(out_arg, x, M, N);
  if (M == 0 || N == 0) return out;

  const fp8serve_staging::Float32Staging io(x, out);
  const float* xp = io.x;
  float* op = io.out;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  // The sequential walk's direct decode at M = 1 only: at M = 2 the kernel ran
  // it 0.75-0.8x as fast as decode16 (one thread, hot and cold), though the
  // same loop alone in a test program ran 1.2x as fast; not understood.
  // Not where the 16-lane loop takes the rows (AVX-512 builds, `wide`): the
  // scaled copy would go unused (rows_tile drops it there too).
#ifdef FP8SERVE_GEMM_AVX512
  const bool wide_loop = wide;
#else
  const bool wide_loop = false;
#endif
  std::vector<float> x_direct_buf;
  const DirectX direct =
      seq && M == 1 && !wide_loop ? scaled_for_direct_decode(xp, K, x_direct_buf) : DirectX{};
  at::parallel_for(0, N, kMinRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> dots(kRowBlock * kMaxTileM);
    for (int64_t n0 = begin; n0 < end; n0 += kRowBlock) {
      const int64_t n1 = std::min(end, n0 + kRowBlock);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTileM) {
        const int64_t mt = std::min(kMaxTileM, M - m0);
        const DirectX d{direct.x ? direct.x + m0 * K : nullptr, direct.rescale};
        if (wide) rows_any_m<true>(mt, seq, op + m0 * N, xp + m0 * K, wp, sp, bp, N, K, n0, n1, dots.data(), d);
        else rows_any_m<false>(mt, seq, op + m0 * N, xp + m0 * K, wp, sp, bp, N, K, n0, n1, dots.data(), d);
      }
    }
    io.narrow(M, begin, end);
  });
  return out;
}

at::Tensor fp8_linear(at::Tensor x, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias) {
  return fp8_linear_impl(x, w, scale, bias, /*wide=*/true, kAutoWalk);
}

// fp8_linear into a given [M, N] tensor: what a decode plan (decode_plan.cpp)
// calls, so every step writes the same buffers.
void fp8_linear_out(at::Tensor out, at::Tensor x, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias) {
  fp8_linear_impl(x, w, scale, bias, /*wide=*/true, kAutoWalk, &out);
}

// Same contract, the 8-lane loops only (what AVX2-only CPUs run).
at::Tensor fp8_linear_avx2(at::Tensor x, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias) {
  return fp8_linear_impl(x, w, scale, bias, /*wide=*/false, kAutoWalk);
}

// Either loop with a forced row walk (tests, benchmarks): walk 1 interleaved, 2 sequential.
at::Tensor fp8_linear_walk(at::Tensor x, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias, bool wide,
                           int64_t walk) {
  return fp8_linear_impl(x, w, scale, bias, wide, walk);
}

// The walk kAutoWalk takes at M rows on this CPU: 1 interleaved, 2 sequential.
int64_t fp8_linear_auto_walk(int64_t M) {
  return fp8serve_walk::sequential(kAutoWalk, M) ? kSequential : kInterleaved;
}

// out[n, k] = e4m3(w[n, k]) * scale[n] for a block of rows; out is a
// contiguous float32 or bf16 [n, K] buffer the caller reuses.
void fp8_dequantize(at::Tensor out, at::Tensor w, at::Tensor scale) {
  const int64_t N = w.size(0), K = w.dim() == 2 ? w.size(1) : -1;
  check_weight(w, scale, K);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == K && out.is_contiguous(),
              "out must be a contiguous [N, K] tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "out must be float32 or bf16");
  const bool is_bf16 = out.scalar_type() == at::kBFloat16;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  float* of = is_bf16 ? nullptr : out.data_ptr<float>();
  c10::BFloat16* ob = is_bf16 ? out.data_ptr<c10::BFloat16>() : nullptr;
  at::parallel_for(0, N, kMinRowsPerTask, [&](int64_t begin, int64_t end) {
    const float* table = decode_table().v;
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* src = wp + n * K;
      const float s = sp[n] * kE4M3DecodeMultiplier;
      int64_t k = 0;
      if (is_bf16) {
        // Rounded to bf16 in registers (vec16/vec8 store<1>: nearest even,
        // the bits c10::BFloat16 gives). Per element through a float row and
        // c10::BFloat16 this was 14% of a bf16 FP8-checkpoint prefill.
        c10::BFloat16* d = ob + n * K;
#if defined(FP8SERVE_GEMM_AVX512) && defined(FP8SERVE_VEC16)
        const __m512 vs16 = _mm512_set1_ps(s);
        for (; k + 32 <= K; k += 32) {
          __m512 lo, hi;
          decode32(src + k, lo, hi);
          fp8serve_vec16::store<1>(d, k, _mm512_mul_ps(lo, vs16));
          fp8serve_vec16::store<1>(d, k + 16, _mm512_mul_ps(hi, vs16));
        }
#endif
#if defined(FP8SERVE_GEMM_AVX2) && defined(FP8SERVE_VEC8)
        const __m256 vs8 = _mm256_set1_ps(s);
        for (; k + 16 <= K; k += 16) {
          __m256 lo, hi;
          decode16(src + k, lo, hi);
          fp8serve_vec8::store<1>(d, k, _mm256_mul_ps(lo, vs8));
          fp8serve_vec8::store<1>(d, k + 8, _mm256_mul_ps(hi, vs8));
        }
#endif
        for (; k < K; ++k) d[k] = c10::BFloat16(table[src[k]] * s);  // round to nearest even
        continue;
      }
      float* dst = of + n * K;
#ifdef FP8SERVE_GEMM_AVX2
      const __m256 vs = _mm256_set1_ps(s);
      for (; k + 16 <= K; k += 16) {
        __m256 lo, hi;
        decode16(src + k, lo, hi);
        _mm256_storeu_ps(dst + k, _mm256_mul_ps(lo, vs));
        _mm256_storeu_ps(dst + k + 8, _mm256_mul_ps(hi, vs));
      }
#endif
      for (; k < K; ++k) dst[k] = table[src[k]] * s;
    }
  });
}

bool fp8_gemm_has_avx2() {
#ifdef FP8SERVE_GEMM_AVX2
  return true;
#else
  return false;
#endif
}

bool fp8_gemm_has_avx512() {
#ifdef FP8SERVE_GEMM_AVX512
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(FP8SERVE_GEMM_NS, m) {
  m.def("fp8_linear", &fp8_linear);
  m.def("fp8_linear_out(Tensor(a!) out, Tensor x, Tensor w, Tensor scale, Tensor? bias) -> ()", &fp8_linear_out);
  m.def("fp8_linear_avx2", &fp8_linear_avx2);
  m.def("fp8_linear_walk", &fp8_linear_walk);
  m.def("fp8_linear_auto_walk", &fp8_linear_auto_walk);
  m.def("fp8_gemm_has_avx512", &fp8_gemm_has_avx512);
  m.def("fp8_dequantize", &fp8_dequantize);
  m.def("fp8_gemm_has_avx2", &fp8_gemm_has_avx2);
}
