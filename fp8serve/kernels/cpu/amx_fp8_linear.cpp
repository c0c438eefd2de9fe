// FP8 (e4m3) linear layers for decode batches on AMX, bf16 activations:
//   out[m, n] = scale[n] * sum_k e4m3(w[n, k]) * x[m, k] + bias[n]
// for M <= 64 rows, the weight kept as one byte per element, bf16 out.
//
// Why: with AMX the FP8 checkpoint's decode batches of 13-64 rows decoded
// each layer's whole weight to a bf16 buffer (fp8_dequantize) and ran
// amx_linear over it: every code became two bytes written and read back, so
// on a 2-core Xeon (AMX) the FP8 checkpoint's decode steps ran slower than the
// bf16 model's at batch 16 and up, although they read half the bytes.
//
// How: amx_linear.cpp's tile product (weight rows as AMX's A operand, the
// packed rows of x as B, out^T in float32 C tiles), but each A tile comes
// from 16 rows of codes decoded into a 2 KiB buffer (L1) right before it is
// loaded: per 64 codes of a row, two byte-table lookups (fp8_bf16_lut.h) give
// 64 bf16 in two vectors. Those vectors hold the codes in a lane order of
// their own (unpacks work within 128-bit lanes), so the first holds 32 of the
// 64 columns and the second the other 32; x is packed in that same order
// (pack_x_lut_order), and the products pair up as before. A tile's row of a
// weight holds value * 2^-8 exactly (every e4m3 code is a normal bf16 in that
// scale), AMX multiplies bf16 pairs exactly and sums in float32, and the row's
// scale * 2^8 multiplies the sum once, with the bias in the same FMA, before
// the one rounding to bf16. K must be a multiple of 64.
//
// The codes of a block are 16 rows read 64 bytes at a time, each row K bytes
// after the last: without help the loads wait on memory. Each load also
// prefetches the next block's same 64 bytes, a block ahead: 1.23-1.47x at
// 1-16 rows, 0.91-1.10x at 32-64 (benchmarks/amx_fp8_linear.py --baseline-rev,
// results/amx_fp8_linear_2026-12-06_xeon_amx.md).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "amx_tiles.h"
#include "fp8_bf16_lut.h"
#include "transpose16.h"
#include "vec16.h"

#if defined(FP8SERVE_AMX) && defined(FP8SERVE_FP8_BF16_LUT) && defined(FP8SERVE_VEC16)
#define FP8SERVE_AMX_FP8_LINEAR 1
#endif

namespace {

constexpr int64_t kMaxRows = 64;  // activation rows per call: four C tiles

#ifdef FP8SERVE_AMX_FP8_LINEAR

namespace lut = fp8serve_fp8bf16;

// Tiles: 0 and 2 = A (16 weight rows x 32 bf16: the two halves of 64
// columns), 1 = B (16 pairs x 16 x rows), 4-7 = C (16 weight rows x 16 x rows).
void configure_tiles() { fp8serve_amx::configure_16x64({0, 1, 2, 4, 5, 6, 7}); }

// The 32-bit pair (of columns 2u, 2u + 1 of a group of 64) that pair r of
// half h of the group holds: bf16_from_codes64's lanes 2r and 2r + 1 hold
// codes 16 (r / 4) + 2 (r % 4) (+ 8 in the second vector) and the next one.
constexpr int pair_of(int h, int r) { return 8 * (r / 4) + 4 * h + r % 4; }

// x [M, K] bf16 -> B tiles in the decoded weights' column order:
// xb[((mb * KC + kc) * 16 + r) * 32 + m * 2 + e], kc = 2 g + h (group g of 64
// columns, half h), = x[mb * 16 + m][64 g + 2 pair_of(h, r) + e], zero where
// mb * 16 + m >= M. Each half is a 16 x 16 transpose of 32-bit pairs: one
// permute picks row m's 16 pairs of it, then the transpose in registers for
// blocks of kTransposeMinRows rows or more (transpose16.h), one scatter down
// column m per row below that.
void pack_x_lut_order(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int64_t MB, uint16_t* xb) {
  const int64_t KC = K / 32;
  uint32_t* xb32 = reinterpret_cast<uint32_t*>(xb);
  const __m512i down_column = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(16));
  alignas(64) int32_t idx[2][16];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < 16; ++r) idx[h][r] = pair_of(h, r);
  const __m512i pick[2] = {_mm512_load_si512(idx[0]), _mm512_load_si512(idx[1])};
  for (int64_t mb = 0; mb < MB; ++mb) {
    const int64_t rows = std::min<int64_t>(16, M - 16 * mb);
    const uint16_t* x0 = x + 16 * mb * ldx;
    uint32_t* blk = xb32 + mb * KC * 256;
    if (rows >= fp8serve_transpose::kTransposeMinRows) {
      for (int64_t g = 0; g < K / 64; ++g)
        for (int h = 0; h < 2; ++h) {
          __m512i r[16];
          for (int64_t m = 0; m < 16; ++m) {
            const uint16_t* row = x0 + m * ldx + 64 * g;
            r[m] = m < rows ? _mm512_permutex2var_epi32(_mm512_loadu_si512(row), pick[h], _mm512_loadu_si512(row + 32))
                            : _mm512_setzero_si512();
          }
          fp8serve_transpose::transpose16x16_epi32(r);
          for (int i = 0; i < 16; ++i) _mm512_storeu_si512(blk + (2 * g + h) * 256 + 16 * i, r[i]);
        }
      continue;
    }
    std::memset(blk, 0, KC * 256 * sizeof(uint32_t));
    for (int64_t m = 0; m < rows; ++m) {
      const uint16_t* row = x0 + m * ldx;
      for (int64_t g = 0; g < K / 64; ++g) {
        const __m512i p0 = _mm512_loadu_si512(row + 64 * g), p1 = _mm512_loadu_si512(row + 64 * g + 32);
        for (int h = 0; h < 2; ++h)
          _mm512_i32scatter_epi32(blk + (2 * g + h) * 256 + m, down_column, _mm512_permutex2var_epi32(p0, pick[h], p1),
                                  4);
      }
    }
  }
}

