// bf16 linear weights under float32 compute (a bf16 checkpoint on a CPU
// without fast bf16 arithmetic: narrow_weights.py), decode batches and
// prefills of BF16_TILED_GEMM_MIN_ROWS or more activation rows (cpu_ops),
// AVX2 + FMA:
//   out[m, n] = sum_k x[m, k] * w[n, k] + bias[n]      (float32 out)
// read from the weight's packed copy in the pair-interleaved blocks of 16
// output rows that dense_gemv_packed reads (gemv_packing.pack_gemv_weight):
//   packed[b][p][j][i] = w[16 * b + j][2 * p + i]      shape [ceil(N/16), K/2, 16, 2]
//
// Why: above dense_gemv's rows, those batches ran oneDNN on its packed
// float32 copy of the weight: four bytes per weight read from memory each
// step, at 77-98 GFLOP/s for 48-64 rows on the AVX2-only Zen 2 EPYC, and a
// second copy of every weight twice its size.
// dense_gemv (plain [N, K] rows, 8 activation rows per register tile) decodes
// each bf16 weight once per 8 rows and is bound by its loads past 16 rows.
// Here every weight is converted once per 6 rows, in registers, by one shift
// or one AND per 8 weights: a 32-bit lane of a packed vector holds the pair
// (w[n][k], w[n][k + 1]); shifted left 16 it is w[n][k] as a float32, with its
// low 16 bits cleared it is w[n][k + 1].
// On that machine (the default model's 120 decode linears read from memory,
// ABBA rounds, benchmarks/results/bf16_tiled_gemm_2026-12-05_zen2.md):
// 1.09-1.29x dense_gemv at 12-32 rows, 1.12-1.57x oneDNN's packed float32
// weight at 48-256; at 256-2048 rows 1.09-1.18x, and 1.21-1.27x on one
// weight of each Llama-3-8B shape at 512 rows
// (benchmarks/results/bf16_tiled_gemm_prefill_2026-12-06_zen2.md).
//
// Schedule (fp8_tiled_gemm.cpp's, with the weight panels already packed):
// the rows of x packed once as [tile][k][kMr] floats (each k's broadcasts
// consecutive; blocks of kMcTiles tiles past 264 rows); per 16-row block of
// the weight (a panel) every row tile runs the whole of K over it: a 6 x 16
// register tile, 12 accumulators, per pair of k 2 loads of the panel, 2
// shifts, 2 ANDs and 12 broadcasts for 24 FMAs (AVX-512 builds: two panels
// per 16-lane tile, the same per pair of k on 16 lanes: tile2). K in blocks only past
// kMaxKc (4096): up to there each output is written once; a later K block
// adds its sums to what the earlier ones wrote. A thread takes a range of
// panels for all rows (it packs the rows itself) when there are enough
// panels, else a range of row tiles for all panels.
//
// Sums run along k in order, in float32 with FMAs: results match a float64
// reference to float32 rounding, not torch's GEMM bit for bit.
//
// The gated form (bf16_tiled_gemm_silu_and_mul) serves an MLP's gate_up
// projection: per row tile it runs the gate panel's tile and the matching up
// panel's tile and writes silu(gate) * up, so the [M, 2d] projection is never
// written to memory and read back by silu_and_mul. The default model's 30
// gate_up passes ran 1.05-1.09x as fast as the two steps at 12-512 rows, and
// prefill steps of 1 x 512 tokens 1.01-1.05x (benchmarks/gate_up_silu.py,
// benchmarks/results/gate_up_silu_2026-12-06_zen2.md).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "silu_mul_row.h"
#include "tile_shares.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FP8SERVE_BF16_TILED_GEMM 1
#endif

