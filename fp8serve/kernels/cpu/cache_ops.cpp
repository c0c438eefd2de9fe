// Writing a step's K/V into the paged cache: convert (or quantize to FP8 with
// the layer's k_scale / v_scale) and scatter into `slot_mapping` in one pass.
//
// The torch path took four passes per tensor (to float32, divide, clamp,
// cast) and an index_copy_; here each element is read once, converted in
// registers and written once. Optionally the decoded codes (what a later
// read of the cache returns, at scale 1) are written to `key_out` /
// `value_out` in the input dtype, so a fresh prefill can attend to exactly
// the values decode will see without gathering them back from the cache.
// Slots < 0 are skipped (padding tokens), as in vLLM's reshape_and_cache.
//
// The FP8 encode (divide by the scale, saturate, round to nearest even,
// subnormals, NaN) is ~20 vector operations whatever the width, so on builds
// for AVX-512 CPUs it runs 16 lanes (vec16.h, bit-identical to the 8-lane and
// scalar code). Measured side by side with the 8-lane build on the 2-vCPU
// Xeon (benchmarks/cache_write.py, results/cache_write_2026-11-30.md): 1.2-2x
// for 16 to 8192 tokens per call, the most where the read-back is written in
// bf16; at 8192 tokens an FP8 write takes what a bf16 one does (at 512,
// still 1.3x).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kv_layout.h"
#include "scalar_convert.h"
#include "vec16.h"
#include "vec8.h"

namespace {

using namespace fp8serve_cvt;

enum KVFormat : int64_t { kF32 = 0, kBF16 = 1, kF16 = 2, kE4M3 = 3, kE5M2 = 4 };

// One row (num_kv_heads * head_size elements) of one token.
template <int In, int64_t F>
inline void write_row(const void* src, void* dst, void* decoded, int64_t n, float scale) {
  int64_t i = 0;
  if constexpr (F == kE4M3 || F == kE5M2) {
    constexpr bool e4m3 = F == kE4M3;
    uint8_t* d = static_cast<uint8_t*>(dst);
#ifdef FP8SERVE_VEC16
    // 16 lanes where the build CPU has AVX-512 (see the file header).
    namespace v16 = fp8serve_vec16;
    const __m512 vs16 = _mm512_set1_ps(scale);
    for (; i + 16 <= n; i += 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), v16::fp8_codes<e4m3>(_mm512_div_ps(v16::load<In>(src, i), vs16)));
      if (decoded != nullptr) v16::store<In>(decoded, i, v16::fp8_decode<e4m3>(d + i));
    }
#endif
#ifdef FP8SERVE_VEC8
    namespace v8 = fp8serve_vec8;
    const __m256 vs = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
      v8::store_bytes(d + i, v8::fp8_codes<e4m3>(_mm256_div_ps(v8::load<In>(src, i), vs)));
      if (decoded != nullptr) v8::store<In>(decoded, i, v8::fp8_decode<e4m3>(d + i));
    }
#endif
    for (; i < n; ++i) {
      const float x = load_as_f32<In>(src, i) / scale;
      d[i] = e4m3 ? f32_to_e4m3(x) : f32_to_e5m2(x);
      if (decoded != nullptr) store_from_f32<In>(decoded, i, e4m3 ? e4m3_to_f32(d[i]) : e5m2_to_f32(d[i]));
    }
  } else {
    constexpr int Out = F == kF32 ? 0 : (F == kBF16 ? 1 : 2);
#ifdef FP8SERVE_VEC8
    namespace v8 = fp8serve_vec8;
    for (; i + 8 <= n; i += 8) {
      v8::store<Out>(dst, i, v8::load<In>(src, i));
      if (decoded != nullptr) v8::store<In>(decoded, i, v8::load<Out>(dst, i));
    }
#endif
    for (; i < n; ++i) {
      store_from_f32<Out>(dst, i, load_as_f32<In>(src, i));
      if (decoded != nullptr) store_from_f32<In>(decoded, i, load_as_f32<Out>(dst, i));
    }
  }
}

// Address of slot `slot`'s row of kv head h (kv_layout.h).
inline int64_t row_offset(const fp8serve_kv::CacheStrides& cs, int64_t block_size, int64_t slot, int64_t h) {
  return slot / block_size * cs.block_bytes + slot % block_size * cs.token_bytes + h * cs.head_bytes;
}

