// bf16 linear layers for decode batches (the engine sends 13-256 activation
// rows here: cpu_ops.GEMV_PACKED_MIN_ROWS / MAX_ROWS) on a weight packed once
// into pair-interleaved blocks of 16 output rows:
//
//   w_packed[b][p][j][i] = w[16 * b + j][2 * p + i]     shape [ceil(N/16), K/2, 16, 2]
//
// (rows past N are zeros; gemv_packing.pack_gemv_weight). One 64-byte vector
// of a block then holds the k-pair p of 16 output rows, which is what
// vdpbf16ps multiplies against a broadcast pair (x[m][2p], x[m][2p+1]): each
// accumulator lane is one output, summed along the whole of k, so a tile ends
// with 16 finished outputs per register. dense_gemv's bf16 dot products (plain
// [N, K] rows) sum 16-lane partial dots and reduce each one at the end of a
// tile; with the default model's short rows (K = 576: 18 vdpbf16ps per
// accumulator) those sums and the per-tile setup held its hot calls to 260-390
// GFLOP/s at 8-32 rows on a Zen 4 EPYC whose bf16 peak is ~440, where this
// layout reached 330-440. Read from memory (the default model's 120 decode
// linears, benchmarks/results/dense_gemv_packed_2026-12-01_zen4.md): 1.02-1.39x
// dense_gemv at 13-32 rows, 1.05-1.57x oneDNN on its own packed weight at
// 48-256; at 1-12 rows 0.88-1.16x dense_gemv, which keeps those.
//
// Accumulation is float32 (vdpbf16ps: products exact, denormal bf16 inputs
// read as zero, as in dense_gemv's bf16 dot products); the result is rounded
// once to bf16, nearest even, as c10::BFloat16 rounds.
//
// An MLP's gate_up projection has a gated form (dense_gemv_packed_silu_and_mul,
// tile_gated): SiLU-and-mul applied as each tile's results leave the
// registers, with silu_and_mul's bits.
//
// Threads: blocks of 16 output rows are split over torch's thread pool; a
// task walks its blocks in chunks whose weights stay in L2 while each tile of
// at most 8 activation rows passes over them, so the weight comes from memory
// once per call whatever M.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "float_staging.h"
#include "fp8_bf16_lut.h"
#include "prefetch_level.h"
#include "silu_table.h"
#include "vec16.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FP8SERVE_GEMV_PACKED 1
#endif

namespace {

constexpr int64_t kMaxRows = 512;  // activation rows per call (above, oneDNN: see cpu_ops.GEMV_PACKED_MAX_ROWS)
constexpr int64_t kTileRows = 8;   // activation rows per register tile
constexpr int kTileBlocks = 3;     // 16-row blocks per register tile: 8 x 3 = 24 accumulators
// The blocks a task walks at a time: ~128 KiB of weight, a whole number of
// tiles. The first tile of activation rows streams a chunk from memory,
// prefetching kPrefetchBytes ahead in each block; the second prefetches the
// next chunk into L2 while it re-reads this one from there, so from the
// second chunk on no tile waits for memory at M > 8. Measured against a
// distance-only prefetch with 224 KiB chunks (120 decode linears from memory,
// ABBA): 1.03-1.08x at M = 8-32; 2 KiB ahead against 1 KiB, 1.03-1.08x.
constexpr int64_t kChunkBytes = 128 * 1024;
constexpr int64_t kPrefetchBytes = 2048;

#ifdef FP8SERVE_GEMV_PACKED
// float32 -> bf16 bits in the low half of each lane, nearest even, NaN ->
// 0x7FC0: what c10::BFloat16(float) gives (vcvtneps2bf16 would flush
// denormal results to zero).
inline __m512i round_to_bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// Stores 16 results rounded to bf16: as bf16, or (FloatOut) as the float32
// holding the same value, what `.float()` of the bf16 result gives without
// a second pass over it (the LM head's logits).
template <bool FloatOut>
inline void store_rounded(void* out, int64_t offset, __mmask16 mask, __m512 v) {
  const __m512i bits = round_to_bf16_bits(v);
  if constexpr (FloatOut) {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + offset, mask, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + offset, mask, _mm512_cvtepi32_epi16(bits));
  }
}

