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
// With bf16 weights and bf16 activations on a build for a CPU with
// AVX512-BF16 (where --dtype auto picks bf16 at all), the dot products use
// vdpbf16ps: 32 bf16 pairs multiplied exactly and summed into 16 float32
// lanes per instruction, no conversions. The float32-FMA loop needs eight
// FMAs per weight vector at M = 8 and becomes compute-bound there (1.1x over
// F.linear at M = 8, 0.66x at 16), where memory allows ~2x; see
// benchmarks/results/dense_gemv_2026-11-30.md. (vdpbf16ps reads denormal bf16
// inputs as zero; products of normal bf16 values are exact in float32.)
//
// Threads: rows of w are split over torch's thread pool (at::parallel_for).
//
// Row walk at M = 1-2 (`Walk`). Interleaved, the Xeon's best: R = 4 weight
// rows per tile and a software prefetch two tiles ahead. On AMD Zen 4 (2-vCPU
// EPYC guest, 2026-11-30) that read 19-25 GB/s where a plain read gave 31-54,
// and one row at a time with no software prefetch, so that each thread reads
// its rows of w front to back as a single stream, read 21-46 GB/s: 1.3-1.8x on
// the default model's 120 decode linears and its lm_head at M = 1-2 (1.1-1.6x
// for bf16 weights through the float32-FMA loop)
// (benchmarks/results/dense_gemv_2026-11-30_zen4.md). Two rows at a time were
// as slow as four there, and a prefetch 1-4 rows ahead cost 20-40%. So
// AMD CPUs walk rows sequentially at M <= 2, with two accumulator sets along k
// to keep the FMA chains short; Intel CPUs keep the interleaved walk, measured
// best there (stop 18). At M >= 3 both walk interleaved, and on AMD its
// prefetch targets L2 (prefetch_level.h): the default model's 120 decode
// linears at M = 4 / 8 / 16 ran 1.44 / 1.29 / 1.17x (float32) and
// 1.51 / 1.66 / 1.27x (bf16) as fast as with the L1 prefetch
// (benchmarks/results/dense_gemv_prefetch_l2_2026-11-30_zen4.md). At M = 1-2
// the interleaved walk with the L2 prefetch ran 0.92-0.95x the sequential walk
// (float32) and 1.03-1.06x (bf16) in a scratch build: the sequential walk stays.
// On AVX2-only builds it prefetches 16-bit weights 4 KiB down its stream
// (kSeqPrefetchBytes, measured on the AVX2-only Zen 3 EPYC).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_vendor.h"
#include "prefetch_level.h"
#include "row_walk.h"
#include "float_staging.h"
#include "scalar_convert.h"
#include "vec8.h"

