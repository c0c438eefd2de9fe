// Causal attention for fresh prefills: each sequence's new tokens attend to
// the K/V of its own tokens (no cached context), packed varlen like
// flash_attn_varlen_func: query [num_tokens, num_heads, head_size], key/value
// [num_tokens, num_kv_heads, head_size], cu_seqlens [num_seqs + 1]. The
// context form (prefill_attention_with_context, for prefix caching) takes
// keys/values per sequence by cu_seqlens_k, the queries being the last of
// those positions; rows and key blocks are placed by absolute position, so
// its rows equal a fresh prefill's of the whole sequence bit for bit.
//
// Why not torch's SDPA: its CPU flash kernel runs a 512-token causal float32
// prompt of the default model (9 heads, 3 KV heads, head 64) at ~110-130
// GFLOP/s (counting the causal half), about a third of what F.linear reaches
// on the same cores, and it was 18-20% of a float32 prefill. This kernel: ~200
// GFLOP/s there, 1.55x (benchmarks/results/prefill_attention_2026-11-30.md).
// For bf16 torch's kernel runs on AMX and stays faster: the engine uses this
// one where it measured faster (kernels/prefill_attention_ops.py).
//
// Schedule (flash attention, online softmax):
//   1. Pack: per (sequence, kv head), K is transposed to float32 [head_size][len]
//      and V copied to float32 [len][head_size], both zero-padded to a whole
//      number of key tiles. Each K/V element is converted once, whatever
//      the input dtype.
//   2. Work items (sequence, kv head, block of kQueryTokens query tokens),
//      biggest first, pulled by the threads from an atomic counter (causal
//      items differ in cost up to len / kQueryTokens times). An item's rows
//      are its tokens x the kv head's group of query heads, so each K/V tile
//      load serves `group` heads.
//   3. Per key block of kKeyBlock keys up to the item's last token: scores by
//      register tiles (rows x keys, K^T rows broadcast-free), masked softmax
//      update per row, then out = out * alpha + P V by register tiles
//      (rows x head dims). Key blocks past the item's last token are never
//      computed: the work is the causal half, not the full square.
//
// For bf16 inputs on AVX512-BF16 builds (CPUs without AMX: with AMX the
// engine runs prefill_attention_amx.cpp) "best" is run_bf16_dot: the same
// schedule with vdpbf16ps and P rounded to bf16, 1.55-1.67x the float32 tiles
// on a Zen 4 guest (benchmarks/results/prefill_attention_2026-12-01_zen4.md).
// Every path's softmax works in log2 units (2^x by a short polynomial,
// exp2_le0_16); this one also writes P's bf16 pairs in the same pass:
// 1.05-1.11x the kernel before that
// (benchmarks/results/prefill_attention_exp2_2026-12-04_zen4.md).
//
// The same template runs 16 lanes (AVX-512), 8 lanes (AVX2+FMA) and 1 lane
// (scalar; also what tests use to keep that path correct), so the schedule
// and the masking are shared; only the tile sizes differ. Results differ
// from a float64 reference by float32 rounding only (tests: < 1e-5 relative).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "scalar_convert.h"
#include "vec16.h"
#include "vec8.h"

namespace {

// Measured on the default model's shapes (AVX-512, 2 threads): 16 or 32
// query tokens and 64-256 keys per block all land within 5%; 64 keys was the
// slowest, 128 the fastest at 512 and 2048 tokens.
constexpr int64_t kQueryTokens = 16;  // query tokens per work item
constexpr int64_t kKeyBlock = 128;    // keys per softmax update; a multiple of every key tile
constexpr int64_t kRowPad = 16;     // floats added to each K^T row (see run)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^x for x <= 0 (log2-unit scores minus their running max; the kernels
// scale scores by log2(e), so the softmax's exponentials are powers of 2):
// x = n + f with n = round(x), |f| <= 1/2, 2^f by a degree-5 polynomial
// (coefficients fitted for relative error on [-1/2, 1/2]: 1.8e-7, float32's
// own rounding), times 2^n. Five FMAs and three other operations against the
// thirteen of exp_fma, which first multiplies by log2(e) and reduces with two
// constants. 16 lanes: vscalefps (0 far below); 8 lanes: 2^n from the
// exponent bits, x clamped at -126 (2^-126 for 0 where it is not masked);
// 1 lane: std::exp2.
#define FP8SERVE_EXP2_POLY(FMA, SET1, p, f)   \
  p = SET1(1.3218672247603536e-3f);          \
  p = FMA(p, f, SET1(9.671698324382305e-3f)); \
  p = FMA(p, f, SET1(5.550893023610115e-2f)); \
  p = FMA(p, f, SET1(2.4022237956523895e-1f)); \
  p = FMA(p, f, SET1(6.931468844413757e-1f)); \
  p = FMA(p, f, SET1(1.f));
#ifdef FP8SERVE_VEC16
inline __m512 exp2_le0_16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p;
  FP8SERVE_EXP2_POLY(_mm512_fmadd_ps, _mm512_set1_ps, p, f)
  return _mm512_scalef_ps(p, n);
}
#endif
#ifdef FP8SERVE_VEC8
inline __m256 exp2_le0_8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p;
  FP8SERVE_EXP2_POLY(_mm256_fmadd_ps, _mm256_set1_ps, p, f)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif
#undef FP8SERVE_EXP2_POLY

// Lane traits. kQk*: score tile = kQkRows rows x (kQkVecs * W) keys;
// kPv*: output tile = kPvRows rows x (kPvVecs * W) head dims. Sized so the
// accumulators plus the loaded operands fit the register file (32 zmm, 16 ymm).
// AVX-512 shapes measured at 1 x 512 / 1 x 2048 (ms): score tiles 8x2 1.72 /
// 25.5, 4x4 1.80 / 23.6, 6x4 1.73 / 24.2, 12x2 2.62 / 37.7 (spills); output
// tiles 6x4 as above, 3x4 1.88 / 23.7, 12x2 2.77 / 41.4. On hot data the
// 8x2 score tile and the 6x4 output tile run at 165-185 GFLOP/s per core,
// F.linear's per-core rate.
// AVX2: the output tile is 6 rows x 2 vectors, like the score tile: 12
// accumulators, and per key 2 V loads and 6 P broadcasts. The 2 x 4 tile it
// replaced had 8 accumulators, exactly the FMAs in flight that two FMA pipes
// of 4-cycle latency need, and 6 loads per 8 FMAs; perf had its P V at 30% of
// a 1 x 512 call against 24% for the scores (same FLOPs). On the AVX2-only
// Zen 3 EPYC (2 vCPUs) the whole kernel ran 1.17-1.30x as fast at 1 x 512 to
// 16 x 512 and 1 x 2048, bit-identical (each output's sums keep their order;
// benchmarks/results/prefill_attention_pv_tile_2026-12-02_zen3.md).
struct Scalar {
  using T = float;
  static constexpr int W = 1, kQkRows = 4, kQkVecs = 4, kPvRows = 4, kPvVecs = 1;
  static T zero() { return 0.f; }
  static T set1(float x) { return x; }
  static T load(const float* p) { return *p; }
  static void store(float* p, T v) { *p = v; }
  static T fma(T a, T b, T c) { return a * b + c; }
  static T mul(T a, T b) { return a * b; }
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T max(T a, T b) { return a > b ? a : b; }
  static T exp2_le0(T a) { return std::exp2(a); }
  static float hmax(T a) { return a; }
  static float hsum(T a) { return a; }
  static T keep_first(T v, int n, T fill) { return n > 0 ? v : fill; }  // lanes >= n := fill
};

