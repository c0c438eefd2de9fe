// Causal attention for fresh bf16 prefills on AMX tiles: the bf16
// counterpart of prefill_attention.cpp (same contract: packed varlen
// sequences, GQA, scale = softmax_scale * k_scale, out_scale = v_scale).
//
// Why: with --dtype auto on an AMX CPU the model computes in bf16, and
// torch's CPU flash attention took ~1.4 ms per layer of a 1 x 512 prefill of
// the default model (~0.3 GFLOP: ~230 GFLOP/s, a seventh of what AMX does for
// the linear layers next to it), 28% of the whole prefill.
//
// How: per sequence and kv head, K is copied dense (it is already the A
// operand of S^T = K Q^T: a row per key) and V is packed transposed (A of
// O^T = V^T P^T: a row per head element), both zero-padded to whole blocks of
// 32 keys. Then per query head and block of 16 queries, Q^T is packed as a B
// operand (head-element pairs down, queries across) and every key block up to
// the causal limit does: S^T (32 keys x 16 queries, two tiles); the online
// softmax lane by lane (a lane per query: max, sum and rescale are vertical,
// no horizontal reductions), the reference max moving only when a score beats
// it by kRescaleSlack; P^T rounded to bf16 as a B operand (key pairs down);
// and O^T += V^T P^T, kept in tiles 4-7 across key blocks for head_size <= 64
// (stored only to rescale) or added to memory four tiles at a time. The output
// rows are gathered down O^T at the end. Work items (sequence, query head,
// query block) go to threads from a counter, costliest first.
//
// Numerics: q, k, v are bf16 already; products are exact and sums float32,
// as in torch's kernel; P is rounded to bf16 before P V (as GPU flash kernels
// do in bf16), which torch's CPU kernel does not. Measured over 40 seeds: at
// most 2.8 x 2^-9 of the largest output off the float64 reference, 0.9x
// torch SDPA's error in the median and 1.3x at most. Splitting P into two
// bf16 parts (hi + lo, twice the P V products) brought that to at most 0.87x
// SDPA's but cost a quarter of the kernel's speed (1 x 512: 1.28x SDPA
// instead of 1.54x in the same script), and the default model's logits moved
// no closer to transformers' (max |dlogit| to float64 0.33 against 0.31, a
// 218-token prompt): not kept.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx_tiles.h"
#include "vec16.h"

#if defined(FP8SERVE_AMX) && defined(FP8SERVE_VEC16) && defined(__AVX512BF16__)
#define FP8SERVE_AMX_ATTENTION 1
#endif

namespace {

#ifdef FP8SERVE_AMX_ATTENTION

constexpr int64_t kQueryRows = 16;  // queries per block: the 16 columns of Q^T / P^T tiles
constexpr int64_t kKeyBlock = 32;   // keys per step: two S tiles, one P tile's 32 bf16
constexpr float kRescaleSlack = 8.f;  // see query_block

struct Problem {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  uint16_t* out;
  const int64_t* cu;
  int64_t q_stride, k_stride, v_stride;  // elements between consecutive tokens
  int64_t num_seqs, num_heads, num_kv_heads, head_size;
  float scale, out_scale;
};

// K of one sequence and kv head as A tiles for S^T = K Q^T: rows are keys,
// so this is K itself, copied dense and zero-padded to whole key blocks.
void pack_k(const uint16_t* k, int64_t stride, int64_t len, int64_t padded, int64_t hs, uint16_t* kp) {
  for (int64_t key = 0; key < len; ++key) std::memcpy(kp + key * hs, k + key * stride, hs * sizeof(uint16_t));
  std::memset(kp + len * hs, 0, (padded - len) * hs * sizeof(uint16_t));
}

// V^T of one sequence and kv head as A tiles for O^T = V^T P^T: tile (b, d)
// is 16 head elements [16 d, 16 d + 16) x the 32 keys of block b, row-major.
void pack_vt(const uint16_t* v, int64_t stride, int64_t len, int64_t padded, int64_t hs, uint16_t* vt) {
  const int64_t chunks = hs / 16;
  std::memset(vt, 0, padded * hs * sizeof(uint16_t));
  // 16 keys at a time: one 32-bit gather down the rows fetches the pair of
  // head elements (2 r, 2 r + 1) of each key; their low and high halves are
  // rows 2 r and 2 r + 1 of the tile, 16 keys each.
  const __m512i down = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(stride / 2)));
  int64_t key = 0;
  for (; key + 16 <= len; key += 16) {
    const int64_t b = key / kKeyBlock, j = key % kKeyBlock;
    const auto* base = reinterpret_cast<const int*>(v + key * stride);
    for (int64_t e = 0; e < hs; e += 2) {
      const __m512i pair = _mm512_i32gather_epi32(down, base + e / 2, 4);
      uint16_t* row0 = vt + ((b * chunks + e / 16) * 16 + e % 16) * kKeyBlock + j;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row0), _mm512_cvtepi32_epi16(pair));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row0 + kKeyBlock), _mm512_cvtepi32_epi16(_mm512_srli_epi32(pair, 16)));
    }
  }
  for (; key < len; ++key) {
    const uint16_t* row = v + key * stride;
    const int64_t b = key / kKeyBlock, j = key % kKeyBlock;
    for (int64_t d = 0; d < chunks; ++d)
      for (int64_t r = 0; r < 16; ++r) vt[((b * chunks + d) * 16 + r) * kKeyBlock + j] = row[d * 16 + r];
  }
}