// acc[m][c] = the float32 sums of MT activation rows against the NB blocks
// starting at wb; every weight line read also prefetches the line
// prefetch_offset bytes on (none when 0).
template <int MT, int NB>
__attribute__((always_inline)) inline void accumulate(const uint32_t* x_pairs, int64_t kp_count, const uint16_t* wb,
                                                      int64_t prefetch_offset, __m512 (&acc)[MT][NB]) {
  for (int m = 0; m < MT; ++m)
    for (int c = 0; c < NB; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp_count; ++p) {
    __m512bh wv[NB];
    for (int c = 0; c < NB; ++c) {
      const uint16_t* src = wb + (c * kp_count + p) * 32;
      if (prefetch_offset != 0)
        fp8serve_prefetch::line<fp8serve_prefetch::kL2>(reinterpret_cast<const char*>(src) + prefetch_offset);
      wv[c] = (__m512bh)_mm512_loadu_si512(src);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[m * kp_count + p]));
      for (int c = 0; c < NB; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], wv[c], xv);
    }
  }
}

// out[m][16 * (b0 + c) + j] for MT activation rows and NB blocks b0 .. b0 + NB - 1.
template <int MT, int NB, bool FloatOut>
__attribute__((always_inline)) inline void tile(const uint32_t* x_pairs, int64_t kp_count, const uint16_t* wp,
                                                int64_t b0, const float* bias, void* out, int64_t N,
                                                int64_t prefetch_offset) {
  __m512 acc[MT][NB];
  accumulate<MT, NB>(x_pairs, kp_count, wp + b0 * kp_count * 32, prefetch_offset, acc);
  for (int c = 0; c < NB; ++c) {
    const int64_t n0 = (b0 + c) * 16;
    const int64_t valid = std::min<int64_t>(16, N - n0);
    const __mmask16 mask = valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) store_rounded<FloatOut>(out, m * N + n0, mask, _mm512_add_ps(acc[m][c], b));
  }
}

// Blocks [b_begin, b_end) for MT rows, kTileBlocks per tile.
template <int MT, bool FloatOut>
void blocks(const uint32_t* x_pairs, int64_t kp_count, const uint16_t* wp, int64_t b_begin, int64_t b_end,
            const float* bias, void* out, int64_t N, int64_t prefetch_offset) {
  int64_t b = b_begin;
  for (; b + kTileBlocks <= b_end; b += kTileBlocks)
    tile<MT, kTileBlocks, FloatOut>(x_pairs, kp_count, wp, b, bias, out, N, prefetch_offset);
  for (; b < b_end; ++b) tile<MT, 1, FloatOut>(x_pairs, kp_count, wp, b, bias, out, N, prefetch_offset);
}

template <bool FloatOut>
void blocks_any(int64_t mt, const uint32_t* x_pairs, int64_t kp_count, const uint16_t* wp, int64_t b_begin,
                int64_t b_end, const float* bias, void* out, int64_t N, int64_t prefetch_offset) {
  switch (mt) {
#define FP8SERVE_CASE(T) \
  case T: blocks<T, FloatOut>(x_pairs, kp_count, wp, b_begin, b_end, bias, out, N, prefetch_offset); break;
    FP8SERVE_CASE(1) FP8SERVE_CASE(2) FP8SERVE_CASE(3) FP8SERVE_CASE(4)
    FP8SERVE_CASE(5) FP8SERVE_CASE(6) FP8SERVE_CASE(7) FP8SERVE_CASE(8)
#undef FP8SERVE_CASE
    default: TORCH_CHECK(false, "bad activation tile ", mt);
  }
}