#ifdef FP8SERVE_VEC8
struct Avx2 {
  using T = __m256;
  static constexpr int W = 8, kQkRows = 6, kQkVecs = 2, kPvRows = 6, kPvVecs = 2;
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T exp2_le0(T x) { return exp2_le0_8(x); }
  static float hmax(T a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float hsum(T a) { return fp8serve_vec8::hsum(a); }
  static T keep_first(T v, int n, T fill) {
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_blendv_ps(fill, v, _mm256_castsi256_ps(keep));
  }
};
#endif

#ifdef FP8SERVE_VEC16
struct Avx512 {
  using T = __m512;
  static constexpr int W = 16, kQkRows = 8, kQkVecs = 2, kPvRows = 6, kPvVecs = 4;
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T exp2_le0(T x) { return exp2_le0_16(x); }
  static float hmax(T a) { return _mm512_reduce_max_ps(a); }
  static float hsum(T a) { return _mm512_reduce_add_ps(a); }
  static T keep_first(T v, int n, T fill) {
    const __mmask16 keep = n >= 16 ? 0xffff : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
    return _mm512_mask_blend_ps(keep, fill, v);
  }
};
#endif

struct Problem {
  int64_t num_seqs, num_heads, num_kv_heads, head_size, group;
  const int64_t* cu;         // [num_seqs + 1] query rows of each sequence
  const int64_t* cu_k;       // [num_seqs + 1] key/value rows; == cu for a fresh prefill
  float scale, out_scale;
  const void* q;             // rows of num_heads * head_size at stride q_ld elements
  const void* k;
  const void* v;
  int64_t q_ld, k_ld, v_ld;
  void* out;                 // [num_tokens, num_heads, head_size], contiguous
  int dtype;                 // 0 float32, 1 bf16, 2 fp16 (q, k, v and out)
  // Cascade attention's prefix phase (prefill_attention_over_prefix): no
  // causal mask (every query row sees all of its sequence's keys), a float32
  // `out`, and each row's log-sum-exp of its scaled scores in `lse`
  // ([num_tokens, num_heads], natural log), so the caller can merge the
  // result with attention over the rest of the keys.
  bool causal = true;
  float* lse = nullptr;
  int64_t query_tokens = kQueryTokens;  // per work item
  int64_t pack_chunk = 512;             // keys per packing unit, a multiple of 16
};

// dst[i] = src[i] * scale for a row of n elements in storage format DT (0
// float32, 1 bf16, 2 fp16), 16 or 8 at a time where the build has the lanes.
template <int DT>
void row_to_f32(const void* src, float* dst, int64_t n, float scale) {
  int64_t i = 0;
#if defined(FP8SERVE_VEC16)
  const __m512 sv = _mm512_set1_ps(scale);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(fp8serve_vec16::load<DT>(src, i), sv));
#elif defined(FP8SERVE_VEC8)
  const __m256 sv = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(fp8serve_vec8::load<DT>(src, i), sv));
#endif
  for (; i < n; ++i) dst[i] = fp8serve_cvt::load_as_f32<DT>(src, i) * scale;
}

// dst[i] = src[i] * f rounded to storage format DT.
template <int DT>
void row_from_f32(const float* src, void* dst, int64_t n, float f) {
  int64_t i = 0;
#if defined(FP8SERVE_VEC16)
  const __m512 fv = _mm512_set1_ps(f);
  for (; i + 16 <= n; i += 16) fp8serve_vec16::store<DT>(dst, i, _mm512_mul_ps(_mm512_loadu_ps(src + i), fv));
#elif defined(FP8SERVE_VEC8)
  const __m256 fv = _mm256_set1_ps(f);
  for (; i + 8 <= n; i += 8) fp8serve_vec8::store<DT>(dst, i, _mm256_mul_ps(_mm256_loadu_ps(src + i), fv));
#endif
  for (; i < n; ++i) fp8serve_cvt::store_from_f32<DT>(dst, i, src[i] * f);
}

template <int DT>
const void* row_ptr(const void* base, int64_t elem) {
  return static_cast<const char*>(base) + elem * (DT == 0 ? 4 : 2);
}