template <int In, int64_t F>
void cache_impl(const at::Tensor& x, const at::Tensor& cache, const int64_t* slots, const at::Tensor* out, float scale) {
  const int64_t num_tokens = x.size(0), row = x.size(1) * x.size(2);
  const int64_t nkv = x.size(1), hs = x.size(2), bs = cache.size(1);
  const fp8serve_kv::CacheStrides cs = fp8serve_kv::cache_strides(cache, "reshape_and_cache");
  const int64_t x_stride = x.stride(0) * x.element_size();
  const int64_t out_stride = out ? out->stride(0) * out->element_size() : 0;
  const int64_t x_head = hs * x.element_size(), out_head = out ? hs * out->element_size() : 0;
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  char* dec = out ? static_cast<char*>(out->data_ptr()) : nullptr;
  // ~64 KiB of input per task: small batches stay on one thread.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, row * x.element_size()));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
#ifdef FP8SERVE_VEC8
    // Each token's slot is somewhere else in a large cache. Measured on a
    // 2-vCPU KVM guest, 64 decode tokens (FP8) took 19 us with the cache
    // lines hot and 274 us once other work had evicted them, ~0.7 us per
    // line: the misses (and their page walks) ran one after another. A first
    // pass that only prefetches every destination line lets them overlap:
    // 145 us. Inside an engine's batch-64 decode steps (FP8, Zen 2, a timing
    // wrapper around each call, 330 calls) it takes 48 us (median; 21 us
    // called again at once); the mean, 87 us, is carried by first writes into
    // pages of the cache nothing has touched yet (up to 3 ms: the OS zeroes a
    // 2 MiB page). The ~190-260 us per call that profile_step.py showed were
    // steps where every sequence opened a new block, in fresh pages (context
    // 576); with the profiled steps inside blocks already written (context
    // 584) the same profile shows 48 us.
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      for (int64_t h = 0; h < nkv; ++h) {
        const char* d = dst + row_offset(cs, bs, slots[t], h);
        for (int64_t off = 0; off < cs.row_bytes; off += 64) _mm_prefetch(d + off, _MM_HINT_T0);
      }
    }
#endif
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) {
        // Nothing stored: the read-back is zeros, never stale memory.
        if (dec) std::memset(dec + t * out_stride, 0, row * out->element_size());
        continue;
      }
      if (cs.slot_contiguous) {  // NHD: the token's kv heads are one run
        write_row<In, F>(src + t * x_stride, dst + row_offset(cs, bs, slot, 0), dec ? dec + t * out_stride : nullptr,
                         row, scale);
        continue;
      }
      for (int64_t h = 0; h < nkv; ++h)
        write_row<In, F>(src + t * x_stride + h * x_head, dst + row_offset(cs, bs, slot, h),
                         dec ? dec + t * out_stride + h * out_head : nullptr, hs, scale);
    }
  });
}

template <int In>
void dispatch_format(const at::Tensor& x, const at::Tensor& cache, const int64_t* slots, const at::Tensor* out,
                     int64_t fmt, float scale) {
  switch (fmt) {
    case kF32: cache_impl<In, kF32>(x, cache, slots, out, scale); break;
    case kBF16: cache_impl<In, kBF16>(x, cache, slots, out, scale); break;
    case kF16: cache_impl<In, kF16>(x, cache, slots, out, scale); break;
    case kE4M3: cache_impl<In, kE4M3>(x, cache, slots, out, scale); break;
    case kE5M2: cache_impl<In, kE5M2>(x, cache, slots, out, scale); break;
    default: TORCH_CHECK(false, "unknown kv_format ", fmt);
  }
}

int in_tag(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, "key/value must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
  return -1;
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3, name, " must be [num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), name,
              " must have contiguous heads within a token (any token stride)");
}

at::ScalarType storage_type(int64_t fmt) {
  switch (fmt) {
    case kF32: return at::kFloat;
    case kBF16: return at::kBFloat16;
    case kF16: return at::kHalf;
    case kE4M3:
    case kE5M2: return at::kByte;
    default: TORCH_CHECK(false, "unknown kv_format ", fmt);
  }
  return at::kByte;
}

}  // namespace