// Q^T of a block of 16 queries as B tiles: for head chunk c (32 elements), row
// r holds the pair q[n][32 c + 2 r .. + 1] of every query n (zero past rows).
// 16 x 16 transpose of 32-bit elements in registers: r[i] is row i on entry,
// column i on return (unpacks within 128-bit lanes, then a 4 x 4 transpose of
// the lanes).
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // lane L of r[i + j]: column 4 L + j of rows i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Q^T of a block of 16 queries as B tiles: for head chunk c (32 elements), row
// r holds the pair q[n][32 c + 2 r .. + 1] of every query n (zero past rows):
// each chunk's 16 x 16 block of pairs, transposed.
void pack_qt(const uint16_t* q, int64_t stride, int64_t rows, int64_t hs, uint32_t* qt) {
  const int64_t chunks = hs / 32;
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i r[16];
    for (int64_t n = 0; n < 16; ++n)
      r[n] = n < rows ? _mm512_loadu_si512(q + n * stride + c * 32) : _mm512_setzero_si512();
    transpose16x16(r);
    for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(qt + c * 256 + i * 16, r[i]);
  }
}

// One block of up to 16 queries [q0, q0 + rows) (sequence-local positions)
// of one query head against keys [0, q0 + rows). Scores are computed
// transposed (a row per key, a lane per query), so the online softmax's max,
// sum and rescale are lane-wise vector ops with no horizontal reductions.
void query_block(const Problem& p, const uint32_t* qt, int64_t q0, int64_t rows, const uint16_t* kp,
                 const uint16_t* vt, uint16_t* out, int64_t out_stride, std::vector<float>& ot) {
  const int64_t hs = p.head_size, kchunks = hs / 32, vchunks = hs / 16;
  const int64_t num_blocks = (q0 + rows + kKeyBlock - 1) / kKeyBlock;
  alignas(64) float st[kKeyBlock][16];     // S^T of one key block
  alignas(64) uint16_t pt[16][kKeyBlock];  // P^T as B tile: key pairs x 16 queries x 2
  alignas(64) float c[4][16][16];
  std::fill(ot.begin(), ot.end(), 0.f);  // O^T: [head element][query], the worker's buffer
  // head_size <= 64: O^T lives in tiles 4-7 (one per 16 head elements).
  const bool resident = vchunks <= 4;
  const auto store_ot = [&] {
    _tile_stored(4, ot.data(), 64);
    if (vchunks > 1) _tile_stored(5, ot.data() + 256, 64);
    if (vchunks > 2) _tile_stored(6, ot.data() + 512, 64);
    if (vchunks > 3) _tile_stored(7, ot.data() + 768, 64);
  };
  const auto load_ot = [&] {
    _tile_loadd(4, ot.data(), 64);
    if (vchunks > 1) _tile_loadd(5, ot.data() + 256, 64);
    if (vchunks > 2) _tile_loadd(6, ot.data() + 512, 64);
    if (vchunks > 3) _tile_loadd(7, ot.data() + 768, 64);
  };
  if (resident) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
  }
  const __m512 scale = _mm512_set1_ps(p.scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Interleaves two rows of 16 bf16 (a | b) into pairs (a0 b0 a1 b1 ...).
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 m = ninf, l = _mm512_setzero_ps();
  // Lanes past `rows` are padding: treated as the block's last query so that
  // they never hold an all-masked (NaN-producing) row; their outputs are dropped.
  const __m512i qpos = _mm512_add_epi32(_mm512_min_epi32(lane, _mm512_set1_epi32(static_cast<int>(rows - 1))),
                                        _mm512_set1_epi32(static_cast<int>(q0)));

  for (int64_t b = 0; b < num_blocks; ++b) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t cc = 0; cc < kchunks; ++cc) {
      _tile_loadd(3, qt + cc * 256, 64);
      _tile_loadd(2, kp + (b * kKeyBlock) * hs + cc * 32, hs * 2);
      _tile_dpbf16ps(0, 2, 3);
      _tile_loadd(2, kp + (b * kKeyBlock + 16) * hs + cc * 32, hs * 2);
      _tile_dpbf16ps(1, 2, 3);
    }
    _tile_stored(0, &st[0][0], 64);
    _tile_stored(1, &st[16][0], 64);

    __m512 x[kKeyBlock];
    __m512 m_blk = ninf;
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      // key 32 b + j is visible to the queries at or after it
      const __mmask16 vis = _mm512_cmpge_epi32_mask(qpos, _mm512_set1_epi32(static_cast<int>(b * kKeyBlock + j)));
      x[j] = _mm512_mask_mul_ps(ninf, vis, _mm512_load_ps(&st[j][0]), scale);
      m_blk = _mm512_max_ps(m_blk, x[j]);
    }
    // The reference point m moves only when a score exceeds it by more than
    // kRescaleSlack (or on the first block): P = exp(x - m) then stays below
    // e^8 ~ 3e3, harmless in float32 sums and in bf16's relative precision,
    // and the rescaling of O^T is rare instead of once per block.
    const __mmask16 grew = _mm512_cmp_ps_mask(m_blk, _mm512_add_ps(m, _mm512_set1_ps(kRescaleSlack)), _CMP_GT_OQ);
    if (grew) {
      const __m512 m_new = _mm512_mask_blend_ps(grew, m, m_blk);
      const __m512 alpha = _mm512_mask_blend_ps(grew, _mm512_set1_ps(1.f),
                                                fp8serve_vec16::exp_fma(_mm512_sub_ps(m, m_new)));  // 0 for m = -inf
      l = _mm512_mul_ps(l, alpha);
      if (resident && b > 0) store_ot();
      for (int64_t d = 0; d < hs; ++d) _mm512_storeu_ps(&ot[d * 16], _mm512_mul_ps(alpha, _mm512_loadu_ps(&ot[d * 16])));
      if (resident && b > 0) load_ot();
      m = m_new;
    }
    for (int64_t j = 0; j < kKeyBlock; j += 2) {
      const __mmask16 v0 = _mm512_cmp_ps_mask(x[j], ninf, _CMP_NEQ_OQ);
      const __mmask16 v1 = _mm512_cmp_ps_mask(x[j + 1], ninf, _CMP_NEQ_OQ);
      const __m512 p0 = _mm512_maskz_mov_ps(v0, fp8serve_vec16::exp_fma(_mm512_sub_ps(x[j], m)));
      const __m512 p1 = _mm512_maskz_mov_ps(v1, fp8serve_vec16::exp_fma(_mm512_sub_ps(x[j + 1], m)));
      l = _mm512_add_ps(l, _mm512_add_ps(p0, p1));
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // p0 in the low half
      _mm512_store_si512(reinterpret_cast<__m512i*>(&pt[j / 2][0]), _mm512_permutexvar_epi16(pairs, both));
    }

    // O^T += V^T P^T, 16 head elements per C tile. Up to 64 of them stay in
    // tiles 4-7 across key blocks (stored only to rescale, and at the end);
    // wider heads go four tiles at a time through memory. Either way the
    // four tile products are independent, so they overlap.
    _tile_loadd(3, &pt[0][0], 64);
    const uint16_t* vb = vt + b * vchunks * 16 * kKeyBlock;
    constexpr int64_t kVtTile = 16 * kKeyBlock;
    if (resident) {
      _tile_loadd(2, vb, kKeyBlock * 2);
      _tile_dpbf16ps(4, 2, 3);
      if (vchunks > 1) {
        _tile_loadd(2, vb + kVtTile, kKeyBlock * 2);
        _tile_dpbf16ps(5, 2, 3);
      }
      if (vchunks > 2) {
        _tile_loadd(2, vb + 2 * kVtTile, kKeyBlock * 2);
        _tile_dpbf16ps(6, 2, 3);
      }
      if (vchunks > 3) {
        _tile_loadd(2, vb + 3 * kVtTile, kKeyBlock * 2);
        _tile_dpbf16ps(7, 2, 3);
      }
    } else {
      for (int64_t d0 = 0; d0 < vchunks; d0 += 4) {
        // head_size is a multiple of 32 here: vchunks is even, and > 4, so a multiple of 2; the
        // last group may hold two chunks.
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        _tile_loadd(2, vb + d0 * kVtTile, kKeyBlock * 2);
        _tile_dpbf16ps(4, 2, 3);
        _tile_loadd(2, vb + (d0 + 1) * kVtTile, kKeyBlock * 2);
        _tile_dpbf16ps(5, 2, 3);
        if (d0 + 2 < vchunks) {
          _tile_loadd(2, vb + (d0 + 2) * kVtTile, kKeyBlock * 2);
          _tile_dpbf16ps(6, 2, 3);
          _tile_loadd(2, vb + (d0 + 3) * kVtTile, kKeyBlock * 2);
          _tile_dpbf16ps(7, 2, 3);
        }
        _tile_stored(4, &c[0][0][0], 64);
        _tile_stored(5, &c[1][0][0], 64);
        _tile_stored(6, &c[2][0][0], 64);
        _tile_stored(7, &c[3][0][0], 64);
        for (int64_t t = 0; t < std::min<int64_t>(4, vchunks - d0); ++t)
          for (int64_t r = 0; r < 16; ++r) {
            float* row = &ot[((d0 + t) * 16 + r) * 16];
            _mm512_storeu_ps(row, _mm512_add_ps(_mm512_loadu_ps(row), _mm512_load_ps(&c[t][r][0])));
          }
      }
    }
  }
  if (resident) store_ot();
  // out[n][d] = O^T[d][n] * out_scale / l[n]: scale the columns, then read
  // each query's row as a gather down O^T (stride 16 floats).
  const __m512 f = _mm512_div_ps(_mm512_set1_ps(p.out_scale), l);
  for (int64_t d = 0; d < hs; ++d) _mm512_storeu_ps(&ot[d * 16], _mm512_mul_ps(f, _mm512_loadu_ps(&ot[d * 16])));
  const __m512i down = _mm512_mullo_epi32(lane, _mm512_set1_epi32(16));
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t d = 0; d < hs; d += 16)
      fp8serve_vec16::store<1>(out + n * out_stride, d, _mm512_i32gather_ps(down, &ot[d * 16 + n], 4));
}

