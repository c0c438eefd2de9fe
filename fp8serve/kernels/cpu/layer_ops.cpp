// Fused elementwise layers: RMSNorm (with the residual add), SiluAndMul and
// rotary embedding, each one pass over memory instead of 4-8 torch ops.
//
// A prefill of 8192 tokens spent more time in these than in the matmuls
// (every torch op streams a multi-MB intermediate through DRAM); a decode
// step paid ~5 dispatches per layer. Rounding follows the torch layers
// exactly, so 16-bit results match them bit for bit up to the float32
// summation order of the norm:
//   RMSNorm:   out = dt(w * dt(x * rsqrt(mean(x^2) + eps)))  (float32: one rounding)
//   add:       residual = dt(x + residual)
//   SiluAndMul: out = dt(dt(silu(gate)) * up)
//   RoPE:      x1' = dt(dt(x1 * cos) - dt(x2 * sin)), x2' = dt(dt(x2 * cos) + dt(x1 * sin))
// where dt() rounds to the tensor's dtype (a no-op for float32).
//
// Builds for AVX-512 CPUs run 16 lanes first (vec16.h, the same operations
// per lane, so the same bits). Measured on a 2-vCPU Xeon, bf16: SiluAndMul
// 4096 x 3072 5.5-6.2 -> 3.8-3.9 ms (torch's unfused silu * up: 3.5-3.7 ms),
// fused add + RMSNorm 4096 x 576 1.1-1.2 -> 0.9 ms; a whole 8 x 512 bf16
// prefill 1.36-1.42 -> 1.31-1.34 s. float32 is unchanged (no rounding to
// emulate). With AVX512-BF16 the rounding to bf16 is one instruction
// (vec16.h bf16_packed): best of 30 calls, three runs each, SiluAndMul
// 2048 x 3072 1.44-1.50 -> 1.37-1.42 ms, fused add + RMSNorm 2048 x 576
// 0.40-0.41 -> 0.36-0.37 ms, plain RMSNorm 0.33-0.34 -> 0.31-0.32 ms.
// 16-bit SiluAndMul reads silu(gate) from a 64K-entry table per dtype
// (SiluTable: the same bits, no exp or division per element): 512 x 3072
// bf16 432 -> 167 us. float32 SiluAndMul has no torch bits to match, so its
// 16-lane loop uses an FMA exp and a reciprocal instead of a division
// (vec16.h silu_f32_fast): 512 x 3072 366 -> 306 us (now bound by reading the
// 6 MB input), max relative error vs float64 2.1e-7 (torch's own: 1.9e-7).
// The 8-lane loop does the same for float32 (vec8.h silu_f32_fast, vrcpps and
// a Newton step): on the AVX2-only Zen 3 EPYC (2 vCPUs) 1.15-1.39x at 1-2048
// rows x 1536, 512 x 1536 555 -> 401 us, max relative error vs float64
// 2.4e-7 (benchmarks/results/silu_and_mul_avx2_fast_2026-12-02_zen3.md).
// RoPE runs 16 lanes too (it had only the 8-lane loop): 512 tokens x (9 + 3)
// heads of 64, hot, 2 threads: bf16 139 -> 67 us, fp16 64 -> 50 us, float32
// 40 -> 32 us.
// RMSNorm's sum of squares runs 16 lanes in two FMA chains (it was one 8-lane
// chain, waiting on the FMA's latency), and the fused add takes it in its own
// pass over the sums instead of reading the row again. On the 2-core Xeon with
// AMX, hidden 576, hot, median of three alternating rounds against the
// previous build: bf16 fused add + RMSNorm 1.23-1.37x at 16-2048 rows (512:
// 78.6 -> 57.3 us), RMSNorm 1.44-1.62x; float32 1.28-2.08x at 16-512 rows,
// 1.0x at 2048 (bound by memory there).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "scalar_convert.h"
#include "silu_mul_row.h"
#include "silu_table.h"
#include "vec16.h"
#include "vec8.h"

