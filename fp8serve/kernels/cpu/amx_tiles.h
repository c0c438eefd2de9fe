// What every AMX kernel here needs: the process's permission to use the tile
// state and a tile configuration. Linux grants the tile data state only on
// request (arch_prctl ARCH_REQ_XCOMP_PERM); where that fails, a kernel must
// not execute tile instructions.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#define FP8SERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <initializer_list>

namespace fp8serve_amx {

inline bool permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures the listed tiles as 16 rows x 64 bytes (the only shape these
// kernels use); once per thread before its first tile instruction.
inline void configure_16x64(std::initializer_list<int> tiles) {
  TileConfig c;
  for (int t : tiles) c.rows[t] = 16, c.colsb[t] = 64;
  // GCC does not treat ldtilecfg as reading the 64 bytes: without this
  // barrier a build of a variant of amx_linear.cpp dropped the rows/colsb
  // stores (only the palette byte was written) and the instruction faulted.
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

}  // namespace fp8serve_amx
#endif
