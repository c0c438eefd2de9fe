// Decode attention over the paged KV cache, reading K/V in their storage
// format (float32, bf16, fp16, fp8 e4m3, fp8 e5m2) and converting to float32
// in registers, fused with the FMAs that use them. One query token per sequence.
//
// FP8 is decoded through fp16 bit patterns and F16C:
//   e5m2 is the top byte of an fp16, so half = code << 8;
//   e4m3 (bias 7) placed as half = (sign << 15) | ((code & 0x7f) << 7) has the
//   right mantissa and an exponent 8 too small (bias 15), for normals and
//   subnormals alike, so value = half * 2^8. That constant is folded into the
//   per-layer scales by the caller (`kv_multiplier`), as are k_scale (into q)
//   and v_scale (into the output): no per-element scaling here. (e4m3's NaN
//   codes 0x7f/0xff decode as 480: quantize_fp8 never writes them for finite
//   inputs.) In 16-bit lanes holding code << 8, the e4m3 pattern is one
//   arithmetic shift right and one AND away.
// On AMD CPUs the AVX2 tiles decode e4m3 straight to float32 bits instead
// (e4m3_direct8: no F16C conversion) and fix the units inside the tile and
// once per item, so the caller's contract is the same. Against the F16C
// decode on the AVX2-only Zen 3 EPYC (SmolLM2 shapes, batch 1-64 x 512-2048
// tokens, hot, 10 alternating rounds): 1.03-1.12x, with unchanged formats
// at 0.96-1.17x in the same run
// (benchmarks/results/attention_direct_e4m3_2026-12-02_zen3.md).
//
// Schedule. The work is split into items (sequence, range of its context),
// each covering every kv head, so one item reads whole blocks (contiguous
// block_size * num_kv_heads * head_size elements). Within a tile it takes
// one kv head at a time: under the engine's HND cache layout (kv_layout.h)
// that head's rows of a block are consecutive, under NHD they are one row
// in num_kv_heads (FP8 with Llama-3-8B's heads ran 1.12-1.18x as fast under
// HND on 2 MiB pages, 1.2-1.4x on 4 KiB pages: kv_cache_spec.py).
// Long contexts are split when there are too few
// sequences to keep every thread busy (flash-decoding): each split keeps its
// own running max / sum / weighted V and a merge pass combines them. Threads
// pull items from an atomic counter, so uneven sequence lengths balance.
//
// Inside an item, tokens go in tiles of 16 (across block boundaries, any
// block_size) with online softmax: the tile's scores for all query heads of a
// kv head (GQA group) from one read of each K row, then one rescale of the
// running state when the max grows, then one read of each V row. Each K/V
// element is converted once and used for `group` FMAs. Scores are reduced
// eight tokens at a time (one transpose-add) instead of a horizontal sum per
// dot product. The next tile's rows are prefetched: blocks are scattered, so
// the hardware prefetchers lose the stream at every block boundary. The
// prefetches go to L1 on Intel and to L2 on AMD (prefetch_level.h).
//
// The scalar path (no AVX2/FMA/F16C at build time, head_size % 8 != 0, or
// asked for: `paged_attention_decode_scalar`, which tests use to keep it
// correct on AVX2 machines) has the same schedule and plain C++ decoding.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cpu_vendor.h"
#include "e4m3_direct.h"
#include "amx_tiles.h"
#include "fp8_bf16_lut.h"
#include "kv_layout.h"
#include "prefetch_level.h"
#include "scalar_convert.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FP8SERVE_AVX2 1
#endif

namespace {

// The prefix phase of cascade attention runs ops of prefill_attention.cpp and
// cache_ops.cpp, called through the dispatcher rather than by symbol:
// benchmarks/kernel_ab_engine.py builds this file alone (another commit's, in
// another namespace) and its ops must still find these.
at::Tensor prefill_attention_over_prefix(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor cu_seqlens,
                                         at::Tensor cu_seqlens_k, double scale, double out_scale, int64_t path,
                                         at::Tensor lse) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fp8serve::prefill_attention_over_prefix", "")
          .typed<at::Tensor(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, double, double, int64_t,
                            at::Tensor)>();
  return op.call(query, key, value, cu_seqlens, cu_seqlens_k, scale, out_scale, path, lse);
}

void gather_cache(at::Tensor cache, at::Tensor slots, int64_t kv_format, at::Tensor out) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fp8serve::gather_cache", "")
                             .typed<void(at::Tensor, at::Tensor, int64_t, at::Tensor)>();
  op.call(cache, slots, kv_format, out);
}

enum KVFormat : int64_t { kF32 = 0, kBF16 = 1, kF16 = 2, kE4M3 = 3, kE5M2 = 4 };

constexpr int64_t kTileTokens = 16;
// The bf16 dot-product tiles take four times as many: their per-tile work
// (the softmax's reductions, the query's conversion, the accumulators' loads
// and stores) was ~30% of a call at 16 (e4m3, 16 x 512 tokens, hot); 32 ran
// ~1.15-1.2x as fast as 16, 64 another 1.03-1.12x, 128 1-2% more than 64.
constexpr int64_t kBf16DotTileTokens = 64;
// A context is split only into pieces of at least this many tokens: a split
// costs one partial result (num_heads * (head_size + 2) floats) and its merge.
constexpr int64_t kMinSplitTokens = 64;
constexpr int64_t kAmxMinSplitTokens = 256;  // the AMX tiles' (see decode_impl)
// Largest GQA group handled in registers at once; bigger groups go in slices.
constexpr int kMaxGroupSlice = 8;

// The AVX2 tiles' direct e4m3 decode (e4m3_direct8): its units, and the CPUs
// that take it (AMD: denormal operands at full speed there; not measured on
// Intel).
constexpr float kDirectScoreFix = 0x1p112f;  // direct scores -> load16 units
constexpr float kDirectPScale = 0x1p56f;     // p as stored for the weighted V
constexpr float kDirectAccFix = 0x1p56f;     // weighted V -> load16 units
inline bool direct_e4m3_cpu() { return fp8serve_cpu::is_amd(); }
// Whether the AVX2 V loop of a tile of g query heads runs on 16 lanes (2g + 3
// registers) rather than 8: the direct tiles' weighted V is then deinterleaved
// (see e4m3_direct8).
constexpr bool v_loop_on_16_lanes(int64_t g) { return 2 * g + 3 <= 16; }

struct Problem {
  float* out;                // [num_seqs, num_heads, head_size]
  const float* q;            // [num_seqs, num_heads, head_size], pre-scaled
  const uint8_t* k_cache;    // [num_blocks, block_size, num_kv_heads, head_size] view, HND or NHD (kv_layout.h)
  const uint8_t* v_cache;
  const int64_t* block_tables;  // [num_seqs, max_blocks]
  const int64_t* seq_lens;      // [num_seqs]
  int64_t num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks;
  int64_t row_bytes;    // one token, one kv head
  int64_t token_bytes;  // from a token's row to the next token's (kv_layout.h)
  int64_t head_bytes;   // from a kv head's row to the next kv head's
  int64_t block_bytes;  // one block
  float out_scale;
};

// Tokens [begin, end) of sequence `seq`; `partial` >= 0 is its slot in the
// scratch buffer when the sequence is split, -1 when the item is the whole context.
struct WorkItem {
  int64_t seq, begin, end, partial;
};

// The running online-softmax state of `group` query heads.
struct HeadState {
  float* m;    // [group] running max of the scores
  float* l;    // [group] running sum of exp(score - m)
  float* acc;  // [group, head_size] running sum of exp(score - m) * v
};

// Raises head g's running max to m_new where that is higher, rescaling its
// running sum and weighted V by exp(m_old - m_new) (0 on the first tile, where
// m_old = -inf). Every tile's online softmax goes through here.
inline void raise_running_max(HeadState st, int64_t g, float m_new, int64_t head_size) {
  if (!(m_new > st.m[g])) return;
  const float alpha = std::exp(st.m[g] - m_new);
  st.l[g] *= alpha;
  if (alpha != 1.f) {
    float* acc = st.acc + g * head_size;
    for (int64_t d = 0; d < head_size; ++d) acc[d] *= alpha;
  }
  st.m[g] = m_new;
}

// Rows of the next tile for one kv head, prefetched a token at a time while
// the current tile's scores are computed: spread over the tile, the
// prefetches keep a few lines in flight all along instead of stalling the core
// in one burst while the line-fill buffers drain (see run_item).
struct NextRows {
  const uint8_t* const* k;
  const uint8_t* const* v;
  int64_t n;          // tokens to prefetch (0: none)
  int64_t head_off;   // byte offset of the kv head in a slot
  int64_t row_bytes;  // one token, one kv head
};

// ---------------------------------------------------------------- scalar path

inline float half_bits_to_float_portable(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    v = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    v = std::ldexp(static_cast<float>(man | 0x400u), static_cast<int>(exp) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits |= sign;
  std::memcpy(&v, &bits, 4);
  return v;
}

template <int64_t F>
inline float decode_scalar(const uint8_t* row, int64_t i) {
  if constexpr (F == kF32) {
    float v;
    std::memcpy(&v, row + 4 * i, 4);
    return v;
  } else if constexpr (F == kBF16) {
    uint16_t h;
    std::memcpy(&h, row + 2 * i, 2);
    const uint32_t b = static_cast<uint32_t>(h) << 16;
    float v;
    std::memcpy(&v, &b, 4);
    return v;
  } else if constexpr (F == kF16) {
    uint16_t h;
    std::memcpy(&h, row + 2 * i, 2);
    return half_bits_to_float_portable(h);
  } else if constexpr (F == kE5M2) {
    return half_bits_to_float_portable(static_cast<uint16_t>(row[i] << 8));
  } else {  // kE4M3, value * 2^-8 (see header)
    const uint16_t b = row[i];
    return half_bits_to_float_portable(static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7)));
  }
}

// One tile of n tokens for `group` query heads sharing the kv head at byte
// offset `head_off` of each slot.
template <int64_t F>
void tile_scalar(const uint8_t* const* krows, const uint8_t* const* vrows, int64_t n, int64_t head_off,
                 int64_t head_size, int64_t group, const float* q, HeadState st) {
  float s[kTileTokens];
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * head_size;
    float tile_max = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) {
      const uint8_t* row = krows[t] + head_off;
      float dot = 0.f;
      for (int64_t d = 0; d < head_size; ++d) dot += qg[d] * decode_scalar<F>(row, d);
      s[t] = dot;
      tile_max = std::max(tile_max, dot);
    }
    float* acc = st.acc + g * head_size;
    const float m_new = std::max(st.m[g], tile_max);
    raise_running_max(st, g, m_new, head_size);
    for (int64_t t = 0; t < n; ++t) {
      const float p = std::exp(s[t] - st.m[g]);
      st.l[g] += p;
      const uint8_t* row = vrows[t] + head_off;
      for (int64_t d = 0; d < head_size; ++d) acc[d] += p * decode_scalar<F>(row, d);
    }
  }
}

// ------------------------------------------------------------------ AVX2 path

#ifdef FP8SERVE_AVX2

// 16 consecutive elements of a row (starting at element i) as two float32 vectors.
template <int64_t F>
inline void load16(const uint8_t* row, int64_t i, __m256& lo, __m256& hi) {
  if constexpr (F == kF32) {
    const float* p = reinterpret_cast<const float*>(row) + i;
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
  } else if constexpr (F == kBF16) {
    const __m128i* p = reinterpret_cast<const __m128i*>(row + 2 * i);
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
    hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + 1)), 16));
  } else if constexpr (F == kF16) {
    const __m128i* p = reinterpret_cast<const __m128i*>(row + 2 * i);
    lo = _mm256_cvtph_ps(_mm_loadu_si128(p));
    hi = _mm256_cvtph_ps(_mm_loadu_si128(p + 1));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
    __m128i h0 = _mm_unpacklo_epi8(_mm_setzero_si128(), b);  // code << 8 in 16-bit lanes
    __m128i h1 = _mm_unpackhi_epi8(_mm_setzero_si128(), b);
    if constexpr (F == kE4M3) {
      const __m128i keep = _mm_set1_epi16(static_cast<short>(0xBFFF));  // drop the sign's copy in bit 14
      h0 = _mm_and_si128(_mm_srai_epi16(h0, 1), keep);
      h1 = _mm_and_si128(_mm_srai_epi16(h1, 1), keep);
    }
    lo = _mm256_cvtph_ps(h0);
    hi = _mm256_cvtph_ps(h1);
  }
}