namespace {

using fp8serve_walk::kAutoWalk;
using fp8serve_walk::kInterleaved;
using fp8serve_walk::kMaxSequentialRows;
using fp8serve_walk::kSequential;

using namespace fp8serve_cvt;

constexpr int64_t kMaxRows = 32;      // activation rows per call
constexpr int64_t kTileRows = 8;      // activation rows per register tile
// Weight rows per pass over the activation tiles: their bytes (64 * K * 2 or
// 4) stay in L2 while each tile of 8 activation rows re-reads them, so the
// weight comes from memory once per call whatever M.
constexpr int64_t kRowBlock = 64;
constexpr int64_t kMinRowsPerTask = 32;  // weight rows per thread task, at least
// Long rows at 5+ activation rows (float32-FMA loop): the dot products run over
// K in slices of kKChunk, so a tile's 8 activation rows (16 KiB of the slice)
// stay in L1 while the block's weight rows pass, instead of coming from L2 at
// every FMA (a tile of 8 rows of K = 2048 is 64 KiB). At K = 576 (the default
// model) the whole rows fit and nothing changes. On the AVX2-only Zen 3 EPYC
// at K = 2048-8192 and 8-32 rows: 66-80 GFLOP/s before, against 112-129 at
// K = 576 (benchmarks/results/dense_gemv_kchunk_2026-12-02_zen3.md). Each
// output still sums its slices in one fixed order that depends on M and K
// only, so a row's result does not depend on the other rows called with it.
constexpr int64_t kKChunk = 512;
constexpr int64_t kKChunkMinRows = 5;

// WT: 0 float32 weights, 1 bf16, 2 fp16 (the storage tags of scalar_convert.h).
// dots[r * MT + m] = sum_k w[r][k] * x[m][k] for R weight rows, MT activation rows,
// summed in KS independent accumulator sets along k (shorter FMA chains when
// R * MT is small). With prefetch_ahead > 0, each 64 bytes of a row also
// prefetch the same columns that many bytes further on (two tiles of rows
// ahead): rows are short, so the Xeon's hardware prefetchers barely ramp up
// before a stream ends (see fp8_gemm.cpp, where this doubled the batch-1 read
// rate there).
template <int WT, int R, int MT, int KS = 1, fp8serve_prefetch::Level L = fp8serve_prefetch::kL1>
__attribute__((always_inline)) inline void dot_tile(const char* w, int64_t w_row_bytes, const float* x, int64_t ldx,
                                                    int64_t K, float* dots, int64_t prefetch_ahead) {
  int64_t k = 0;
#ifdef FP8SERVE_VEC8
  namespace v8 = fp8serve_vec8;
  constexpr int64_t kElemBytes = WT == 0 ? 4 : 2;
  __m256 acc[KS][R][MT];
  for (int s = 0; s < KS; ++s)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[s][r][m] = _mm256_setzero_ps();
  const auto step = [&](int s, int64_t kk) {
    if (prefetch_ahead > 0 && ((kk * kElemBytes) & 63) == 0) {
      for (int r = 0; r < R; ++r) fp8serve_prefetch::line<L>(w + r * w_row_bytes + kk * kElemBytes + prefetch_ahead);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 wv = v8::load<WT>(w + r * w_row_bytes, kk);
      for (int m = 0; m < MT; ++m) acc[s][r][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + kk), acc[s][r][m]);
    }
  };
  for (; k + 8 * KS <= K; k += 8 * KS)
    for (int s = 0; s < KS; ++s) step(s, k + 8 * s);
  for (; k + 8 <= K; k += 8) step(0, k);
  for (int s = 1; s < KS; ++s)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[0][r][m] = _mm256_add_ps(acc[0][r][m], acc[s][r][m]);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) dots[r * MT + m] = v8::hsum(acc[0][r][m]);
#else
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) dots[r * MT + m] = 0.f;
#endif
  for (; k < K; ++k) {
    for (int r = 0; r < R; ++r) {
      const float wv = load_as_f32<WT>(w + r * w_row_bytes, k);
      for (int m = 0; m < MT; ++m) dots[r * MT + m] += wv * x[m * ldx + k];
    }
  }
}

// How far down its stream (bytes, the order it reads w) the sequential walk
// prefetches 16-bit weights: rows are walked front to back, so 4 KiB ahead is
// the same stream whatever K. As in fp8_gemm.cpp's sequential walk. On the
// AVX2-only Zen 3 EPYC (the default model's 120 decode linears, contiguous on
// 2 MiB pages as the engine keeps them, ABBA rounds) bf16 weights ran
// 1.07-1.10x as fast with it at M = 1 and 1.02-1.08x at M = 2; float32
// weights 0.97x and 0.88x, so they keep none. A whole batch-1 decode step of
// the default model (bf16 weights, float32 compute) ran 1.07-1.11x as fast
// (benchmarks/results/dense_gemv_seq_prefetch_2026-12-02_zen3.md). AVX-512
// builds (the Zen 4 guest, where this walk was measured best without one)
// keep none.
#ifdef __AVX512F__
constexpr int64_t kSeqPrefetchBytes = 0;
#else
constexpr int64_t kSeqPrefetchBytes = 4096;
#endif

