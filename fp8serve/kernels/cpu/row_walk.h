// How a GEMV at one or two activation rows walks the weight rows
// (dense_gemv.cpp, fp8_gemm.cpp). Interleaved: a few rows per tile with a
// software prefetch ahead, the best measured on a Xeon. Sequential: one row at
// a time, no software prefetch, so each thread reads its rows front to back as
// one stream, the best measured on AMD Zen 4. The best differs by vendor (their
// hardware prefetchers), so the default picks by vendor; each kernel's header
// has its numbers.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

#include "cpu_vendor.h"

namespace fp8serve_walk {

enum Walk : int64_t { kAutoWalk = 0, kInterleaved = 1, kSequential = 2 };

// Activation rows that may walk sequentially: past two, the loops are bound
// by FMAs, and more weight rows per tile share each activation load.
constexpr int64_t kMaxSequentialRows = 2;

using fp8serve_cpu::is_amd;

// Rejects a walk code that is not a Walk, and kSequential past kMaxSequentialRows rows.
inline void check(int64_t walk, int64_t M) {
  TORCH_CHECK(walk == kAutoWalk || walk == kInterleaved || walk == kSequential, "walk must be 0, 1 or 2, got ", walk);
  TORCH_CHECK(walk != kSequential || M <= kMaxSequentialRows, "the sequential walk takes at most ",
              kMaxSequentialRows, " rows, got ", M);
}

// Whether a call with `walk` at M activation rows walks sequentially.
inline bool sequential(int64_t walk, int64_t M) {
  if (walk == kAutoWalk) return is_amd() && M <= kMaxSequentialRows;
  return walk == kSequential;
}

}  // namespace fp8serve_walk
