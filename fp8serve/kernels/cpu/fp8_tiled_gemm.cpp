// FP8-weight linear layers for many activation rows (prefills, decode
// batches past the GEMV's rows), float32 activations, AVX2 + FMA + F16C:
//   out[m, n] = sum_k x[m, k] * (e4m3(w[n, k]) * scale[n]) + bias[n]
// with the weights kept as one byte each, in the [N, K] layout the GEMV
// (fp8_gemm.cpp) reads: no second copy of any weight.
//
// Why: the other path for many rows decodes the whole weight to a float32
// buffer every call and hands it to oneDNN, which reorders a plain weight into
// its blocked layout every call too; on the AVX2-only Zen 3 EPYC that ran the
// default model's shapes at 0.64-0.76x of oneDNN on a packed float32 weight at
// 64 rows and 0.91-0.93x at 512. This kernel ran them 1.23-2.44x as fast as
// that path at 16-128 rows and 0.89-1.21x at 512, about float32's speed
// (benchmarks/results/fp8_tiled_gemm_2026-12-02_zen3.md).
//
// Schedule (a BLIS-style GEMM whose B packing is the FP8 decode):
//   - K in blocks of at most kMaxKc; rows of x in blocks of kMcTiles tiles of
//     kMr rows, packed per block as [tile][k][kMr] floats (each tile's
//     broadcasts read consecutively);
//   - per block of 16 output columns (a "panel") and K block, the 16 weight
//     rows are decoded once into a [k][16] float buffer (L1) with their
//     scales applied (fp8_dequantize's rounding: value * 2^-8, then
//     * (scale * 2^8)), 8 rows x 8 codes at a time through an 8 x 8 register
//     transpose, then every row tile of the block runs over it;
//   - register tile: 6 rows x 16 columns, 12 accumulators, per k 2 loads of
//     the panel and 6 broadcasts for 12 FMAs (the same tile as the prefill
//     attention's scores). A K block's sums are added to the output, the
//     bias after the last block.
// Threads: with enough panels each thread takes a range of panels for all
// rows (it packs the rows it needs itself: one parallel region, no shared
// scratch); otherwise each takes a range of row tiles for all panels.
//
// Sums run in a different order from a float GEMM library's, so results
// match fp8_linear_ref to float32 rounding, not bit for bit.
//
// The gated form (fp8_tiled_gemm_silu_and_mul) serves an MLP's gate_up
// projection as bf16_tiled_gemm's does: per pair of gate and up panels it
// decodes both, runs each row tile over the two and writes silu(gate) * up,
// so the [M, 2d] projection is never written to memory and read back by
// silu_and_mul. The default model's FP8 checkpoint on the AVX2-only Zen 2
// EPYC (benchmarks/gate_up_silu.py --weights fp8, two runs, same bits and
// tokens): the 30 gate_up passes 1.01-1.08x at 25-512 rows, engine prefill
// steps of 1 x 512 tokens 1.01-1.03x, decode steps at batch 32-64
// 0.99-1.03x (benchmarks/results/gate_up_silu_fp8_2026-12-06_zen2.md). With
// K past one K block (TinyLlama-1.1B's 2048 -> 2 x 5632, four weights from
// memory, same bits) 1.07-1.11x the two steps at 25-512 rows
// (benchmarks/results/gate_up_silu_fp8_kblocks_2026-12-06_zen2.md).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "e4m3_half.h"
#include "tile_shares.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FP8SERVE_TILED_GEMM 1
#endif