#if defined(FP8SERVE_VEC16)
#define FP8SERVE_GEMV_PACKED_GATED 1
// The gated form (dense_gemv_packed_silu_and_mul) for MT rows and the NB
// gate blocks from b0 (their up blocks `up_blocks` further on): the gate
// tile's sums rounded to bf16 with their bias as `tile` stores them, kept
// on the stack while the up tile runs, then silu of each gate from
// silu_and_mul's table times the up value rounded the same way, the product
// rounded as silu_and_mul rounds it (vec16.h store). So the result is the
// two steps' bits, and the [M, 2d] projection is never written and read
// back. d: a multiple of 16 (every block whole). Zen 4 EPYC, the default
// model's 30 gate_up layers from memory: 1.00-1.10x the two steps at 13-256
// rows; engine decode steps 1.006-1.024x at batch 16-64
// (benchmarks/results/gate_up_silu_bf16_compute_2026-12-07_zen4.md).
template <int MT, int NB>
__attribute__((always_inline)) inline void tile_gated(const uint32_t* x_pairs, int64_t kp_count, const uint16_t* wp,
                                                      int64_t b0, int64_t up_blocks, const float* bias,
                                                      uint16_t* out, int64_t d, int64_t prefetch_offset,
                                                      const uint16_t* table) {
  __m512 acc[MT][NB];
  alignas(64) uint16_t gate[MT][NB][16];
  accumulate<MT, NB>(x_pairs, kp_count, wp + b0 * kp_count * 32, prefetch_offset, acc);
  for (int c = 0; c < NB; ++c) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + (b0 + c) * 16) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m)
      _mm256_store_si256(reinterpret_cast<__m256i*>(gate[m][c]),
                         _mm512_cvtepi32_epi16(round_to_bf16_bits(_mm512_add_ps(acc[m][c], b))));
  }
  accumulate<MT, NB>(x_pairs, kp_count, wp + (b0 + up_blocks) * kp_count * 32, prefetch_offset, acc);
  for (int c = 0; c < NB; ++c) {
    const int64_t n0 = (b0 + c) * 16;
    const __m512 b = bias ? _mm512_loadu_ps(bias + d + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) {
      const __m512 up = _mm512_castsi512_ps(_mm512_slli_epi32(round_to_bf16_bits(_mm512_add_ps(acc[m][c], b)), 16));
      const __m512i g = _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(gate[m][c])));
      fp8serve_vec16::store<1>(out, m * d + n0, _mm512_mul_ps(fp8serve_act::silu_bf16_from_table16(table, g), up));
    }
  }
}

template <int MT>
void blocks_gated(const uint32_t* x_pairs, int64_t kp_count, const uint16_t* wp, int64_t b_begin, int64_t b_end,
                  int64_t up_blocks, const float* bias, uint16_t* out, int64_t d, int64_t prefetch_offset,
                  const uint16_t* table) {
  int64_t b = b_begin;
  for (; b + kTileBlocks <= b_end; b += kTileBlocks)
    tile_gated<MT, kTileBlocks>(x_pairs, kp_count, wp, b, up_blocks, bias, out, d, prefetch_offset, table);
  for (; b < b_end; ++b) tile_gated<MT, 1>(x_pairs, kp_count, wp, b, up_blocks, bias, out, d, prefetch_offset, table);
}

void blocks_gated_any(int64_t mt, const uint32_t* x_pairs, int64_t kp_count, const uint16_t* wp, int64_t b_begin,
                      int64_t b_end, int64_t up_blocks, const float* bias, uint16_t* out, int64_t d,
                      int64_t prefetch_offset, const uint16_t* table) {
  switch (mt) {
#define FP8SERVE_CASE(T)                                                                                         \
  case T:                                                                                                        \
    blocks_gated<T>(x_pairs, kp_count, wp, b_begin, b_end, up_blocks, bias, out, d, prefetch_offset, table); \
    break;
    FP8SERVE_CASE(1) FP8SERVE_CASE(2) FP8SERVE_CASE(3) FP8SERVE_CASE(4)
    FP8SERVE_CASE(5) FP8SERVE_CASE(6) FP8SERVE_CASE(7) FP8SERVE_CASE(8)
#undef FP8SERVE_CASE
    default: TORCH_CHECK(false, "bad activation tile ", mt);
  }
}
#endif  // FP8SERVE_VEC16
#endif