// 8 consecutive elements (head sizes that are an odd multiple of 8).
template <int64_t F>
inline __m256 load8(const uint8_t* row, int64_t i) {
  if constexpr (F == kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else if constexpr (F == kBF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (F == kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
  } else {
    __m128i h = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
    if constexpr (F == kE4M3) h = _mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16(static_cast<short>(0xBFFF)));
    return _mm256_cvtph_ps(h);
  }
}

// exp(x) for x <= 0 (scores minus their max); relative error ~1e-7. NaN stays NaN.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);  // NaN in the second operand passes through
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // x - fx*ln2 in two parts for accuracy
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  const __m256 x2 = _mm256_mul_ps(x, x);
  y = _mm256_fmadd_ps(y, x2, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane j of the result = sum of the 8 lanes of v[j].
inline __m256 transpose_sum8(const __m256* v) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

inline void prefetch_row_pair(const NextRows& next, int64_t t, fp8serve_prefetch::Level level) {
  const char* k = reinterpret_cast<const char*>(next.k[t] + next.head_off);
  const char* v = reinterpret_cast<const char*>(next.v[t] + next.head_off);
  for (int64_t off = 0; off < next.row_bytes; off += 64) {
    fp8serve_prefetch::line(k + off, level);
    fp8serve_prefetch::line(v + off, level);
  }
}

// e4m3 through e4m3_direct.h (value * 2^-120 per code, exact; no F16C
// conversion: per 16 codes five integer instructions against load16's two
// unpacks, two shifts, two masks and two conversions), on AMD CPUs only
// (direct_e4m3_cpu). Units: scores come out 2^-112 of load16's and are
// multiplied back per 8 tokens; the weighted V is kept at 2^-56 of load16's
// units (p is stored times 2^56, so no product of a small p and a small value
// falls into the denormal range) and run_item multiplies it back once per item.
// Order: a whole 16 of a row comes deinterleaved (direct16_deinterleaved:
// lo its even elements, hi its odd ones; a tail of 8 comes in order), so
// run_item hands the tiles a query stored in that order (deinterleave16)
// and restores the order of the weighted V of the heads whose V loop runs on
// 16 lanes (v_loop_on_16_lanes) once per item. Against two direct8 per 16
// codes (Zen 3, SmolLM2's shapes, batch 1-64 x 512-2048 tokens, two runs of
// 8 and 16 alternating rounds): 1.00-1.10x hot (median 1.06x), 1.00-1.10x
// cold (1.05x), where the unchanged bf16 tiles in the same runs gave 0.99-1.04x
// hot (1.02x) and 0.93-1.07x cold (1.03x)
// (benchmarks/results/attention_direct_deinterleaved_2026-12-08_zen3.md).
inline __m256 e4m3_direct8(const uint8_t* p) { return fp8serve_e4m3::direct8(p); }

template <int64_t F, bool kDirect>
inline void load16_any(const uint8_t* row, int64_t i, __m256& lo, __m256& hi) {
  if constexpr (kDirect) {
    fp8serve_e4m3::direct16_deinterleaved(row + i, lo, hi);
  } else {
    load16<F>(row, i, lo, hi);
  }
}

template <int64_t F, bool kDirect>
inline __m256 load8_any(const uint8_t* row, int64_t i) {
  if constexpr (kDirect) return e4m3_direct8(row + i);
  else return load8<F>(row, i);
}

// One tile of n <= 16 tokens for G query heads sharing one kv head (see
// header). kDirect: e4m3 through e4m3_direct.h, q deinterleaved (see there). HS: the head size
// when known at compile time (64, 128), else 0 (head_size at run time): a
// known size unrolls the score loop over the row, so all of a token's
// decodes and FMAs are in view of the out-of-order core at once instead of
// four iterations of a loop (Zen 3, against the run-time loop, three runs of
// attention.py's 24 hot cells: e4m3 1.04-1.21x in 17 of 18 cell runs, the
// other formats 0.92-1.16x, mostly 1.0-1.1x; cold, one run: e4m3 0.94-1.11x,
// the others 0.96-1.12x; benchmarks/results/attention_head_size_unroll_*).
// Tried and dropped (standalone copy of the tile, one thread): 32- and
// 64-token tiles, one softmax reduction per 32 or 64 tokens: hot in L2
// 1.03-1.11x the run-time loop's tile but no faster than this one
// (0.96-1.01x), and 0.90-0.97x the run-time loop's tile on contexts streamed
// from memory, where the next tile's prefetch works best one block ahead.
template <int64_t F, int G, bool kDirect = false, int64_t HS = 0>
void tile_avx2(const uint8_t* const* krows, const uint8_t* const* vrows, int64_t n, int64_t head_off,
               int64_t head_size_arg, const float* q, HeadState st, NextRows next) {
  const int64_t head_size = HS != 0 ? HS : head_size_arg;
  // Two accumulator sets per head while registers allow: shorter FMA chains.
  constexpr bool kSplitAcc = G <= 4;
  alignas(32) __m256 partial[G][8];  // per-token dot-product lanes, 8 tokens at a time
  alignas(32) float s[G][kTileTokens];
  const fp8serve_prefetch::Level level = fp8serve_prefetch::level();

  // Scores: each K element converted once, used by G FMAs.
  for (int64_t t = 0; t < n; ++t) {
    if (t < next.n) prefetch_row_pair(next, t, level);
    const uint8_t* row = krows[t] + head_off;
    __m256 a[G], b[G];
    for (int g = 0; g < G; ++g) a[g] = b[g] = _mm256_setzero_ps();
    const auto step16 = [&](int64_t d) {
      __m256 x0, x1;
      load16_any<F, kDirect>(row, d, x0, x1);
      for (int g = 0; g < G; ++g) {
        const float* qg = q + g * head_size + d;
        a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg), x0, a[g]);
        if constexpr (kSplitAcc) {
          b[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8), x1, b[g]);
        } else {
          a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8), x1, a[g]);
        }
      }
    };
    int64_t d = 0;
    if constexpr (HS != 0) {
      static_assert(HS % 16 == 0, "compile-time head sizes are multiples of 16");
#pragma GCC unroll 16
      for (int64_t i = 0; i < HS; i += 16) step16(i);
      d = HS;
    } else {
      for (; d + 16 <= head_size; d += 16) step16(d);
    }
    if (d < head_size) {
      const __m256 x0 = load8_any<F, kDirect>(row, d);
      for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_size + d), x0, a[g]);
    }
    for (int g = 0; g < G; ++g) partial[g][t & 7] = kSplitAcc ? _mm256_add_ps(a[g], b[g]) : a[g];
    if ((t & 7) == 7 || t == n - 1) {
      // Lanes past t hold stale data; they are masked below.
      for (int g = 0; g < G; ++g) {
        __m256 sums = transpose_sum8(partial[g]);
        if constexpr (kDirect) sums = _mm256_mul_ps(sums, _mm256_set1_ps(kDirectScoreFix));
        _mm256_store_ps(&s[g][t & ~int64_t{7}], sums);
      }
    }
  }

  // Online softmax update; p overwrites s.
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), nv = _mm256_set1_ps(static_cast<float>(n));
  const __m256 valid0 = _mm256_cmp_ps(lane, nv, _CMP_LT_OQ);
  const __m256 valid1 = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(8.f)), nv, _CMP_LT_OQ);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < G; ++g) {
    const __m256 s0 = _mm256_blendv_ps(neg_inf, _mm256_load_ps(s[g]), valid0);
    const __m256 s1 = _mm256_blendv_ps(neg_inf, _mm256_load_ps(s[g] + 8), valid1);
    const float m_new = std::max(st.m[g], hmax(_mm256_max_ps(s0, s1)));
    raise_running_max(st, g, m_new, head_size);
    const __m256 vm = _mm256_set1_ps(st.m[g]);
    const __m256 p0 = _mm256_and_ps(exp256(_mm256_sub_ps(s0, vm)), valid0);
    const __m256 p1 = _mm256_and_ps(exp256(_mm256_sub_ps(s1, vm)), valid1);
    if constexpr (kDirect) {
      _mm256_store_ps(s[g], _mm256_mul_ps(p0, _mm256_set1_ps(kDirectPScale)));
      _mm256_store_ps(s[g] + 8, _mm256_mul_ps(p1, _mm256_set1_ps(kDirectPScale)));
    } else {
      _mm256_store_ps(s[g], p0);
      _mm256_store_ps(s[g] + 8, p1);
    }
    st.l[g] += hsum(_mm256_add_ps(p0, p1));
  }

  // Weighted V: each V element converted once, used by G FMAs; the
  // accumulators of 16 output lanes stay in registers across the tile.
  int64_t d = 0;
  if constexpr (v_loop_on_16_lanes(G)) {
    for (; d + 16 <= head_size; d += 16) {
      __m256 a0[G], a1[G];
      for (int g = 0; g < G; ++g) {
        a0[g] = _mm256_loadu_ps(st.acc + g * head_size + d);
        a1[g] = _mm256_loadu_ps(st.acc + g * head_size + d + 8);
      }
      for (int64_t t = 0; t < n; ++t) {
        __m256 x0, x1;
        load16_any<F, kDirect>(vrows[t] + head_off, d, x0, x1);
        for (int g = 0; g < G; ++g) {
          const __m256 p = _mm256_broadcast_ss(&s[g][t]);
          a0[g] = _mm256_fmadd_ps(p, x0, a0[g]);
          a1[g] = _mm256_fmadd_ps(p, x1, a1[g]);
        }
      }
      for (int g = 0; g < G; ++g) {
        _mm256_storeu_ps(st.acc + g * head_size + d, a0[g]);
        _mm256_storeu_ps(st.acc + g * head_size + d + 8, a1[g]);
      }
    }
  }
  for (; d < head_size; d += 8) {
    __m256 a0[G];
    for (int g = 0; g < G; ++g) a0[g] = _mm256_loadu_ps(st.acc + g * head_size + d);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 x0 = load8_any<F, kDirect>(vrows[t] + head_off, d);
      for (int g = 0; g < G; ++g) a0[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(&s[g][t]), x0, a0[g]);
    }
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(st.acc + g * head_size + d, a0[g]);
  }
}

#endif  // FP8SERVE_AVX2

// ---------------------------------------------------------------- AVX-512 path
//
// The same schedule with 16-lane vectors, for builds whose target has
// AVX-512F (-march=native on such a CPU); AVX2-only CPUs (the EPYC this engine
// targets first) run tile_avx2. The FP8 decode is the AVX2 one widened: 16
// codes -> 16 fp16 patterns in a ymm -> one vcvtph2ps to a zmm. A head's 16
// scores of a tile fit one vector, so the softmax takes one exp per head, and
// V accumulates up to 64 lanes per head per pass over the tile's tokens.
//
// Twice the lanes do not halve the time: a single thread runs ~5.5 G K/V
// elements/s on either path even with the data in L2 (2-vCPU Xeon). Measured
// side by side (benchmarks/results/attention_2026-11-30.md): e4m3 1.1-1.17x,
// bf16 1.04-1.13x, e5m2 and float32 1.0-1.07x over the AVX2 tiles. Removing
// parts of the tile one at a time (fp8 e4m3, 8 x 256 tokens, one thread): the
// scores take ~45% of the time, V ~30%, the softmax ~20% (before it was
// vectorized over 16 tokens). Small calls (one sequence) once ran 0.8-0.97x as
// fast as on the AVX2 tiles and kept those below 8192 context tokens; re-measured
// after the prefetch changes (stop 14: 1-24 sequences of 400-2048 tokens, e4m3
// and bf16, alternating) the AVX-512 tiles ran 1.04-1.17x in every cell, and a
// batch-16 engine decode step (FP8 KV, ~400 tokens each) 26.0-27.5 ms against
// 28.1-32.1, so every call on an AVX-512 build takes them.

#if defined(FP8SERVE_AVX2) && defined(__AVX512F__)
#define FP8SERVE_AVX512 1

// 16 consecutive elements of a row, starting at element i.
template <int64_t F>
inline __m512 load16_512(const uint8_t* row, int64_t i) {
  if constexpr (F == kF32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else if constexpr (F == kBF16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (F == kF16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * i)));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
    __m256i h;
    if constexpr (F == kE5M2) {
      h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);  // code << 8
    } else {
      // int16(int8(code)) << 7: sign in bits 15 and 14, magnitude in 13..7; clear bit 14.
      h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                           _mm256_set1_epi16(static_cast<short>(0xBFFF)));
    }
    return _mm512_cvtph_ps(h);
  }
}

// exp(x) for x <= 0, exp256's algorithm on 16 lanes. NaN stays NaN.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// Scores with q held in registers: head size 64 and up to 4 query heads per kv
// head (16 zmm for q, leaving room for the tile's K vectors), FP8 caches only.
// Measured on the Zen 4 guest (alternating builds): FP8 tiles, bound by their
// arithmetic, ran 1.05-1.23x as fast, hot and cold. Float32 and bf16 caches
// larger than L3, bound by memory, ran 0.69-0.75x (float32) and 0.85x (bf16
// 64 x 2048, cold) as fast, as if the faster demand loads starved the L2
// prefetches (not verified).
constexpr int64_t kQRegHeadSize = 64;
constexpr int kMaxQInRegisters = 4;
template <int64_t F>
constexpr bool kQInRegisters = F == kE4M3 || F == kE5M2;