namespace {

#ifdef FP8SERVE_BF16_TILED_GEMM

constexpr int kMr = 6;   // rows per register tile
constexpr int kNr = 16;  // output columns per panel (gemv_packing.BLOCK_ROWS)
// Row tiles per block of packed x: 44 tiles = 264 rows, so every decode
// batch (at most 256 rows) packs its rows once and reads each weight panel
// from memory once, then from L1 / L2 for every row tile. Blocks of
// 256 KiB of x (18 tiles at K = 576, 7 at K = 1536) read the down
// projection's weight twice at 64 rows: 129 ms a pass of the 120 decode
// linears against 100 with one block (Zen 2, ABBA). Larger M (prefills)
// goes in blocks, a pass over the weight per block.
constexpr int64_t kMcTiles = 44;
// K per block at most 4096: a tile's 6 rows of packed x (96 KiB) and its
// panel (128 KiB of bf16) then share a core's 512 KiB L2. With all of
// K = 14336 in one block (Llama-3-8B's down projection, 512 rows) the panel
// (448 KiB) and the rows streaming past it did not, and the kernel ran 0.81x
// oneDNN's packed float32 copy where K = 4096 ran 1.21-1.30x (one run, Zen 2);
// in blocks of 3584 it ran 1.21-1.25x. The default model's K (576, 1536) is
// one block: each output is written once.
constexpr int64_t kMaxKc = 4096;
// The weight streams from memory, a panel after another: without help the
// first row tile over each panel waits on its lines (the hardware prefetcher
// does not run far enough ahead). So the first row tile over a panel also
// prefetches the next panel (kPrefetch), one line per pair of k at the same
// offset, a panel ahead of the loads. Zen 2, the default model's 120 decode
// linears read from memory, against no prefetch (ABBA, same bits,
// benchmarks/results/bf16_tiled_gemm_prefetch_inloop_2026-12-06_zen2.md):
// 1.25x at 12 rows, 1.15x at 16, 1.09-1.11x at 24-32, 1.03-1.06x at 48-128,
// 1.00x at 256-512; engine decode steps at batch 16 1.11x. A share of the
// next panel before each row tile instead (at most 16 lines; more in one
// burst stalled the tile) gave 0.98-1.05x, and nothing on top of this.

// The kMr x kNr tile of out (+ bias) for rows `a` (packed [k][kMr], K even)
// against panel `b` ([K/2][16][2] bf16 bits); nvalid < kNr: the last panel of
// an N that is not a multiple of 16 (its padding rows are zeros). kPrefetch:
// also prefetch the K / 2 lines of `next` (the next panel's same K block).
template <int R, bool kAccumulate, bool kPrefetch>
__attribute__((always_inline)) inline void tile(const float* __restrict a, const uint16_t* __restrict b, int64_t K,
                                                float* c, int64_t ldc, const float* bias, int nvalid,
                                                const char* next) {
  // Accumulator sets: a tile of 1-3 rows (the last of M = 6t + 1..3) has too
  // few accumulators to hide the FMA's latency with one set (2R chains of two
  // FMAs per pair of k: 5 cycles per k whatever R, so a 1-row tile cost what a
  // 6-row one does); it keeps one set per k of a pair, a 1-row tile one per k
  // of two pairs, added together at the end (fixed order: the bits depend on
  // the tile's height, not on threads). The default model's 120 decode
  // linears (Zen 2, from memory): 1.05-1.16x at M = 6t + 1..3, engine decode
  // steps at batch 13 1.05x (benchmarks/results/tiled_gemm_tail_tiles_2026-12-06_zen2.md).
  constexpr int kSets = R == 1 ? 4 : (R <= 3 ? 2 : 1);
  __m256 lo[kSets][R], hi[kSets][R];
#pragma GCC unroll 8
  for (int s = 0; s < kSets; ++s)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) lo[s][r] = hi[s][r] = _mm256_setzero_ps();
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  // k and k + 1 into sets se and so.
  const auto pair = [&](int64_t k, int se, int so) __attribute__((always_inline)) {
    if (kPrefetch) _mm_prefetch(next + k * kNr * 2, _MM_HINT_T0);  // the 64 bytes this pair of k reads, a panel on
    const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + k * kNr));
    const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + k * kNr + 16));
    const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(p0, 16));  // w[n0 + 0..7][k]
    const __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(p1, 16));  // w[n0 + 8..15][k]
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + k * kMr + r);
      lo[se][r] = _mm256_fmadd_ps(av, w0, lo[se][r]);
      hi[se][r] = _mm256_fmadd_ps(av, w1, hi[se][r]);
    }
    const __m256 v0 = _mm256_castsi256_ps(_mm256_and_si256(p0, high_half));  // w[n0 + 0..7][k + 1]
    const __m256 v1 = _mm256_castsi256_ps(_mm256_and_si256(p1, high_half));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + (k + 1) * kMr + r);
      lo[so][r] = _mm256_fmadd_ps(av, v0, lo[so][r]);
      hi[so][r] = _mm256_fmadd_ps(av, v1, hi[so][r]);
    }
  };
  int64_t k = 0;
  if constexpr (kSets == 4) {
    for (; k + 4 <= K; k += 4) {
      pair(k, 0, 1);
      pair(k + 2, 2, 3);
    }
  }
  for (; k < K; k += 2) pair(k, 0, kSets > 1 ? 1 : 0);
  fp8serve_tiles::finish_tile8<R, kSets>(lo, hi, c, ldc, kAccumulate, bias, nvalid);
}