// S[r][0 : nkeys) = Q[r] . K^T[:, 0 : nkeys) for RT rows, nkeys a multiple of
// the key tile. kt: [head_size][ldk]; q: [RT][head_size]; s: [RT][lds].
// The scores come out multiplied by out_mul (log2(e): log2 units).
template <class V, int RT>
void qk_rows(const float* q, const float* kt, int64_t ldk, int64_t hs, int64_t nkeys, float* s, int64_t lds,
             float out_mul) {
  constexpr int NV = V::kQkVecs, KT = NV * V::W;
  const typename V::T mul = V::set1(out_mul);
  for (int64_t j = 0; j < nkeys; j += KT) {
    typename V::T acc[RT][NV];
#pragma GCC unroll 8
    for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
      for (int n = 0; n < NV; ++n) acc[r][n] = V::zero();
    const float* kp = kt + j;
    for (int64_t d = 0; d < hs; ++d, kp += ldk) {
      typename V::T kv[NV];
      for (int n = 0; n < NV; ++n) kv[n] = V::load(kp + n * V::W);
#pragma GCC unroll 8
      for (int r = 0; r < RT; ++r) {
        const typename V::T b = V::set1(q[r * hs + d]);
        for (int n = 0; n < NV; ++n) acc[r][n] = V::fma(b, kv[n], acc[r][n]);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int n = 0; n < NV; ++n) V::store(s + r * lds + j + n * V::W, V::mul(acc[r][n], mul));
  }
}

template <class V, int RT>
void qk_tail(int rt, const float* q, const float* kt, int64_t ldk, int64_t hs, int64_t nkeys, float* s, int64_t lds,
             float out_mul) {
  if constexpr (RT > 0) {
    if (rt == RT) return qk_rows<V, RT>(q, kt, ldk, hs, nkeys, s, lds, out_mul);
    qk_tail<V, RT - 1>(rt, q, kt, ldk, hs, nkeys, s, lds, out_mul);
  }
}

// o[r] = o[r] * alpha[r] + P[r][0 : nkeys) . V[0 : nkeys) for RT rows, over
// all head dims. p: [RT][ldp]; vrows: [nkeys][head_size]; o: [RT][head_size].
template <class V, int RT>
void pv_rows(const float* p, int64_t ldp, const float* vrows, int64_t hs, int64_t nkeys, const float* alpha, float* o) {
  constexpr int NV = V::kPvVecs, DT = NV * V::W;
  for (int64_t c = 0; c < hs; c += DT) {
    typename V::T acc[RT][NV];
    for (int r = 0; r < RT; ++r) {
      const typename V::T a = V::set1(alpha[r]);
      for (int n = 0; n < NV; ++n) acc[r][n] = V::mul(V::load(o + r * hs + c + n * V::W), a);
    }
    const float* vp = vrows + c;
    for (int64_t j = 0; j < nkeys; ++j, vp += hs) {
      typename V::T vv[NV];
      for (int n = 0; n < NV; ++n) vv[n] = V::load(vp + n * V::W);
#pragma GCC unroll 8
      for (int r = 0; r < RT; ++r) {
        const typename V::T b = V::set1(p[r * ldp + j]);
        for (int n = 0; n < NV; ++n) acc[r][n] = V::fma(b, vv[n], acc[r][n]);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int n = 0; n < NV; ++n) V::store(o + r * hs + c + n * V::W, acc[r][n]);
  }
}

template <class V, int RT>
void pv_tail(int rt, const float* p, int64_t ldp, const float* vrows, int64_t hs, int64_t nkeys, const float* alpha,
             float* o) {
  if constexpr (RT > 0) {
    if (rt == RT) return pv_rows<V, RT>(p, ldp, vrows, hs, nkeys, alpha, o);
    pv_tail<V, RT - 1>(rt, p, ldp, vrows, hs, nkeys, alpha, o);
  }
}

// One row's online-softmax update over a key block: scores s[0 : nvalid) are
// real, s[nvalid : npad) masked; scores, the running max m and alpha are in
// log2 units (q carries the factor log2(e)), so P = 2^(s - m). Overwrites s
// with P (0 where masked), adds the row's P to its lane-wise sum `lsum`
// (reduced once, at the end: one horizontal add per row instead of one per
// block) and returns alpha, the factor for the row's earlier output and sum.
template <class V>
float softmax_row(float* s, int64_t nvalid, int64_t npad, float& m, typename V::T& lsum) {
  using T = typename V::T;
  const T neg_inf = V::set1(kNegInf), zero = V::zero();
  if (nvalid <= 0) {
    for (int64_t j = 0; j < npad; j += V::W) V::store(s + j, zero);
    return 1.f;
  }
  // Vectors wholly inside [0, nvalid) need no mask; only the tail does.
  const int64_t nfull = nvalid / V::W * V::W;
  T mx = neg_inf;
  for (int64_t j = 0; j < nfull; j += V::W) mx = V::max(mx, V::load(s + j));
  for (int64_t j = nfull; j < npad; j += V::W)
    mx = V::max(mx, V::keep_first(V::load(s + j), static_cast<int>(nvalid - j), neg_inf));
  const float m_new = std::max(m, V::hmax(mx));
  // Past the first blocks the running max rarely moves: no exp, no rescale.
  const float alpha = m_new == m ? 1.f : std::exp2(m - m_new);  // 0 on the first block (m = -inf)
  const T mv = V::set1(m_new);
  T sum0 = zero, sum1 = zero;
  int64_t j = 0;
  for (; j + 2 * V::W <= nfull; j += 2 * V::W) {
    const T e0 = V::exp2_le0(V::sub(V::load(s + j), mv)), e1 = V::exp2_le0(V::sub(V::load(s + j + V::W), mv));
    V::store(s + j, e0);
    V::store(s + j + V::W, e1);
    sum0 = V::add(sum0, e0);
    sum1 = V::add(sum1, e1);
  }
  for (; j < nfull; j += V::W) {
    const T e = V::exp2_le0(V::sub(V::load(s + j), mv));
    V::store(s + j, e);
    sum0 = V::add(sum0, e);
  }
  for (; j < npad; j += V::W) {
    const T e = V::keep_first(V::exp2_le0(V::sub(V::load(s + j), mv)), static_cast<int>(nvalid - j), zero);
    V::store(s + j, e);
    sum1 = V::add(sum1, e);
  }
  m = m_new;
  lsum = V::add(alpha == 1.f ? lsum : V::mul(lsum, V::set1(alpha)), V::add(sum0, sum1));
  return alpha;
}

struct Item {
  int64_t seq, kv_head, t0;
  int64_t cost;
};

// Start of each sequence's keys in the packed K/V buffers, lengths rounded
// up to whole key tiles: [num_seqs + 1].
std::vector<int64_t> padded_offsets(const Problem& p, int64_t key_tile) {
  std::vector<int64_t> pad_off(p.num_seqs + 1, 0);
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t len = p.cu_k[s + 1] - p.cu_k[s];
    pad_off[s + 1] = pad_off[s] + (len + key_tile - 1) / key_tile * key_tile;
  }
  return pad_off;
}

// The number of keys before a sequence's first query row: its cached
// context (0 for a fresh prefill). Query row t sits at position context + t.
inline int64_t context_len(const Problem& p, int64_t s) {
  return (p.cu_k[s + 1] - p.cu_k[s]) - (p.cu[s + 1] - p.cu[s]);
}

// Every (sequence, kv head, block of p.query_tokens query rows), in groups
// of one (sequence, kv head): the costliest group first, and in a group the
// costliest block first (a causal block's cost grows with its position).
// Group by group, the blocks a thread pulls one after another read the same
// packed K/V, which stays in its L2 (256 KiB at 512 float32 keys of head
// size 64); costliest-first over all blocks interleaved every group, so at
// 16 sequences each block read its keys from L3 or memory again. The threads
// still finish together: the last blocks pulled are the cheapest of the
// cheapest group.
std::vector<Item> work_items(const Problem& p) {
  std::vector<Item> items;
  std::vector<int64_t> group_cost(p.num_seqs * p.num_kv_heads, 0);
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t len = p.cu[s + 1] - p.cu[s], ctx = context_len(p, s), qt = p.query_tokens;
    for (int64_t h = 0; h < p.num_kv_heads; ++h)
      for (int64_t t0 = 0; t0 < len; t0 += qt) {
        items.push_back({s, h, t0, (p.causal ? ctx + t0 + qt : p.cu_k[s + 1] - p.cu_k[s]) * qt});
        group_cost[s * p.num_kv_heads + h] += items.back().cost;
      }
  }
  const auto group = [&](const Item& it) { return it.seq * p.num_kv_heads + it.kv_head; };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    const int64_t ga = group(a), gb = group(b);
    if (ga != gb) return group_cost[ga] != group_cost[gb] ? group_cost[ga] > group_cost[gb] : ga < gb;
    return a.cost > b.cost;
  });
  return items;
}

// The packed K and V of one call, per (sequence, kv head): K as `width` rows
// of lpad + kRowPad elements (lpad: the sequence's padded length), V as lpad
// rows of `width`. K rows are kRowPad elements longer than the keys so that
// prompts of 512, 1024, ... tokens do not put the rows a score tile walks at a
// stride of a multiple of 4 KiB (the same few L1 sets); a precaution: at
// 1 x 512 it measured within the noise (1.71 vs 1.77 ms). The buffers are
// kept per calling thread and only grow: freed and re-allocated per call,
// megabytes came back from the OS as fresh pages every call (page faults were
// 15% of a 16 x 32-token call). Plain pointers, because inside the parallel
// regions the thread_local would name the worker thread's own (empty) buffer.
template <class E>
struct PackedKV {
  const int64_t* pad_off;
  int64_t nkv, width;
  E* kt_base;
  E* v_base;
  E* kt(int64_t s, int64_t h) const {
    return kt_base + ((pad_off[s] + kRowPad * s) * nkv + h * (pad_off[s + 1] - pad_off[s] + kRowPad)) * width;
  }
  E* v(int64_t s, int64_t h) const { return v_base + (pad_off[s] * nkv + h * (pad_off[s + 1] - pad_off[s])) * width; }
};