inline __m256 fold_halves(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// One tile of n <= 16 tokens for G query heads sharing one kv head; head_size % 16 == 0.
template <int64_t F, int G>
void tile_avx512(const uint8_t* const* krows, const uint8_t* const* vrows, int64_t n, int64_t head_off,
                 int64_t head_size, const float* q, HeadState st, NextRows next) {
  alignas(32) __m256 partial[G][8];
  alignas(32) float s[G][kTileTokens];
  const fp8serve_prefetch::Level level = fp8serve_prefetch::level();

  if (kQInRegisters<F> && G <= kMaxQInRegisters && head_size == kQRegHeadSize) {
    // q stays in registers across the tile (G * 4 zmm): otherwise each token
    // reloads G * head_size floats, more loads than the FMAs that use them.
    __m512 qv[G][kQRegHeadSize / 16];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kQRegHeadSize / 16; ++c) qv[g][c] = _mm512_loadu_ps(q + g * head_size + 16 * c);
    for (int64_t t = 0; t < n; ++t) {
      if (t < next.n) prefetch_row_pair(next, t, level);
      const uint8_t* row = krows[t] + head_off;
      __m512 x[kQRegHeadSize / 16];
      for (int c = 0; c < kQRegHeadSize / 16; ++c) x[c] = load16_512<F>(row, 16 * c);
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], x[0]);
        for (int c = 1; c < kQRegHeadSize / 16; ++c) a = _mm512_fmadd_ps(qv[g][c], x[c], a);
        partial[g][t & 7] = fold_halves(a);
      }
      if ((t & 7) == 7 || t == n - 1) {
        for (int g = 0; g < G; ++g) _mm256_store_ps(&s[g][t & ~int64_t{7}], transpose_sum8(partial[g]));
      }
    }
  } else {
    for (int64_t t = 0; t < n; ++t) {
      if (t < next.n) prefetch_row_pair(next, t, level);
      const uint8_t* row = krows[t] + head_off;
      __m512 a[G];
      for (int g = 0; g < G; ++g) a[g] = _mm512_setzero_ps();
      for (int64_t d = 0; d < head_size; d += 16) {
        const __m512 x = load16_512<F>(row, d);
        for (int g = 0; g < G; ++g) a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * head_size + d), x, a[g]);
      }
      for (int g = 0; g < G; ++g) partial[g][t & 7] = fold_halves(a[g]);
      if ((t & 7) == 7 || t == n - 1) {
        for (int g = 0; g < G; ++g) _mm256_store_ps(&s[g][t & ~int64_t{7}], transpose_sum8(partial[g]));
      }
    }
  }

  // Online softmax, the tile's 16 scores of a head in one vector.
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < G; ++g) {
    const __m512 sg = _mm512_mask_loadu_ps(neg_inf, valid, s[g]);
    const float m_new = std::max(st.m[g], _mm512_reduce_max_ps(sg));
    raise_running_max(st, g, m_new, head_size);
    const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sg, _mm512_set1_ps(st.m[g]))));
    _mm512_storeu_ps(s[g], p);
    st.l[g] += _mm512_reduce_add_ps(p);
  }

  // Weighted V: up to 4 * 16 output lanes of every head per pass over the
  // tokens (4G accumulators in registers), so each accumulator's FMA chain is
  // interleaved with 4G - 1 others.
  constexpr int kChunks = G <= 6 ? 4 : 2;
  int64_t d = 0;
  for (; d + 16 * kChunks <= head_size; d += 16 * kChunks) {
    __m512 a[G][kChunks];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kChunks; ++c) a[g][c] = _mm512_loadu_ps(st.acc + g * head_size + d + 16 * c);
    for (int64_t t = 0; t < n; ++t) {
      const uint8_t* row = vrows[t] + head_off;
      __m512 x[kChunks];
      for (int c = 0; c < kChunks; ++c) x[c] = load16_512<F>(row, d + 16 * c);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(s[g][t]);
        for (int c = 0; c < kChunks; ++c) a[g][c] = _mm512_fmadd_ps(p, x[c], a[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(st.acc + g * head_size + d + 16 * c, a[g][c]);
  }
  for (; d < head_size; d += 16) {
    __m512 a0[G];
    for (int g = 0; g < G; ++g) a0[g] = _mm512_loadu_ps(st.acc + g * head_size + d);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 x0 = load16_512<F>(vrows[t] + head_off, d);
      for (int g = 0; g < G; ++g) a0[g] = _mm512_fmadd_ps(_mm512_set1_ps(s[g][t]), x0, a0[g]);
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(st.acc + g * head_size + d, a0[g]);
  }
}

#endif  // FP8SERVE_AVX512

// ------------------------------------------------------- bf16 dot-product path
//
// For FP8 caches and a bf16 query (a bf16 model: the query is bf16 already),
// on CPUs with AVX512-BF16 and AVX512-VBMI (Zen 4; CPUs with AMX take the
// AMX tiles below, which share this decode): the codes become bf16 instead
// of float32 and the products are vdpbf16ps pairs
// (two multiply-adds per lane, float32 sums), about half the instructions of
// the float32 tiles for the same K/V. The FP8 tiles
// above are bound by that arithmetic, not by their reads (benchmarks/results/
// attention_2026-11-30_stop20_zen4.md: ~14 G K/V elements/s on 2 threads, hot
// or cold).
//
// FP8 -> bf16 is exact (3 or 2 mantissa bits fit in 7) and keeps the scale
// convention of the tiles above (e4m3 decodes to value * 2^-8, e5m2 to the
// value); every code, subnormals included, stays a normal bf16 (vdpbf16ps
// treats bf16 denormals as 0). The decode is two byte-table lookups by the
// code's magnitude (bf16_from_codes64, fp8_bf16_lut.h). It replaced rebasing
// the exponent in 16-bit lanes plus a table for the subnormals (12
// instructions per 64 codes against 5), which ran 1.11-1.32x the float32
// tiles where this ran
// 1.38-1.50x (both with 32-token tiles), and before that a branch around
// the subnormal fix, which made uncalibrated caches (scale 1.0, many
// subnormal codes) 1.44x slower than the float32 tiles in an engine decode
// step
// (benchmarks/results/decode_attention_bf16dot_2026-12-01_zen4.md).
// The query is rounded to bf16 (round to nearest even), as are the softmax
// weights for V; the weights' sum l is taken over the rounded weights, so the
// output stays a convex combination of V rows. V is read two tokens at a
// time, their rows' bytes interleaved so each 32-bit lane holds the pair
// (v[t][d], v[t+1][d]) that the pair (p[t], p[t+1]) multiplies. The byte
// unpacks work within 128-bit lanes and permute d: the query is permuted the
// same way for K once per tile, and V's accumulators are put back in order
// once per item (unpermute_bf16_dot_acc). K is read two tokens at a time too,
// half a row of each in one vector (PairQueryOrder), so one product holds
// both tokens' partial sums and needs no fold to 256 bits before the
// transpose-add (transpose_sum_pairs): 1.03-1.08x hot, 0.95-1.11x cold
// (within noise) against one token at a time, attention.py on the Zen 4 EPYC.
#if defined(FP8SERVE_AVX512) && defined(__AVX512BF16__) && defined(FP8SERVE_FP8_BF16_LUT)
#define FP8SERVE_BF16_DOT 1

// The byte-table decode (fp8_bf16_lut.h), with this file's format numbers.
using fp8serve_fp8bf16::bf16_from_codes64;
using fp8serve_fp8bf16::ByteLut;
using fp8serve_fp8bf16::load_byte_lut;
static_assert(kE4M3 == fp8serve_fp8bf16::kE4M3 && kE5M2 == fp8serve_fp8bf16::kE5M2, "format numbers differ");

// Query lanes in the order bf16_from_codes64 leaves a K row's (the AMX
// tiles'): a vpermt2w index per output vector (`a` or `b`) of a 64-element
// chunk held as two vectors of 32; built once at compile time, not per tile.
struct QueryOrder {
  alignas(64) uint16_t idx[2][32];
  constexpr QueryOrder() : idx() {
    for (int which = 0; which < 2; ++which)
      for (int k = 0; k < 32; ++k) idx[which][k] = static_cast<uint16_t>(16 * (k / 8) + 8 * which + k % 8);
  }
};
inline constexpr QueryOrder kQueryOrder{};
inline __m512i query_order_index(int which) { return _mm512_load_si512(kQueryOrder.idx[which]); }

// The K loop reads two tokens at once: 32 codes of token t in the low half
// of a 64-byte vector, the same 32 of token t + 1 in the high half, so after
// bf16_from_codes64 (whose unpacks stay within 128-bit lanes) the low 8 float
// lanes of a product hold t's sums and the high 8 hold t + 1's. Query lanes
// in that order, per 32-element half and output vector (`a` or `b`): one
// vpermw index each, the same for both tokens.
struct PairQueryOrder {
  alignas(64) uint16_t idx[2][32];
  constexpr PairQueryOrder() : idx() {
    for (int which = 0; which < 2; ++which)
      for (int k = 0; k < 32; ++k) idx[which][k] = static_cast<uint16_t>(8 * which + 16 * ((k % 16) / 8) + k % 8);
  }
};
inline constexpr PairQueryOrder kPairQueryOrder{};

// Scores of 8 tokens from four token-pair products (z[i]: token 2i in the
// low 8 lanes, token 2i + 1 in the high 8): lane j = the sum of token j's 8
// lanes. In 512-bit registers throughout, where folding each token's product
// to 256 bits and summing 8 of those with hadds took an extract and an add
// per token and head and 9 hadd-based instructions per 8.
inline __m256 transpose_sum_pairs(const __m512* z) {
  // Within 128-bit lanes: [z0 lane0+2, z1 lane0+2, z0 lane1+3, z1 lane1+3].
  const __m512 u01 = _mm512_add_ps(_mm512_unpacklo_ps(z[0], z[1]), _mm512_unpackhi_ps(z[0], z[1]));
  const __m512 u23 = _mm512_add_ps(_mm512_unpacklo_ps(z[2], z[3]), _mm512_unpackhi_ps(z[2], z[3]));
  // 128-bit lane L: tokens (0, 2, 4, 6) for L = 0, 1 and (1, 3, 5, 7) for L = 2, 3; each
  // value the sum of four of the token's lanes (its lanes 0-3 in L = 0, 2, 4-7 in L = 1, 3).
  const __m512 v = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u01), _mm512_castps_pd(u23))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u01), _mm512_castps_pd(u23))));
  const __m512 w = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  // Lanes 0-3: tokens 0, 2, 4, 6; lanes 8-11: 1, 3, 5, 7.
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, w));
}

// V accumulators per 64-element chunk and head: four vectors, lane i of
// vector c holding d = 16 (i / 4) + 4 c + i % 4 (two interleaves: the tokens'
// bytes, then bf16_from_codes64's). run_item restores the order once per
// item (the rescale by alpha is elementwise, so the order does not matter
// until then).
inline void unpermute_bf16_dot_acc(float* acc, int64_t n) {
  float tmp[64];
  for (int64_t base = 0; base < n; base += 64) {
    for (int c = 0; c < 4; ++c)
      for (int j = 0; j < 4; ++j) std::memcpy(tmp + 16 * j + 4 * c, acc + base + 16 * c + 4 * j, 4 * sizeof(float));
    std::memcpy(acc + base, tmp, sizeof(tmp));
  }
}

// The online softmax of one tile of n <= kBf16DotTileTokens tokens, scores
// s[g][t], for the tiles whose V products take bf16 weights: raises the
// running max, adds the weights to the running sum and leaves them in pp as
// bf16 pairs (p[2j], p[2j+1]), zeros past n. The sum is over the rounded
// weights, so the output stays a convex combination of V rows.
template <int G>
inline void softmax_bf16_pairs(const float (*s)[kBf16DotTileTokens], int64_t n, HeadState st, int64_t hs,
                               uint32_t (*pp)[kBf16DotTileTokens / 2]) {
  constexpr int kVecs = kBf16DotTileTokens / 16;
  __mmask16 valid[kVecs];
  for (int i = 0; i < kVecs; ++i) {
    const int64_t left = n - 16 * i;
    valid[i] = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : static_cast<__mmask16>((1u << left) - 1u);
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < G; ++g) {
    __m512 sv[kVecs];
    __m512 mx = neg_inf;
    for (int i = 0; i < kVecs; ++i) {
      sv[i] = _mm512_mask_loadu_ps(neg_inf, valid[i], s[g] + 16 * i);
      mx = _mm512_max_ps(mx, sv[i]);
    }
    const float m_new = std::max(st.m[g], _mm512_reduce_max_ps(mx));
    raise_running_max(st, g, m_new, hs);
    const __m512 vm = _mm512_set1_ps(st.m[g]);
    __m512 rsum = _mm512_setzero_ps();
    for (int i = 0; i < kVecs; ++i) {
      const __m512 p = _mm512_maskz_mov_ps(valid[i], exp512(_mm512_sub_ps(sv[i], vm)));
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(p);  // past n: 0
      _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g] + 8 * i), b);
      rsum = _mm512_add_ps(rsum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    st.l[g] += _mm512_reduce_add_ps(rsum);
  }
}