template <bool kAccumulate, bool kPrefetch>
void tile_rows(int rows, const float* a, const uint16_t* b, int64_t K, float* c, int64_t ldc, const float* bias,
               int nvalid, const char* next) {
  switch (rows) {
    case 6: return tile<6, kAccumulate, kPrefetch>(a, b, K, c, ldc, bias, nvalid, next);
    case 5: return tile<5, kAccumulate, kPrefetch>(a, b, K, c, ldc, bias, nvalid, next);
    case 4: return tile<4, kAccumulate, kPrefetch>(a, b, K, c, ldc, bias, nvalid, next);
    case 3: return tile<3, kAccumulate, kPrefetch>(a, b, K, c, ldc, bias, nvalid, next);
    case 2: return tile<2, kAccumulate, kPrefetch>(a, b, K, c, ldc, bias, nvalid, next);
    default: return tile<1, kAccumulate, kPrefetch>(a, b, K, c, ldc, bias, nvalid, next);
  }
}

template <bool kAccumulate>
void tile_rows(int rows, const float* a, const uint16_t* b, int64_t K, float* c, int64_t ldc, const float* bias,
               int nvalid, const char* next) {
  if (next) return tile_rows<kAccumulate, true>(rows, a, b, K, c, ldc, bias, nvalid, next);
  tile_rows<kAccumulate, false>(rows, a, b, K, c, ldc, bias, nvalid, nullptr);
}