// key, value: [num_tokens, num_kv_heads, head_size] float32/bf16/fp16, heads
// contiguous within a token. key_cache, value_cache: [num_blocks, block_size,
// num_kv_heads, head_size] views of HND or NHD memory (kv_layout.h) in the
// storage dtype of kv_format.
// slot_mapping: [num_tokens] int64 (block * block_size + offset; < 0 skips).
// key_out / value_out: optional [num_tokens, num_kv_heads, head_size]
// contiguous, key's dtype: receive the decoded stored values (scale 1).
void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                       at::Tensor slot_mapping, int64_t kv_format, double k_scale, double v_scale,
                       c10::optional<at::Tensor> key_out, c10::optional<at::Tensor> value_out) {
  check_rows(key, "key");
  check_rows(value, "value");
  TORCH_CHECK(key.sizes() == value.sizes() && key.scalar_type() == value.scalar_type(),
              "key and value must have one shape and dtype");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "caches must be [num_blocks, block_size, num_kv_heads, head_size], K and V alike");
  fp8serve_kv::cache_strides(key_cache, "reshape_and_cache");  // HND or NHD, or an error
  TORCH_CHECK(value_cache.strides() == key_cache.strides(), "reshape_and_cache: K and V caches must have one layout, "
              "got strides ", key_cache.strides(), " and ", value_cache.strides());
  TORCH_CHECK(key_cache.scalar_type() == storage_type(kv_format) && value_cache.scalar_type() == key_cache.scalar_type(),
              "cache dtype ", key_cache.scalar_type(), " does not match kv_format ", kv_format);
  TORCH_CHECK(key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
              "cache rows are [", key_cache.size(2), ", ", key_cache.size(3), "], key rows [", key.size(1), ", ",
              key.size(2), "]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0),
              "slot_mapping must be int64 [num_tokens]");
  TORCH_CHECK(k_scale > 0 && v_scale > 0, "scales must be > 0");
  const bool fp8 = kv_format == kE4M3 || kv_format == kE5M2;
  TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0), "only FP8 storage takes scales");
  for (const auto* o : {&key_out, &value_out}) {
    if (o->has_value()) {
      const at::Tensor& t = o->value();
      TORCH_CHECK(t.sizes() == key.sizes() && t.scalar_type() == key.scalar_type() && t.is_contiguous(),
                  "key_out/value_out must be contiguous, shaped and typed like key");
    }
  }
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t) {
    TORCH_CHECK(slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t], " is past the cache's ", num_slots, " slots");
  }
  const int tag = in_tag(key);
  const at::Tensor* ko = key_out.has_value() ? &key_out.value() : nullptr;
  const at::Tensor* vo = value_out.has_value() ? &value_out.value() : nullptr;
  const auto run = [&](const at::Tensor& x, const at::Tensor& cache, const at::Tensor* out, float scale) {
    if (tag == 0) dispatch_format<0>(x, cache, slots, out, kv_format, scale);
    if (tag == 1) dispatch_format<1>(x, cache, slots, out, kv_format, scale);
    if (tag == 2) dispatch_format<2>(x, cache, slots, out, kv_format, scale);
  };
  run(key, key_cache, ko, static_cast<float>(k_scale));
  run(value, value_cache, vo, static_cast<float>(v_scale));
}

// ------------------------------------------------------------------ reading back

namespace {

// One slot's row of n stored elements, decoded to Out (0 float32, 1 bf16,
// 2 fp16) at scale 1: the values reshape_and_cache's key_out / value_out get.
template <int Out, int64_t F>
inline void read_row(const void* src, void* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (F == kE4M3 || F == kE5M2) {
    constexpr bool e4m3 = F == kE4M3;
    const uint8_t* s = static_cast<const uint8_t*>(src);
#ifdef FP8SERVE_VEC16
    for (; i + 16 <= n; i += 16) fp8serve_vec16::store<Out>(dst, i, fp8serve_vec16::fp8_decode<e4m3>(s + i));
#endif
#ifdef FP8SERVE_VEC8
    for (; i + 8 <= n; i += 8) fp8serve_vec8::store<Out>(dst, i, fp8serve_vec8::fp8_decode<e4m3>(s + i));
#endif
    for (; i < n; ++i) store_from_f32<Out>(dst, i, e4m3 ? e4m3_to_f32(s[i]) : e5m2_to_f32(s[i]));
  } else {
    constexpr int In = F == kF32 ? 0 : (F == kBF16 ? 1 : 2);
    if constexpr (In == Out) {
      std::memcpy(dst, src, n * (In == 0 ? 4 : 2));
    } else {
#ifdef FP8SERVE_VEC8
      for (; i + 8 <= n; i += 8) fp8serve_vec8::store<Out>(dst, i, fp8serve_vec8::load<In>(src, i));
#endif
      for (; i < n; ++i) store_from_f32<Out>(dst, i, load_as_f32<In>(src, i));
    }
  }
}

template <int Out, int64_t F>
void gather_impl(const at::Tensor& cache, const int64_t* slots, int64_t n, const at::Tensor& out) {
  const int64_t bs = cache.size(1), nkv = cache.size(2), hs = cache.size(3), row = nkv * hs;
  const fp8serve_kv::CacheStrides cs = fp8serve_kv::cache_strides(cache, "gather_cache");
  const int64_t slot_bytes = row * cache.element_size(), out_bytes = row * out.element_size();
  const int64_t out_head = hs * out.element_size();
  const char* src = static_cast<const char*>(cache.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, slot_bytes));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
#ifdef FP8SERVE_VEC8
      // The slots are scattered blocks: ask for a later row's lines early.
      if (t + 4 < end) {
        for (int64_t h = 0; h < (cs.slot_contiguous ? 1 : nkv); ++h) {
          const char* ahead = src + row_offset(cs, bs, slots[t + 4], h);
          const int64_t run = cs.slot_contiguous ? slot_bytes : cs.row_bytes;
          for (int64_t off = 0; off < run; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        }
      }
#endif
      if (cs.slot_contiguous) {
        read_row<Out, F>(src + row_offset(cs, bs, slots[t], 0), dst + t * out_bytes, row);
        continue;
      }
      for (int64_t h = 0; h < nkv; ++h)
        read_row<Out, F>(src + row_offset(cs, bs, slots[t], h), dst + t * out_bytes + h * out_head, hs);
    }
  });
}

