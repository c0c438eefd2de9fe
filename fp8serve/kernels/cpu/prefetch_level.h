// Which cache level a kernel's software prefetch of soon-needed data targets,
// by vendor. The Xeon of stops 8-18 was measured with every prefetch into L1
// (_MM_HINT_T0). On AMD Zen 4 (a 2-vCPU guest, stop 20), prefetching the
// paged KV cache into L2 instead (_MM_HINT_T1) let more misses overlap: cold
// decode attention ran 1.4-1.9x as fast over float32 caches and 1.2-2.0x over
// bf16 ones, FP8 1.03-1.12x, and hot calls within 3% (paged_attention.cpp).
#pragma once

#include <cstdint>

#include "cpu_vendor.h"

namespace fp8serve_prefetch {

enum Level : int64_t { kL1 = 1, kL2 = 2 };

// The level this CPU's KV-cache prefetches target.
inline Level kv_level() { return fp8serve_cpu::is_amd() ? kL2 : kL1; }

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

}  // namespace fp8serve_prefetch