namespace {

using namespace fp8serve_cvt;

int tag(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, "expected float32, bfloat16 or float16, got ", x.scalar_type());
  }
  return -1;
}

template <typename Fn>
void by_tag(int t, Fn&& fn) {
  if (t == 0) fn(std::integral_constant<int, 0>{});
  if (t == 1) fn(std::integral_constant<int, 1>{});
  if (t == 2) fn(std::integral_constant<int, 2>{});
}

// Rows per parallel task: ~32 KiB of input each.
inline int64_t grain_for(int64_t row_bytes) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_bytes)); }

void check_2d_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

// ---------------------------------------------------------------- RMSNorm

// Sum of squares of a row. 16 lanes in two chains where built: one 8-lane
// chain waited on its FMA's latency every 8 elements.
template <int T>
inline float sum_squares(const void* x, int64_t n) {
  float ss = 0.f;
  int64_t i = 0;
#ifdef FP8SERVE_VEC16
  {
    namespace v16 = fp8serve_vec16;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
      const __m512 v0 = v16::load<T>(x, i), v1 = v16::load<T>(x, i + 16);
      a0 = _mm512_fmadd_ps(v0, v0, a0);
      a1 = _mm512_fmadd_ps(v1, v1, a1);
    }
    for (; i + 16 <= n; i += 16) {
      const __m512 v = v16::load<T>(x, i);
      a0 = _mm512_fmadd_ps(v, v, a0);
    }
    ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
#endif
#ifdef FP8SERVE_VEC8
  namespace v8 = fp8serve_vec8;
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = v8::load<T>(x, i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss += v8::hsum(acc);
#endif
  for (; i < n; ++i) ss += load_as_f32<T>(x, i) * load_as_f32<T>(x, i);
  return ss;
}

// out = rms_norm(x) * w for one row whose sum of squares is ss.
template <int T>
inline void norm_row_ss(const void* x, void* out, const void* w, int64_t n, float eps, float ss) {
  int64_t i = 0;
#ifdef FP8SERVE_VEC8
  namespace v8 = fp8serve_vec8;
#endif
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  // float32: x * r * w rounded once (F.rms_norm with weight); 16-bit: the
  // normalised value is rounded before the weight multiply (HF Llama).
  i = 0;
#ifdef FP8SERVE_VEC16
  {
    namespace v16 = fp8serve_vec16;
    const __m512 vr16 = _mm512_set1_ps(r);
    for (; i + 16 <= n; i += 16) {
      const __m512 y = _mm512_mul_ps(v16::round_to<T>(_mm512_mul_ps(v16::load<T>(x, i), vr16)), v16::load<T>(w, i));
      v16::store<T>(out, i, y);
    }
  }
#endif
#ifdef FP8SERVE_VEC8
  const __m256 vr = _mm256_set1_ps(r);
  for (; i + 8 <= n; i += 8) {
    const __m256 y = _mm256_mul_ps(v8::round_to<T>(_mm256_mul_ps(v8::load<T>(x, i), vr)), v8::load<T>(w, i));
    v8::store<T>(out, i, y);
  }
#endif
  for (; i < n; ++i) store_from_f32<T>(out, i, round_to<T>(load_as_f32<T>(x, i) * r) * load_as_f32<T>(w, i));
}

template <int T>
inline void norm_row(const void* x, void* out, const void* w, int64_t n, float eps) {
  norm_row_ss<T>(x, out, w, n, eps, sum_squares<T>(x, n));
}

// out = rms_norm(x) * weight. x, out: [num_tokens, hidden]; weight: [hidden].
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_2d_rows(x, "x");
  check_2d_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "out must match x");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] contiguous, x's dtype");
  const int64_t n = x.size(1), es = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const void* wp = weight.data_ptr();
  const int64_t xs = x.stride(0) * es, os = out.stride(0) * es;
  by_tag(tag(x), [&](auto t) {
    constexpr int T = decltype(t)::value;
    at::parallel_for(0, x.size(0), grain_for(n * es), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) norm_row<T>(xp + r * xs, op + r * os, wp, n, static_cast<float>(eps));
    });
  });
}