// What one thread packs at a time: keys [k0, k1) of (sequence, kv head).
// Sequences are cut into chunks of Problem::pack_chunk keys (512; a
// multiple of 16, so the bf16 packer's transposes stay whole) so that few long ones
// still spread over every thread: a prefill of 32 new tokens over a 4096-token
// cached context has one sequence and three kv heads, three units for two
// threads, and the idle one spun in the OpenMP barrier.
struct PackUnit {
  int64_t seq, kv_head, k0, k1;
};
std::vector<PackUnit> pack_units(const Problem& p) {
  std::vector<PackUnit> units;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t len = p.cu_k[s + 1] - p.cu_k[s];
    for (int64_t h = 0; h < p.num_kv_heads; ++h)
      for (int64_t k0 = 0; k0 < len; k0 += p.pack_chunk) units.push_back({s, h, k0, std::min(len, k0 + p.pack_chunk)});
  }
  return units;
}

template <class E>
PackedKV<E> packed_kv(const Problem& p, const std::vector<int64_t>& pad_off, int64_t width) {
  thread_local std::vector<E> kt_buf, v_buf;
  const int64_t nkv = p.num_kv_heads, n = pad_off[p.num_seqs];
  const size_t kt_need = (n + kRowPad * p.num_seqs) * nkv * width, v_need = n * nkv * width;
  if (kt_buf.size() < kt_need) kt_buf.resize(kt_need);
  if (v_buf.size() < v_need) v_buf.resize(v_need);
  return {pad_off.data(), nkv, width, kt_buf.data(), v_buf.data()};
}

// The attention itself, shared by both kernels: work items pulled by the
// threads from an atomic counter; per key block the score tiles, the online
// softmax per row and the P V tiles. `Tiles` says how a Q row is held, how a
// block's scores and P V run over the packed K / V, and the lanes the softmax
// uses (Tiles::V).
template <class Tiles, int DT>
void run_items(const Problem& p, const std::vector<int64_t>& pad_off, const PackedKV<typename Tiles::E>& kv) {
  using V = typename Tiles::V;
  using Q = typename Tiles::Q;
  static_assert(kKeyBlock % Tiles::kKeyTile == 0, "key blocks must be whole key tiles");
  const int64_t hs = p.head_size, g = p.group, qw = Tiles::q_words(hs);
  const std::vector<Item> items = work_items(p);
  const int64_t max_rows = p.query_tokens * g;
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<Q> qs(max_rows * qw);
    std::vector<float> o(max_rows * hs), sc(max_rows * kKeyBlock), m(max_rows), alpha(max_rows);
    std::vector<typename V::T> lsum(max_rows);
    typename Tiles::Scratch scratch(max_rows);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
      const Item& it = items[i];
      const int64_t base = p.cu[it.seq], len = p.cu[it.seq + 1] - base, ctx = context_len(p, it.seq);
      const int64_t ldk = pad_off[it.seq + 1] - pad_off[it.seq] + kRowPad;
      const int64_t n = std::min(p.query_tokens, len - it.t0), rows = n * g;
      // Rows r = token * group + head in group.
      for (int64_t ti = 0; ti < n; ++ti)
        for (int64_t j = 0; j < g; ++j) {
          const void* qr = row_ptr<DT>(p.q, (base + it.t0 + ti) * p.q_ld + (it.kv_head * g + j) * hs);
          Tiles::template load_q<DT>(qr, qs.data() + (ti * g + j) * qw, hs, p.scale);
        }
      std::fill(o.begin(), o.begin() + rows * hs, 0.f);
      std::fill(m.begin(), m.begin() + rows, kNegInf);
      std::fill(lsum.begin(), lsum.begin() + rows, V::zero());
      const typename Tiles::E* kt = kv.kt(it.seq, it.kv_head);
      const typename Tiles::E* vv = kv.v(it.seq, it.kv_head);
      // Keys [0, kend): the last row's token sees them all. Rows and key blocks
      // are placed by absolute position, so a row gets the same arithmetic
      // whether its sequence's earlier keys came from a cached context or from
      // this call: a key block past a row's position is fully masked for it,
      // which leaves its max, sum and output exactly as they were.
      // Without the causal mask every row sees all of the sequence's keys.
      const int64_t kend = p.causal ? ctx + it.t0 + n : p.cu_k[it.seq + 1] - p.cu_k[it.seq];
      for (int64_t k0 = 0; k0 < kend; k0 += kKeyBlock) {
        const int64_t kw = std::min(kKeyBlock, kend - k0);
        const int64_t kwp = (kw + Tiles::kKeyTile - 1) / Tiles::kKeyTile * Tiles::kKeyTile;  // within the padding
        Tiles::qk(rows, qs.data(), qw, kt + k0, ldk, hs, kwp, p.scale, sc.data());
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t pos = p.causal ? ctx + it.t0 + r / g : kend - 1;  // the row sees keys [0, pos]
          const int64_t nvalid = std::min(pos + 1 - k0, kw);
          alpha[r] = Tiles::softmax(scratch, r, sc.data() + r * kKeyBlock, nvalid, kwp, m[r], lsum[r]);
        }
        Tiles::pv(rows, sc.data(), scratch, vv, k0, hs, kwp, alpha.data(), o.data());
      }
      for (int64_t ti = 0; ti < n; ++ti)
        for (int64_t j = 0; j < g; ++j) {
          const int64_t r = ti * g + j;
          const float l = V::hsum(lsum[r]), f = p.out_scale / l;
          const int64_t row = (base + it.t0 + ti) * p.num_heads + it.kv_head * g + j, dst = row * hs;
          if (p.lse != nullptr) {
            // m and the scores are in log2 units (see softmax_row).
            p.lse[row] = (m[r] + std::log2(l)) * 0.693147180559945309f;
            row_from_f32<0>(o.data() + r * hs, static_cast<float*>(p.out) + dst, hs, f);
          } else {
            row_from_f32<DT>(o.data() + r * hs, static_cast<char*>(p.out) + dst * (DT == 0 ? 4 : 2), hs, f);
          }
        }
    }
  });
}