// One tile of n <= kBf16DotTileTokens tokens for G query heads sharing one kv
// head; head_size = 64 * NC.
template <int64_t F, int G, int NC>
void tile_bf16_dot_nc(const uint8_t* const* krows, const uint8_t* const* vrows, int64_t n, int64_t head_off,
                      const float* q, HeadState st, NextRows next) {
  constexpr int64_t hs = 64 * NC;
  const ByteLut lut = load_byte_lut<F>();
  // Token-pair products awaiting their sums (transpose_sum_pairs): zeros until written.
  alignas(64) __m512 pair_partial[G][4] = {};
  alignas(64) float s[G][kBf16DotTileTokens];
  alignas(64) uint32_t pp[G][kBf16DotTileTokens / 2];  // bf16 weight pairs (p[2j], p[2j+1])
  const fp8serve_prefetch::Level level = fp8serve_prefetch::level();

  // The query in bf16 in the K loop's lane order (PairQueryOrder): [g][32-element half][a or b].
  constexpr int kHalvesK = 2 * NC;
  __m512i qv[G][kHalvesK][2];
  {
    const __m512i ia = _mm512_load_si512(kPairQueryOrder.idx[0]), ib = _mm512_load_si512(kPairQueryOrder.idx[1]);
    for (int g = 0; g < G; ++g)
      for (int h = 0; h < kHalvesK; ++h) {
        const float* qh = q + g * hs + 32 * h;
        const __m512i bits = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qh + 16), _mm512_loadu_ps(qh));
        qv[g][h][0] = _mm512_permutexvar_epi16(ia, bits);
        qv[g][h][1] = _mm512_permutexvar_epi16(ib, bits);
      }
  }

  // Scores two tokens at a time (PairQueryOrder); past n the last row again, its score unused.
  const int64_t k_pairs = (n + 1) / 2;
  for (int64_t j = 0; j < k_pairs; ++j) {
    const int64_t t = 2 * j;
    if (t < next.n) prefetch_row_pair(next, t, level);
    if (t + 1 < next.n) prefetch_row_pair(next, t + 1, level);
    const uint8_t* r0 = krows[t] + head_off;
    const uint8_t* r1 = t + 1 < n ? krows[t + 1] + head_off : r0;
    __m512i ka[kHalvesK], kb[kHalvesK];
    for (int h = 0; h < kHalvesK; ++h) {
      const __m512i codes = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 32 * h))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 32 * h)), 1);
      bf16_from_codes64(codes, lut, ka[h], kb[h]);
    }
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qv[g][0][0], (__m512bh)ka[0]);
      a = _mm512_dpbf16_ps(a, (__m512bh)qv[g][0][1], (__m512bh)kb[0]);
      for (int h = 1; h < kHalvesK; ++h) {
        a = _mm512_dpbf16_ps(a, (__m512bh)qv[g][h][0], (__m512bh)ka[h]);
        a = _mm512_dpbf16_ps(a, (__m512bh)qv[g][h][1], (__m512bh)kb[h]);
      }
      pair_partial[g][j & 3] = a;
    }
    if ((j & 3) == 3 || j == k_pairs - 1) {
      for (int g = 0; g < G; ++g) _mm256_store_ps(&s[g][8 * (j >> 2)], transpose_sum_pairs(pair_partial[g]));
    }
  }

  softmax_bf16_pairs<G>(s, n, st, hs, pp);

  // Weighted V per 64-element chunk: the rows of tokens 2j and 2j+1
  // interleaved byte by byte, so after bf16_from_codes64 each 32-bit lane
  // holds the pair (v[2j][d], v[2j+1][d]) for one d; four accumulators per
  // head (unpermute_bf16_dot_acc's order). Large groups take the chunk's two
  // halves in separate passes, to keep the accumulators in registers.
  constexpr int kHalves = G <= 5 ? 2 : 1;  // halves per pass
  const int64_t pairs = (n + 1) / 2;
  for (int c = 0; c < NC; ++c) {
    for (int h0 = 0; h0 < 2; h0 += kHalves) {
      __m512 acc[G][kHalves][2];
      for (int g = 0; g < G; ++g)
        for (int h = 0; h < kHalves; ++h) {
          const float* a = st.acc + g * hs + 64 * c + 32 * (h0 + h);
          acc[g][h][0] = _mm512_loadu_ps(a);
          acc[g][h][1] = _mm512_loadu_ps(a + 16);
        }
      for (int64_t j = 0; j < pairs; ++j) {
        const uint8_t* r0 = vrows[2 * j] + head_off + 64 * c;
        const uint8_t* r1 = 2 * j + 1 < n ? vrows[2 * j + 1] + head_off + 64 * c : r0;  // its weight is 0
        const __m512i x0 = _mm512_loadu_si512(r0), x1 = _mm512_loadu_si512(r1);
        __m512i v[kHalves][2];
        for (int h = 0; h < kHalves; ++h) {
          const __m512i x = h0 + h == 0 ? _mm512_unpacklo_epi8(x0, x1) : _mm512_unpackhi_epi8(x0, x1);
          bf16_from_codes64(x, lut, v[h][0], v[h][1]);
        }
        for (int g = 0; g < G; ++g) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[g][j]));
          for (int h = 0; h < kHalves; ++h) {
            acc[g][h][0] = _mm512_dpbf16_ps(acc[g][h][0], (__m512bh)v[h][0], w);
            acc[g][h][1] = _mm512_dpbf16_ps(acc[g][h][1], (__m512bh)v[h][1], w);
          }
        }
      }
      for (int g = 0; g < G; ++g)
        for (int h = 0; h < kHalves; ++h) {
          float* a = st.acc + g * hs + 64 * c + 32 * (h0 + h);
          _mm512_storeu_ps(a, acc[g][h][0]);
          _mm512_storeu_ps(a + 16, acc[g][h][1]);
        }
    }
  }
}

// A tile for head size 64 or 128 (TileTable::pick checks) from its two forms
// with the head size fixed (64-element chunks: 1 or 2).
using ChunkTileFn = void (*)(const uint8_t* const*, const uint8_t* const*, int64_t, int64_t, const float*, HeadState,
                             NextRows);
template <ChunkTileFn Tile64, ChunkTileFn Tile128>
void tile_by_head_size(const uint8_t* const* krows, const uint8_t* const* vrows, int64_t n, int64_t head_off,
                       int64_t head_size, const float* q, HeadState st, NextRows next) {
  (head_size == 64 ? Tile64 : Tile128)(krows, vrows, n, head_off, q, st, next);
}

template <int64_t F, int G>
constexpr auto tile_bf16_dot = tile_by_head_size<tile_bf16_dot_nc<F, G, 1>, tile_bf16_dot_nc<F, G, 2>>;

#endif  // FP8SERVE_BF16_DOT

// ----------------------------------------------------------------- AMX path
//
// FP8 caches with a bf16 query on CPUs with AMX (Sapphire Rapids and later):
// the bf16 dot-product tiles' decode (the same byte tables, the same lane
// order, the same units and roundings), with the products on AMX tiles
// instead of vdpbf16ps. Why: on the 2-vCPU Xeon with AMX those tiles read
// FP8 at 13.5-15 GB/s against the bf16 cache's 26-28 (the same time per
// token), bound by their instructions: three scores' horizontal sums and a
// weight broadcast per token and head, besides the decode.
//
// Per tile of kBf16DotTileTokens tokens and one kv head:
//   S = K Q^T per 16 tokens: K's decoded rows are the A operand as they are
//     (a row per token, 32 bf16 of one half of a 64-element chunk), Q^T the B
//     operand (head-element pairs down, the group's heads across), built once
//     per tile; tile rows come out a token each, a column per head, and
//     store_score_columns turns the columns into each head's scores;
//   the online softmax as in tile_bf16_dot_nc (p rounded to bf16, pairs);
//   O += P V per 64-element chunk: P (a row per head, token pairs across) is
//     the A operand, V's rows of two tokens interleaved byte by byte and
//     decoded (tile_bf16_dot_nc's V pairs) the B operand, one B tile per
//     16 of the chunk's elements; the accumulators are the heads' running
//     sums in HeadState (tile loads and stores; rows are heads), in
//     unpermute_bf16_dot_acc's order.
// Tile registers (configure_amx_decode_tiles): 0 scores, 1 K, 2 Q^T, 3 and 6
// P (first and second 32 tokens), 4 and 5 accumulators, 7 V.
//
// Measured on that Xeon (SmolLM2's 9 heads over 3 kv heads, head size 64,
// 2 threads; benchmarks/results/attention_amx_decode_2026-12-06_xeon_amx.md):
// 1.28-1.36x the bf16 dot-product tiles hot and 1.17-1.31x cold at 16-64
// sequences of 512-2048 tokens, FP8 at 0.65-0.78x the bf16 cache's time hot;
// one sequence of 512 tokens ~1.0x (the call's fixed costs). Inside engine
// decode steps, where K/V come from memory at ~14 GB/s, much less: 1.028x a
// step at 16 sequences of ~410 tokens (kernel_ab_engine.py). Removing one
// part at a time (64 x 512, hot): the score products, the gathers that were
// store_score_columns' first form, the K decode, the V decode, the P V
// products and the softmax each took 8-16% of the call, none dominant; the
// loop with all of them removed (prefetches, Q^T, bookkeeping) still took
// 48%, at ~33 GB/s of prefetched K/V. Moving the next tile's prefetches (V
// rows during the V products, or to L2) changed nothing beyond noise. Tried and dropped: all 64 tokens' K decoded before their score
// products, two score tiles and two K tiles in flight (0.82-1.10x of this
// form: the tile unit's latency is not what bounds it).
#if defined(FP8SERVE_BF16_DOT) && defined(FP8SERVE_AMX)
#define FP8SERVE_AMX_DECODE 1

static_assert(kBf16DotTileTokens == 64, "the AMX tiles take 64 tokens: four score tiles, two P tiles");

// Shapes for a slice of g query heads; once per thread before a slice of a
// new size (run_item), since other AMX kernels leave their own configuration.
inline void configure_amx_decode_tiles(int64_t g) {
  fp8serve_amx::TileConfig c;
  const uint8_t rows16 = 16, rows_g = static_cast<uint8_t>(g);
  const uint16_t full = 64, heads = static_cast<uint16_t>(4 * g);
  c.rows[0] = rows16, c.colsb[0] = heads;  // S: 16 tokens x g heads, float32
  c.rows[1] = rows16, c.colsb[1] = full;   // K: 16 tokens x 32 bf16
  c.rows[2] = rows16, c.colsb[2] = heads;  // Q^T: 16 element pairs x g heads
  c.rows[3] = rows_g, c.colsb[3] = full;   // P: g heads x 16 token pairs
  c.rows[6] = rows_g, c.colsb[6] = full;
  c.rows[4] = rows_g, c.colsb[4] = full;   // O: g heads x 16 elements, float32
  c.rows[5] = rows_g, c.colsb[5] = full;
  c.rows[7] = rows16, c.colsb[7] = full;   // V: 16 token pairs x 16 elements
  asm volatile("" : : "r"(&c) : "memory");  // see fp8serve_amx::configure_16x64
  _tile_loadconfig(&c);
}

// Stores tile 0 (16 tokens' scores, a row per token and a column per head)
// and copies head g's column into s[g][t0, t0 + 16). Up to 4 heads the rows
// are stored packed (4 G bytes each, 16 G floats in G vectors) and a column
// is one or two two-source permutes: the gather (one per head, rows 64 bytes
// apart) took ~12% of a call at 64 x 512 tokens with 3 heads.
template <int G>
inline void store_score_columns(float* sbuf, float (*s)[kBf16DotTileTokens], int64_t t0) {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  if constexpr (G <= 4) {
    _tile_stored(0, sbuf, 4 * G);
    __m512 z[4];
    for (int v = 0; v < 4; ++v) z[v] = _mm512_load_ps(sbuf + 16 * std::min(v, G - 1));
    for (int g = 0; g < G; ++g) {
      // Element g + G r of the packed rows; permutes read the index's low 5 bits.
      const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(g), _mm512_mullo_epi32(iota, _mm512_set1_epi32(G)));
      __m512 col = _mm512_permutex2var_ps(z[0], idx, z[1]);
      if constexpr (G > 2) {
        const __mmask16 upper = _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(32));
        col = _mm512_mask_blend_ps(upper, col, _mm512_permutex2var_ps(z[2], idx, z[3]));
      }
      _mm512_store_ps(&s[g][t0], col);
    }
  } else {
    _tile_stored(0, sbuf, 64);
    const __m512i column = _mm512_mullo_epi32(iota, _mm512_set1_epi32(16));
    for (int g = 0; g < G; ++g) _mm512_store_ps(&s[g][t0], _mm512_i32gather_ps(column, sbuf + g, 4));
  }
}

// One tile of n <= kBf16DotTileTokens tokens for G query heads sharing one kv
// head; head_size = 64 * NC.
template <int64_t F, int G, int NC>
void tile_amx_nc(const uint8_t* const* krows, const uint8_t* const* vrows, int64_t n, int64_t head_off,
                 const float* q, HeadState st, NextRows next) {
  constexpr int64_t hs = 64 * NC;
  constexpr int64_t kPairs = kBf16DotTileTokens / 2;
  const ByteLut lut = load_byte_lut<F>();
  const fp8serve_prefetch::Level level = fp8serve_prefetch::level();
  alignas(64) uint16_t kbuf[NC][2][16][32];    // 16 tokens' K, [chunk][a or b][token][element]
  alignas(64) uint32_t qt[NC][2][16][16];      // Q^T: [chunk][a or b][element pair][head]
  alignas(64) float sbuf[16 * 16];             // one S tile: [token][head]
  alignas(64) float s[G][kBf16DotTileTokens];  // scores
  alignas(64) uint32_t pp[G][kPairs];          // bf16 weight pairs (p[2j], p[2j+1])
  alignas(64) uint32_t vbuf[4][kPairs][16];    // V pairs of one chunk: [16 elements][pair][lane]

  // Q^T in bf16, in K's lane order (tile_bf16_dot_nc's query, transposed).
  {
    const __m512i ia = query_order_index(0), ib = query_order_index(1);
    alignas(64) uint32_t qg[2][16];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) {
        const float* qc = q + g * hs + 64 * c;
        const __m512i q0 = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qc + 16), _mm512_loadu_ps(qc));
        const __m512i q1 = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qc + 48), _mm512_loadu_ps(qc + 32));
        _mm512_store_si512(qg[0], _mm512_permutex2var_epi16(q0, ia, q1));
        _mm512_store_si512(qg[1], _mm512_permutex2var_epi16(q0, ib, q1));
        for (int h = 0; h < 2; ++h)
          for (int k = 0; k < 16; ++k) qt[c][h][k][g] = qg[h][k];
      }
  }

  // Scores, 16 tokens per S tile.
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - t0);
    for (int64_t r = 0; r < m; ++r) {
      const int64_t t = t0 + r;
      if (t < next.n) prefetch_row_pair(next, t, level);
      const uint8_t* row = krows[t] + head_off;
      for (int c = 0; c < NC; ++c) {
        __m512i ka, kb;
        bf16_from_codes64(_mm512_loadu_si512(row + 64 * c), lut, ka, kb);
        _mm512_store_si512(kbuf[c][0][r], ka);
        _mm512_store_si512(kbuf[c][1][r], kb);
      }
    }
    // Rows past n: zeros (finite), their scores are masked below.
    for (int64_t r = m; r < 16; ++r)
      for (int c = 0; c < NC; ++c) {
        _mm512_store_si512(kbuf[c][0][r], _mm512_setzero_si512());
        _mm512_store_si512(kbuf[c][1][r], _mm512_setzero_si512());
      }
    _tile_zero(0);
    for (int c = 0; c < NC; ++c)
      for (int h = 0; h < 2; ++h) {
        _tile_loadd(1, kbuf[c][h], 64);
        _tile_loadd(2, qt[c][h], 64);
        _tile_dpbf16ps(0, 1, 2);
      }
    store_score_columns<G>(sbuf, s, t0);
  }

  softmax_bf16_pairs<G>(s, n, st, hs, pp);

  // P V: the pairs of tokens past n (weights 0) must still be finite.
  const int64_t pairs = (n + 1) / 2;
  const bool two = pairs > 16;  // a second 16-pair step
  const int64_t filled = two ? kPairs : 16;
  _tile_loadd(3, pp[0], sizeof(pp[0]));
  if (two) _tile_loadd(6, pp[0] + 16, sizeof(pp[0]));
  for (int c = 0; c < NC; ++c) {
    for (int64_t j = 0; j < pairs; ++j) {
      const uint8_t* r0 = vrows[2 * j] + head_off + 64 * c;
      const uint8_t* r1 = 2 * j + 1 < n ? vrows[2 * j + 1] + head_off + 64 * c : r0;  // its weight is 0
      const __m512i x0 = _mm512_loadu_si512(r0), x1 = _mm512_loadu_si512(r1);
      __m512i v0, v1, v2, v3;
      bf16_from_codes64(_mm512_unpacklo_epi8(x0, x1), lut, v0, v1);
      bf16_from_codes64(_mm512_unpackhi_epi8(x0, x1), lut, v2, v3);
      _mm512_store_si512(vbuf[0][j], v0);
      _mm512_store_si512(vbuf[1][j], v1);
      _mm512_store_si512(vbuf[2][j], v2);
      _mm512_store_si512(vbuf[3][j], v3);
    }
    for (int64_t j = pairs; j < filled; ++j)
      for (int e = 0; e < 4; ++e) _mm512_store_si512(vbuf[e][j], _mm512_setzero_si512());
    // Four accumulators of 16 elements, two in flight at a time.
    float* a = st.acc + 64 * c;
    constexpr int64_t ld = hs * sizeof(float);
    for (int e = 0; e < 4; e += 2) {
      _tile_loadd(4, a + 16 * e, ld);
      _tile_loadd(5, a + 16 * (e + 1), ld);
      _tile_loadd(7, vbuf[e][0], 64);
      _tile_dpbf16ps(4, 3, 7);
      _tile_loadd(7, vbuf[e + 1][0], 64);
      _tile_dpbf16ps(5, 3, 7);
      if (two) {
        _tile_loadd(7, vbuf[e][16], 64);
        _tile_dpbf16ps(4, 6, 7);
        _tile_loadd(7, vbuf[e + 1][16], 64);
        _tile_dpbf16ps(5, 6, 7);
      }
      _tile_stored(4, a + 16 * e, ld);
      _tile_stored(5, a + 16 * (e + 1), ld);
    }
  }
}