void run(const Problem& p) {
  const int64_t hs = p.head_size, nkv = p.num_kv_heads, group = p.num_heads / nkv;
  // Packed K and V per (sequence, kv head), each padded to whole key blocks.
  std::vector<int64_t> base(p.num_seqs + 1, 0);
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t len = p.cu[s + 1] - p.cu[s];
    base[s + 1] = base[s] + (len + kKeyBlock - 1) / kKeyBlock * kKeyBlock * nkv * hs;
  }
  std::vector<uint16_t> kt(base[p.num_seqs]), vt(base[p.num_seqs]);
  at::parallel_for(0, p.num_seqs * nkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / nkv, h = item % nkv, t0 = p.cu[s], len = p.cu[s + 1] - t0;
      const int64_t padded = (len + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
      const int64_t off = base[s] + h * padded * hs;
      pack_k(p.k + t0 * p.k_stride + h * hs, p.k_stride, len, padded, hs, kt.data() + off);
      pack_vt(p.v + t0 * p.v_stride + h * hs, p.v_stride, len, padded, hs, vt.data() + off);
    }
  });

  // Work items: (sequence, query head, block of 16 queries), costliest (last
  // blocks: most keys) first, pulled from a counter so threads balance.
  struct Item {
    int64_t seq, head, q0;
  };
  std::vector<Item> items;
  for (int64_t s = 0; s < p.num_seqs; ++s)
    for (int64_t q0 = 0; q0 < p.cu[s + 1] - p.cu[s]; q0 += kQueryRows)
      for (int64_t h = 0; h < p.num_heads; ++h) items.push_back({s, h, q0});
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.q0 > b.q0; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    fp8serve_amx::configure_16x64({0, 1, 2, 3, 4, 5, 6, 7});
    std::vector<uint32_t> qt(hs / 32 * 256);
    std::vector<float> ot(hs * 16);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
      const Item& it = items[i];
      const int64_t t0 = p.cu[it.seq], len = p.cu[it.seq + 1] - t0, rows = std::min(kQueryRows, len - it.q0);
      const int64_t kvh = it.head / group, padded = (len + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
      const int64_t off = base[it.seq] + kvh * padded * hs;
      pack_qt(p.q + (t0 + it.q0) * p.q_stride + it.head * hs, p.q_stride, rows, hs, qt.data());
      query_block(p, qt.data(), it.q0, rows, kt.data() + off, vt.data() + off,
                  p.out + (t0 + it.q0) * p.num_heads * hs + it.head * hs, p.num_heads * hs, ot);
    }
    _tile_release();
  });
}