#ifdef __AVX512F__
// AVX-512 builds: two panels at once on 16 lanes, each broadcast of x feeding
// one FMA per panel. A panel's pair of k is one 64-byte vector (shift: k, AND:
// k + 1). One panel per 16-lane tile left one FMA per broadcast of x, and on
// an Ice Lake Xeon the broadcasts, not the FMAs, bound the loop: hot in L1 on
// one core, 6 rows, K = 576, the 8-lane tile ran 51-61 GFLOP/s, one panel on
// 16 lanes 60-69, two panels 86-98 (a standalone copy of the loops). The
// accumulator sets and the order of every sum are the 8-lane tile's, so the
// bits are the same. c1 / bias1 / nvalid1 / next1: the second panel's.
template <int R, bool kAccumulate, bool kPrefetch>
__attribute__((always_inline)) inline void tile2(const float* __restrict a, const uint16_t* __restrict b0,
                                                 const uint16_t* __restrict b1, int64_t K, float* c0, float* c1,
                                                 int64_t ldc, const float* bias0, const float* bias1, int nvalid0,
                                                 int nvalid1, const char* next0, const char* next1) {
  constexpr int kSets = R == 1 ? 4 : (R <= 3 ? 2 : 1);
  __m512 x0[kSets][R], x1[kSets][R];
#pragma GCC unroll 8
  for (int s = 0; s < kSets; ++s)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) x0[s][r] = x1[s][r] = _mm512_setzero_ps();
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const auto pair = [&](int64_t k, int se, int so) __attribute__((always_inline)) {
    if (kPrefetch) {
      _mm_prefetch(next0 + k * kNr * 2, _MM_HINT_T0);
      _mm_prefetch(next1 + k * kNr * 2, _MM_HINT_T0);
    }
    const __m512i p0 = _mm512_loadu_si512(b0 + k * kNr), p1 = _mm512_loadu_si512(b1 + k * kNr);
    const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(p0, 16));  // panel 0, k
    const __m512 w1 = _mm512_castsi512_ps(_mm512_slli_epi32(p1, 16));  // panel 1, k
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[k * kMr + r]);
      x0[se][r] = _mm512_fmadd_ps(av, w0, x0[se][r]);
      x1[se][r] = _mm512_fmadd_ps(av, w1, x1[se][r]);
    }
    const __m512 v0 = _mm512_castsi512_ps(_mm512_and_si512(p0, high_half));  // panel 0, k + 1
    const __m512 v1 = _mm512_castsi512_ps(_mm512_and_si512(p1, high_half));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[(k + 1) * kMr + r]);
      x0[so][r] = _mm512_fmadd_ps(av, v0, x0[so][r]);
      x1[so][r] = _mm512_fmadd_ps(av, v1, x1[so][r]);
    }
  };
  int64_t k = 0;
  if constexpr (kSets == 4) {
    for (; k + 4 <= K; k += 4) {
      pair(k, 0, 1);
      pair(k + 2, 2, 3);
    }
  }
  for (; k < K; k += 2) pair(k, 0, kSets > 1 ? 1 : 0);
  const __mmask16 m0 = static_cast<__mmask16>(nvalid0 >= kNr ? 0xFFFFu : (1u << nvalid0) - 1u);
  const __mmask16 m1 = static_cast<__mmask16>(nvalid1 >= kNr ? 0xFFFFu : (1u << nvalid1) - 1u);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int s = 1; s < kSets; ++s) {
      x0[0][r] = _mm512_add_ps(x0[0][r], x0[s][r]);
      x1[0][r] = _mm512_add_ps(x1[0][r], x1[s][r]);
    }
    // As the 8-lane tile: the earlier K block's sums, then the bias.
    if (kAccumulate) {
      x0[0][r] = _mm512_add_ps(x0[0][r], _mm512_maskz_loadu_ps(m0, c0 + r * ldc));
      x1[0][r] = _mm512_add_ps(x1[0][r], _mm512_maskz_loadu_ps(m1, c1 + r * ldc));
    }
    if (bias0) x0[0][r] = _mm512_add_ps(x0[0][r], _mm512_maskz_loadu_ps(m0, bias0));
    if (bias1) x1[0][r] = _mm512_add_ps(x1[0][r], _mm512_maskz_loadu_ps(m1, bias1));
    _mm512_mask_storeu_ps(c0 + r * ldc, m0, x0[0][r]);
    _mm512_mask_storeu_ps(c1 + r * ldc, m1, x1[0][r]);
  }
}

template <bool kAccumulate, bool kPrefetch>
void tile2_rows(int rows, const float* a, const uint16_t* b0, const uint16_t* b1, int64_t K, float* c0, float* c1,
                int64_t ldc, const float* bias0, const float* bias1, int nvalid0, int nvalid1, const char* next0,
                const char* next1) {
#define FP8SERVE_TILE2(R) \
  return tile2<R, kAccumulate, kPrefetch>(a, b0, b1, K, c0, c1, ldc, bias0, bias1, nvalid0, nvalid1, next0, next1)
  switch (rows) {
    case 6: FP8SERVE_TILE2(6);
    case 5: FP8SERVE_TILE2(5);
    case 4: FP8SERVE_TILE2(4);
    case 3: FP8SERVE_TILE2(3);
    case 2: FP8SERVE_TILE2(2);
    default: FP8SERVE_TILE2(1);
  }
#undef FP8SERVE_TILE2
}