template <int64_t F, int G>
constexpr auto tile_amx = tile_by_head_size<tile_amx_nc<F, G, 1>, tile_amx_nc<F, G, 2>>;

#endif  // FP8SERVE_AMX_DECODE

// ------------------------------------------------------------------- schedule

using TileFn = void (*)(const uint8_t* const*, const uint8_t* const*, int64_t, int64_t, int64_t, const float*,
                        HeadState, NextRows);

// Which tiles run: the portable scalar code, the AVX2 tiles, the AVX-512
// tiles (head_size % 16 == 0; tests), the best for the call (AVX-512 where
// built and the call is large enough, else AVX2), the bf16 dot-product
// tiles where they apply and "best" elsewhere, or the AMX tiles where they
// apply and the bf16 dot-product path elsewhere (bf16 queries).
enum Path : int { kScalarPath = 0, kAvx2Path = 1, kBestPath = 2, kAvx512Path = 3, kBf16DotPath = 4, kAmxPath = 5 };

inline bool bf16_dot_head_size(int64_t head_size) { return head_size == 64 || head_size == 128; }

// Head sizes the AVX2 tiles know at compile time (see tile_avx2); class 0 is
// any other size, read at run time.
inline int avx2_head_size_class(int64_t head_size) { return head_size == 64 ? 1 : head_size == 128 ? 2 : 0; }

#ifdef FP8SERVE_AVX2
template <int64_t F, bool kDirect, int64_t HS, int... G>
void fill_avx2_tiles(TileFn* row, std::integer_sequence<int, G...>) {
  ((row[G] = tile_avx2<F, G, kDirect, HS>), ...);
}

template <int64_t F, bool kDirect>
void fill_avx2_classes(TileFn (*rows)[kMaxGroupSlice + 1]) {
  using Groups = std::integer_sequence<int, 1, 2, 3, 4, 5, 6, 7, 8>;
  static_assert(kMaxGroupSlice == 8, "Groups lists 1..kMaxGroupSlice");
  fill_avx2_tiles<F, kDirect, 0>(rows[0], Groups{});
  fill_avx2_tiles<F, kDirect, 64>(rows[1], Groups{});
  fill_avx2_tiles<F, kDirect, 128>(rows[2], Groups{});
}
#endif

template <int64_t F>
struct TileTable {
  // [head-size class][g]: a slice of g query heads (avx2_head_size_class).
  TileFn avx2[3][kMaxGroupSlice + 1] = {};
  TileFn avx2_direct[3][kMaxGroupSlice + 1] = {};  // same, e4m3 through e4m3_direct8 (AMD)
  TileFn avx512[kMaxGroupSlice + 1] = {};  // [g], head_size % 16 == 0 only
  TileFn bf16dot[kMaxGroupSlice + 1] = {};  // same, FP8 formats and bf16_dot_head_size only
  TileFn amx[kMaxGroupSlice + 1] = {};  // same, where the process may use AMX tiles
  TileTable() {
#ifdef FP8SERVE_AVX2
    fill_avx2_classes<F, false>(avx2);
    if constexpr (F == kE4M3) fill_avx2_classes<F, true>(avx2_direct);
#endif
#ifdef FP8SERVE_AVX512
    avx512[1] = tile_avx512<F, 1>;
    avx512[2] = tile_avx512<F, 2>;
    avx512[3] = tile_avx512<F, 3>;
    avx512[4] = tile_avx512<F, 4>;
    avx512[5] = tile_avx512<F, 5>;
    avx512[6] = tile_avx512<F, 6>;
    avx512[7] = tile_avx512<F, 7>;
    avx512[8] = tile_avx512<F, 8>;
#endif
#ifdef FP8SERVE_BF16_DOT
    if constexpr (F == kE4M3 || F == kE5M2) {
      bf16dot[1] = tile_bf16_dot<F, 1>;
      bf16dot[2] = tile_bf16_dot<F, 2>;
      bf16dot[3] = tile_bf16_dot<F, 3>;
      bf16dot[4] = tile_bf16_dot<F, 4>;
      bf16dot[5] = tile_bf16_dot<F, 5>;
      bf16dot[6] = tile_bf16_dot<F, 6>;
      bf16dot[7] = tile_bf16_dot<F, 7>;
      bf16dot[8] = tile_bf16_dot<F, 8>;
    }
#endif
#ifdef FP8SERVE_AMX_DECODE
    if constexpr (F == kE4M3 || F == kE5M2) {
      if (fp8serve_amx::permitted()) {
        amx[1] = tile_amx<F, 1>;
        amx[2] = tile_amx<F, 2>;
        amx[3] = tile_amx<F, 3>;
        amx[4] = tile_amx<F, 4>;
        amx[5] = tile_amx<F, 5>;
        amx[6] = tile_amx<F, 6>;
        amx[7] = tile_amx<F, 7>;
        amx[8] = tile_amx<F, 8>;
      }
    }
#endif
  }
  // nullptr: use the scalar tile. direct_ok: the AVX2 e4m3 tiles may decode
  // through e4m3_direct8 (direct_e4m3_cpu() and this thread keeps denormals).
  const TileFn* pick(int path, int64_t head_size, bool direct_ok) const {
    if (path == kScalarPath || avx2[0][1] == nullptr || head_size % 8 != 0) return nullptr;
    // The AMX or bf16 path where it applies; other formats and head sizes take "best".
    const bool bf16_path = path == kBf16DotPath || path == kAmxPath;
    if (path == kAmxPath && amx[1] != nullptr && bf16_dot_head_size(head_size)) return amx;
    if (bf16_path && bf16dot[1] != nullptr && bf16_dot_head_size(head_size)) return bf16dot;
    const bool wants_avx512 = path == kBestPath || path == kAvx512Path || bf16_path;
    if (wants_avx512 && avx512[1] != nullptr && head_size % 16 == 0) return avx512;
    const int c = avx2_head_size_class(head_size);
    return direct_ok && avx2_direct[c][1] != nullptr ? avx2_direct[c] : avx2[c];
  }
};

inline void prefetch_rows(const uint8_t* const* rows, int64_t n, int64_t head_off, int64_t row_bytes,
                          fp8serve_prefetch::Level level) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t off = 0; off < row_bytes; off += 64) fp8serve_prefetch::line(rows[t] + head_off + off, level);
  }
}

// The direct e4m3 tiles' weighted V in order and in load16's units: the heads
// of slices (run_item's, of at most kMaxGroupSlice) whose V loop ran on 16
// lanes hold each whole 16 deinterleaved.
inline void restore_direct_acc(float* acc, int64_t num_heads, int64_t group, int64_t hs) {
  float tmp[16];
  for (int64_t h = 0; h < num_heads; ++h) {
    float* a = acc + h * hs;
    const int64_t g0 = h % group / kMaxGroupSlice * kMaxGroupSlice;
    int64_t c = 0;
    if (v_loop_on_16_lanes(std::min<int64_t>(kMaxGroupSlice, group - g0))) {
      for (; c + 16 <= hs; c += 16) {
        for (int j = 0; j < 8; ++j) {
          tmp[2 * j] = a[c + j];
          tmp[2 * j + 1] = a[c + 8 + j];
        }
        for (int j = 0; j < 16; ++j) a[c + j] = tmp[j] * kDirectAccFix;
      }
    }
    for (; c < hs; ++c) a[c] *= kDirectAccFix;
  }
}

// Slot addresses of tokens [t, t + n) of one sequence.
inline void tile_rows(const Problem& p, const int64_t* bt, int64_t t, int64_t n, const uint8_t** krows,
                      const uint8_t** vrows) {
  int64_t blk = t / p.block_size, off = t % p.block_size;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = bt[blk] * p.block_bytes + off * p.token_bytes;
    krows[i] = p.k_cache + pos;
    vrows[i] = p.v_cache + pos;
    if (++off == p.block_size) off = 0, ++blk;
  }
}

// Attends tokens [item.begin, item.end) of one sequence for every head,
// leaving the unnormalized state in m, l, acc ([num_heads], [num_heads],
// [num_heads, head_size]).
// `after()`, called once as the last tile begins, gives the item this worker
// runs next (none: nullptr), whose first tile the last tile prefetches as it
// would the item's own next tile. Called that late because it may claim
// work: a claim when the item starts would take a piece from a thread that
// has not started yet (batch 1: both pieces on one thread, 0.6-0.8x). Same
// bits as without it (240 random calls); Zen 4, attention.py against no
// prefetch: 0.98-1.08x cold over FP8 caches under bf16 compute, 0.97-1.04x
// the other paths; engine decode steps of 16 x 512 tokens (FP8 cache,
// kernel_ab_engine.py) 1.049x, 5 of 8 rounds faster.
template <int64_t F, class After>
void run_item(const Problem& p, const WorkItem& item, int path, float* m, float* l, float* acc,
              const After& after) {
  static const TileTable<F> table;
#ifdef FP8SERVE_AVX2
  // MXCSR is per thread: DAZ or FTZ would read subnormal codes as zero.
  const bool direct_ok = direct_e4m3_cpu() && fp8serve_e4m3::denormals_kept();
#else
  const bool direct_ok = false;
#endif
  const TileFn* tiles = table.pick(path, p.head_size, direct_ok);
  const bool vector_path = tiles != nullptr;
  const int64_t group = p.num_heads / p.num_kv_heads, hs = p.head_size;
  const int64_t* bt = p.block_tables + item.seq * p.max_blocks;
  const float* q = p.q + item.seq * p.num_heads * hs;
  const bool direct = vector_path && tiles == table.avx2_direct[avx2_head_size_class(hs)];
  if (direct) {
    thread_local std::vector<float> q_direct;
    q_direct.resize(p.num_heads * hs);
    for (int64_t h = 0; h < p.num_heads; ++h)
      fp8serve_e4m3::deinterleave16(q + h * hs, hs, 1.f, q_direct.data() + h * hs);
    q = q_direct.data();
  }
  std::fill(m, m + p.num_heads, -std::numeric_limits<float>::infinity());
  std::fill(l, l + p.num_heads, 0.f);
  std::fill(acc, acc + p.num_heads * hs, 0.f);

  int64_t tile_tokens = kTileTokens;
#ifdef FP8SERVE_AMX_DECODE
  // The AMX tiles' configuration is for slices of this many heads (0: none yet).
  int64_t amx_rows = 0;
#endif
#ifdef FP8SERVE_BF16_DOT
  const bool bf16_pairs = vector_path && (tiles == table.bf16dot || tiles == table.amx);
  if (bf16_pairs) tile_tokens = kBf16DotTileTokens;
#endif
  const uint8_t *krows[2][kBf16DotTileTokens], *vrows[2][kBf16DotTileTokens];
  int cur = 0;
  int64_t n = std::min(tile_tokens, item.end - item.begin);
  tile_rows(p, bt, item.begin, n, krows[cur], vrows[cur]);
  // Nothing prefetched the item's first tile: ask for all of it before its
  // first loads (every kv head, in the order the heads are read).
  const fp8serve_prefetch::Level level = fp8serve_prefetch::level();
  if (vector_path) {
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      prefetch_rows(krows[cur], n, h * p.head_bytes, p.row_bytes, level);
      prefetch_rows(vrows[cur], n, h * p.head_bytes, p.row_bytes, level);
    }
  }
  for (int64_t t = item.begin; t < item.end; t += tile_tokens) {
    const int64_t next_t = t + tile_tokens;
    const int64_t next_n = std::min(tile_tokens, item.end - next_t);
    // Rows the tiles prefetch: the next tile's, or on the last tile the next item's first.
    int64_t prefetch_n = next_n;
    if (next_n > 0) {
      tile_rows(p, bt, next_t, next_n, krows[cur ^ 1], vrows[cur ^ 1]);
    } else if (const WorkItem* following = after(); following != nullptr) {
      prefetch_n = std::min(tile_tokens, following->end - following->begin);
      tile_rows(p, p.block_tables + following->seq * p.max_blocks, following->begin, prefetch_n, krows[cur ^ 1],
                vrows[cur ^ 1]);
    }
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      const int64_t head_off = h * p.head_bytes;
      for (int64_t g0 = 0; g0 < group; g0 += kMaxGroupSlice) {
        const int64_t gs = std::min<int64_t>(kMaxGroupSlice, group - g0);
        const int64_t qh = h * group + g0;  // first query head of the slice
        const HeadState st{m + qh, l + qh, acc + qh * hs};
        if (vector_path) {
          // The first slice of the head prefetches the next tile's rows of it.
          const NextRows next{krows[cur ^ 1], vrows[cur ^ 1], g0 == 0 ? prefetch_n : 0, head_off, p.row_bytes};
#ifdef FP8SERVE_AMX_DECODE
          if (tiles == table.amx && gs != amx_rows) configure_amx_decode_tiles(gs), amx_rows = gs;
#endif
          tiles[gs](krows[cur], vrows[cur], n, head_off, hs, q + qh * hs, st, next);
        } else {
          tile_scalar<F>(krows[cur], vrows[cur], n, head_off, hs, gs, q + qh * hs, st);
        }
      }
    }
    cur ^= 1;
    n = next_n;
  }