// C tiles c[mb][n][m] of one block of weight rows -> out[mb * 16 + m][n0 + n]
// = c * s[n] + bias[n0 + n], rounded to bf16; s = scale * 2^8.
inline void write_block(const float (*c)[16][16], int64_t M, int64_t n0, int64_t rows, int64_t N, const float* s,
                        const float* bias, uint16_t* out) {
  const __mmask16 live = rows == 16 ? 0xffff : static_cast<__mmask16>((1u << rows) - 1);
  const __m512 sv = _mm512_maskz_loadu_ps(live, s);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(live, bias + n0) : _mm512_setzero_ps();
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  for (int64_t m = 0; m < M; ++m) {
    const __m512 v = _mm512_fmadd_ps(_mm512_i32gather_ps(column, &c[m / 16][0][m % 16], 4), sv, b);
    const __m256i h = fp8serve_vec16::bf16_packed(v);
    _mm256_mask_storeu_epi16(out + m * N + n0, live, h);
  }
}

// Weight row blocks [n_begin, n_end) (blocks of 16 rows) of one task.
template <int MB>
void run_blocks(const uint8_t* w, const float* scale, int64_t K, const uint16_t* xb, const float* bias, int64_t M,
                int64_t n_begin, int64_t n_end, int64_t N, uint16_t* out) {
  configure_tiles();
  const int64_t KC = K / 32;
  const lut::ByteLut t = lut::load_byte_lut<lut::kE4M3>();
  alignas(64) uint16_t a[2][16][32];  // the decoded halves of 64 columns of 16 weight rows
  alignas(64) float c[4][16][16];
  alignas(64) float s[16];
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 16) {
    const int64_t rows = std::min<int64_t>(16, N - n0);
    for (int j = 0; j < 16; ++j) s[j] = j < rows ? scale[n0 + j] * 256.f : 0.f;
    if (rows < 16) std::memset(a, 0, sizeof(a));  // rows past N stay zero codes
    _tile_zero(4);
    if constexpr (MB > 1) _tile_zero(5);
    if constexpr (MB > 2) _tile_zero(6);
    if constexpr (MB > 3) _tile_zero(7);
    const uint8_t* wb = w + n0 * K;
    const bool prefetch_next = n0 + 32 <= n_end;  // the next block's same 64 columns, a block ahead
    for (int64_t g = 0; g < K / 64; ++g) {
      for (int64_t r = 0; r < rows; ++r) {
        __m512i lo, hi;
        if (prefetch_next) _mm_prefetch(reinterpret_cast<const char*>(wb + (16 + r) * K + 64 * g), _MM_HINT_T0);
        lut::bf16_from_codes64(_mm512_loadu_si512(wb + r * K + 64 * g), t, lo, hi);
        _mm512_store_si512(a[0][r], lo);
        _mm512_store_si512(a[1][r], hi);
      }
      _tile_loadd(0, a[0], 64);
      _tile_loadd(2, a[1], 64);
      for (int h = 0; h < 2; ++h) {
        const int64_t kc = 2 * g + h;
        _tile_loadd(1, xb + kc * 16 * 32, 64);
        if (h == 0) _tile_dpbf16ps(4, 0, 1);
        else _tile_dpbf16ps(4, 2, 1);
        if constexpr (MB > 1) {
          _tile_loadd(1, xb + (KC + kc) * 16 * 32, 64);
          if (h == 0) _tile_dpbf16ps(5, 0, 1);
          else _tile_dpbf16ps(5, 2, 1);
        }
        if constexpr (MB > 2) {
          _tile_loadd(1, xb + (2 * KC + kc) * 16 * 32, 64);
          if (h == 0) _tile_dpbf16ps(6, 0, 1);
          else _tile_dpbf16ps(6, 2, 1);
        }
        if constexpr (MB > 3) {
          _tile_loadd(1, xb + (3 * KC + kc) * 16 * 32, 64);
          if (h == 0) _tile_dpbf16ps(7, 0, 1);
          else _tile_dpbf16ps(7, 2, 1);
        }
      }
    }
    _tile_stored(4, c[0], 64);
    if constexpr (MB > 1) _tile_stored(5, c[1], 64);
    if constexpr (MB > 2) _tile_stored(6, c[2], 64);
    if constexpr (MB > 3) _tile_stored(7, c[3], 64);
    write_block(c, M, n0, rows, N, s, bias, out);
  }
  _tile_release();
}