// Float32 tiles over float32 K^T / V: q pre-scaled, P used as it is.
template <class Lanes>
struct Float32Tiles {
  using V = Lanes;
  using E = float;
  using Q = float;
  static constexpr int64_t kKeyTile = V::kQkVecs * V::W;
  struct Scratch {
    explicit Scratch(int64_t) {}
  };
  static int64_t q_words(int64_t hs) { return hs; }
  template <int DT>
  // q pre-scaled by scale; qk multiplies the scores by log2(e) (log2 units,
  // see exp2_le0_16). Folding log2(e) into q instead rounded every q element
  // once more: an error in each score that grows with sum |q_d k_d|, 4.7x torch
  // SDPA's error at scores in the hundreds (test_large_scores_stay_finite_and_exact).
  static void load_q(const void* qr, float* dst, int64_t hs, float scale) { row_to_f32<DT>(qr, dst, hs, scale); }
  static void qk(int64_t rows, const float* qs, int64_t, const float* kt, int64_t ldk, int64_t hs, int64_t kwp, float,
                 float* sc) {
    constexpr float kLog2e = 1.44269504088896341f;
    int64_t r = 0;
    for (; r + V::kQkRows <= rows; r += V::kQkRows)
      qk_rows<V, V::kQkRows>(qs + r * hs, kt, ldk, hs, kwp, sc + r * kKeyBlock, kKeyBlock, kLog2e);
    if (r < rows)
      qk_tail<V, V::kQkRows - 1>(static_cast<int>(rows - r), qs + r * hs, kt, ldk, hs, kwp, sc + r * kKeyBlock,
                                 kKeyBlock, kLog2e);
  }
  // The online softmax update of row r (P stays in the scores, as floats).
  static float softmax(Scratch&, int64_t, float* s, int64_t nvalid, int64_t npad, float& m, typename V::T& lsum) {
    return softmax_row<V>(s, nvalid, npad, m, lsum);
  }
  static void pv(int64_t rows, const float* sc, const Scratch&, const float* vv, int64_t k0, int64_t hs, int64_t kwp,
                 const float* alpha, float* o) {
    int64_t r = 0;
    for (; r + V::kPvRows <= rows; r += V::kPvRows)
      pv_rows<V, V::kPvRows>(sc + r * kKeyBlock, kKeyBlock, vv + k0 * hs, hs, kwp, alpha + r, o + r * hs);
    if (r < rows)
      pv_tail<V, V::kPvRows - 1>(static_cast<int>(rows - r), sc + r * kKeyBlock, kKeyBlock, vv + k0 * hs, hs, kwp,
                                 alpha + r, o + r * hs);
  }
};

template <class V, int DT>
void run(const Problem& p) {
  using Tiles = Float32Tiles<V>;
  const int64_t hs = p.head_size;
  // Packed K^T / V per (sequence, kv head), lengths padded to whole key
  // tiles (the last tile of a block reads up to there, never further).
  const std::vector<int64_t> pad_off = padded_offsets(p, Tiles::kKeyTile);
  // K^T: head_size rows of float32 keys; V: float32 rows.
  const PackedKV<float> kv = packed_kv<float>(p, pad_off, hs);

  const std::vector<PackUnit> units = pack_units(p);
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const PackUnit& u = units[i];
      const int64_t s = u.seq, h = u.kv_head, base = p.cu_k[s], len = p.cu_k[s + 1] - base;
      const int64_t lpad = pad_off[s + 1] - pad_off[s], ldk = lpad + kRowPad;
      float* kt = kv.kt(s, h);
      float* vv = kv.v(s, h);
      for (int64_t t = u.k0; t < u.k1; ++t) {
        const void* kr = row_ptr<DT>(p.k, (base + t) * p.k_ld + h * hs);
        for (int64_t d = 0; d < hs; ++d) kt[d * ldk + t] = fp8serve_cvt::load_as_f32<DT>(kr, d);
        row_to_f32<DT>(row_ptr<DT>(p.v, (base + t) * p.v_ld + h * hs), vv + t * hs, hs, 1.f);
      }
      if (u.k1 < len) continue;  // the sequence's padding: its last unit's
      for (int64_t d = 0; d < hs; ++d) std::fill(kt + d * ldk + len, kt + d * ldk + lpad, 0.f);
      std::fill(vv + len * hs, vv + lpad * hs, 0.f);
    }
  });

  run_items<Tiles, DT>(p, pad_off, kv);
}

#if defined(FP8SERVE_VEC16) && defined(__AVX512BF16__)
#define FP8SERVE_BF16_DOT 1
// ------------------------------------------------------- bf16 dot products
// For bf16 inputs on CPUs with AVX512-BF16 (and no AMX, where
// prefill_attention_amx.cpp runs): the same schedule with vdpbf16ps, which
// multiplies pairs of bf16 and adds both products into a float32 lane: 32
// multiply-adds per instruction against an FMA's 16. Q, K and V keep their
// bf16 values (exact); P is rounded to bf16 before P V, as GPU flash kernels
// and the AMX kernel do; scores, softmax and accumulators stay float32.
// Layouts, pairs being two consecutive bf16 in one 32-bit word:
//   K: [head_size / 2][keys] pairs (k[key][2d], k[key][2d + 1]): a score tile
//      lane is one key, and a word of a K row already is that pair;
//   V: [keys / 2][head_size] pairs (v[2j][d], v[2j + 1][d]): an output lane is
//      one head dim, the pair runs over two keys;
//   Q and P: rows of pairs, broadcast one word at a time.
struct Bf16Dot {
  static constexpr int W = 16, kQkRows = 8, kQkVecs = 2, kPvRows = 6, kPvVecs = 4;
};

template <int RT>
void qk_rows_bf16(const uint32_t* q, int64_t hp, const uint32_t* kt, int64_t ldk, int64_t nkeys, float scale,
                  float* s, int64_t lds) {
  constexpr int NV = Bf16Dot::kQkVecs, KT = NV * Bf16Dot::W;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < nkeys; j += KT) {
    __m512 acc[RT][NV];
#pragma GCC unroll 8
    for (int r = 0; r < RT; ++r)
#pragma GCC unroll 8
      for (int n = 0; n < NV; ++n) acc[r][n] = _mm512_setzero_ps();
    const uint32_t* kp = kt + j;
    for (int64_t d = 0; d < hp; ++d, kp += ldk) {
      __m512i kv[NV];
      for (int n = 0; n < NV; ++n) kv[n] = _mm512_loadu_si512(kp + n * Bf16Dot::W);
#pragma GCC unroll 8
      for (int r = 0; r < RT; ++r) {
        const __m512i b = _mm512_set1_epi32(static_cast<int>(q[r * hp + d]));
        for (int n = 0; n < NV; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], (__m512bh)kv[n], (__m512bh)b);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int n = 0; n < NV; ++n) _mm512_storeu_ps(s + r * lds + j + n * Bf16Dot::W, _mm512_mul_ps(acc[r][n], sv));
  }
}

template <int RT>
void qk_tail_bf16(int rt, const uint32_t* q, int64_t hp, const uint32_t* kt, int64_t ldk, int64_t nkeys, float scale,
                  float* s, int64_t lds) {
  if constexpr (RT > 0) {
    if (rt == RT) return qk_rows_bf16<RT>(q, hp, kt, ldk, nkeys, scale, s, lds);
    qk_tail_bf16<RT - 1>(rt, q, hp, kt, ldk, nkeys, scale, s, lds);
  }
}