// next0 == nullptr: no prefetch (next1 then unused).
template <bool kAccumulate>
void tile2_rows(int rows, const float* a, const uint16_t* b0, const uint16_t* b1, int64_t K, float* c0, float* c1,
                int64_t ldc, const float* bias0, const float* bias1, int nvalid0, int nvalid1, const char* next0,
                const char* next1) {
  if (next0) {
    return tile2_rows<kAccumulate, true>(rows, a, b0, b1, K, c0, c1, ldc, bias0, bias1, nvalid0, nvalid1, next0,
                                         next1 ? next1 : next0);
  }
  tile2_rows<kAccumulate, false>(rows, a, b0, b1, K, c0, c1, ldc, bias0, bias1, nvalid0, nvalid1, nullptr, nullptr);
}
#endif  // __AVX512F__

// One thread's share: row tiles [t0, t1) x panels [p0, p1), K in blocks of
// kc_max (even): the first block stores its sums, later ones add theirs, the
// bias comes with the last.
void run_share(const float* x, const uint16_t* w, const float* bias, float* out, int64_t M, int64_t N, int64_t K,
               int64_t kc_max, int64_t t0, int64_t t1, int64_t p0, int64_t p1) {
  std::vector<float> packed(std::min(kMcTiles, t1 - t0) * kMr * kc_max);
  for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
    const int64_t kc = std::min(kc_max, K - k0);
    const bool first = k0 == 0, last = k0 + kc == K;
    for (int64_t tb = t0; tb < t1; tb += kMcTiles) {
      const int64_t tiles = std::min(kMcTiles, t1 - tb);
      fp8serve_tiles::pack_rows<kMr>(x, M, K, tb * kMr, tiles, k0, kc, packed.data());
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kNr;
        const int nvalid = static_cast<int>(std::min<int64_t>(kNr, N - n0));
        const uint16_t* b = w + p * K * kNr + k0 * kNr;  // the panel's pairs k0 / 2 ... (k0 + kc) / 2
        const float* bias_n = last && bias ? bias + n0 : nullptr;
#ifdef __AVX512F__
        if (p + 1 < p1) {  // panels p and p + 1 together (tile2); the first row tile prefetches the next two
          const uint16_t* b1 = b + K * kNr;
          const int nvalid1 = static_cast<int>(std::min<int64_t>(kNr, N - n0 - kNr));
          const float* bias1 = last && bias ? bias + n0 + kNr : nullptr;
          const char* next0 = p + 2 < p1 ? reinterpret_cast<const char*>(b + 2 * K * kNr) : nullptr;
          const char* next1 = p + 3 < p1 ? reinterpret_cast<const char*>(b + 3 * K * kNr) : nullptr;
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t m = (tb + t) * kMr;
            const int rows = static_cast<int>(std::min<int64_t>(kMr, M - m));
            const float* a = packed.data() + t * kc * kMr;
            float* c = out + m * N + n0;
            const char* n0p = t == 0 ? next0 : nullptr;
            if (first) {
              tile2_rows<false>(rows, a, b, b1, kc, c, c + kNr, N, bias_n, bias1, nvalid, nvalid1, n0p, next1);
            } else {
              tile2_rows<true>(rows, a, b, b1, kc, c, c + kNr, N, bias_n, bias1, nvalid, nvalid1, n0p, next1);
            }
          }
          ++p;
          continue;
        }
#endif
        // The next panel (its same K block), prefetched by this panel's first row tile.
        const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(b + K * kNr) : nullptr;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t m = (tb + t) * kMr;
          const int rows = static_cast<int>(std::min<int64_t>(kMr, M - m));
          const float* a = packed.data() + t * kc * kMr;
          if (first) {
            tile_rows<false>(rows, a, b, kc, out + m * N + n0, N, bias_n, nvalid, t == 0 ? next : nullptr);
          } else {
            tile_rows<true>(rows, a, b, kc, out + m * N + n0, N, bias_n, nvalid, t == 0 ? next : nullptr);
          }
        }
      }
    }
  }
}

