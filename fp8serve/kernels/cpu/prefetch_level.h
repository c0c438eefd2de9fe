// Which cache level the kernels' software prefetches of soon-needed data
// target, by vendor. The Xeon of stops 8-18 was measured with every prefetch
// into L1 (_MM_HINT_T0). On AMD Zen 4 (a 2-vCPU guest, stop 20), prefetching
// into L2 instead (_MM_HINT_T1) let more misses overlap:
//   - paged decode attention, cold: 1.4-1.9x as fast over float32 caches,
//     1.2-1.9x over bf16 ones, 1.06-1.3x over FP8; hot calls on caches that
//     fit in L3 within 3%, larger float32 ones 2.7-2.8x;
//   - dense_gemv's interleaved walk (3-16 activation rows), the default
//     model's 120 decode linears: 1.17-1.44x (float32), 1.27-1.66x (bf16).
// fp8_gemm keeps L1: its loops are bound by the FP8 decode, and L2 measured
// 0.96-1.01x there (scratch build).
#pragma once

#include <cstdint>

#include "cpu_vendor.h"

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace fp8serve_prefetch {

enum Level : int64_t { kL1 = 1, kL2 = 2 };

// The level this CPU's prefetches target.
inline Level level() { return fp8serve_cpu::is_amd() ? kL2 : kL1; }

// Prefetches the 64-byte line holding p into `level` (and the levels below it).
// Inline asm, not _mm_prefetch: with _mm_prefetch under a runtime branch on
// the level, GCC 12 -O3 left no prefetch at all in the attention tiles (seen in
// the assembly; the tiles then ran 1.4x slower).
inline void line(const void* p, Level level) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  if (level == kL2) {
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
  } else {
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  }
#else
  (void)p, (void)level;
#endif
}

// The same with the level fixed at compile time, for inner loops: no branch.
// (The runtime version above cost dense_gemv's bf16 tiles up to 2x.)
template <Level L>
inline void line(const void* p) {
#if defined(__SSE__)
  _mm_prefetch(static_cast<const char*>(p), L == kL2 ? _MM_HINT_T1 : _MM_HINT_T0);
#else
  (void)p;
#endif
}

}  // namespace fp8serve_prefetch