// o[r] = o[r] * alpha[r] + P[r] . V over nkeys (even) keys; p: rows of
// nkeys / 2 pairs at stride ldp words; v2: [nkeys / 2][hs] pairs.
template <int RT>
void pv_rows_bf16(const uint32_t* p, int64_t ldp, const uint32_t* v2, int64_t hs, int64_t nkeys, const float* alpha,
                  float* o) {
  constexpr int NV = Bf16Dot::kPvVecs, DT = NV * Bf16Dot::W;
  for (int64_t c = 0; c < hs; c += DT) {
    __m512 acc[RT][NV];
    for (int r = 0; r < RT; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int n = 0; n < NV; ++n) acc[r][n] = _mm512_mul_ps(_mm512_loadu_ps(o + r * hs + c + n * Bf16Dot::W), a);
    }
    const uint32_t* vp = v2 + c;
    for (int64_t j = 0; j < nkeys / 2; ++j, vp += hs) {
      __m512i vv[NV];
      for (int n = 0; n < NV; ++n) vv[n] = _mm512_loadu_si512(vp + n * Bf16Dot::W);
#pragma GCC unroll 8
      for (int r = 0; r < RT; ++r) {
        const __m512i b = _mm512_set1_epi32(static_cast<int>(p[r * ldp + j]));
        for (int n = 0; n < NV; ++n) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], (__m512bh)vv[n], (__m512bh)b);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int n = 0; n < NV; ++n) _mm512_storeu_ps(o + r * hs + c + n * Bf16Dot::W, acc[r][n]);
  }
}

template <int RT>
void pv_tail_bf16(int rt, const uint32_t* p, int64_t ldp, const uint32_t* v2, int64_t hs, int64_t nkeys,
                  const float* alpha, float* o) {
  if constexpr (RT > 0) {
    if (rt == RT) return pv_rows_bf16<RT>(p, ldp, v2, hs, nkeys, alpha, o);
    pv_tail_bf16<RT - 1>(rt, p, ldp, v2, hs, nkeys, alpha, o);
  }
}

// bf16 pairs over the packed K / V pairs: q kept as it is (the scale goes on
// the scores), P rounded to bf16 pairs before P V.
struct Bf16DotTiles {
  using V = Avx512;  // softmax on float32 scores
  using E = uint32_t;
  using Q = uint32_t;
  static constexpr int64_t kKeyTile = Bf16Dot::kQkVecs * Bf16Dot::W;
  static constexpr int64_t kPairsPerRow = kKeyBlock / 2;
  struct Scratch {
    std::vector<uint32_t> p;  // [rows][kKeyBlock / 2] P pairs
    explicit Scratch(int64_t max_rows) : p(max_rows * kPairsPerRow) {}
  };
  static int64_t q_words(int64_t hs) { return hs / 2; }
  template <int DT>
  static void load_q(const void* qr, uint32_t* dst, int64_t hs, float) {
    static_assert(DT == 1, "bf16 inputs only");
    std::memcpy(dst, qr, hs * 2);
  }
  static void qk(int64_t rows, const uint32_t* qs, int64_t qw, const uint32_t* kt, int64_t ldk, int64_t, int64_t kwp,
                 float scale, float* sc) {
    scale *= 1.44269504088896341f;  // log2(e): scores in log2 units, for softmax's 2^x
    int64_t r = 0;
    for (; r + Bf16Dot::kQkRows <= rows; r += Bf16Dot::kQkRows)
      qk_rows_bf16<Bf16Dot::kQkRows>(qs + r * qw, qw, kt, ldk, kwp, scale, sc + r * kKeyBlock, kKeyBlock);
    if (r < rows)
      qk_tail_bf16<Bf16Dot::kQkRows - 1>(static_cast<int>(rows - r), qs + r * qw, qw, kt, ldk, kwp, scale,
                                         sc + r * kKeyBlock, kKeyBlock);
  }
  // softmax_row's update for scores in log2 units (qk scaled them by
  // log2(e)), so each exponential is exp2_le0's 2^x: no multiply by log2(e)
  // and no two-constant reduction. P goes straight to row r's bf16 pairs
  // (32 floats -> 16 words a step; npad is a multiple of 32) instead of being
  // stored as floats and converted in a second pass; the sums add the
  // unrounded exponentials, as before.
  static float softmax(Scratch& scratch, int64_t r, const float* s, int64_t nvalid, int64_t npad, float& m,
                       __m512& lsum) {
    uint32_t* prow = scratch.p.data() + r * kPairsPerRow;
    const __m512 zero = _mm512_setzero_ps();
    if (nvalid <= 0) {
      for (int64_t j = 0; j < npad; j += 32) _mm512_storeu_si512(prow + j / 2, _mm512_setzero_si512());
      return 1.f;
    }
    const int64_t nfull = nvalid / 16 * 16;
    __m512 mx = _mm512_set1_ps(kNegInf);
    for (int64_t j = 0; j < nfull; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
    for (int64_t j = nfull; j < npad; j += 16)
      mx = _mm512_max_ps(mx, Avx512::keep_first(_mm512_loadu_ps(s + j), static_cast<int>(nvalid - j), mx));
    const float m_new = std::max(m, _mm512_reduce_max_ps(mx));
    const float alpha = m_new == m ? 1.f : std::exp2(m - m_new);  // 0 on the first block (m = -inf)
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum0 = zero, sum1 = zero;
    for (int64_t j = 0; j < npad; j += 32) {
      __m512 e0 = exp2_le0_16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
      __m512 e1 = exp2_le0_16(_mm512_sub_ps(_mm512_loadu_ps(s + j + 16), mv));
      if (j + 32 > nfull) {  // the masked tail: keys past the row's position weigh 0
        e0 = Avx512::keep_first(e0, static_cast<int>(nvalid - j), zero);
        e1 = Avx512::keep_first(e1, static_cast<int>(nvalid - j - 16), zero);
      }
      sum0 = _mm512_add_ps(sum0, e0);
      sum1 = _mm512_add_ps(sum1, e1);
      _mm512_storeu_si512(prow + j / 2, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    m = m_new;
    lsum = _mm512_add_ps(alpha == 1.f ? lsum : _mm512_mul_ps(lsum, _mm512_set1_ps(alpha)), _mm512_add_ps(sum0, sum1));
    return alpha;
  }
  static void pv(int64_t rows, const float*, const Scratch& scratch, const uint32_t* v2, int64_t k0, int64_t hs,
                 int64_t kwp, const float* alpha, float* o) {
    const uint32_t* pb = scratch.p.data();
    int64_t r = 0;
    for (; r + Bf16Dot::kPvRows <= rows; r += Bf16Dot::kPvRows)
      pv_rows_bf16<Bf16Dot::kPvRows>(pb + r * kPairsPerRow, kPairsPerRow, v2 + k0 / 2 * hs, hs, kwp, alpha + r,
                                     o + r * hs);
    if (r < rows)
      pv_tail_bf16<Bf16Dot::kPvRows - 1>(static_cast<int>(rows - r), pb + r * kPairsPerRow, kPairsPerRow,
                                         v2 + k0 / 2 * hs, hs, kwp, alpha + r, o + r * hs);
  }
};

// r[i] = 16 words of row i; afterwards r[j] word k = row k's word j.
inline void transpose16x16_epi32(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + 4 + i], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
  }
}

// vpermt2w indexes interleaving two rows of 32 bf16 (a, b) into pairs (a[d], b[d]):
// [0] for d 0-15, [1] for d 16-31.
struct PairInterleave {
  alignas(64) uint16_t idx[2][32];
  constexpr PairInterleave() : idx() {
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 32; ++i) idx[h][i] = static_cast<uint16_t>((i % 2 ? 32 : 0) + 16 * h + i / 2);
  }
};
inline constexpr PairInterleave kPairInterleave{};

