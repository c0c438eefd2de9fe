// Decode attention over the paged KV cache, reading K/V in their storage
// format (float32, bf16, fp16, fp8 e4m3, fp8 e5m2) and converting to float32
// in registers. One query token per sequence.
//
// FP8 is decoded through fp16 bit patterns and F16C:
//   e5m2 is the top byte of an fp16, so half = code << 8;
//   e4m3 (bias 7) placed as half = (sign << 15) | ((code & 0x7f) << 7) has the
//   right mantissa and an exponent 8 too small (bias 15), for normals and
//   subnormals alike, so value = half * 2^8. That constant is folded into the
//   per-layer scales by the caller (`kv_multiplier`), as are k_scale (into q)
//   and v_scale (into the output): no per-element scaling here.
//
// Work is split over (sequence, kv head) pairs on torch's thread pool; each task keeps
// the scores of its query heads (all heads that share this kv head, GQA) in a
// thread-local buffer and reads each K and V row exactly once.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FP8SERVE_AVX2 1
#endif

namespace {

enum KVFormat : int64_t { kF32 = 0, kBF16 = 1, kF16 = 2, kE4M3 = 3, kE5M2 = 4 };

inline float half_bits_to_float(uint16_t h) {
#ifdef FP8SERVE_AVX2
  return _cvtsh_ss(h);
#else
  // Portable fallback (normals, subnormals, zero; inf/NaN are never stored).
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    v = man ? NAN : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(man | 0x400u), static_cast<int>(exp) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits |= sign;
  std::memcpy(&v, &bits, 4);
  return v;
#endif
}

// Convert `n` elements of one cache row to float32.
template <int64_t F>
inline void load_row(const void* src, float* dst, int64_t n) {
  if constexpr (F == kF32) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (F == kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    int64_t i = 0;
#ifdef FP8SERVE_AVX2
    for (; i + 8 <= n; i += 8) {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(w));
    }
#endif
    for (; i < n; ++i) {
      uint32_t b = static_cast<uint32_t>(s[i]) << 16;
      std::memcpy(dst + i, &b, 4);
    }
  } else if constexpr (F == kF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    int64_t i = 0;
#ifdef FP8SERVE_AVX2
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
    }
#endif
    for (; i < n; ++i) dst[i] = half_bits_to_float(s[i]);
  } else if constexpr (F == kE5M2) {
    const uint8_t* s = static_cast<const uint8_t*>(src);
    int64_t i = 0;
#ifdef FP8SERVE_AVX2
    for (; i + 8 <= n; i += 8) {
      __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + i));
      __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(b), 8);
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
#endif
    for (; i < n; ++i) dst[i] = half_bits_to_float(static_cast<uint16_t>(s[i]) << 8);
  } else {  // kE4M3, value * 2^-8 (see header)
    const uint8_t* s = static_cast<const uint8_t*>(src);
    int64_t i = 0;
#ifdef FP8SERVE_AVX2
    const __m128i sign_mask = _mm_set1_epi16(0x80), mag_mask = _mm_set1_epi16(0x7f);
    for (; i + 8 <= n; i += 8) {
      __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + i)));
      __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, sign_mask), 8),
                               _mm_slli_epi16(_mm_and_si128(b, mag_mask), 7));
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
#endif
    for (; i < n; ++i) {
      uint16_t b = s[i];
      dst[i] = half_bits_to_float(static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7)));
    }
  }
}