// In place: residual = x + residual; x = rms_norm(residual) * weight.
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_2d_rows(x, "x");
  check_2d_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual must match x");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] contiguous, x's dtype");
  const int64_t n = x.size(1), es = x.element_size();
  char* xp = static_cast<char*>(x.data_ptr());
  char* rp = static_cast<char*>(residual.data_ptr());
  const void* wp = weight.data_ptr();
  const int64_t xs = x.stride(0) * es, rs = residual.stride(0) * es;
  by_tag(tag(x), [&](auto t) {
    constexpr int T = decltype(t)::value;
    at::parallel_for(0, x.size(0), grain_for(n * es), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        void* xr = xp + r * xs;
        void* rr = rp + r * rs;
        // The sum of squares of the rounded sums as they are stored, taken in
        // the same pass instead of a second read of the row (see the header).
        float ss = 0.f;
        int64_t i = 0;
#ifdef FP8SERVE_VEC16
        {
          namespace v16 = fp8serve_vec16;
          __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
          for (; i + 32 <= n; i += 32) {
            const __m512 y0 = v16::round_to<T>(_mm512_add_ps(v16::load<T>(xr, i), v16::load<T>(rr, i)));
            const __m512 y1 = v16::round_to<T>(_mm512_add_ps(v16::load<T>(xr, i + 16), v16::load<T>(rr, i + 16)));
            v16::store<T>(rr, i, y0);
            v16::store<T>(rr, i + 16, y1);
            a0 = _mm512_fmadd_ps(y0, y0, a0);
            a1 = _mm512_fmadd_ps(y1, y1, a1);
          }
          for (; i + 16 <= n; i += 16) {
            const __m512 y = v16::round_to<T>(_mm512_add_ps(v16::load<T>(xr, i), v16::load<T>(rr, i)));
            v16::store<T>(rr, i, y);
            a0 = _mm512_fmadd_ps(y, y, a0);
          }
          ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        }
#endif
#ifdef FP8SERVE_VEC8
        {
          namespace v8 = fp8serve_vec8;
          __m256 acc = _mm256_setzero_ps();
          for (; i + 8 <= n; i += 8) {
            const __m256 y = v8::round_to<T>(_mm256_add_ps(v8::load<T>(xr, i), v8::load<T>(rr, i)));
            v8::store<T>(rr, i, y);
            acc = _mm256_fmadd_ps(y, y, acc);
          }
          ss += v8::hsum(acc);
        }
#endif
        for (; i < n; ++i) {
          const float y = round_to<T>(load_as_f32<T>(xr, i) + load_as_f32<T>(rr, i));
          store_from_f32<T>(rr, i, y);
          ss += y * y;
        }
        norm_row_ss<T>(rr, xr, wp, n, static_cast<float>(eps), ss);
      }
    });
  });
}

// ------------------------------------------------------------- SiluAndMul

// The silu tables of 16-bit gates: silu_table.h.
using fp8serve_act::silu_table;

