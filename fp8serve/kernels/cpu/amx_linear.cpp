// bf16 linear layers for decode batches on AMX: out[m, n] = sum_k x[m, k] *
// w[n, k] (+ bias[n]) for M <= 64 activation rows, bf16 x, w and out, float32
// accumulation.
//
// Why: at M = 8..64 a decode step's linears read every weight once to do
// 2 * M flops per weight, which is still memory-bound on AMX but not on
// vector units. Measured on this 2-vCPU Xeon for the default model at batch 16
// (profile of one engine step): torch's bf16 GEMM (AMX, via oneDNN/MKL) took
// 25.5 ms for the 270 MB of weights, 10.6 GB/s, against ~25 GB/s of read
// bandwidth; the AVX512-BF16 GEMV (dense_gemv.cpp) becomes compute-bound past
// ~12 rows.
//
// How: the weight is used as AMX's A operand as it lies in memory: a tile is
// 16 weight rows x 32 k (64 bytes of each row, at the row stride), so nothing
// is repacked per call. The activations, small, are packed once per call into
// the B operand's pair-interleaved layout (16 k pairs x 16 rows of x), zero
// for missing rows. One tdpbf16ps per (16 weight rows, 32 k, 16 x rows)
// accumulates out^T in a 16 x 16 float32 tile; each weight row block is read
// once for all (up to four) blocks of 16 x rows. Weight row blocks are split
// over torch's thread pool; every worker loads the tile configuration first.
// Result: 11.7 ms for those 270 MB at 16 rows (F.linear 21.4), 24.2 at 64
// (27.8); see kernels/amx_linear_ops.py for the table and where it is used.
// Packing x with one scatter per 16 pairs (instead of element by element)
// took 24 / 32 rows from 17.2 / 22.7 to 14.5 / 15.1 ms; a register transpose
// per 16 rows instead of the scatters (transpose16.h) then gave that pass
// 1.02x at 16 rows, 1.06x at 64, and engine decode steps at batch 16 1.014x
// (results/amx_pack_transpose_2026-12-07_xeon_amx.md).
//
// AMX multiplies bf16 pairs exactly and accumulates in float32 (denormal
// inputs read as zero, as AVX512-BF16 does); the summation order differs from
// torch's, so outputs may differ by an ulp of bf16. Linux grants the tile
// state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM); where
// that fails or the build has no AMX, `amx_linear_available()` is false.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "scalar_convert.h"
#include "transpose16.h"
#include "vec16.h"

#include "amx_tiles.h"

#if defined(FP8SERVE_VEC16) && defined(FP8SERVE_AMX)
#define FP8SERVE_AMX_LINEAR 1
#endif

namespace {

constexpr int64_t kMaxRows = 64;  // activation rows per call: four C tiles

#ifdef FP8SERVE_AMX_LINEAR

// Tiles: 0 and 2 = A (16 weight rows x 64 bytes), 1 and 3 = B (16 k pairs x
// 16 x rows x 2 bf16), 4-7 = C (16 weight rows x 16 float32).
void configure_tiles() { fp8serve_amx::configure_16x64({0, 1, 2, 3, 4, 5, 6, 7}); }

// x [M, K] bf16 -> B tiles: xb[((mb * KC + kc) * 16 + r) * 32 + m * 2 + e] =
// x[mb * 16 + m][kc * 32 + 2 r + e], zero where mb * 16 + m >= M. Seen as
// 32-bit pairs, each (mb, kc) block is a 16 x 16 transpose of row m's 16
// pairs of chunk kc: in registers for blocks of kTransposeMinRows rows or
// more (transpose16.h), one scatter down column m per row below that.
void pack_x(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int64_t MB, uint16_t* xb) {
  const int64_t KC = K / 32;
  uint32_t* xb32 = reinterpret_cast<uint32_t*>(xb);
  const __m512i down_column = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(16));
  for (int64_t mb = 0; mb < MB; ++mb) {
    const int64_t rows = std::min<int64_t>(16, M - 16 * mb);
    const uint16_t* x0 = x + 16 * mb * ldx;
    uint32_t* blk = xb32 + mb * KC * 256;
    if (rows >= fp8serve_transpose::kTransposeMinRows) {
      for (int64_t kc = 0; kc < KC; ++kc) {
        __m512i r[16];
        for (int64_t m = 0; m < 16; ++m)
          r[m] = m < rows ? _mm512_loadu_si512(x0 + m * ldx + kc * 32) : _mm512_setzero_si512();
        fp8serve_transpose::transpose16x16_epi32(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(blk + kc * 256 + 16 * i, r[i]);
      }
      continue;
    }
    std::memset(blk, 0, KC * 256 * sizeof(uint32_t));
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t kc = 0; kc < KC; ++kc)
        _mm512_i32scatter_epi32(blk + kc * 256 + m, down_column, _mm512_loadu_si512(x0 + m * ldx + kc * 32), 4);
  }
}