#ifdef FP8SERVE_AMX_DECODE
  if (amx_rows != 0) _tile_release();
#endif
#ifdef FP8SERVE_BF16_DOT
  if (bf16_pairs) unpermute_bf16_dot_acc(acc, p.num_heads * hs);
#endif
  if (direct) restore_direct_acc(acc, p.num_heads, group, hs);
}

// Cascade attention's results over shared prefixes (see shared_prefix_groups):
// sequence b with row[b] >= 0 has had its tokens [0, start[b]) attended
// already; out (in the tiles' units, unnormalized with a running sum of 1)
// and lse (its running max) join its other pieces in the merge below.
struct PrefixResults {
  const int64_t* row;    // [num_seqs]: the sequence's row of out / lse, or -1
  const int64_t* start;  // [num_seqs]
  const float* out;      // [rows, num_heads, head_size]
  const float* lse;      // [rows, num_heads]
};

inline bool bf16_dot_tiles(int path, int64_t kv_format, int64_t head_size);

template <int64_t F>
void decode_impl(const Problem& p, int path, const PrefixResults* prefix) {
  const int64_t hs = p.head_size, nh = p.num_heads;
  const int64_t num_threads = at::get_num_threads();
  const auto begin_of = [&](int64_t b) -> int64_t {
    return prefix != nullptr && prefix->row[b] >= 0 ? prefix->start[b] : 0;
  };

  // Split contexts only when there are too few sequences for the threads.
  int64_t total_tokens = 0, max_len = 0;
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t n = p.seq_lens[b] - begin_of(b);
    total_tokens += n, max_len = std::max(max_len, n);
  }
  // Four items per thread. Two were 5-11% faster on hot, direct calls
  // (stop 14), but whole engine decode steps (cold K/V, alternating builds,
  // six pairs) ran slower with them: batch 1 median 16.0 vs 15.0 ms, batch 4
  // 22.1 vs 20.7 ms.
  const int64_t target_items = 4 * num_threads;
  int64_t split_tokens = max_len;
  const bool split = p.num_seqs < target_items && num_threads > 1;
  // Whether run_item takes the AMX tiles (else, for a bf16 path on an FP8
  // cache, the bf16 dot-product tiles).
#ifdef FP8SERVE_AMX_DECODE
  const bool amx_tiles =
      path == kAmxPath && (F == kE4M3 || F == kE5M2) && bf16_dot_head_size(hs) && fp8serve_amx::permitted();
#else
  const bool amx_tiles = false;
#endif
  if (split) {
    // The AMX tiles' fixed costs per item (tile configuration, Q^T per tile,
    // the first tile's prefetch burst, the partial and its merge) outweigh
    // 64-token pieces: one sequence of 512 tokens took the same ~20 us on one
    // thread as on two in pieces of 64.
    const int64_t min_split = amx_tiles ? kAmxMinSplitTokens : kMinSplitTokens;
    split_tokens = std::max(min_split, (total_tokens + target_items - 1) / target_items);
    split_tokens = (split_tokens + kTileTokens - 1) / kTileTokens * kTileTokens;
  }
  // The bf16 dot-product tiles split the batch's tokens, taken in order, into
  // one piece per thread instead (cut inside a sequence where a piece ends):
  // their 64-token tiles made 4 items per thread mostly one- to four-tile
  // items, each opening with a tile nothing prefetched and ending with a
  // partial to merge. On the Zen 4 EPYC (2 threads, SmolLM2's heads, e4m3,
  // attention.py against the previous build): batch 1-4 x 512-2048 1.01-1.14x
  // hot, 1.01-1.08x cold; in engine decode steps (kernel_ab_engine.py, batch 1
  // x 1024, batch 4 x 512) 1.003x and 1.03x, within the rounds' noise.
  const bool thread_pieces = split && !amx_tiles && bf16_dot_tiles(path, F, hs);
  const int64_t piece_tokens =
      thread_pieces ? std::max(kMinSplitTokens, (total_tokens + num_threads - 1) / num_threads) : 0;
  std::vector<WorkItem> items;
  items.reserve(p.num_seqs + total_tokens / std::max<int64_t>(split_tokens, 1) + 1);
  // Items [piece_start[k], piece_start[k + 1]) are piece k, which one worker
  // takes whole; without thread_pieces every item is a piece.
  std::vector<int64_t> piece_start{0};
  std::vector<int64_t> first_partial(p.num_seqs + 1, 0);  // seq b's partials: [first[b], first[b+1])
  int64_t num_partials = 0;
  std::vector<int64_t> prefix_partial;  // (seq, its slot) of each prefix result
  int64_t pos = 0;                      // thread_pieces: the batch's tokens before this sequence's
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t len = p.seq_lens[b], begin = begin_of(b);
    first_partial[b] = num_partials;
    if (begin > 0) {
      // A shared prefix's result is one more piece of the sequence.
      prefix_partial.push_back(b);
      prefix_partial.push_back(num_partials++);
    }
    if (thread_pieces) {
      const int64_t n = len - begin;
      const bool whole = begin == 0 && (n == 0 || pos / piece_tokens == (pos + n - 1) / piece_tokens);
      for (int64_t t = begin; t < len || (whole && t == begin);) {
        const int64_t at = pos + (t - begin), piece = at / piece_tokens;
        if (piece + 1 > static_cast<int64_t>(piece_start.size()))
          piece_start.push_back(static_cast<int64_t>(items.size()));
        const int64_t end = std::min(len, t + (piece + 1) * piece_tokens - at);
        items.push_back({b, t, end, whole ? -1 : num_partials++});
        if (end == t) break;  // an empty sequence's one item
        t = end;
      }
      pos += n;
      continue;
    }
    if (begin == 0 && len <= split_tokens) {
      items.push_back({b, 0, len, -1});
    } else {
      for (int64_t t = begin; t < len; t += split_tokens)
        items.push_back({b, t, std::min(len, t + split_tokens), num_partials++});
    }
    for (int64_t i = piece_start.back(); i < static_cast<int64_t>(items.size()); ++i) piece_start.push_back(i + 1);
  }
  first_partial[p.num_seqs] = num_partials;
  // Partial results: [num_partials, num_heads, head_size + 2] (acc, then m and l).
  const int64_t partial_stride = nh * (hs + 2);
  std::unique_ptr<float[]> partials(new float[num_partials * partial_stride]);
  for (size_t i = 0; i < prefix_partial.size(); i += 2) {
    const int64_t b = prefix_partial[i], r = prefix->row[b];
    float* part = partials.get() + prefix_partial[i + 1] * partial_stride;
    std::memcpy(part, prefix->out + r * nh * hs, nh * hs * sizeof(float));
    std::memcpy(part + nh * hs, prefix->lse + r * nh, nh * sizeof(float));
    std::fill(part + nh * hs + nh, part + nh * hs + 2 * nh, 1.f);
  }

  if (thread_pieces) piece_start.push_back(static_cast<int64_t>(items.size()));
  std::atomic<int64_t> next_piece{0};
  const int64_t num_pieces = static_cast<int64_t>(piece_start.size()) - 1;
  const int64_t workers = std::max<int64_t>(1, std::min(num_threads, num_pieces));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // One buffer per worker per call, not per item.
    std::vector<float> state(nh * (hs + 2));
    float* acc = state.data();
    float* m = acc + nh * hs;
    float* l = m + nh;
    // The next piece is claimed as the last tile of this one's last item
    // begins, so that tile can prefetch the first tile of what follows it.
    for (int64_t k = next_piece.fetch_add(1, std::memory_order_relaxed); k < num_pieces;) {
      const int64_t end = piece_start[k + 1];
      int64_t k_next = -1;
      for (int64_t i = piece_start[k]; i < end; ++i) {
        const auto after = [&]() -> const WorkItem* {
          if (i + 1 < end) return &items[i + 1];
          k_next = next_piece.fetch_add(1, std::memory_order_relaxed);
          const bool more = k_next < num_pieces && piece_start[k_next] < piece_start[k_next + 1];
          return more ? &items[piece_start[k_next]] : nullptr;
        };
        const WorkItem& item = items[i];
        run_item<F>(p, item, path, m, l, acc, after);
        if (item.partial < 0) {
          float* o = p.out + item.seq * nh * hs;
          for (int64_t h = 0; h < nh; ++h) {
            const float f = p.out_scale / l[h];
            for (int64_t d = 0; d < hs; ++d) o[h * hs + d] = acc[h * hs + d] * f;
          }
        } else {
          std::memcpy(partials.get() + item.partial * partial_stride, state.data(), partial_stride * sizeof(float));
        }
      }
      // Not claimed when the last item had no tile (no tokens) or the piece no item.
      k = k_next >= 0 ? k_next : next_piece.fetch_add(1, std::memory_order_relaxed);
    }
  });

  if (num_partials == 0) return;
  // Merge the splits of each split sequence: rescale every split to the common max.
  at::parallel_for(0, p.num_seqs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = first_partial[b], count = first_partial[b + 1] - first;
      if (count == 0) continue;
      float* o = p.out + b * nh * hs;
      for (int64_t h = 0; h < nh; ++h) {
        float m_max = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < count; ++s) m_max = std::max(m_max, partials[(first + s) * partial_stride + nh * hs + h]);
        float l_sum = 0.f;
        std::fill(o + h * hs, o + (h + 1) * hs, 0.f);
        for (int64_t s = 0; s < count; ++s) {
          const float* part = partials.get() + (first + s) * partial_stride;
          const float w = std::exp(part[nh * hs + h] - m_max);
          l_sum += w * part[nh * hs + nh + h];
          for (int64_t d = 0; d < hs; ++d) o[h * hs + d] += w * part[h * hs + d];
        }
        const float f = p.out_scale / l_sum;
        for (int64_t d = 0; d < hs; ++d) o[h * hs + d] *= f;
      }
    }
  });
}

// Whether run_item takes the bf16 dot-product tiles for this call (FP8
// caches, head size 64 or 128, an AVX512-BF16 build; see TileTable::pick).
inline bool bf16_dot_tiles(int path, int64_t kv_format, int64_t head_size) {
#ifdef FP8SERVE_BF16_DOT
  return (path == kBf16DotPath || path == kAmxPath) && (kv_format == kE4M3 || kv_format == kE5M2) &&
         bf16_dot_head_size(head_size);
#else
  static_cast<void>(path), static_cast<void>(kv_format), static_cast<void>(head_size);
  return false;
#endif
}

// ------------------------------------------------------- cascade attention
// Sequences whose block tables start with the same physical blocks (a shared
// system prompt under prefix caching, the n samples of one prompt) read the
// same K/V there. Cascade attention (as FlashInfer's and vLLM's) attends all
// of their queries to that shared prefix in one call of the prefill kernel's
// prefix form, a matrix product over keys packed once instead of one decode
// pass per sequence, and then each sequence to the rest of its context here;
// the two pieces merge by their log-sum-exp like the splits of a long context.

enum CascadeMode : int64_t { kCascadeOff = 0, kCascadeAuto = 1, kCascadeAlways = 2 };

// FP8SERVE_CASCADE_ATTENTION=0 turns it off (A/B runs, bisecting); the
// benchmarks switch it per call through set_cascade_attention.
std::atomic<int64_t>& cascade_mode() {
  static std::atomic<int64_t> mode{[] {
    const char* v = std::getenv("FP8SERVE_CASCADE_ATTENTION");
    return v != nullptr && std::string(v) == "0" ? int64_t{kCascadeOff} : int64_t{kCascadeAuto};
  }()};
  return mode;
}