// kWideR: weight rows per tile at MT = 5-8 (see kAmdWideRows). x rows are ldx
// floats apart. kAccumulate: add each dot product to partial[(n - n_begin) * MT + m]
// (a slice of K: see kKChunk) instead of writing out[m * N + n] (+ bias).
template <int WT, int MT, bool kSeq, fp8serve_prefetch::Level L = fp8serve_prefetch::kL1, int kWideR = 1,
          bool kAccumulate = false>
void rows(float* out, const float* x, int64_t ldx, const char* w, int64_t w_row_bytes, const float* bias, int64_t N,
          int64_t K, int64_t n_begin, int64_t n_end) {
  // Interleaved: R * MT <= 8 accumulators (R * MT <= 24 with kWideR = 3)
  // leave registers for the weight vectors, and a prefetch two tiles ahead.
  // Sequential: one row, two accumulator sets, and the prefetch
  // kSeqPrefetchBytes down the stream (none on AVX-512 builds).
  constexpr int R = kSeq ? 1 : MT <= 2 ? 4 : MT <= 4 ? 2 : kWideR;
  constexpr int KS = kSeq ? 2 : 1;
  const int64_t tiles_ahead = kSeq ? 0 : 2;
  const int64_t seq_ahead = kSeq && WT != 0 ? kSeqPrefetchBytes : 0;
  float dots[R * MT];
  int64_t n = n_begin;
  const auto emit = [&](int64_t n0, int rr) {
    for (int r = 0; r < rr; ++r) {
      if constexpr (kAccumulate) {
        for (int m = 0; m < MT; ++m) out[(n0 + r - n_begin) * MT + m] += dots[r * MT + m];
      } else {
        const float b = bias ? bias[n0 + r] : 0.f;
        for (int m = 0; m < MT; ++m) out[m * N + n0 + r] = dots[r * MT + m] + b;
      }
    }
  };
  for (; n + R <= n_end; n += R) {
    dot_tile<WT, R, MT, KS, L>(w + n * w_row_bytes, w_row_bytes, x, ldx, K, dots,
                               kSeq ? seq_ahead : tiles_ahead * R * w_row_bytes);
    emit(n, R);
  }
  for (; n < n_end; ++n) {
    dot_tile<WT, 1, MT, KS, L>(w + n * w_row_bytes, w_row_bytes, x, ldx, K, dots,
                               kSeq ? seq_ahead : tiles_ahead * w_row_bytes);
    emit(n, 1);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define FP8SERVE_BF16_DOT 1
// Sums of 16 accumulators at once, lane i of the result = the sum of v[i]'s
// 16 lanes: a tree of 128-bit-chunk shuffles and in-lane unpacks, 45
// instructions where 16 separate horizontal sums take ~8 each. The tile's
// dot products are short (K = 576 on the default model: 18 vdpbf16ps per
// accumulator), so the per-accumulator sums were a large part of a tile.
// Measured on the Zen 4 EPYC (the 120 decode linears from memory, 8 ABBA
// rounds against the per-accumulator sums): 1.04-1.05x at 8-32 rows, 1.00x
// at 4 (tiles of fewer than 6 accumulators, M = 1-2, sum them one by one).
__attribute__((always_inline)) inline __m512 reduce16(const __m512* v) {
  // Fed in the order that puts v[i]'s sum in lane i: the tree below leaves
  // input 4e + j's sum in lane 4j + e.
  __m512 u[8];
  for (int i = 0; i < 8; ++i) {
    const int a = (2 * i) % 4 * 4 + (2 * i) / 4, b = (2 * i + 1) % 4 * 4 + (2 * i + 1) / 4;
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[a], v[b], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[a], v[b], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  __m512 w[4];
  for (int i = 0; i < 4; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 p = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
  const __m512 q = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(p, q, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(p, q, _MM_SHUFFLE(3, 2, 3, 2)));
}

// dots[i] = the sum of v[i]'s lanes, i < N: groups of 16 through reduce16
// (a short last group padded with zeros), the rest one at a time.
template <int N>
__attribute__((always_inline)) inline void reduce_into(const __m512* v, float* dots) {
  int i = 0;
  for (; i + 16 <= N; i += 16) _mm512_storeu_ps(dots + i, reduce16(v + i));
  if constexpr (N % 16 >= 6) {
    __m512 pad[16];
    for (int j = 0; j < 16; ++j) pad[j] = j < N % 16 ? v[i + j] : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(dots + i, static_cast<__mmask16>((1u << (N % 16)) - 1), reduce16(pad));
  } else {
    for (; i < N; ++i) dots[i] = _mm512_reduce_add_ps(v[i]);
  }
}

// dots[r * MT + m] = sum_k w[r][k] * x[m][k], bf16 rows of K (a multiple of
// 32) elements, KS * R * MT zmm accumulators (KS sets along k). prefetch_ahead
// as in dot_tile (0: none).
// always_inline: GCC 12 (-O3) called the 3 x 8 tile out of line, where its
// 24 accumulators were zeroed on the stack for every tile. Inlined, they stay
// in registers: with the three-row tiles the AMD path ran 1.12-1.13x as fast
// as before at 16-32 rows (120 decode linears, ABBA), against 0.99-1.07x with
// the tile out of line. The float32 tile (dot_tile) is inlined likewise.
template <int R, int MT, int KS = 1, fp8serve_prefetch::Level L = fp8serve_prefetch::kL1>
__attribute__((always_inline)) inline void dot_tile_bf16(const uint16_t* w, const uint16_t* x, int64_t K, float* dots,
                                                         int64_t prefetch_ahead) {
  __m512 acc[KS][R][MT];
  for (int s = 0; s < KS; ++s)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[s][r][m] = _mm512_setzero_ps();
  const char* wb = reinterpret_cast<const char*>(w);
  const auto step = [&](int s, int64_t k) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) {
      if (prefetch_ahead > 0) fp8serve_prefetch::line<L>(wb + (r * K + k) * 2 + prefetch_ahead);
      wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[s][r][m] = _mm512_dpbf16_ps(acc[s][r][m], wv[r], xv);
    }
  };
  int64_t k = 0;
  for (; k + 32 * KS <= K; k += 32 * KS)
    for (int s = 0; s < KS; ++s) step(s, k + 32 * s);
  for (; k < K; k += 32) step(0, k);
  for (int s = 1; s < KS; ++s)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[0][r][m] = _mm512_add_ps(acc[0][r][m], acc[s][r][m]);
  reduce_into<R * MT>(&acc[0][0][0], dots);
}

// MT <= 8 activation rows in one register tile: each weight vector feeds MT
// instructions. kSeq: the sequential walk (see the header). kWideR: weight
// rows per tile at MT = 5-8. Two (16 accumulators) was measured best on the
// Xeon. On AMD Zen 4, at 8-32 rows, where these dot products are bound by
// arithmetic, loads and prefetches rather than memory, three (24 accumulators,
// 11 loads per 24 instructions instead of 10 per 16) ran the default model's
// 120 decode linears 1.00-1.05x as fast as two (ABBA, 10 rounds, both tiles
// inlined). Dropping the software prefetch instead made hot calls 1.2x as
// fast and cold ones 0.5-0.85x.
template <int MT, bool kSeq, fp8serve_prefetch::Level L = fp8serve_prefetch::kL1, int kWideR = 2>
void rows_bf16(float* out, const uint16_t* x, const uint16_t* w, const float* bias, int64_t N, int64_t K,
               int64_t n_begin, int64_t n_end) {
  constexpr int R = kSeq ? 1 : MT <= 4 ? 4 : MT <= 8 ? kWideR : 1;  // R * MT <= 16 or 24 accumulators
  constexpr int KS = kSeq ? 2 : 1;
  const int64_t tiles_ahead = kSeq ? 0 : 2;
  float dots[R * MT];
  const auto emit = [&](int64_t n0, int rr) {
    for (int r = 0; r < rr; ++r) {
      const float b = bias ? bias[n0 + r] : 0.f;
      for (int m = 0; m < MT; ++m) out[m * N + n0 + r] = dots[r * MT + m] + b;
    }
  };
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) {
    dot_tile_bf16<R, MT, KS, L>(w + n * K, x, K, dots, tiles_ahead * R * K * 2);
    emit(n, R);
  }
  for (; n < n_end; ++n) {
    dot_tile_bf16<1, MT, KS, L>(w + n * K, x, K, dots, tiles_ahead * K * 2);
    emit(n, 1);
  }
}

void rows_bf16_any(int64_t mt, bool seq, float* out, const uint16_t* x, const uint16_t* w, const float* bias,
                   int64_t N, int64_t K, int64_t b, int64_t e) {
  if (seq) {
    TORCH_CHECK(mt <= kMaxSequentialRows, "the sequential walk takes at most ", kMaxSequentialRows, " rows");
    if (mt == 1) rows_bf16<1, true>(out, x, w, bias, N, K, b, e);
    else rows_bf16<2, true>(out, x, w, bias, N, K, b, e);
    return;
  }
  // AMD: the L2 prefetch (prefetch_level.h makes the same vendor choice) and
  // three-row tiles, both measured there; elsewhere what the Xeon measured best.
  const bool amd = fp8serve_cpu::is_amd();
  switch (mt) {
#define FP8SERVE_CASE(T) \
  case T:                                                                                \
    if (amd) rows_bf16<T, false, fp8serve_prefetch::kL2, 3>(out, x, w, bias, N, K, b, e); \
    else rows_bf16<T, false, fp8serve_prefetch::kL1, 2>(out, x, w, bias, N, K, b, e);     \
    break;
    FP8SERVE_CASE(1) FP8SERVE_CASE(2) FP8SERVE_CASE(3) FP8SERVE_CASE(4)
    FP8SERVE_CASE(5) FP8SERVE_CASE(6) FP8SERVE_CASE(7) FP8SERVE_CASE(8)
#undef FP8SERVE_CASE
    default: TORCH_CHECK(false, "bad activation tile ", mt);
  }
}
#endif

// Weight rows per float32-FMA tile of 5-8 activation rows on AMD CPUs. With
// the 32 registers of AVX-512, three rows (24 accumulators) ran the default
// model's 120 decode linears (float32 weights, cold) 1.18-1.39x as fast as
// one row at 6-32 activation rows on Zen 4, and within 2% at 3-5 (ABBA, 8
// rounds; four rows at 3-4 activation rows: 0.93x). AVX2 has 16 registers:
// one row, as before; Intel keeps what was measured there.
#ifdef __AVX512F__
constexpr int kAmdWideRows = 3;
#else
constexpr int kAmdWideRows = 1;
#endif

template <int WT, bool kAccumulate = false>
void rows_any(int64_t mt, bool seq, float* out, const float* x, int64_t ldx, const char* w, int64_t wrb,
              const float* bias, int64_t N, int64_t K, int64_t b, int64_t e) {
  if (seq) {
    TORCH_CHECK(mt <= kMaxSequentialRows && !kAccumulate, "the sequential walk takes at most ", kMaxSequentialRows,
                " rows, whole");
    if (mt == 1) rows<WT, 1, true>(out, x, ldx, w, wrb, bias, N, K, b, e);
    else rows<WT, 2, true>(out, x, ldx, w, wrb, bias, N, K, b, e);
    return;
  }
  // AMD: the L2 prefetch (prefetch_level.h makes the same vendor choice) and
  // kAmdWideRows; elsewhere what the Xeon measured best.
  const bool amd = fp8serve_cpu::is_amd();
  switch (mt) {
#define FP8SERVE_CASE(T) \
  case T:                                                                                                  \
    if (amd) rows<WT, T, false, fp8serve_prefetch::kL2, kAmdWideRows, kAccumulate>(out, x, ldx, w, wrb, bias, N, K, b, e); \
    else rows<WT, T, false, fp8serve_prefetch::kL1, 1, kAccumulate>(out, x, ldx, w, wrb, bias, N, K, b, e);               \
    break;
    FP8SERVE_CASE(1) FP8SERVE_CASE(2) FP8SERVE_CASE(3) FP8SERVE_CASE(4)
    FP8SERVE_CASE(5) FP8SERVE_CASE(6) FP8SERVE_CASE(7) FP8SERVE_CASE(8)
#undef FP8SERVE_CASE
    default: TORCH_CHECK(false, "bad activation tile ", mt);
  }
}

}  // namespace