// run_share for the gated form (one K block): gate panels [p0, p1) of the
// first d = N / 2 outputs, each with its up panel p + d / 16. Per row tile the
// gate and up tiles go to two small buffers through `tile`, as the plain GEMM
// would store them (bias included), and silu(gate) * up to out [M, d]. The
// first row tile over a gate panel prefetches its up panel; over an up panel,
// the next gate panel.
void run_gated_share(const float* x, const uint16_t* w, const float* bias, float* out, int64_t M, int64_t d,
                     int64_t K, int64_t t0, int64_t t1, int64_t p0, int64_t p1) {
  std::vector<float> packed(std::min(kMcTiles, t1 - t0) * kMr * K);
  const int64_t up_off = d / kNr;  // panels between a gate panel and its up panel
  alignas(32) float g[kMr][kNr], u[kMr][kNr];
  for (int64_t tb = t0; tb < t1; tb += kMcTiles) {
    const int64_t tiles = std::min(kMcTiles, t1 - tb);
    fp8serve_tiles::pack_rows<kMr>(x, M, K, tb * kMr, tiles, 0, K, packed.data());
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* bg = w + p * K * kNr;
      const uint16_t* bu = w + (p + up_off) * K * kNr;
      const float* bias_g = bias ? bias + p * kNr : nullptr;
      const float* bias_u = bias ? bias + d + p * kNr : nullptr;
      const char* next_gate = p + 1 < p1 ? reinterpret_cast<const char*>(bg + K * kNr) : nullptr;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m = (tb + t) * kMr;
        const int rows = static_cast<int>(std::min<int64_t>(kMr, M - m));
        const float* a = packed.data() + t * K * kMr;
#ifdef __AVX512F__
        // The gate and up panels together; the first row tile prefetches the next gate and up panels.
        const char* next_up = next_gate ? reinterpret_cast<const char*>(bu + K * kNr) : nullptr;
        tile2_rows<false>(rows, a, bg, bu, K, &g[0][0], &u[0][0], kNr, bias_g, bias_u, kNr, kNr,
                          t == 0 ? next_gate : nullptr, next_up);
#else
        tile_rows<false>(rows, a, bg, K, &g[0][0], kNr, bias_g, kNr,
                         t == 0 ? reinterpret_cast<const char*>(bu) : nullptr);
        tile_rows<false>(rows, a, bu, K, &u[0][0], kNr, bias_u, kNr, t == 0 ? next_gate : nullptr);
#endif
        for (int r = 0; r < rows; ++r) fp8serve_act::silu_mul_row(g[r], u[r], out + (m + r) * d + p * kNr, kNr);
      }
    }
  }
}

#endif  // FP8SERVE_BF16_TILED_GEMM

#ifdef FP8SERVE_BF16_TILED_GEMM
// Shapes of x, packed, n and bias checked; returns (M, K).
std::pair<int64_t, int64_t> check_args(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kNr && packed.size(3) == 2,
              "packed must be a contiguous bf16 [ceil(N/16), K/2, 16, 2] tensor (gemv_packing.pack_gemv_weight)");
  const int64_t M = x.size(0), K = x.size(1), N = n;
  TORCH_CHECK(packed.size(1) * 2 == K, "x is [", M, ", ", K, "] but packed holds K = ", packed.size(1) * 2);
  TORCH_CHECK(N >= 1 && (N + kNr - 1) / kNr == packed.size(0), "n = ", N, " does not fit packed's ", packed.size(0),
              " blocks of 16 rows");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be a contiguous float32 [N] tensor, N = ", N);
  }
  return {M, K};
}