#endif  // FP8SERVE_AMX_FP8_LINEAR

bool amx_fp8_linear_available() {
#ifdef FP8SERVE_AMX_FP8_LINEAR
  return fp8serve_amx::permitted();
#else
  return false;
#endif
}

// x [M, K] bf16 (rows may be strided), w [N, K] uint8 e4m3 codes contiguous,
// scale [N] float32, bias [N] (any float dtype) or None -> [M, N] bf16, into
// `out` where given (a contiguous bf16 [M, N] tensor: the static decode plans'
// form, decode_plan.cpp).
at::Tensor amx_fp8_linear_impl(at::Tensor x, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias,
                               at::Tensor* given_out) {
  TORCH_CHECK(amx_fp8_linear_available(), "amx_fp8_linear: this build or process has no AMX tiles and VBMI");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "amx_fp8_linear: x must be [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "amx_fp8_linear: x must be bf16, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kByte, "amx_fp8_linear: w must be uint8 e4m3 codes, got ", w.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scale.device().is_cpu(),
              "amx_fp8_linear: CPU tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "amx_fp8_linear: x has ", K, " columns, w ", w.size(1));
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "amx_fp8_linear: 1 to ", kMaxRows, " rows, got ", M);
  TORCH_CHECK(K % 64 == 0 && K > 0, "amx_fp8_linear: K must be a positive multiple of 64, got ", K);
  TORCH_CHECK(w.is_contiguous() && x.stride(1) == 1, "amx_fp8_linear: w must be contiguous and x's rows dense");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "amx_fp8_linear: scale must be a contiguous float32 [", N, "] tensor");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "amx_fp8_linear: bias must be [", N, "]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out;
  if (given_out) {
    TORCH_CHECK(given_out->scalar_type() == at::kBFloat16 && given_out->is_contiguous() && given_out->dim() == 2 &&
                    given_out->size(0) == M && given_out->size(1) == N,
                "amx_fp8_linear_out: out must be a contiguous bf16 [", M, ", ", N, "] tensor");
    out = *given_out;
  } else {
    out = at::empty({M, N}, x.options());
  }
#ifdef FP8SERVE_AMX_FP8_LINEAR
  const int64_t MB = (M + 15) / 16;
  std::vector<uint16_t> xb(MB * (K / 32) * 16 * 32);
  pack_x_lut_order(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), M, K, MB, xb.data());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t blocks = (N + 15) / 16;
  // At least 4 blocks (64 weight rows) per task: each task reloads the tile configuration.
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * 16, n1 = std::min(N, end * 16);
    switch (MB) {
      case 1: return run_blocks<1>(wp, sp, K, xb.data(), b, M, n0, n1, N, o);
      case 2: return run_blocks<2>(wp, sp, K, xb.data(), b, M, n0, n1, N, o);
      case 3: return run_blocks<3>(wp, sp, K, xb.data(), b, M, n0, n1, N, o);
      default: return run_blocks<4>(wp, sp, K, xb.data(), b, M, n0, n1, N, o);
    }
  });
#endif
  return out;
}

at::Tensor amx_fp8_linear(at::Tensor x, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias) {
  return amx_fp8_linear_impl(x, w, scale, bias, nullptr);
}

void amx_fp8_linear_out(at::Tensor out, at::Tensor x, at::Tensor w, at::Tensor scale,
                        std::optional<at::Tensor> bias) {
  amx_fp8_linear_impl(x, w, scale, bias, &out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8serve, m) {
  m.def("amx_fp8_linear", &amx_fp8_linear);
  m.def("amx_fp8_linear_out(Tensor(a!) out, Tensor x, Tensor w, Tensor scale, Tensor? bias) -> ()",
        &amx_fp8_linear_out);
  m.def("amx_fp8_linear_available", &amx_fp8_linear_available);
}