#if defined(FP8SERVE_GEMV_PACKED) && defined(FP8SERVE_FP8_BF16_LUT)
#define FP8SERVE_GEMV_PACKED_FP8 1
// FP8 (e4m3) weights: blocks of 16 output rows whose 64-byte vector q holds
// the codes of k = 4q .. 4q + 3, placed so that bf16_from_codes64 (exact, in
// the scale value * 2^-8) leaves the k-pair (4q, 4q + 1) of the 16 rows in
// `a` and (4q + 2, 4q + 3) in `b` (gemv_packing.pack_fp8_gemv_weight):
// half the bytes of bf16 weights, 5 instructions per 64 codes to decode,
// and the row scales (times 2^8) applied to the 16 finished sums of a block.
// Two blocks per tile: 16 accumulators, 4 decoded vectors and the 4 table
// registers stay in the 32.
constexpr int kFp8TileBlocks = 2;

template <int MT, int NB>
__attribute__((always_inline)) inline void tile_fp8(const uint32_t* x_pairs, int64_t kp_count, const uint8_t* wp,
                                                    int64_t b0, const float* scale, const float* bias,
                                                    uint16_t* out, int64_t N, int64_t prefetch_offset,
                                                    const fp8serve_fp8bf16::ByteLut& lut) {
  __m512 acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int c = 0; c < NB; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t quads = kp_count / 2;
  const uint8_t* wb = wp + b0 * quads * 64;
  for (int64_t q = 0; q < quads; ++q) {
    __m512i a[NB], b[NB];
    for (int c = 0; c < NB; ++c) {
      const uint8_t* src = wb + (c * quads + q) * 64;
      if (prefetch_offset != 0)
        fp8serve_prefetch::line<fp8serve_prefetch::kL2>(reinterpret_cast<const char*>(src) + prefetch_offset);
      fp8serve_fp8bf16::bf16_from_codes64(_mm512_loadu_si512(src), lut, a[c], b[c]);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512bh xa = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[m * kp_count + 2 * q]));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[m * kp_count + 2 * q + 1]));
      for (int c = 0; c < NB; ++c) {
        acc[m][c] = _mm512_dpbf16_ps(acc[m][c], (__m512bh)a[c], xa);
        acc[m][c] = _mm512_dpbf16_ps(acc[m][c], (__m512bh)b[c], xb);
      }
    }
  }
  for (int c = 0; c < NB; ++c) {
    const int64_t n0 = (b0 + c) * 16;
    const int64_t valid = std::min<int64_t>(16, N - n0);
    const __mmask16 mask = valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 sc = _mm512_maskz_loadu_ps(mask, scale + n0);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) store_rounded<false>(out, m * N + n0, mask, _mm512_fmadd_ps(acc[m][c], sc, bv));
  }
}

template <int MT>
void blocks_fp8(const uint32_t* x_pairs, int64_t kp_count, const uint8_t* wp, int64_t b_begin, int64_t b_end,
                const float* scale, const float* bias, uint16_t* out, int64_t N, int64_t prefetch_offset) {
  const fp8serve_fp8bf16::ByteLut lut = fp8serve_fp8bf16::load_byte_lut<fp8serve_fp8bf16::kE4M3>();
  int64_t b = b_begin;
  for (; b + kFp8TileBlocks <= b_end; b += kFp8TileBlocks)
    tile_fp8<MT, kFp8TileBlocks>(x_pairs, kp_count, wp, b, scale, bias, out, N, prefetch_offset, lut);
  for (; b < b_end; ++b) tile_fp8<MT, 1>(x_pairs, kp_count, wp, b, scale, bias, out, N, prefetch_offset, lut);
}

void blocks_fp8_any(int64_t mt, const uint32_t* x_pairs, int64_t kp_count, const uint8_t* wp, int64_t b_begin,
                    int64_t b_end, const float* scale, const float* bias, uint16_t* out, int64_t N,
                    int64_t prefetch_offset) {
  switch (mt) {
#define FP8SERVE_CASE(T) \
  case T: blocks_fp8<T>(x_pairs, kp_count, wp, b_begin, b_end, scale, bias, out, N, prefetch_offset); break;
    FP8SERVE_CASE(1) FP8SERVE_CASE(2) FP8SERVE_CASE(3) FP8SERVE_CASE(4)
    FP8SERVE_CASE(5) FP8SERVE_CASE(6) FP8SERVE_CASE(7) FP8SERVE_CASE(8)
#undef FP8SERVE_CASE
    default: TORCH_CHECK(false, "bad activation tile ", mt);
  }
}
#endif