// bf16 inputs only (DT 1); head_size a multiple of 64.
void run_bf16_dot(const Problem& p) {
  const int64_t hs = p.head_size, hp = hs / 2;
  const std::vector<int64_t> pad_off = padded_offsets(p, Bf16DotTiles::kKeyTile);
  // K: head_size / 2 rows of pairs; V: rows of head_size pairs per two keys
  // (lpad / 2 of them: a width of head_size / 2 words per key).
  const PackedKV<uint32_t> kv = packed_kv<uint32_t>(p, pad_off, hp);

  const std::vector<PackUnit> units = pack_units(p);
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const PackUnit& u = units[i];
      const int64_t s = u.seq, h = u.kv_head, base = p.cu_k[s], len = p.cu_k[s + 1] - base;
      const int64_t lpad = pad_off[s + 1] - pad_off[s], ldk = lpad + kRowPad;
      uint32_t* kt = kv.kt(s, h);
      uint16_t* v2 = reinterpret_cast<uint16_t*>(kv.v(s, h));  // [lpad / 2][hs][2] halves
      // Whole groups of 16 keys in registers: K's 16 rows of hp pairs transposed 16 x 16 at a
      // time, V's rows interleaved two by two (the scalar loop below did this one element at a
      // time: ~11% of a 16 x 512 call).
      const int64_t len16 = len / 16 * 16;
      const __m512i pair_lo = _mm512_load_si512(kPairInterleave.idx[0]);
      const __m512i pair_hi = _mm512_load_si512(kPairInterleave.idx[1]);
      for (int64_t t0 = u.k0; t0 < std::min(u.k1, len16); t0 += 16) {
        const uint32_t* krow[16];
        for (int i = 0; i < 16; ++i)
          krow[i] = static_cast<const uint32_t*>(row_ptr<1>(p.k, (base + t0 + i) * p.k_ld + h * hs));
        for (int64_t w0 = 0; w0 < hp; w0 += 16) {
          __m512i r[16];
          for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(krow[i] + w0);
          transpose16x16_epi32(r);
          for (int j = 0; j < 16; ++j) _mm512_storeu_si512(kt + (w0 + j) * ldk + t0, r[j]);
        }
        for (int64_t t = t0; t < t0 + 16; t += 2) {
          const uint16_t* a = static_cast<const uint16_t*>(row_ptr<1>(p.v, (base + t) * p.v_ld + h * hs));
          const uint16_t* b = static_cast<const uint16_t*>(row_ptr<1>(p.v, (base + t + 1) * p.v_ld + h * hs));
          uint16_t* dst = v2 + (t / 2) * hs * 2;
          for (int64_t c = 0; c < hs; c += 32) {
            const __m512i x = _mm512_loadu_si512(a + c), y = _mm512_loadu_si512(b + c);
            _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(x, pair_lo, y));
            _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(x, pair_hi, y));
          }
        }
      }
      for (int64_t t = std::max(u.k0, len16); t < u.k1; ++t) {
        const uint32_t* kr = static_cast<const uint32_t*>(row_ptr<1>(p.k, (base + t) * p.k_ld + h * hs));
        for (int64_t d = 0; d < hp; ++d) kt[d * ldk + t] = kr[d];
        const uint16_t* vr = static_cast<const uint16_t*>(row_ptr<1>(p.v, (base + t) * p.v_ld + h * hs));
        uint16_t* dst = v2 + (t / 2) * hs * 2 + (t % 2);
        for (int64_t d = 0; d < hs; ++d) dst[2 * d] = vr[d];
      }
      if (u.k1 < len) continue;  // the sequence's padding: its last unit's
      for (int64_t d = 0; d < hp; ++d) std::fill(kt + d * ldk + len, kt + d * ldk + lpad, 0u);
      // Padded keys: zero V (their P is 0 too; 0 * 0 keeps the sums exact).
      for (int64_t t = len; t < lpad; ++t) {
        uint16_t* dst = v2 + (t / 2) * hs * 2 + (t % 2);
        for (int64_t d = 0; d < hs; ++d) dst[2 * d] = 0;
      }
    }
  });

  run_items<Bf16DotTiles, 1>(p, pad_off, kv);
}
#endif

constexpr int64_t kBestPath = 0, kAvx2Path = 1, kAvx512Path = 2, kScalarPath = 3, kBf16DotPath = 4;

int64_t pick_path(int64_t path, int64_t head_size, int dtype) {
  const bool bf16_ok =
#ifdef FP8SERVE_BF16_DOT
      dtype == 1 && head_size % (Bf16Dot::kPvVecs * Bf16Dot::W) == 0;
#else
      (static_cast<void>(dtype), false);
#endif
  const bool avx512_ok =
#ifdef FP8SERVE_VEC16
      head_size % (Avx512::kPvVecs * Avx512::W) == 0;
#else
      false;
#endif
  const bool avx2_ok =
#ifdef FP8SERVE_VEC8
      head_size % (Avx2::kPvVecs * Avx2::W) == 0;
#else
      false;
#endif
  if (path == kBestPath) return bf16_ok ? kBf16DotPath : avx512_ok ? kAvx512Path : avx2_ok ? kAvx2Path : kScalarPath;
  TORCH_CHECK(path != kBf16DotPath || bf16_ok,
              "prefill_attention: the bf16 dot-product path needs an AVX512-BF16 build, bf16 inputs and head_size % 64 == 0");
  TORCH_CHECK(path != kAvx512Path || avx512_ok, "prefill_attention: the AVX-512 path needs an AVX-512 build and head_size % 64 == 0");
  TORCH_CHECK(path != kAvx2Path || avx2_ok, "prefill_attention: the AVX2 path needs an AVX2/FMA/F16C build and head_size % 32 == 0");
  TORCH_CHECK(path == kScalarPath || path == kAvx2Path || path == kAvx512Path || path == kBf16DotPath,
              "prefill_attention: unknown path ", path);
  return path;
}

template <int DT>
void run_path(const Problem& p, int64_t path) {
  switch (path) {
#ifdef FP8SERVE_BF16_DOT
    case kBf16DotPath:
      if constexpr (DT == 1) return run_bf16_dot(p);
      [[fallthrough]];  // pick_path gives this path bf16 inputs only
#endif
#ifdef FP8SERVE_VEC16
    case kAvx512Path: return run<Avx512, DT>(p);
#endif
#ifdef FP8SERVE_VEC8
    case kAvx2Path: return run<Avx2, DT>(p);
#endif
    default: return run<Scalar, DT>(p);
  }
}

}  // namespace