template <int Out>
void gather_dispatch(const at::Tensor& cache, const int64_t* slots, int64_t n, const at::Tensor& out, int64_t fmt) {
  switch (fmt) {
    case kF32: gather_impl<Out, kF32>(cache, slots, n, out); break;
    case kBF16: gather_impl<Out, kBF16>(cache, slots, n, out); break;
    case kF16: gather_impl<Out, kF16>(cache, slots, n, out); break;
    case kE4M3: gather_impl<Out, kE4M3>(cache, slots, n, out); break;
    case kE5M2: gather_impl<Out, kE5M2>(cache, slots, n, out); break;
    default: TORCH_CHECK(false, "unknown kv_format ", fmt);
  }
}

}  // namespace

// cache: [num_blocks, block_size, num_kv_heads, head_size], a view of HND or
// NHD memory (kv_layout.h) in the storage dtype of kv_format. slots: [n] int64, each < num_blocks * block_size.
// out: [n, num_kv_heads, head_size] contiguous float32/bf16/fp16: row t gets
// slot slots[t] decoded at scale 1 (a prefill over a cached context reads
// its context back this way: one pass, no index_select of codes followed by
// a table lookup per element).
void gather_cache(at::Tensor cache, at::Tensor slots, int64_t kv_format, at::Tensor out) {
  TORCH_CHECK(cache.dim() == 4, "gather_cache: cache must be a [num_blocks, block_size, num_kv_heads, head_size] "
              "view");
  fp8serve_kv::cache_strides(cache, "gather_cache");  // HND or NHD, or an error
  TORCH_CHECK(cache.scalar_type() == storage_type(kv_format), "gather_cache: cache dtype ", cache.scalar_type(),
              " does not match kv_format ", kv_format);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "gather_cache: slots must be a contiguous int64 vector");
  const int64_t n = slots.size(0);
  TORCH_CHECK(out.dim() == 3 && out.is_contiguous() && out.size(0) == n && out.size(1) == cache.size(2) &&
                  out.size(2) == cache.size(3),
              "gather_cache: out must be a contiguous [num_slots, num_kv_heads, head_size] tensor");
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(s[t] >= 0 && s[t] < num_slots, "gather_cache: slots[", t, "] = ", s[t], " is outside the cache's ",
                num_slots, " slots");
  switch (in_tag(out)) {
    case 0: gather_dispatch<0>(cache, s, n, out, kv_format); break;
    case 1: gather_dispatch<1>(cache, s, n, out, kv_format); break;
    default: gather_dispatch<2>(cache, s, n, out, kv_format); break;
  }
}

TORCH_LIBRARY_FRAGMENT(fp8serve, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
      "int kv_format, float k_scale, float v_scale, Tensor(c!)? key_out=None, Tensor(d!)? value_out=None) -> ()");
  m.impl("reshape_and_cache", c10::DispatchKey::CPU, &reshape_and_cache);
  m.def("gather_cache(Tensor cache, Tensor slots, int kv_format, Tensor(a!) out) -> ()");
  m.impl("gather_cache", c10::DispatchKey::CPU, &gather_cache);
}