// What both ops check of x, n and the bias, and the bias as float32 (none: undefined).
struct GemvArgs {
  int64_t M, K;
  at::Tensor bias;
};
inline GemvArgs check_gemv_args(const char* op, const at::Tensor& x, int64_t num_blocks, int64_t n,
                                const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
              "x must be a [M, K] bf16 CPU tensor, got ", x.scalar_type(), " of ", x.dim(), " dimensions");
  const int64_t M = x.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, op, " takes 1 to ", kMaxRows, " rows, got ", M);
  TORCH_CHECK(n >= 1 && n <= num_blocks * 16 && n > (num_blocks - 1) * 16, "n = ", n, " does not fit ", num_blocks,
              " blocks of 16 rows");
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [", n, "]");
    b = bias->to(at::kFloat).contiguous();
  }
  return {M, x.size(1), b};
}

// What the bf16 ops check of x's K and the packed weight (its dimensions checked before).
inline void check_bf16_packed(const at::Tensor& w_packed, int64_t K) {
  TORCH_CHECK(K % 2 == 0, "K must be even, got ", K);
  TORCH_CHECK(w_packed.scalar_type() == at::kBFloat16 && w_packed.is_contiguous() && w_packed.size(1) == K / 2 &&
                  w_packed.size(2) == 16 && w_packed.size(3) == 2,
              "w_packed must be a contiguous bf16 [ceil(N/16), K/2, 16, 2] = [*, ", K / 2, ", 16, 2] tensor, got ",
              w_packed.sizes());
}

// The walk both ops take: blocks split over the thread pool, each task in
// chunks of ~kChunkBytes (a whole number of tiles), each chunk once per tile
// of rows. The first tile prefetches kPrefetchBytes ahead within the chunk,
// the second the next chunk (the same position one chunk on), later ones read
// L2 only. run(rows, m0, c0, c1, prefetch_offset) does one tile of rows over
// blocks [c0, c1).
// stream_bytes: the bytes of one block along each weight stream a tile reads
// (the gated form's blocks are a gate block and its up block: two streams of
// half its bytes), the step to the same position one chunk on.
template <class Run>
void walk_chunks(int64_t num_blocks, int64_t tile_blocks, int64_t block_bytes, int64_t M, const Run& run,
                 int64_t stream_bytes = 0) {
  if (stream_bytes == 0) stream_bytes = block_bytes;
  const int64_t chunk_blocks = std::max<int64_t>(1, kChunkBytes / block_bytes / tile_blocks) * tile_blocks;
  at::parallel_for(0, num_blocks, tile_blocks, [&](int64_t begin, int64_t end) {
    for (int64_t c0 = begin; c0 < end; c0 += chunk_blocks) {
      const int64_t c1 = std::min(end, c0 + chunk_blocks);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int64_t ahead = m0 == 0 ? kPrefetchBytes : m0 == kTileRows ? (c1 - c0) * stream_bytes : 0;
        run(std::min(kTileRows, M - m0), m0, c0, c1, ahead);
      }
    }
  });
}

}  // namespace