// One block of 16 weight rows: its C tiles c[mb][n][m] -> out[mb * 16 + m][n0 + n],
// bias added, rounded to bf16. FloatOut: out is float32 holding the
// bf16-rounded sums (bit for bit what the bf16 result's .float() would hold),
// for the LM head, whose logits the sampler reads in float32: one pass fewer
// over [M, vocab].
template <bool FloatOut>
inline void write_block(const float (*c)[16][16], int64_t M, int64_t n0, int64_t rows, int64_t N, const float* bias,
                        void* out) {
  const __mmask16 live = rows == 16 ? 0xffff : static_cast<__mmask16>((1u << rows) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(live, bias + n0) : _mm512_setzero_ps();
  // Column m of a C tile: 16 floats 64 bytes apart, one gather from L1.
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  for (int64_t m = 0; m < M; ++m) {
    const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, &c[m / 16][0][m % 16], 4), b);
    if constexpr (FloatOut) {
      _mm512_mask_storeu_ps(static_cast<float*>(out) + m * N + n0, live, fp8serve_vec16::round_to<1>(v));
    } else if (rows == 16) {
      fp8serve_vec16::store<1>(out, m * N + n0, v);
    } else {
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, v);
      for (int64_t n = 0; n < rows; ++n) fp8serve_cvt::store_from_f32<1>(out, m * N + n0 + n, tmp[n]);
    }
  }
}

// Weight row blocks [n_begin, n_end) of one task. Each C tile accumulates
// over k in a chain of dependent tdpbf16ps. With one or two blocks of x rows
// (MB <= 2) a single weight block leaves one or two chains, too few to hide
// their latency, so full weight blocks go in pairs that share each B tile
// load (C tiles 4/5 for the first, 6/7 for the second). Measured side by side
// with the one-block loop (benchmarks/amx_linear.py --baseline-rev, 2-vCPU
// Xeon, results/amx_linear_2026-11-30.md): the default model's decode
// linears read from memory 1.06-1.11x at 8-32 rows; one layer's linears
// repeated (in cache, as the FP8 checkpoint's decoded tiles) 1.06-1.08x at
// 17-32 rows and 0.97-1.02x at 8-16. Engine decode steps (bf16 default
// model, FP8 KV, alternating processes): batch 16 0.94-1.01x the time
// (median 0.965), batch 24 0.93-1.01x; the FP8 checkpoint's unchanged.
// MB = 3-4 already has 3-4 chains and no tiles to spare for a second block.
template <int MB, bool FloatOut>
void run_blocks(const uint16_t* w, int64_t K, const uint16_t* xb, const float* bias, int64_t M, int64_t n_begin,
                int64_t n_end, int64_t N, void* out) {
  configure_tiles();
  const int64_t KC = K / 32, w_stride = K * 2;
  alignas(64) float c[4][16][16];
  std::vector<uint16_t> pad;  // a partial last block of weight rows, zero-padded
  int64_t n0 = n_begin;
  if constexpr (MB <= 2) {
    alignas(64) float c2[2][2][16][16];
    for (; n0 + 32 <= n_end && n0 + 32 <= N; n0 += 32) {
      const uint16_t* a = w + n0 * K;
      _tile_zero(4);
      _tile_zero(6);
      if constexpr (MB == 2) {
        _tile_zero(5);
        _tile_zero(7);
      }
      for (int64_t kc = 0; kc < KC; ++kc) {
        _tile_loadd(1, xb + kc * 16 * 32, 64);
        if constexpr (MB == 2) _tile_loadd(3, xb + (KC + kc) * 16 * 32, 64);
        _tile_loadd(0, a + kc * 32, w_stride);
        _tile_dpbf16ps(4, 0, 1);
        if constexpr (MB == 2) _tile_dpbf16ps(5, 0, 3);
        _tile_loadd(2, a + 16 * K + kc * 32, w_stride);
        _tile_dpbf16ps(6, 2, 1);
        if constexpr (MB == 2) _tile_dpbf16ps(7, 2, 3);
      }
      _tile_stored(4, c2[0][0], 64);
      if constexpr (MB == 2) _tile_stored(5, c2[0][1], 64);
      _tile_stored(6, c2[1][0], 64);
      if constexpr (MB == 2) _tile_stored(7, c2[1][1], 64);
      for (int j = 0; j < 2; ++j) write_block<FloatOut>(c2[j], M, n0 + 16 * j, 16, N, bias, out);
    }
  }
  for (; n0 < n_end; n0 += 16) {
    const uint16_t* a = w + n0 * K;
    const int64_t rows = std::min<int64_t>(16, N - n0);
    if (rows < 16) {
      pad.assign(16 * K, 0);
      std::memcpy(pad.data(), a, rows * K * sizeof(uint16_t));
      a = pad.data();
    }
    _tile_zero(4);
    if constexpr (MB > 1) _tile_zero(5);
    if constexpr (MB > 2) _tile_zero(6);
    if constexpr (MB > 3) _tile_zero(7);
    for (int64_t kc = 0; kc < KC; ++kc) {
      _tile_loadd(0, a + kc * 32, w_stride);
      _tile_loadd(1, xb + kc * 16 * 32, 64);
      _tile_dpbf16ps(4, 0, 1);
      if constexpr (MB > 1) {
        _tile_loadd(1, xb + (KC + kc) * 16 * 32, 64);
        _tile_dpbf16ps(5, 0, 1);
      }
      if constexpr (MB > 2) {
        _tile_loadd(1, xb + (2 * KC + kc) * 16 * 32, 64);
        _tile_dpbf16ps(6, 0, 1);
      }
      if constexpr (MB > 3) {
        _tile_loadd(1, xb + (3 * KC + kc) * 16 * 32, 64);
        _tile_dpbf16ps(7, 0, 1);
      }
    }
    _tile_stored(4, c[0], 64);
    if constexpr (MB > 1) _tile_stored(5, c[1], 64);
    if constexpr (MB > 2) _tile_stored(6, c[2], 64);
    if constexpr (MB > 3) _tile_stored(7, c[3], 64);
    write_block<FloatOut>(c, M, n0, rows, N, bias, out);
  }
  _tile_release();
}