// x: [M, K] float32 or bf16 (rows contiguous), M <= 32; w: [N, K] contiguous,
// float32, bf16 or fp16; bias: [N] or none. Returns [M, N] in x's dtype.
// allow_bf16_dot: false keeps the float32-FMA loop (tests, benchmarks).
// walk: a Walk (kAutoWalk picks by CPU vendor and M; the others force one,
// for tests and benchmarks; kSequential takes M <= 2).
// out_arg: the [M, N] result tensor to write (contiguous, x's dtype), or null: a new one.
at::Tensor dense_gemv_impl(at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias, bool allow_bf16_dot,
                           int64_t walk, const at::Tensor* out_arg = nullptr) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && w.device().is_cpu(), "x must be a [M, K] CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bf16");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf),
              "w must be a contiguous [N, K] float32, bf16 or fp16 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "w has ", w.size(1), " columns, x has ", K);
  TORCH_CHECK(M <= kMaxRows, "dense_gemv takes at most ", kMaxRows, " rows, got ", M);
  fp8serve_walk::check(walk, M);
  const bool seq = fp8serve_walk::sequential(walk, M);
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor out = fp8serve_staging::result_tensor(out_arg, x, M, N);
  if (M == 0 || N == 0) return out;
  const bool wbf16 = w.scalar_type() == at::kBFloat16;
  const bool wf16 = w.scalar_type() == at::kHalf;