namespace {

#ifdef FP8SERVE_TILED_GEMM

constexpr int kMr = 6;             // rows per register tile
constexpr int kNr = 16;            // columns per register tile (a panel)
// K per block at most 640, so the default model's K = 576 is one block and
// each output tile is written once: with 256 (three blocks, a decoded panel
// in L1) the 576 -> 3072 projection at 512 rows took 15.7 ms against 12.6
// (its 6 MB output went through L3 three times); the 36 KiB panel of 576
// comes from L1/L2 at 2 loads per 12 FMAs. Row tiles per block: 24, 144 rows
// x 576 floats = 324 KiB of packed x (L2 is 512 KiB per core on Zen 3).
constexpr int64_t kMaxKc = 640;
constexpr int64_t kMcTiles = 24;

// Accumulators of a kMr x kNr tile over kc steps, then out (+)= them (+ bias).
// `accumulate`: add to what out holds (a later K block); bias: only with the
// last K block. nvalid < kNr: the last panel of an N that is not a multiple
// of 16 (the same additions in the same order, element by element).
template <int R>
__attribute__((always_inline)) inline void tile(const float* __restrict a, const float* __restrict b, int64_t kc,
                                                float* c, int64_t ldc, bool accumulate, const float* bias, int nvalid) {
  // Accumulator sets: a tile of 1-3 rows (the last of M = 6t + 1..3) has too
  // few accumulators to hide the FMA's latency with one set (2R chains: 5
  // cycles per k whatever R, so a 1-row tile cost what a 6-row one does); it
  // keeps a set per k of 2 (1-row tiles: of 4) consecutive k, added together
  // at the end in a fixed order (the bits depend on the tile's height, not on
  // threads), as bf16_tiled_gemm.cpp's tile
  // (benchmarks/results/tiled_gemm_tail_tiles_2026-12-06_zen2.md).
  constexpr int kSets = R == 1 ? 4 : (R <= 3 ? 2 : 1);
  __m256 lo[kSets][R], hi[kSets][R];
#pragma GCC unroll 8
  for (int s = 0; s < kSets; ++s)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) lo[s][r] = hi[s][r] = _mm256_setzero_ps();
  const auto step = [&](int64_t k, int s) __attribute__((always_inline)) {
    const __m256 b0 = _mm256_loadu_ps(b + k * kNr), b1 = _mm256_loadu_ps(b + k * kNr + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + k * kMr + r);
      lo[s][r] = _mm256_fmadd_ps(av, b0, lo[s][r]);
      hi[s][r] = _mm256_fmadd_ps(av, b1, hi[s][r]);
    }
  };
  int64_t k = 0;
  for (; k + kSets <= kc; k += kSets) {
#pragma GCC unroll 4
    for (int s = 0; s < kSets; ++s) step(k + s, s);
  }
  for (; k < kc; ++k) step(k, 0);
  fp8serve_tiles::finish_tile8<R, kSets>(lo, hi, c, ldc, accumulate, bias, nvalid);
}

void tile_rows(int rows, const float* a, const float* b, int64_t kc, float* c, int64_t ldc, bool accumulate,
               const float* bias, int nvalid) {
  switch (rows) {
    case 6: return tile<6>(a, b, kc, c, ldc, accumulate, bias, nvalid);
    case 5: return tile<5>(a, b, kc, c, ldc, accumulate, bias, nvalid);
    case 4: return tile<4>(a, b, kc, c, ldc, accumulate, bias, nvalid);
    case 3: return tile<3>(a, b, kc, c, ldc, accumulate, bias, nvalid);
    case 2: return tile<2>(a, b, kc, c, ldc, accumulate, bias, nvalid);
    default: return tile<1>(a, b, kc, c, ldc, accumulate, bias, nvalid);
  }
}

// In place: r[j] (row j, 8 lanes k) -> r[k] (8 lanes j).
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// panel[k][j] = e4m3(w[n0 + j, k0 + k]) * scale[n0 + j] for k < kc, j < 16;
// 0 for j >= nvalid. `s8` holds scale * 2^8 of the panel's rows (0 past nvalid).
// It also prefetches the same K block of the next `next_rows` rows (the next
// panel, 0 where the caller decodes none next), a line of each row per 64 k:
// the weight streams from memory 16 rows at a time, which the hardware
// prefetchers do not follow far enough ahead, and the decode waited on it.
// The default model's 120 decode linears from memory (Zen 2, ABBA against no
// prefetch, same bits): 1.14x at 24 rows, 1.08x at 48, 1.00x at 512; the
// gated form 1.18x / 1.09x / 1.00x
// (benchmarks/results/fp8_tiled_gemm_prefetch_2026-12-06_zen2.md; prefetcht1
// gave 1.14x / 1.09x / 1.00x in another run of the probe).
void decode_panel(const uint8_t* w, int64_t K, int64_t n0, int nvalid, int64_t k0, int64_t kc, const float* s8,
                  float* panel, int next_rows) {
  int64_t k = 0;
  const uint8_t* next = w + (n0 + kNr) * K + k0;
  for (; k + 8 <= kc; k += 8) {
    if (k % 64 == 0) {
      for (int j = 0; j < next_rows; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(next + j * K + k), _MM_HINT_T0);
    }
    for (int half = 0; half < 2; ++half) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) {
        const int row = half * 8 + j;
        r[j] = row < nvalid ? fp8serve_e4m3::half_decode8(w + (n0 + row) * K + k0 + k) : _mm256_setzero_ps();
      }
      transpose8(r);
      const __m256 sv = _mm256_loadu_ps(s8 + half * 8);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(panel + (k + i) * kNr + half * 8, _mm256_mul_ps(r[i], sv));
    }
  }
  for (; k < kc; ++k)
    for (int j = 0; j < kNr; ++j)
      panel[k * kNr + j] =
          j < nvalid ? _cvtsh_ss(fp8serve_e4m3::e4m3_to_half_bits(w[(n0 + j) * K + k0 + k])) * s8[j] : 0.f;
}