// out[t] = silu(x[t, :d]) * x[t, d:]. x: [num_tokens, 2d]; out: [num_tokens, d].
void silu_and_mul(at::Tensor out, at::Tensor x) {
  check_2d_rows(x, "x");
  check_2d_rows(out, "out");
  TORCH_CHECK(x.size(1) % 2 == 0 && out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2 &&
                  out.scalar_type() == x.scalar_type(),
              "out must be [num_tokens, d] for x [num_tokens, 2d], same dtype");
  const int64_t d = out.size(1), es = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t xs = x.stride(0) * es, os = out.stride(0) * es;
  by_tag(tag(x), [&](auto t) {
    constexpr int T = decltype(t)::value;
    const uint16_t* table = nullptr;
    if constexpr (T != 0) table = silu_table<T>();
    at::parallel_for(0, x.size(0), grain_for(2 * d * es), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const char* g = xp + r * xs;
        const char* u = g + d * es;
        void* o = op + r * os;
        int64_t i = 0;
        if constexpr (T != 0) {
          // 16-bit: silu from the table (see SiluTable), then dt(s * up);
          // 512 x 3072 (2 threads, hot): bf16 432 -> 167 us, fp16 about 260 us.
          const uint16_t* gb = reinterpret_cast<const uint16_t*>(g);
          const auto* tb = reinterpret_cast<const int*>(table);
#ifdef FP8SERVE_VEC16
          for (; i + 16 <= d; i += 16) {
            const __m512i idx = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + i)));
            __m512 sv;
            if constexpr (T == 1) {
              sv = fp8serve_act::silu_bf16_from_table16(table, idx);
            } else {
              const __m512i sb = _mm512_and_si512(_mm512_i32gather_epi32(idx, tb, 2), _mm512_set1_epi32(0xffff));
              sv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(sb));
            }
            fp8serve_vec16::store<T>(o, i, _mm512_mul_ps(sv, fp8serve_vec16::load<T>(u, i)));
          }
#endif
#ifdef FP8SERVE_VEC8
          for (; i + 8 <= d; i += 8) {
            const __m256i idx = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + i)));
            const __m256i sb = _mm256_and_si256(_mm256_i32gather_epi32(tb, idx, 2), _mm256_set1_epi32(0xffff));
            const __m256 sv = T == 1 ? _mm256_castsi256_ps(_mm256_slli_epi32(sb, 16))
                                     : _mm256_cvtph_ps(fp8serve_vec8::pack_u16(sb));
            fp8serve_vec8::store<T>(o, i, _mm256_mul_ps(sv, fp8serve_vec8::load<T>(u, i)));
          }
#endif
          for (; i < d; ++i) {
            const uint16_t sb = table[gb[i]];
            store_from_f32<T>(o, i, load_as_f32<T>(&sb, 0) * load_as_f32<T>(u, i));
          }
        } else {
          // float32: no torch bits to match; silu_f32_fast (vec8.h, vec16.h).
          const float* gf = static_cast<const float*>(static_cast<const void*>(g));
          const float* uf = static_cast<const float*>(static_cast<const void*>(u));
          float* of = static_cast<float*>(o);
#ifdef FP8SERVE_VEC16
          namespace v16 = fp8serve_vec16;
          const __m512 one16 = _mm512_set1_ps(1.0f);
          for (; i + 16 <= d; i += 16) {
            const __m512 gv = _mm512_loadu_ps(gf + i), uv = _mm512_loadu_ps(uf + i);
            if (!_mm512_cmp_ps_mask(gv, _mm512_set1_ps(-80.f), _CMP_LT_OQ)) {
              _mm512_storeu_ps(of + i, _mm512_mul_ps(v16::silu_f32_fast(gv), uv));
              continue;
            }
            const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), gv);
            _mm512_storeu_ps(of + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one16, v16::exp(neg))), uv));
          }
#endif
          // The rest of the row (all of it without AVX-512) through the row
          // function of the tiled GEMMs' gated forms, which so give this op's bits.
          fp8serve_act::silu_mul_row(gf + i, uf + i, of + i, static_cast<int>(d - i));
        }
      }
    });
  });
}

// ------------------------------------------------------------------- RoPE