#ifdef FP8SERVE_BF16_DOT
  const bool bf16_dot = allow_bf16_dot && wbf16 && xc.scalar_type() == at::kBFloat16 && K % 32 == 0;
#else
  const bool bf16_dot = false;
  (void)allow_bf16_dot;
#endif
  // The bf16 dot products read bf16 x as it is: only the result is staged.
  const fp8serve_staging::Float32Staging io(xc, out, /*widen_x=*/!bf16_dot);
  const float* xp = io.x;
  float* op = io.out;
  const char* wp = static_cast<const char*>(w.data_ptr());
  const int64_t wrb = K * w.element_size();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
#ifdef FP8SERVE_BF16_DOT
  if (bf16_dot) {
    const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr());
    const auto* wb16 = reinterpret_cast<const uint16_t*>(wp);
    at::parallel_for(0, N, kMinRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t n0 = begin; n0 < end; n0 += kRowBlock) {
        const int64_t n1 = std::min(end, n0 + kRowBlock);
        // Tiles of at most 8 rows (R = 2 weight rows per pass keeps the
        // activation loads at half a load per instruction); the block's
        // weight rows stay in L2 between tiles.
        for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
          const int64_t mt = std::min(kTileRows, M - m0);
          rows_bf16_any(mt, seq, op + m0 * N, xb + m0 * K, wb16, bp, N, K, n0, n1);
        }
      }
      io.narrow(M, begin, end);
    });
    return out;
  }