// One thread's share: row tiles [t0, t1) x panels [p0, p1), all of K.
void run_share(const float* x, const uint8_t* w, const float* scale, const float* bias, float* out, int64_t M,
               int64_t N, int64_t K, int64_t t0, int64_t t1, int64_t p0, int64_t p1) {
  const int64_t nkb = (K + kMaxKc - 1) / kMaxKc;
  const int64_t kc_max = (K + nkb - 1) / nkb;  // equal K blocks
  std::vector<float> packed(kMcTiles * kMr * kc_max), panel(kc_max * kNr);
  alignas(32) float s8[kNr];
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t k0 = kb * kc_max, kc = std::min(kc_max, K - k0);
    const bool last = kb == nkb - 1;
    for (int64_t tb = t0; tb < t1; tb += kMcTiles) {
      const int64_t tiles = std::min(kMcTiles, t1 - tb);
      fp8serve_tiles::pack_rows<kMr>(x, M, K, tb * kMr, tiles, k0, kc, packed.data());
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * kNr;
        const int nvalid = static_cast<int>(std::min<int64_t>(kNr, N - n0));
        for (int j = 0; j < kNr; ++j) s8[j] = j < nvalid ? scale[n0 + j] * fp8serve_e4m3::kE4M3HalfMultiplier : 0.f;
        decode_panel(w, K, n0, nvalid, k0, kc, s8, panel.data(),
                     static_cast<int>(std::clamp<int64_t>(std::min(N, p1 * kNr) - n0 - kNr, 0, kNr)));
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t m = (tb + t) * kMr;
          tile_rows(static_cast<int>(std::min<int64_t>(kMr, M - m)), packed.data() + t * kc * kMr, panel.data(), kc,
                    out + m * N + n0, N, kb > 0, last && bias ? bias + n0 : nullptr, nvalid);
        }
      }
    }
  }
}

// run_share for the gated form: gate panels [p0, p1) of the first d = N / 2
// outputs, each with its up panel p + d / 16. Per block of row tiles, x is
// packed once for all of K; per pair of panels and K block, both panels are
// decoded and every row tile runs over them into two small buffers, as the
// plain GEMM adds its K blocks into out (bias with the last); after the last
// K block, silu(gate) * up goes to out [M, d]. The [M, N] projection is never
// written. (K blocks inside the pair, not outside the row block as in
// run_share: the gate and up sums of a pair stay in L1 until their silu,
// where K blocks outside would keep the whole [rows, N] projection; packed x
// of all of K then comes from L2 or L3 once per pair.)
void run_gated_share(const float* x, const uint8_t* w, const float* scale, const float* bias, float* out, int64_t M,
                     int64_t d, int64_t K, int64_t t0, int64_t t1, int64_t p0, int64_t p1) {
  const int64_t nkb = (K + kMaxKc - 1) / kMaxKc;
  const int64_t kc_max = (K + nkb - 1) / nkb;  // equal K blocks, as run_share's
  std::vector<float> packed(kMcTiles * kMr * K), gate_panel(kc_max * kNr), up_panel(kc_max * kNr);
  std::vector<float> g(kMcTiles * kMr * kNr), u(kMcTiles * kMr * kNr);
  alignas(32) float s8[kNr];
  const auto decode = [&](int64_t n0, int64_t k0, int64_t kc, float* panel, int next_rows) {
    for (int j = 0; j < kNr; ++j) s8[j] = scale[n0 + j] * fp8serve_e4m3::kE4M3HalfMultiplier;
    decode_panel(w, K, n0, kNr, k0, kc, s8, panel, next_rows);
  };
  for (int64_t tb = t0; tb < t1; tb += kMcTiles) {
    const int64_t tiles = std::min(kMcTiles, t1 - tb);
    // K block kb's packed rows start at tiles * kMr * k0, laid out as run_share's.
    for (int64_t kb = 0; kb < nkb; ++kb) {
      const int64_t k0 = kb * kc_max;
      fp8serve_tiles::pack_rows<kMr>(x, M, K, tb * kMr, tiles, k0, std::min(kc_max, K - k0),
                                     packed.data() + tiles * kMr * k0);
    }
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t ng = p * kNr, nu = d + p * kNr;
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t k0 = kb * kc_max, kc = std::min(kc_max, K - k0);
        const bool last = kb == nkb - 1;
        const int next_rows = p + 1 < p1 ? kNr : 0;
        decode(ng, k0, kc, gate_panel.data(), next_rows);
        decode(nu, k0, kc, up_panel.data(), next_rows);
        for (int64_t t = 0; t < tiles; ++t) {
          const int rows = static_cast<int>(std::min<int64_t>(kMr, M - (tb + t) * kMr));
          const float* a = packed.data() + tiles * kMr * k0 + t * kc * kMr;
          float* gt = g.data() + t * kMr * kNr;
          float* ut = u.data() + t * kMr * kNr;
          tile_rows(rows, a, gate_panel.data(), kc, gt, kNr, kb > 0, last && bias ? bias + ng : nullptr, kNr);
          tile_rows(rows, a, up_panel.data(), kc, ut, kNr, kb > 0, last && bias ? bias + nu : nullptr, kNr);
        }
      }
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m = (tb + t) * kMr;
        const int rows = static_cast<int>(std::min<int64_t>(kMr, M - m));
        for (int r = 0; r < rows; ++r) {
          fp8serve_act::silu_mul_row(g.data() + (t * kMr + r) * kNr, u.data() + (t * kMr + r) * kNr,
                                     out + (m + r) * d + ng, kNr);
        }
      }
    }
  }
}