// Calls that ran a prefix phase, and the (sequence, shared token) pairs they
// covered: tests check the engine's shared blocks reach it, benchmarks report it.
std::atomic<int64_t> g_cascade_calls{0}, g_cascade_pairs{0};

// Where the prefix phase paid for itself (kCascadeAuto), measured with bf16
// queries over an e4m3 cache (the bf16 dot-product tiles), head size 64, 9
// heads over 3 kv heads, 32 tokens of each sequence's own, on the Zen 4
// guest (benchmarks/results/cascade_attention_2026-12-04_zen4.md): 16 or
// more sequences and 16384 or more (sequence, shared token) pairs, 1.06-1.70x
// there, 0.40-0.95x below; whole decode steps of the default model 1.05-1.26x.
// With float32 tiles (float32 queries, 16/32-bit caches) the kernel alone ran
// 0.23-1.65x, the same cells differing from one process to the next, and
// float32 decode steps (64 sequences over 512 shared tokens) gained nothing:
// off there.
constexpr int64_t kCascadeMinMembers = 16;
constexpr int64_t kCascadeMinPairs = 16384;

struct PrefixGroup {
  std::vector<int64_t> members;
  int64_t shared;  // tokens [0, shared) of every member are in the same blocks
};

// Groups of sequences with the same first block, and the tokens all of a
// group's members hold in the same blocks (up to the shortest context).
// One level: a group is cut at its members' first different block.
// Groups with fewer than min_members members, or fewer than min_pairs
// members x shared tokens, are left out.
std::vector<PrefixGroup> shared_prefix_groups(const int64_t* bt, const int64_t* sl, int64_t num_seqs,
                                              int64_t max_blocks, int64_t block_size, int64_t min_members,
                                              int64_t min_pairs) {
  std::vector<PrefixGroup> groups;
  if (num_seqs < min_members) return groups;
  std::vector<int64_t> order(num_seqs);
  for (int64_t b = 0; b < num_seqs; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return bt[a * max_blocks] < bt[b * max_blocks]; });
  for (int64_t i = 0, j; i < num_seqs; i = j) {
    for (j = i + 1; j < num_seqs && bt[order[j] * max_blocks] == bt[order[i] * max_blocks];) ++j;
    if (j - i < min_members) continue;
    int64_t min_len = sl[order[i]];
    for (int64_t k = i + 1; k < j; ++k) min_len = std::min(min_len, sl[order[k]]);
    const int64_t max_common = (min_len + block_size - 1) / block_size;
    const int64_t* first = bt + order[i] * max_blocks;
    int64_t common = 1;
    for (; common < max_common; ++common) {
      bool same = true;
      for (int64_t k = i + 1; k < j && same; ++k) same = bt[order[k] * max_blocks + common] == first[common];
      if (!same) break;
    }
    const int64_t shared = std::min(common * block_size, min_len);
    if (shared * (j - i) < min_pairs) continue;
    groups.push_back({std::vector<int64_t>(order.begin() + i, order.begin() + j), shared});
  }
  return groups;
}

// The prefix phase: every group's queries over its shared tokens, gathered
// from the cache (decoded at scale 1) in bf16 when the tiles are the bf16
// dot-product ones (the query rounded to bf16 as they round it, P rounded
// to bf16 as they and the prefill kernel do) and float32 otherwise. Fills
// `row` / `start` (sized num_seqs) and returns the rows' out and lse.
std::pair<at::Tensor, at::Tensor> attend_shared_prefixes(const std::vector<PrefixGroup>& groups, const at::Tensor& qf,
                                                          const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                          const int64_t* bt, int64_t max_blocks, int64_t kv_format,
                                                          int path, std::vector<int64_t>& row,
                                                          std::vector<int64_t>& start) {
  const int64_t nh = qf.size(1), hs = qf.size(2), nkv = key_cache.size(2), bs = key_cache.size(1);
  int64_t num_rows = 0, num_keys = 0;
  for (const PrefixGroup& g : groups) num_rows += static_cast<int64_t>(g.members.size()), num_keys += g.shared;
  const auto opts = qf.options().dtype(at::kLong);
  at::Tensor slots = at::empty({num_keys}, opts), cu_q = at::empty({static_cast<int64_t>(groups.size()) + 1}, opts);
  at::Tensor cu_k = at::empty({static_cast<int64_t>(groups.size()) + 1}, opts);
  // bf16 where the decode tiles are the bf16 dot-product ones, so both pieces round alike.
  const bool bf16 = bf16_dot_tiles(path, kv_format, hs);
  at::Tensor members = at::empty({num_rows}, opts);
  int64_t* sp = slots.data_ptr<int64_t>();
  int64_t* mp = members.data_ptr<int64_t>();
  int64_t *cq = cu_q.data_ptr<int64_t>(), *ck = cu_k.data_ptr<int64_t>();
  cq[0] = ck[0] = 0;
  int64_t r = 0, k = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const PrefixGroup& g = groups[gi];
    const int64_t* first = bt + g.members[0] * max_blocks;
    for (int64_t t = 0; t < g.shared; ++t) sp[k++] = first[t / bs] * bs + t % bs;
    for (int64_t b : g.members) {
      row[b] = r;
      start[b] = g.shared;
      mp[r++] = b;
    }
    cq[gi + 1] = r;
    ck[gi + 1] = k;
  }
  // ATen's gather and conversion: vectorized (a scalar loop here was 5% of a call at 64 x 512).
  at::Tensor q = qf.index_select(0, members);
  if (bf16) q = q.to(at::kBFloat16);
  at::Tensor kbuf = at::empty({num_keys, nkv, hs}, q.options()), vbuf = at::empty({num_keys, nkv, hs}, q.options());
  gather_cache(key_cache, slots, kv_format, kbuf);
  gather_cache(value_cache, slots, kv_format, vbuf);
  // The tiles' units: e4m3 is decoded as value * 2^-8 there and the caller
  // folded 2^8 into q and into out_scale; the gathered keys and values are
  // the values, so both scales take 2^-8 here (the output in the tiles' units,
  // which the merge's out_scale turns back).
  const float kv_mult = kv_format == kE4M3 ? 256.f : 1.f;
  at::Tensor lse = at::empty({num_rows, nh}, qf.options());
  // prefill_attention.cpp's paths: 0 best (bf16 dot products for bf16), 1 AVX2, 3 scalar.
#ifdef FP8SERVE_AVX2
  const bool avx2 = path == kAvx2Path && hs % 16 == 0;
#else
  const bool avx2 = false;
#endif
  const int64_t prefill_path = path == kScalarPath ? 3 : avx2 ? 1 : 0;
  at::Tensor out = prefill_attention_over_prefix(q, kbuf, vbuf, cu_q, cu_k, 1.0 / kv_mult, 1.0 / kv_mult,
                                                 prefill_path, lse);
  return {out, lse};
}

void paged_attention_decode_dispatch(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                     at::Tensor block_tables, at::Tensor seq_lens, int64_t kv_format, double out_scale,
                                     int path, int64_t cascade = kCascadeOff) {
  TORCH_CHECK(out.is_contiguous() && query.is_contiguous(), "out and query must be contiguous");
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "query and out must be float32");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [num_seqs, num_heads, head_size]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "caches must be [num_blocks, block_size, num_kv_heads, head_size], K and V alike");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "K and V caches must have one dtype");
  const fp8serve_kv::CacheStrides strides = fp8serve_kv::cache_strides(key_cache, "paged_attention_decode");
  TORCH_CHECK(value_cache.strides() == key_cache.strides(), "paged_attention_decode: K and V caches must have one "
              "layout, got strides ", key_cache.strides(), " and ", value_cache.strides());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "block_tables/seq_lens must be contiguous");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_size, "head_size mismatch between query and cache");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs, "block_tables must be [num_seqs, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs, "seq_lens must be [num_seqs]");
  const int64_t max_blocks = block_tables.size(1);
  const auto* bt = block_tables.data_ptr<int64_t>();
  const auto* sl = seq_lens.data_ptr<int64_t>();
  // Every block the kernel will read must exist: a bad table would read out of bounds.
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(sl[b] >= 1 && sl[b] <= max_blocks * block_size, "seq_lens[", b, "] = ", sl[b],
                " is outside [1, max_blocks * block_size]");
    for (int64_t i = 0; i < (sl[b] + block_size - 1) / block_size; ++i) {
      const int64_t id = bt[b * max_blocks + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables[", b, ", ", i, "] = ", id, " is not a block id");
    }
  }
  Problem p{out.data_ptr<float>(), query.data_ptr<float>(),
            static_cast<const uint8_t*>(key_cache.data_ptr()), static_cast<const uint8_t*>(value_cache.data_ptr()),
            bt, sl, num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks,
            strides.row_bytes, strides.token_bytes, strides.head_bytes, strides.block_bytes,
            static_cast<float>(out_scale)};
  if (num_seqs == 0) return;
  const auto dt = key_cache.scalar_type();
  const bool format_ok = kv_format == kF32 ? dt == at::kFloat
                         : kv_format == kBF16 ? dt == at::kBFloat16
                         : kv_format == kF16 ? dt == at::kHalf
                         : (kv_format == kE4M3 || kv_format == kE5M2) && dt == at::kByte;
  TORCH_CHECK(kv_format >= kF32 && kv_format <= kE5M2, "unknown kv_format ", kv_format);
  TORCH_CHECK(format_ok, "the cache's dtype ", dt, " is not kv_format ", kv_format, "'s storage dtype");

  std::vector<int64_t> prefix_row, prefix_start;
  std::pair<at::Tensor, at::Tensor> prefix_out;
  PrefixResults prefix{};
  if (cascade == kCascadeAlways || (cascade == kCascadeAuto && bf16_dot_tiles(path, kv_format, head_size))) {
    const bool always = cascade == kCascadeAlways;
    const std::vector<PrefixGroup> groups =
        shared_prefix_groups(bt, sl, num_seqs, max_blocks, block_size, always ? 2 : kCascadeMinMembers,
                             always ? 1 : kCascadeMinPairs);
    if (!groups.empty()) {
      g_cascade_calls.fetch_add(1, std::memory_order_relaxed);
      for (const PrefixGroup& g : groups)
        g_cascade_pairs.fetch_add(g.shared * static_cast<int64_t>(g.members.size()), std::memory_order_relaxed);
      prefix_row.assign(num_seqs, -1);
      prefix_start.assign(num_seqs, 0);
      prefix_out = attend_shared_prefixes(groups, query, key_cache, value_cache, bt, max_blocks, kv_format, path,
                                          prefix_row, prefix_start);
      prefix = {prefix_row.data(), prefix_start.data(), prefix_out.first.data_ptr<float>(),
                prefix_out.second.data_ptr<float>()};
    }
  }
  const PrefixResults* pre = prefix.row != nullptr ? &prefix : nullptr;
  switch (kv_format) {
    case kF32: decode_impl<kF32>(p, path, pre); break;
    case kBF16: decode_impl<kBF16>(p, path, pre); break;
    case kF16: decode_impl<kF16>(p, path, pre); break;
    case kE4M3: decode_impl<kE4M3>(p, path, pre); break;
    default: decode_impl<kE5M2>(p, path, pre); break;
  }
}

}  // namespace

// out, query: [num_seqs, num_heads, head_size] float32 contiguous; query is
// pre-multiplied by softmax_scale * k_scale (* 2^8 for e4m3).
// key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
// contiguous, dtype per `kv_format` (fp8 as uint8).
// block_tables: [num_seqs, max_blocks] int64; seq_lens: [num_seqs] int64, >= 1.
void paged_attention_decode(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                            at::Tensor block_tables, at::Tensor seq_lens, int64_t kv_format, double out_scale) {
  paged_attention_decode_dispatch(out, query, key_cache, value_cache, block_tables, seq_lens, kv_format, out_scale,
                                  kBestPath);
}

// Same contract, always the AVX2 tiles (what AVX2-only CPUs run), so tests
// keep them correct on AVX-512 machines; the scalar path without AVX2.
void paged_attention_decode_avx2(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                 at::Tensor block_tables, at::Tensor seq_lens, int64_t kv_format, double out_scale) {
  paged_attention_decode_dispatch(out, query, key_cache, value_cache, block_tables, seq_lens, kv_format, out_scale,
                                  kAvx2Path);
}

// Same contract, the AVX-512 tiles whatever the call's size (head sizes that
// are not a multiple of 16 take the AVX2 tiles). Needs an AVX-512 build.
void paged_attention_decode_avx512(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                   at::Tensor block_tables, at::Tensor seq_lens, int64_t kv_format, double out_scale) {
#ifdef FP8SERVE_AVX512
  paged_attention_decode_dispatch(out, query, key_cache, value_cache, block_tables, seq_lens, kv_format, out_scale,
                                  kAvx512Path);
#else
  TORCH_CHECK(false, "this build of the kernels has no AVX-512 tiles");
#endif
}

// Same contract, the bf16 dot-product tiles for FP8 caches with head size
// 64 or 128 (others take "best"); the query is rounded to bf16. Needs an
// AVX512-BF16 and AVX512-VBMI build.
void paged_attention_decode_bf16dot(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                    at::Tensor block_tables, at::Tensor seq_lens, int64_t kv_format, double out_scale) {
#ifdef FP8SERVE_BF16_DOT
  paged_attention_decode_dispatch(out, query, key_cache, value_cache, block_tables, seq_lens, kv_format, out_scale,
                                  kBf16DotPath);
#else
  TORCH_CHECK(false, "this build of the kernels has no bf16 dot-product tiles (AVX512-BF16 and AVX512-VBMI)");
#endif
}