#endif
  const int64_t esz = w.element_size();
  const bool chunk_k = !seq && M >= kKChunkMinRows && K > kKChunk;
  at::parallel_for(0, N, kMinRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> partial(chunk_k ? kRowBlock * M : 0);
    for (int64_t n0 = begin; n0 < end; n0 += kRowBlock) {
      const int64_t n1 = std::min(end, n0 + kRowBlock);
      if (!chunk_k) {
        for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
          const int64_t mt = std::min(kTileRows, M - m0);
          if (wbf16) rows_any<1>(mt, seq, op + m0 * N, xp + m0 * K, K, wp, wrb, bp, N, K, n0, n1);
          else if (wf16) rows_any<2>(mt, seq, op + m0 * N, xp + m0 * K, K, wp, wrb, bp, N, K, n0, n1);
          else rows_any<0>(mt, seq, op + m0 * N, xp + m0 * K, K, wp, wrb, bp, N, K, n0, n1);
        }
        continue;
      }
      // K in slices (see kKChunk): tile m0's sums for the block's rows at
      // partial[m0 * kRowBlock + (n - n0) * mt + (m - m0)], added slice by slice.
      std::fill(partial.begin(), partial.end(), 0.f);
      for (int64_t k0 = 0; k0 < K; k0 += kKChunk) {
        const int64_t kc = std::min(kKChunk, K - k0);
        for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
          const int64_t mt = std::min(kTileRows, M - m0);
          float* acc = partial.data() + m0 * kRowBlock;
          if (wbf16) rows_any<1, true>(mt, false, acc, xp + m0 * K + k0, K, wp + k0 * esz, wrb, nullptr, N, kc, n0, n1);
          else if (wf16) rows_any<2, true>(mt, false, acc, xp + m0 * K + k0, K, wp + k0 * esz, wrb, nullptr, N, kc, n0, n1);
          else rows_any<0, true>(mt, false, acc, xp + m0 * K + k0, K, wp + k0 * esz, wrb, nullptr, N, kc, n0, n1);
        }
      }
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int64_t mt = std::min(kTileRows, M - m0);
        const float* acc = partial.data() + m0 * kRowBlock;
        for (int64_t n = n0; n < n1; ++n) {
          const float bn = bp ? bp[n] : 0.f;
          for (int64_t m = 0; m < mt; ++m) op[(m0 + m) * N + n] = acc[(n - n0) * mt + m] + bn;
        }
      }
    }
    io.narrow(M, begin, end);
  });
  return out;
}

