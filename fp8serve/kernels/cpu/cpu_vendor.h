// Which vendor's CPU this process runs on, for the few choices the kernels
// make by vendor because the hardware prefetchers differ (row_walk.h,
// prefetch_level.h).
#pragma once

namespace fp8serve_cpu {

// Whether this process runs on an AMD CPU; false where the compiler cannot tell.
inline bool is_amd() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return amd;
#else
  return false;
#endif
}

}  // namespace fp8serve_cpu