#endif  // FP8SERVE_AMX_LINEAR

}  // namespace

bool amx_linear_available() {
#ifdef FP8SERVE_AMX_LINEAR
  return fp8serve_amx::permitted();
#else
  return false;
#endif
}

// x [M, K] bf16 (rows may be strided), weight [N, K] bf16 contiguous, bias [N]
// float32 or bf16 or None; returns [M, N] bf16, or float32 holding the
// bf16-rounded values (float_out).
at::Tensor amx_linear_impl(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias, bool float_out) {
  TORCH_CHECK(amx_linear_available(), "amx_linear: this build or process has no AMX tiles");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "amx_linear: x must be [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "amx_linear: bf16 x and weight only");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "amx_linear: CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "amx_linear: x has ", K, " columns, weight ", weight.size(1));
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "amx_linear: 1 to ", kMaxRows, " rows, got ", M);
  TORCH_CHECK(K % 32 == 0, "amx_linear: K must be a multiple of 32, got ", K);
  TORCH_CHECK(weight.is_contiguous() && x.stride(1) == 1, "amx_linear: weight must be contiguous and x's rows dense");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "amx_linear: bias must be [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
#ifdef FP8SERVE_AMX_LINEAR
  const int64_t MB = (M + 15) / 16;
  std::vector<uint16_t> xb(MB * (K / 32) * 16 * 32);
  pack_x(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), M, K, MB, xb.data());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  void* o = out.data_ptr();
  const int64_t blocks = (N + 15) / 16;
  // At least 4 blocks (64 weight rows) per task: each task reloads the tile configuration.
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * 16, n1 = std::min(N, end * 16);
    const auto run = [&](auto float_tag) {
      constexpr bool F = decltype(float_tag)::value;
      switch (MB) {
        case 1: return run_blocks<1, F>(w, K, xb.data(), b, M, n0, n1, N, o);
        case 2: return run_blocks<2, F>(w, K, xb.data(), b, M, n0, n1, N, o);
        case 3: return run_blocks<3, F>(w, K, xb.data(), b, M, n0, n1, N, o);
        default: return run_blocks<4, F>(w, K, xb.data(), b, M, n0, n1, N, o);
      }
    };
    if (float_out) run(std::true_type{});
    else run(std::false_type{});
  });
#endif
  return out;
}

at::Tensor amx_linear(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias) {
  return amx_linear_impl(x, weight, bias, /*float_out=*/false);
}

// The LM head's: logits as float32 (the bf16-rounded sums; see run_blocks).
// Measured on the 2-vCPU Xeon, the default model's head (49152 x 576): 16
// rows 1.54-1.57 -> 1.39-1.42 ms, 64 rows 3.79-3.90 -> 3.15-3.21 ms against
// the bf16 result and a separate .float().
at::Tensor amx_linear_float_out(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias) {
  return amx_linear_impl(x, weight, bias, /*float_out=*/true);
}

TORCH_LIBRARY_FRAGMENT(fp8serve, m) {
  m.def("amx_linear", &amx_linear);
  m.def("amx_linear_float_out", &amx_linear_float_out);
  m.def("amx_linear_available", &amx_linear_available);
}