// x: [M, K] bf16, rows contiguous, 1 <= M <= 512, K even; w_packed: the
// [ceil(N/16), K/2, 16, 2] bf16 layout above (contiguous); n: N, the
// layer's output size; bias: [N] float32 or bf16, or none. Returns [M, N] bf16,
// or float32 holding the same bf16-rounded values (float_out).
at::Tensor dense_gemv_packed_impl(at::Tensor x, at::Tensor w_packed, int64_t n, std::optional<at::Tensor> bias,
                                  bool float_out) {
#ifdef FP8SERVE_GEMV_PACKED
  TORCH_CHECK(w_packed.dim() == 4, "w_packed must be a contiguous bf16 [ceil(N/16), K/2, 16, 2] tensor, got ",
              w_packed.sizes());
  const GemvArgs a = check_gemv_args("dense_gemv_packed", x, w_packed.size(0), n, bias);
  const int64_t M = a.M, K = a.K;
  check_bf16_packed(w_packed, K);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, n}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w_packed.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t row_bytes = n * out.element_size();
  const float* bp = a.bias.defined() ? a.bias.data_ptr<float>() : nullptr;
  const int64_t kp_count = K / 2;
  walk_chunks(w_packed.size(0), kTileBlocks, kp_count * 64, M,
              [&](int64_t rows, int64_t m0, int64_t c0, int64_t c1, int64_t ahead) {
                const uint32_t* x_pairs = xp + m0 * kp_count;
                char* rows_out = op + m0 * row_bytes;
                if (float_out) blocks_any<true>(rows, x_pairs, kp_count, wp, c0, c1, bp, rows_out, n, ahead);
                else blocks_any<false>(rows, x_pairs, kp_count, wp, c0, c1, bp, rows_out, n, ahead);
              });
  return out;
#else
  (void)x, (void)w_packed, (void)n, (void)bias, (void)float_out;
  TORCH_CHECK(false, "dense_gemv_packed needs a build for a CPU with AVX512-BF16 (see dense_gemv_has_packed)");
  return at::Tensor();
#endif
}

at::Tensor dense_gemv_packed(at::Tensor x, at::Tensor w_packed, int64_t n, std::optional<at::Tensor> bias) {
  return dense_gemv_packed_impl(x, w_packed, n, bias, /*float_out=*/false);
}

at::Tensor dense_gemv_packed_float_out(at::Tensor x, at::Tensor w_packed, int64_t n, std::optional<at::Tensor> bias) {
  return dense_gemv_packed_impl(x, w_packed, n, bias, /*float_out=*/true);
}

// silu(gate) * up of a gate_up projection in one call: w_packed as above for
// the [n, K] weight whose first n / 2 rows are the gate's and the rest the
// up's, n / 2 a multiple of 16; bias: [n] or none. Returns [M, n / 2] bf16,
// the bits of dense_gemv_packed followed by silu_and_mul (tile_gated).
at::Tensor dense_gemv_packed_silu_and_mul(at::Tensor x, at::Tensor w_packed, int64_t n,
                                          std::optional<at::Tensor> bias) {
#ifdef FP8SERVE_GEMV_PACKED_GATED
  TORCH_CHECK(w_packed.dim() == 4, "w_packed must be a contiguous bf16 [ceil(N/16), K/2, 16, 2] tensor, got ",
              w_packed.sizes());
  TORCH_CHECK(n % 32 == 0, "dense_gemv_packed_silu_and_mul takes n = 2d with d a multiple of 16, got n = ", n);
  const GemvArgs a = check_gemv_args("dense_gemv_packed_silu_and_mul", x, w_packed.size(0), n, bias);
  const int64_t M = a.M, K = a.K, d = n / 2;
  check_bf16_packed(w_packed, K);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, d}, x.options().dtype(at::kBFloat16));
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w_packed.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float* bp = a.bias.defined() ? a.bias.data_ptr<float>() : nullptr;
  const uint16_t* table = fp8serve_act::silu_table<1>();
  const int64_t kp_count = K / 2, up_blocks = d / 16, block_bytes = kp_count * 64;
  walk_chunks(
      up_blocks, kTileBlocks, 2 * block_bytes, M,
      [&](int64_t rows, int64_t m0, int64_t c0, int64_t c1, int64_t ahead) {
        blocks_gated_any(rows, xp + m0 * kp_count, kp_count, wp, c0, c1, up_blocks, bp, op + m0 * d, d, ahead, table);
      },
      block_bytes);
  return out;
#else
  (void)x, (void)w_packed, (void)n, (void)bias;
  TORCH_CHECK(false, "dense_gemv_packed_silu_and_mul needs a build for a CPU with AVX512-BF16 "
                     "(see dense_gemv_has_packed)");
  return at::Tensor();
#endif
}

