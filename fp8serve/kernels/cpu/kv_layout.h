// Byte strides of a K or V cache as the ops walk it. Every op takes the cache
// as the view [num_blocks, block_size, num_kv_heads, head_size] (Python's
// attention/kv_cache_spec.py) over memory in one of two orders:
//
//   HND: [num_blocks, num_kv_heads, block_size, head_size] (the engine's default):
//        a kv head's rows of a block are consecutive;
//   NHD: [num_blocks, block_size, num_kv_heads, head_size]: a token's kv heads are.
//
// Row (block b, token offset o, kv head h) starts at
//   b * block_bytes + o * token_bytes + h * head_bytes
// and holds head_size contiguous elements in both.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace fp8serve_kv {

struct CacheStrides {
  int64_t block_bytes;  // one block
  int64_t token_bytes;  // from a token's row to the next token's, same kv head
  int64_t head_bytes;   // from a kv head's row to the next kv head's, same token
  int64_t row_bytes;    // one token, one kv head: head_size elements
  bool slot_contiguous;  // NHD (or one kv head): a token's rows of every kv head are one run of memory
};

// The strides of `cache`, checked to be one of the two layouts (`op` names the
// caller in the error).
inline CacheStrides cache_strides(const at::Tensor& cache, const char* op) {
  TORCH_CHECK(cache.dim() == 4, op, ": a K or V cache must be a [num_blocks, block_size, num_kv_heads, head_size] "
              "view, got ", cache.dim(), " dimensions");
  const int64_t bs = cache.size(1), nkv = cache.size(2), hs = cache.size(3);
  const int64_t s0 = cache.stride(0), s1 = cache.stride(1), s2 = cache.stride(2), s3 = cache.stride(3);
  const bool dense = s3 == 1 && s0 == bs * nkv * hs;
  const bool nhd = dense && s2 == hs && s1 == nkv * hs;
  const bool hnd = dense && s1 == hs && s2 == bs * hs;
  TORCH_CHECK(nhd || hnd, op, ": a K or V cache must be laid out as HND ([num_blocks, num_kv_heads, block_size, "
              "head_size] in memory) or NHD ([num_blocks, block_size, num_kv_heads, head_size]); got sizes ",
              cache.sizes(), " and strides ", cache.strides());
  const int64_t es = cache.element_size();
  // With one kv head (or a block of one token) both checks can hold: the stride of a
  // dimension of size 1 is never used, so take the other one's.
  const int64_t token = bs == 1 ? nkv * hs : s1, head = nkv == 1 ? hs : s2;
  return {s0 * es, token * es, head * es, hs * es, nhd || nkv == 1};
}

}  // namespace fp8serve_kv