// Shapes and dtypes of x, w, scale and bias checked; returns (M, K, N).
std::tuple<int64_t, int64_t, int64_t> check_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                                                 const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "w must be contiguous uint8 e4m3 codes [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "x is [", M, ", ", K, "] but w is [", N, ", ", w.size(1), "]: K must match");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "scale must be a contiguous float32 [N] tensor, N = ", N);
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be a contiguous float32 [N] tensor, N = ", N);
  }
  return {M, K, N};
}

#endif  // FP8SERVE_TILED_GEMM

at::Tensor fp8_tiled_gemm(at::Tensor x, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias) {
#ifndef FP8SERVE_TILED_GEMM
  TORCH_CHECK(false, "fp8_tiled_gemm needs a build with AVX2, FMA and F16C (see fp8_tiled_gemm_available)");
#else
  const auto [M, K, N] = check_args(x, w, scale, bias);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return bias ? out.copy_(bias->expand({M, N})) : out.zero_();
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t tiles = (M + kMr - 1) / kMr, panels = (N + kNr - 1) / kNr;
  fp8serve_tiles::for_each_share(tiles, panels, [&](int64_t t0, int64_t t1, int64_t p0, int64_t p1) {
    run_share(xp, wp, sp, bp, op, M, N, K, t0, t1, p0, p1);
  });
  return out;
#endif
}

// silu(gate) * up of a gate_up projection: w's first n / 2 rows are the
// gate's, the rest the up projection's (as MergedLinear stacks them), and
// out [M, n / 2] = silu(x @ gate.T + bias[:n/2]) * (x @ up.T + bias[n/2:]),
// what fp8_tiled_gemm followed by silu_and_mul gives (bit for bit where
// silu_and_mul runs its 8-lane loop: builds without AVX-512), without writing
// and re-reading the [M, n] projection, for any K (K blocks as the plain
// GEMM's). Where the gate's rows are not a whole number of 16-row panels it
// runs those two steps itself.
at::Tensor fp8_tiled_gemm_silu_and_mul(at::Tensor x, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias) {
#ifndef FP8SERVE_TILED_GEMM
  TORCH_CHECK(false,
              "fp8_tiled_gemm_silu_and_mul needs a build with AVX2, FMA and F16C (see fp8_tiled_gemm_available)");
#else
  const auto [M, K, N] = check_args(x, w, scale, bias);
  TORCH_CHECK(N % 2 == 0, "w has ", N, " rows: a gate_up projection has an even number of rows");
  const int64_t d = N / 2;
  at::Tensor out = at::empty({M, d}, x.options());
  if (M == 0) return out;
  if (d % kNr != 0 || K == 0) {
    const at::Tensor gate_up = fp8_tiled_gemm(x, w, scale, bias);
    fp8serve_tiles::silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), M, d);
    return out;
  }
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t tiles = (M + kMr - 1) / kMr, pairs = d / kNr;
  fp8serve_tiles::for_each_share(tiles, pairs, [&](int64_t t0, int64_t t1, int64_t p0, int64_t p1) {
    run_gated_share(xp, wp, sp, bp, op, M, d, K, t0, t1, p0, p1);
  });
  return out;
#endif
}

bool fp8_tiled_gemm_available() {
#ifdef FP8SERVE_TILED_GEMM
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8serve, m) {
  m.def("fp8_tiled_gemm", &fp8_tiled_gemm);
  m.def("fp8_tiled_gemm_silu_and_mul", &fp8_tiled_gemm_silu_and_mul);
  m.def("fp8_tiled_gemm_available", &fp8_tiled_gemm_available);
}