// Same contract, the AMX tiles for FP8 caches with head size 64 or 128
// (others as paged_attention_decode_bf16dot); the query is rounded to bf16.
// Needs an AMX build and the process's permission to use the tiles
// (paged_attention_has_amx).
void paged_attention_decode_amx(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                at::Tensor block_tables, at::Tensor seq_lens, int64_t kv_format, double out_scale) {
#ifdef FP8SERVE_AMX_DECODE
  TORCH_CHECK(fp8serve_amx::permitted(), "the kernel may not use AMX tiles: the OS refused the tile data state");
  paged_attention_decode_dispatch(out, query, key_cache, value_cache, block_tables, seq_lens, kv_format, out_scale,
                                  kAmxPath);
#else
  TORCH_CHECK(false, "this build of the kernels has no AMX decode tiles (AMX-BF16, AVX512-BF16 and AVX512-VBMI)");
#endif
}

// Same contract, always the portable scalar path (what non-AVX2 builds run).
void paged_attention_decode_scalar(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                   at::Tensor block_tables, at::Tensor seq_lens, int64_t kv_format, double out_scale) {
  paged_attention_decode_dispatch(out, query, key_cache, value_cache, block_tables, seq_lens, kv_format, out_scale,
                                  kScalarPath);
}

// The engine's decode entry: query [num_seqs, num_heads, head_size] in the
// compute dtype (float32, bf16 or fp16; heads contiguous, any row stride, as
// a view of the fused qkv output), scaled by q_scale on the way in; returns
// out in query's dtype. Doing the conversions here saves three ATen ops per
// layer (query.float().mul_(), empty_like, out.to(dtype)), ~10 us each at
// batch 1.
// out_arg: the [num_seqs, num_heads, head_size] result to write (contiguous,
// query's dtype), or null: a new one.
// cascade: a CascadeMode (the engine's entries pass cascade_mode()).
at::Tensor paged_attention_decode_fused_impl(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                             at::Tensor block_tables, at::Tensor seq_lens, int64_t kv_format,
                                             double q_scale, double out_scale, const at::Tensor* out_arg,
                                             int64_t cascade) {
  TORCH_CHECK(query.dim() == 3 && query.device().is_cpu(), "query must be a [num_seqs, num_heads, head_size] CPU tensor");
  const int64_t n = query.size(0), h = query.size(1), d = query.size(2);
  TORCH_CHECK(query.stride(2) == 1 && (h <= 1 || query.stride(1) == d), "query's heads must be contiguous");
  const auto dt = query.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "query must be float32, bf16 or fp16");
  if (out_arg != nullptr) {
    TORCH_CHECK(out_arg->dim() == 3 && out_arg->size(0) == n && out_arg->size(1) == h && out_arg->size(2) == d &&
                    out_arg->scalar_type() == dt && out_arg->is_contiguous() && out_arg->device().is_cpu(),
                "out must be a contiguous [", n, ", ", h, ", ", d, "] CPU tensor of query's dtype, got ",
                out_arg->sizes(), " ", out_arg->scalar_type());
  }
  const at::Tensor qf = at::empty({n, h, d}, query.options().dtype(at::kFloat));
  // A float32 result goes straight into out_arg.
  at::Tensor outf = out_arg != nullptr && dt == at::kFloat ? *out_arg
                                                            : at::empty({n, h, d}, query.options().dtype(at::kFloat));
  const int64_t row = h * d, ld = query.stride(0);
  const float qs = static_cast<float>(q_scale);
  float* qp = qf.data_ptr<float>();
  const char* src = static_cast<const char*>(query.data_ptr());
  const int64_t esz = query.element_size();
  for (int64_t i = 0; i < n; ++i) {
    const void* r = src + i * ld * esz;
    float* dst = qp + i * row;
    if (dt == at::kFloat) for (int64_t j = 0; j < row; ++j) dst[j] = fp8serve_cvt::load_as_f32<0>(r, j) * qs;
    else if (dt == at::kBFloat16) for (int64_t j = 0; j < row; ++j) dst[j] = fp8serve_cvt::load_as_f32<1>(r, j) * qs;
    else for (int64_t j = 0; j < row; ++j) dst[j] = fp8serve_cvt::load_as_f32<2>(r, j) * qs;
  }
  // A bf16 query loses nothing more worth speaking of when its scaled copy is
  // rounded to bf16 again: FP8 caches take the bf16 dot-product tiles then.
  paged_attention_decode_dispatch(outf, qf, key_cache, value_cache, block_tables, seq_lens, kv_format, out_scale,
                                  dt == at::kBFloat16 ? kAmxPath : kBestPath, cascade);
  if (dt == at::kFloat) return outf;
  at::Tensor out = out_arg != nullptr ? *out_arg : at::empty({n, h, d}, query.options());
  const float* op = outf.data_ptr<float>();
  void* dst = out.data_ptr();
  for (int64_t i = 0; i < n * row; ++i) {
    if (dt == at::kBFloat16) fp8serve_cvt::store_from_f32<1>(dst, i, op[i]);
    else fp8serve_cvt::store_from_f32<2>(dst, i, op[i]);
  }
  return out;
}

at::Tensor paged_attention_decode_fused(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                        at::Tensor block_tables, at::Tensor seq_lens, int64_t kv_format,
                                        double q_scale, double out_scale) {
  return paged_attention_decode_fused_impl(query, key_cache, value_cache, block_tables, seq_lens, kv_format, q_scale,
                                           out_scale, nullptr, cascade_mode().load(std::memory_order_relaxed));
}

// The same with cascade attention's mode given (0 off, 1 where it measured
// faster, 2 for every group of two or more sequences sharing a block): tests
// and benchmarks.
at::Tensor paged_attention_decode_fused_cascade(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                                at::Tensor block_tables, at::Tensor seq_lens, int64_t kv_format,
                                                double q_scale, double out_scale, int64_t cascade) {
  TORCH_CHECK(cascade >= kCascadeOff && cascade <= kCascadeAlways, "cascade must be 0, 1 or 2, got ", cascade);
  return paged_attention_decode_fused_impl(query, key_cache, value_cache, block_tables, seq_lens, kv_format, q_scale,
                                           out_scale, nullptr, cascade);
}

// paged_attention_decode's contract on the tiles of `path` (0 scalar, 1 AVX2,
// 2 best, 3 AVX-512, 4 bf16 dot products, 5 AMX; see Path) with cascade attention's
// mode given: tests keep the prefix phase right on every path.
void paged_attention_decode_cascade(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                    at::Tensor block_tables, at::Tensor seq_lens, int64_t kv_format, double out_scale,
                                    int64_t path, int64_t cascade) {
  TORCH_CHECK(path >= kScalarPath && path <= kAmxPath, "path must be 0-5, got ", path);
  TORCH_CHECK(cascade >= kCascadeOff && cascade <= kCascadeAlways, "cascade must be 0, 1 or 2, got ", cascade);
  paged_attention_decode_dispatch(out, query, key_cache, value_cache, block_tables, seq_lens, kv_format, out_scale,
                                  static_cast<int>(path), cascade);
}

// For each sequence, the shared prefix (tokens) cascade attention would
// attend to once for its group, 0 where it has none: groups of at least
// min_members sequences and min_pairs members x shared tokens. Tests and
// benchmarks.
at::Tensor shared_prefix_lengths(at::Tensor block_tables, at::Tensor seq_lens, int64_t block_size, int64_t min_members,
                                 int64_t min_pairs) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "block_tables must be a contiguous int64 [num_seqs, max_blocks] tensor");
  const int64_t n = block_tables.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == n && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int64 [num_seqs] tensor");
  TORCH_CHECK(block_size >= 1 && min_members >= 2, "block_size must be >= 1 and min_members >= 2");
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < n; ++b)
    TORCH_CHECK(sl[b] >= 1 && sl[b] <= max_blocks * block_size, "seq_lens[", b, "] = ", sl[b],
                " is outside [1, max_blocks * block_size]");
  at::Tensor out = at::zeros({n}, seq_lens.options());
  for (const PrefixGroup& g : shared_prefix_groups(block_tables.data_ptr<int64_t>(), sl, n, max_blocks, block_size,
                                                   min_members, min_pairs))
    for (int64_t b : g.members) out.data_ptr<int64_t>()[b] = g.shared;
  return out;
}

// [calls that ran cascade attention's prefix phase, (sequence, shared token)
// pairs they covered] since the process started.
std::vector<int64_t> cascade_attention_stats() {
  return {g_cascade_calls.load(std::memory_order_relaxed), g_cascade_pairs.load(std::memory_order_relaxed)};
}

// Sets the mode the engine's entries use (FP8SERVE_CASCADE_ATTENTION=0 starts
// it off); returns the previous one. For A/B benchmarks in one process.
int64_t set_cascade_attention(int64_t mode) {
  TORCH_CHECK(mode >= kCascadeOff && mode <= kCascadeAlways, "cascade mode must be 0, 1 or 2, got ", mode);
  return cascade_mode().exchange(mode);
}

// The same into a given tensor (decode plans: decode_plan.cpp).
void paged_attention_decode_fused_out(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                      at::Tensor block_tables, at::Tensor seq_lens, int64_t kv_format, double q_scale,
                                      double out_scale) {
  paged_attention_decode_fused_impl(query, key_cache, value_cache, block_tables, seq_lens, kv_format, q_scale,
                                    out_scale, &out, cascade_mode().load(std::memory_order_relaxed));
}

bool has_avx2() {
#ifdef FP8SERVE_AVX2
  return true;
#else
  return false;
#endif
}

// Whether the decode attention has its AVX-512 tiles (see tile_avx512).
bool has_avx512() {
#ifdef FP8SERVE_AVX512
  return true;
#else
  return false;
#endif
}

// The bf16 dot-product tiles' decode of FP8 codes, on its own, so tests can
// check every code: codes [n] uint8 -> [n] bf16 (e4m3 as value * 2^-8, e5m2
// as the value, the tiles' convention).
at::Tensor fp8_codes_to_bf16(at::Tensor codes, int64_t kv_format) {
#ifdef FP8SERVE_BF16_DOT
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 1 && codes.is_contiguous(),
              "codes must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(kv_format == kE4M3 || kv_format == kE5M2, "kv_format must be fp8_e4m3 or fp8_e5m2");
  const int64_t n = codes.numel();
  at::Tensor out = at::empty({n}, codes.options().dtype(at::kBFloat16));
  const uint8_t* src = codes.data_ptr<uint8_t>();
  auto* dst = static_cast<uint16_t*>(out.data_ptr());
  const ByteLut lut = kv_format == kE4M3 ? load_byte_lut<kE4M3>() : load_byte_lut<kE5M2>();
  for (int64_t i = 0; i < n; i += 64) {
    alignas(64) uint8_t in[64] = {};
    alignas(64) uint16_t res[2][32];
    const int64_t m = std::min<int64_t>(64, n - i);
    std::memcpy(in, src + i, m);
    __m512i a, b;
    bf16_from_codes64(_mm512_load_si512(in), lut, a, b);
    _mm512_store_si512(res[0], a);
    _mm512_store_si512(res[1], b);
    // Back to the codes' order (see bf16_from_codes64).
    for (int k = 0; k < 64; ++k) {
      const int which = (k / 8) % 2, lane = 8 * (k / 16) + k % 8;
      if (k < m) dst[i + k] = res[which][lane];
    }
  }
  return out;
#else
  TORCH_CHECK(false, "this build of the kernels has no bf16 dot-product tiles (AVX512-BF16 and AVX512-VBMI)");
  return codes;
#endif
}

// Whether the decode attention has its bf16 dot-product tiles (AVX512-BF16 and -VBMI).
bool has_bf16_dot() {
#ifdef FP8SERVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

// Whether the decode attention runs its AMX tiles in this process (an AMX
// build, and the OS granted the tile data state).
bool has_amx_decode() {
#ifdef FP8SERVE_AMX_DECODE
  return fp8serve_amx::permitted();
#else
  return false;
#endif
}

// The cache level (1 or 2) the kernels' software prefetches target on this CPU (prefetch_level.h).
int64_t prefetch_level() { return static_cast<int64_t>(fp8serve_prefetch::level()); }

// Each source file registers its own ops in the `fp8serve` namespace, so
// kernels can be added without a shared binding file.
TORCH_LIBRARY_FRAGMENT(fp8serve, m) {
  m.def("paged_attention_decode", &paged_attention_decode);
  m.def("paged_attention_decode_avx2", &paged_attention_decode_avx2);
  m.def("paged_attention_decode_avx512", &paged_attention_decode_avx512);
  m.def("paged_attention_decode_scalar", &paged_attention_decode_scalar);
  m.def("paged_attention_decode_bf16dot", &paged_attention_decode_bf16dot);
  m.def("paged_attention_decode_amx", &paged_attention_decode_amx);
  m.def("paged_attention_decode_fused", &paged_attention_decode_fused);
  m.def(
      "paged_attention_decode_fused_out(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, int kv_format, float q_scale, float out_scale) -> ()",
      &paged_attention_decode_fused_out);
  m.def("paged_attention_decode_fused_cascade", &paged_attention_decode_fused_cascade);
  m.def(
      "paged_attention_decode_cascade(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, int kv_format, float out_scale, int path, int cascade) -> ()",
      &paged_attention_decode_cascade);
  m.def("set_cascade_attention", &set_cascade_attention);
  m.def("shared_prefix_lengths", &shared_prefix_lengths);
  m.def("cascade_attention_stats", &cascade_attention_stats);
  m.def("has_avx2", &has_avx2);
  m.def("has_avx512", &has_avx512);
  m.def("paged_attention_has_bf16_dot", &has_bf16_dot);
  m.def("paged_attention_has_amx", &has_amx_decode);
  m.def("fp8_codes_to_bf16", &fp8_codes_to_bf16);
  m.def("prefetch_level", &prefetch_level);
}