at::Tensor dense_gemv(at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias) {
  return dense_gemv_impl(x, w, bias, /*allow_bf16_dot=*/true, kAutoWalk);
}

// dense_gemv into a given [M, N] tensor (decode plans: decode_plan.cpp).
void dense_gemv_out(at::Tensor out, at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias) {
  dense_gemv_impl(x, w, bias, /*allow_bf16_dot=*/true, kAutoWalk, &out);
}

// Same contract, always the float32-FMA loop (what CPUs without AVX512-BF16 run).
at::Tensor dense_gemv_fma(at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias) {
  return dense_gemv_impl(x, w, bias, /*allow_bf16_dot=*/false, kAutoWalk);
}

// Either path with a forced row walk (tests, benchmarks): walk 1 interleaved, 2 sequential.
at::Tensor dense_gemv_walk(at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias, bool allow_bf16_dot,
                           int64_t walk) {
  return dense_gemv_impl(x, w, bias, allow_bf16_dot, walk);
}

// The walk kAutoWalk takes at M rows on this CPU: 1 interleaved, 2 sequential.
int64_t dense_gemv_auto_walk(int64_t M) {
  return fp8serve_walk::sequential(kAutoWalk, M) ? kSequential : kInterleaved;
}

bool dense_gemv_has_bf16_dot() {
#ifdef FP8SERVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(fp8serve, m) {
  m.def("dense_gemv", &dense_gemv);
  m.def("dense_gemv_out(Tensor(a!) out, Tensor x, Tensor w, Tensor? bias) -> ()", &dense_gemv_out);
  m.def("dense_gemv_fma", &dense_gemv_fma);
  m.def("dense_gemv_walk", &dense_gemv_walk);
  m.def("dense_gemv_auto_walk", &dense_gemv_auto_walk);
  m.def("dense_gemv_has_bf16_dot", &dense_gemv_has_bf16_dot);
}