// softmax(scale * q k^T + causal mask) v * out_scale for each sequence of a
// packed varlen batch; returns [num_tokens, num_heads, head_size] in q's dtype.
// path: 0 best, 1 AVX2, 2 AVX-512, 3 scalar, 4 bf16 dot products (bf16 inputs, AVX512-BF16 builds).
// cu_seqlens_k (prefill_attention_with_context): sequence s has keys/values
// [cu_k[s], cu_k[s + 1]) and its queries are the last cu[s + 1] - cu[s] of
// those positions (a prefill continuing a cached context: causal from the
// bottom right, as flash_attn_varlen_func with causal=True).
// prefix_lse (prefill_attention_over_prefix): no causal mask, a float32 out
// and the rows' log-sum-exp written there; every sequence needs a key.
at::Tensor prefill_attention_impl(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor cu_seqlens,
                                  const at::Tensor* cu_seqlens_k, double scale, double out_scale, int64_t path,
                                  const at::Tensor* prefix_lse = nullptr) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "prefill_attention: query/key/value must be 3-D");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(), "prefill_attention: CPU tensors only");
  const auto dt = query.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "prefill_attention: float32, bf16 or fp16 only");
  TORCH_CHECK(key.scalar_type() == dt && value.scalar_type() == dt, "prefill_attention: query, key and value dtypes differ");
  const int64_t num_tokens = query.size(0), nh = query.size(1), hs = query.size(2), nkv = key.size(1);
  const int64_t num_keys = key.size(0);
  TORCH_CHECK(key.size(2) == hs && value.sizes() == key.sizes() && (cu_seqlens_k != nullptr || num_keys == num_tokens),
              "prefill_attention: key/value shapes do not match the query");
  TORCH_CHECK(nkv > 0 && nh % nkv == 0, "prefill_attention: num_heads must be a multiple of num_kv_heads");
  for (const auto* t : {&query, &key, &value})
    TORCH_CHECK(t->stride(2) == 1 && (t->size(1) <= 1 || t->stride(1) == hs), "prefill_attention: heads must be contiguous");
  for (const at::Tensor* c : {static_cast<const at::Tensor*>(&cu_seqlens), cu_seqlens_k}) {
    if (c == nullptr) continue;
    TORCH_CHECK(c->dim() == 1 && c->scalar_type() == at::kLong && c->is_contiguous() && c->size(0) >= 1,
                "prefill_attention: cu_seqlens must be a contiguous int64 vector");
  }
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const int64_t num_seqs = cu_seqlens.size(0) - 1;
  TORCH_CHECK(cu[0] == 0 && cu[num_seqs] == num_tokens, "prefill_attention: cu_seqlens must run from 0 to num_tokens");
  for (int64_t s = 0; s < num_seqs; ++s) TORCH_CHECK(cu[s + 1] >= cu[s], "prefill_attention: cu_seqlens must not decrease");
  const int64_t* cu_k = cu;
  if (cu_seqlens_k != nullptr) {
    TORCH_CHECK(cu_seqlens_k->size(0) == num_seqs + 1, "prefill_attention: cu_seqlens_k must have num_seqs + 1 entries");
    cu_k = cu_seqlens_k->data_ptr<int64_t>();
    TORCH_CHECK(cu_k[0] == 0 && cu_k[num_seqs] == num_keys, "prefill_attention: cu_seqlens_k must run from 0 to the number of keys");
    for (int64_t s = 0; s < num_seqs; ++s) {
      if (prefix_lse != nullptr) {
        TORCH_CHECK(cu_k[s + 1] - cu_k[s] >= 1, "prefill_attention_over_prefix: a sequence has no keys");
      } else {
        TORCH_CHECK(cu_k[s + 1] - cu_k[s] >= cu[s + 1] - cu[s],
                    "prefill_attention: a sequence has fewer keys than queries (its queries are its last positions)");
      }
    }
  }

  at::Tensor out = at::empty({num_tokens, nh, hs}, query.options().dtype(prefix_lse != nullptr ? at::kFloat : dt));
  Problem p{num_seqs, nh, nkv, hs, nh / nkv, cu, cu_k, static_cast<float>(scale), static_cast<float>(out_scale),
            query.data_ptr(), key.data_ptr(), value.data_ptr(), query.stride(0), key.stride(0), value.stride(0),
            out.data_ptr(), dt == at::kFloat ? 0 : dt == at::kBFloat16 ? 1 : 2};
  if (prefix_lse != nullptr) {
    const at::Tensor& lse = *prefix_lse;
    TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 2 && lse.size(0) == num_tokens &&
                    lse.size(1) == nh,
                "prefill_attention_over_prefix: lse must be a contiguous float32 [num_tokens, num_heads] tensor");
    p.causal = false;
    p.lse = lse.data_ptr<float>();
    // Few query rows over many keys (a decode batch over a shared prefix):
    // smaller items and packing units, so both threads get work.
    const int64_t threads = at::get_num_threads();
    while (p.query_tokens > 4 && (num_tokens + p.query_tokens - 1) / p.query_tokens * nkv < 4 * threads)
      p.query_tokens /= 2;
    p.pack_chunk = 128;
  }
  if (num_tokens == 0) return out;
  const int64_t chosen = pick_path(path, hs, p.dtype);
  if (p.dtype == 0) run_path<0>(p, chosen);
  else if (p.dtype == 1) run_path<1>(p, chosen);
  else run_path<2>(p, chosen);
  return out;
}

at::Tensor prefill_attention(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor cu_seqlens, double scale,
                             double out_scale, int64_t path) {
  return prefill_attention_impl(query, key, value, cu_seqlens, nullptr, scale, out_scale, path);
}

at::Tensor prefill_attention_with_context(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor cu_seqlens,
                                          at::Tensor cu_seqlens_k, double scale, double out_scale, int64_t path) {
  return prefill_attention_impl(query, key, value, cu_seqlens, &cu_seqlens_k, scale, out_scale, path);
}

// Cascade attention's prefix phase (paged_attention.cpp): softmax(scale q k^T) v
// with no causal mask, sequence s's queries [cu[s], cu[s + 1]) over its keys
// [cu_k[s], cu_k[s + 1]) (at least one). Returns out as float32 [num_tokens,
// num_heads, head_size]; lse [num_tokens, num_heads] float32 gets each row's
// log of the sum of exp(scaled score), natural log; out is multiplied by out_scale.
at::Tensor prefill_attention_over_prefix(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor cu_seqlens,
                                         at::Tensor cu_seqlens_k, double scale, double out_scale, int64_t path,
                                         at::Tensor lse) {
  return prefill_attention_impl(query, key, value, cu_seqlens, &cu_seqlens_k, scale, out_scale, path, &lse);
}

// Whether this build has the bf16 dot-product path (AVX512-BF16 at build time).
bool prefill_attention_has_bf16_dot() {
#ifdef FP8SERVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(fp8serve, m) {
  m.def("prefill_attention", &prefill_attention);
  m.def("prefill_attention_with_context", &prefill_attention_with_context);
  m.def("prefill_attention_over_prefix(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens, "
        "Tensor cu_seqlens_k, float scale, float out_scale, int path, Tensor(a!) lse) -> Tensor",
        &prefill_attention_over_prefix);
  m.def("prefill_attention_has_bf16_dot", &prefill_attention_has_bf16_dot);
}