#endif  // FP8SERVE_AMX_ATTENTION

}  // namespace

bool prefill_attention_amx_available() {
#ifdef FP8SERVE_AMX_ATTENTION
  return fp8serve_amx::permitted();
#else
  return false;
#endif
}

// query [T, H, D], key/value [T, Hkv, D], bf16, heads contiguous (token rows
// may be strided); cu_seqlens [S + 1] int64. Returns [T, H, D] bf16.
at::Tensor prefill_attention_amx(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor cu_seqlens,
                                 double scale, double out_scale) {
  TORCH_CHECK(prefill_attention_amx_available(), "prefill_attention_amx: this build or process has no AMX tiles");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "prefill_attention_amx: 3-D tensors only");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                  value.scalar_type() == at::kBFloat16, "prefill_attention_amx: bf16 only");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "prefill_attention_amx: CPU tensors only");
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2), Hkv = key.size(1);
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == T && key.size(2) == D,
              "prefill_attention_amx: key/value shapes do not match query");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "prefill_attention_amx: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(D % 32 == 0, "prefill_attention_amx: head_size must be a multiple of 32, got ", D);
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->stride(2) == 1 && (t->size(1) <= 1 || t->stride(1) == D),
                "prefill_attention_amx: heads must be contiguous");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous() &&
                  cu_seqlens.size(0) >= 1, "prefill_attention_amx: cu_seqlens must be a contiguous int64 [S + 1]");
  const int64_t S = cu_seqlens.size(0) - 1;
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[S] == T, "prefill_attention_amx: cu_seqlens must run from 0 to num_tokens");
  for (int64_t s = 0; s < S; ++s) TORCH_CHECK(cu[s + 1] >= cu[s], "prefill_attention_amx: cu_seqlens must not decrease");
  at::Tensor out = at::empty({T, H, D}, query.options().memory_format(at::MemoryFormat::Contiguous));
#ifdef FP8SERVE_AMX_ATTENTION
  if (T > 0) {
    const Problem p{reinterpret_cast<const uint16_t*>(query.data_ptr()), reinterpret_cast<const uint16_t*>(key.data_ptr()),
                    reinterpret_cast<const uint16_t*>(value.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
                    cu, query.stride(0), key.stride(0), value.stride(0), S, H, Hkv, D,
                    static_cast<float>(scale), static_cast<float>(out_scale)};
    run(p);
  }
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(fp8serve, m) {
  m.def("prefill_attention_amx", &prefill_attention_amx);
  m.def("prefill_attention_amx_available", &prefill_attention_amx_available);
}