// x: [M, K] bf16, rows contiguous, 1 <= M <= 512, K a multiple of 4;
// codes_packed: [ceil(N/16), K/4, 64] uint8 e4m3 codes in the layout above;
// scale: [ceil(N/16) * 16] float32, each row's weight scale times 2^8 (the
// decode's scale); n: N; bias: [N] float32 or bf16, or none. Returns [M, N]
// bf16: out_arg when given (the `_out` entry of static decode plans).
at::Tensor fp8_gemv_packed_impl(at::Tensor x, at::Tensor codes_packed, at::Tensor scale, int64_t n,
                                std::optional<at::Tensor> bias, const at::Tensor* out_arg) {
#ifdef FP8SERVE_GEMV_PACKED_FP8
  TORCH_CHECK(codes_packed.dim() == 3, "codes_packed must be a contiguous uint8 [ceil(N/16), K/4, 64] tensor, got ",
              codes_packed.sizes());
  const int64_t num_blocks = codes_packed.size(0);
  const GemvArgs a = check_gemv_args("fp8_gemv_packed", x, num_blocks, n, bias);
  const int64_t M = a.M, K = a.K;
  TORCH_CHECK(K % 4 == 0, "K must be a multiple of 4, got ", K);
  TORCH_CHECK(codes_packed.scalar_type() == at::kByte && codes_packed.is_contiguous() &&
                  codes_packed.size(1) == K / 4 && codes_packed.size(2) == 64,
              "codes_packed must be a contiguous uint8 [ceil(N/16), K/4, 64] = [*, ", K / 4, ", 64] tensor, got ",
              codes_packed.sizes());
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.size(0) == num_blocks * 16,
              "scale must be a contiguous float32 [", num_blocks * 16, "] tensor");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = fp8serve_staging::result_tensor(out_arg, x, M, n);
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr());
  const auto* wp = codes_packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float* bp = a.bias.defined() ? a.bias.data_ptr<float>() : nullptr;
  const int64_t kp_count = K / 2;
  walk_chunks(num_blocks, kFp8TileBlocks, K * 16, M,
              [&](int64_t rows, int64_t m0, int64_t c0, int64_t c1, int64_t ahead) {
                blocks_fp8_any(rows, xp + m0 * kp_count, kp_count, wp, c0, c1, sp, bp, op + m0 * n, n, ahead);
              });
  return out;
#else
  (void)x, (void)codes_packed, (void)scale, (void)n, (void)bias, (void)out_arg;
  TORCH_CHECK(false, "fp8_gemv_packed needs a build for a CPU with AVX512-BF16 and AVX512-VBMI "
                     "(see fp8_gemv_has_packed)");
  return at::Tensor();
#endif
}

at::Tensor fp8_gemv_packed(at::Tensor x, at::Tensor codes_packed, at::Tensor scale, int64_t n,
                           std::optional<at::Tensor> bias) {
  return fp8_gemv_packed_impl(x, codes_packed, scale, n, bias, nullptr);
}

void fp8_gemv_packed_out(at::Tensor out, at::Tensor x, at::Tensor codes_packed, at::Tensor scale, int64_t n,
                         std::optional<at::Tensor> bias) {
  fp8_gemv_packed_impl(x, codes_packed, scale, n, bias, &out);
}

bool fp8_gemv_has_packed() {
#ifdef FP8SERVE_GEMV_PACKED_FP8
  return true;
#else
  return false;
#endif
}

bool dense_gemv_has_packed() {
#ifdef FP8SERVE_GEMV_PACKED
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(fp8serve, m) {
  m.def("dense_gemv_packed", &dense_gemv_packed);
  m.def("dense_gemv_packed_float_out", &dense_gemv_packed_float_out);
  m.def("dense_gemv_packed_silu_and_mul", &dense_gemv_packed_silu_and_mul);
  m.def("dense_gemv_has_packed", &dense_gemv_has_packed);
  m.def("fp8_gemv_packed", &fp8_gemv_packed);
  m.def("fp8_gemv_packed_out(Tensor(a!) out, Tensor x, Tensor codes_packed, Tensor scale, int n, Tensor? bias) -> ()",
        &fp8_gemv_packed_out);
  m.def("fp8_gemv_has_packed", &fp8_gemv_has_packed);
}