void gemm_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t N,
               const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  if (M == 0) return;
  if (K == 0) {
    if (bias) out.copy_(bias->expand({M, N}));
    else out.zero_();
    return;
  }
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t tiles = (M + kMr - 1) / kMr, panels = packed.size(0);
  // Equal even K blocks of at most kMaxKc (one block up to kMaxKc).
  const int64_t nkb = (K + kMaxKc - 1) / kMaxKc;
  const int64_t kc_max = ((K / 2 + nkb - 1) / nkb) * 2;
  fp8serve_tiles::for_each_share(tiles, panels, [&](int64_t t0, int64_t t1, int64_t p0, int64_t p1) {
    run_share(xp, wp, bp, op, M, N, K, kc_max, t0, t1, p0, p1);
  });
}
#endif  // FP8SERVE_BF16_TILED_GEMM

at::Tensor bf16_tiled_gemm(at::Tensor x, at::Tensor packed, int64_t n, std::optional<at::Tensor> bias) {
#ifndef FP8SERVE_BF16_TILED_GEMM
  TORCH_CHECK(false, "bf16_tiled_gemm needs a build with AVX2 and FMA (see bf16_tiled_gemm_available)");
#else
  const int64_t M = check_args(x, packed, n, bias).first;
  at::Tensor out = at::empty({M, n}, x.options());
  gemm_into(out, x, packed, n, bias);
  return out;
#endif
}

// silu(gate) * up of a gate_up projection: the weight's first n / 2 rows are
// the gate's, the rest the up projection's (as MergedLinear stacks them), and
// out [M, n / 2] = silu(x @ gate.T + bias[:n/2]) * (x @ up.T + bias[n/2:]),
// what bf16_tiled_gemm followed by silu_and_mul gives (bit for bit where
// silu_and_mul runs its 8-lane loop: builds without AVX-512), without writing
// and re-reading the [M, n] projection. Where the gate's rows are not
// a whole number of 16-row panels, or K needs more than one K block, it runs
// those two steps itself.
at::Tensor bf16_tiled_gemm_silu_and_mul(at::Tensor x, at::Tensor packed, int64_t n, std::optional<at::Tensor> bias) {
#ifndef FP8SERVE_BF16_TILED_GEMM
  TORCH_CHECK(false, "bf16_tiled_gemm_silu_and_mul needs a build with AVX2 and FMA (see bf16_tiled_gemm_available)");
#else
  const auto [M, K] = check_args(x, packed, n, bias);
  TORCH_CHECK(n % 2 == 0, "n = ", n, ": a gate_up projection has an even number of rows");
  const int64_t d = n / 2;
  at::Tensor out = at::empty({M, d}, x.options());
  if (M == 0) return out;
  if (d % kNr != 0 || K > kMaxKc || K == 0) {
    at::Tensor gate_up = at::empty({M, n}, x.options());
    gemm_into(gate_up, x, packed, n, bias);
    fp8serve_tiles::silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), M, d);
    return out;
  }
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t tiles = (M + kMr - 1) / kMr, pairs = d / kNr;
  fp8serve_tiles::for_each_share(tiles, pairs, [&](int64_t t0, int64_t t1, int64_t p0, int64_t p1) {
    run_gated_share(xp, wp, bp, op, M, d, K, t0, t1, p0, p1);
  });
  return out;
#endif
}

bool bf16_tiled_gemm_available() {
#ifdef FP8SERVE_BF16_TILED_GEMM
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8serve, m) {
  m.def("bf16_tiled_gemm", &bf16_tiled_gemm);
  m.def("bf16_tiled_gemm_silu_and_mul", &bf16_tiled_gemm_silu_and_mul);
  m.def("bf16_tiled_gemm_available", &bf16_tiled_gemm_available);
}
