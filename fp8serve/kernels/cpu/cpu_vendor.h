// The CPU vendor, for kernels whose best memory access pattern differs
// between vendors' hardware prefetchers (see dense_gemv.cpp, fp8_gemm.cpp:
// their weight-row walks at one or two activation rows).
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