// In place, rotate-half (GPT-NeoX / Llama) layout. query: [num_tokens,
// num_heads, head_size], key: [num_tokens, num_kv_heads, head_size] (any
// token stride, heads contiguous: views into the fused qkv output work).
// cos, sin: [max_position, head_size / 2] in the query's dtype; positions:
// [num_tokens] int64.
void rotary_embedding(at::Tensor positions, at::Tensor query, at::Tensor key, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous(),
              "positions must be int64 [num_tokens]");
  for (const auto* x : {&query, &key}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->stride(1) == x->size(2),
                "query/key must be [num_tokens, heads, head_size] with contiguous heads");
    TORCH_CHECK(x->size(0) == positions.size(0), "query/key and positions disagree on num_tokens");
  }
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && query.size(2) == key.size(2),
              "query and key must share dtype and head_size");
  const int64_t hs = query.size(2), half = hs / 2;
  TORCH_CHECK(hs % 2 == 0, "head_size must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == half && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == query.scalar_type() &&
                  sin.scalar_type() == query.scalar_type(),
              "cos/sin must be [max_position, head_size / 2] contiguous in the query's dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "positions[", t, "] = ", pos[t], " is outside [0, ", max_pos, ")");
  }
  const int64_t es = query.element_size();
  char* qp = static_cast<char*>(query.data_ptr());
  char* kp = static_cast<char*>(key.data_ptr());
  const char* cp = static_cast<const char*>(cos.data_ptr());
  const char* sp = static_cast<const char*>(sin.data_ptr());
  const int64_t qs = query.stride(0) * es, ks = key.stride(0) * es;
  const int64_t nq = query.size(1), nk = key.size(1);
  by_tag(tag(query), [&](auto t) {
    constexpr int T = decltype(t)::value;
    at::parallel_for(0, positions.size(0), grain_for((nq + nk) * hs * es), [&](int64_t b, int64_t e) {
      for (int64_t tok = b; tok < e; ++tok) {
        const void* c = cp + pos[tok] * half * es;
        const void* s = sp + pos[tok] * half * es;
        for (int64_t h = 0; h < nq + nk; ++h) {
          char* row = h < nq ? qp + tok * qs + h * hs * es : kp + tok * ks + (h - nq) * hs * es;
          void* x2p = row + half * es;
          int64_t i = 0;
#ifdef FP8SERVE_VEC16
          // 16 lanes first (the same operations per lane, so the same bits;
          // gain in the header).
          namespace v16 = fp8serve_vec16;
          for (; i + 16 <= half; i += 16) {
            const __m512 x1 = v16::load<T>(row, i), x2 = v16::load<T>(x2p, i);
            const __m512 cv = v16::load<T>(c, i), sv = v16::load<T>(s, i);
            v16::store<T>(row, i, _mm512_sub_ps(v16::round_to<T>(_mm512_mul_ps(x1, cv)), v16::round_to<T>(_mm512_mul_ps(x2, sv))));
            v16::store<T>(x2p, i, _mm512_add_ps(v16::round_to<T>(_mm512_mul_ps(x2, cv)), v16::round_to<T>(_mm512_mul_ps(x1, sv))));
          }
#endif
#ifdef FP8SERVE_VEC8
          namespace v8 = fp8serve_vec8;
          for (; i + 8 <= half; i += 8) {
            const __m256 x1 = v8::load<T>(row, i), x2 = v8::load<T>(x2p, i);
            const __m256 cv = v8::load<T>(c, i), sv = v8::load<T>(s, i);
            v8::store<T>(row, i, _mm256_sub_ps(v8::round_to<T>(_mm256_mul_ps(x1, cv)), v8::round_to<T>(_mm256_mul_ps(x2, sv))));
            v8::store<T>(x2p, i, _mm256_add_ps(v8::round_to<T>(_mm256_mul_ps(x2, cv)), v8::round_to<T>(_mm256_mul_ps(x1, sv))));
          }
#endif
          for (; i < half; ++i) {
            const float x1 = load_as_f32<T>(row, i), x2 = load_as_f32<T>(x2p, i), cv = load_as_f32<T>(c, i), sv = load_as_f32<T>(s, i);
            store_from_f32<T>(row, i, round_to<T>(x1 * cv) - round_to<T>(x2 * sv));
            store_from_f32<T>(x2p, i, round_to<T>(x2 * cv) + round_to<T>(x1 * sv));
          }
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fp8serve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &fused_add_rms_norm);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
  m.impl("rotary_embedding", c10::DispatchKey::CPU, &rotary_embedding);
}