#ifdef FP8SERVE_AVX2
// exp for x <= 0 (softmax after max subtraction); relative error ~1e-7.
inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  x = _mm256_max_ps(x, lo);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // x - fx*ln2 in two parts for accuracy
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  __m256 x2 = _mm256_mul_ps(x, x);
  y = _mm256_fmadd_ps(y, x2, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// exp(s - m) in place over n scores; returns their sum.
inline float exp_sum(float* s, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef FP8SERVE_AVX2
  __m256 vm = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, acc);
  for (float t : tmp) sum += t;
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

template <int64_t F>
void decode_impl(float* out, const float* q, const uint8_t* k_cache, const uint8_t* v_cache,
                 const int64_t* block_tables, const int64_t* seq_lens, int64_t num_seqs, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_size, int64_t block_size, int64_t max_blocks,
                 int64_t elem_size, float out_scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_bytes = head_size * elem_size;               // one token, one kv head
  const int64_t slot_bytes = num_kv_heads * row_bytes;            // one token, all kv heads
  const int64_t block_bytes = block_size * slot_bytes;
  // torch's own thread pool: a second OpenMP runtime in the process would
  // fight torch's spinning worker threads for the same cores.
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row(head_size), acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = seq_lens[b];
      const float* qh = q + (b * num_heads + h * group) * head_size;  // [group, head_size]
      scores.assign(group * len, 0.f);
      const int64_t* bt = block_tables + b * max_blocks;
      // Scores: one pass over K.
      for (int64_t t = 0; t < len; ++t) {
        const uint8_t* src = k_cache + bt[t / block_size] * block_bytes + (t % block_size) * slot_bytes + h * row_bytes;
        load_row<F>(src, row.data(), head_size);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qh + g * head_size;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_size; ++d) dot += qg[d] * row[d];
          scores[g * len + t] = dot;
        }
      }
      std::vector<float> inv_sum(group);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        float m = *std::max_element(s, s + len);
        inv_sum[g] = out_scale / exp_sum(s, len, m);
      }
      // Weighted sum: one pass over V.
      acc.assign(group * head_size, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const uint8_t* src = v_cache + bt[t / block_size] * block_bytes + (t % block_size) * slot_bytes + h * row_bytes;
        load_row<F>(src, row.data(), head_size);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * head_size;
#pragma omp simd
          for (int64_t d = 0; d < head_size; ++d) a[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = out + (b * num_heads + h * group + g) * head_size;
        for (int64_t d = 0; d < head_size; ++d) o[d] = acc[g * head_size + d] * inv_sum[g];
      }
    }
  });
}

}  // namespace

// out, query: [num_seqs, num_heads, head_size] float32 contiguous; query is
// pre-multiplied by softmax_scale * k_scale (* 2^8 for e4m3).
// key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
// contiguous, dtype per `kv_format` (fp8 as uint8).
// block_tables: [num_seqs, max_blocks] int64; seq_lens: [num_seqs] int64.
void paged_attention_decode(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                            int64_t kv_format, double out_scale) {
  TORCH_CHECK(out.is_contiguous() && query.is_contiguous(), "out and query must be contiguous");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32,
              "query and out must be float32");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "block_tables/seq_lens must be contiguous");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_size, "head_size mismatch between query and cache");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t elem = key_cache.element_size();
  auto* o = out.data_ptr<float>();
  const auto* q = query.data_ptr<float>();
  const auto* kc = static_cast<const uint8_t*>(key_cache.data_ptr());
  const auto* vc = static_cast<const uint8_t*>(value_cache.data_ptr());
  const auto* bt = block_tables.data_ptr<int64_t>();
  const auto* sl = seq_lens.data_ptr<int64_t>();
  const float os = static_cast<float>(out_scale);
#define FP8SERVE_CALL(F) decode_impl<F>(o, q, kc, vc, bt, sl, num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks, elem, os)
  switch (kv_format) {
    case kF32: TORCH_CHECK(elem == 4, "float32 cache expected"); FP8SERVE_CALL(kF32); break;
    case kBF16: TORCH_CHECK(elem == 2, "bf16 cache expected"); FP8SERVE_CALL(kBF16); break;
    case kF16: TORCH_CHECK(elem == 2, "fp16 cache expected"); FP8SERVE_CALL(kF16); break;
    case kE4M3: TORCH_CHECK(elem == 1, "uint8 cache expected"); FP8SERVE_CALL(kE4M3); break;
    case kE5M2: TORCH_CHECK(elem == 1, "uint8 cache expected"); FP8SERVE_CALL(kE5M2); break;
    default: TORCH_CHECK(false, "unknown kv_format ", kv_format);
  }
#undef FP8SERVE_CALL
}

bool has_avx2() {
#ifdef FP8SERVE_AVX2
  return true;
#else
  return false;
#endif
}

// Each source file registers its own ops in the `fp8serve` namespace, so
// kernels can be added without a shared binding file.
TORCH_LIBRARY_FRAGMENT(fp8serve, m) {
  m.def("paged_attention_decode", &paged_attention_decode);
  m.def("has_avx2", &has_avx2);
}
