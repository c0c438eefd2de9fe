"""glibc malloc settings for a CPU engine process: freed activations stay in
the process for the next forward instead of going back to the OS.

Why: with glibc's defaults, 16 x 512-token prefill steps of the default
model took 14,000 to 570,000 minor page faults each (up to 2.2 GB of pages
the kernel zeroes and maps, every step), depending on what the process had
allocated before: a forward's large activations (the gate_up output alone is
25 MB at 4096 tokens) were mmapped and unmapped, or trimmed off the top of
the heap, and the next allocation faulted its pages in again. Fixed
thresholds stop both: blocks up to 32 MiB (glibc's largest mmap threshold)
come from the heap, and up to 256 MiB of free memory at the heap's top stays
there; ~1,000 faults per step remain. Setting only one of the two was worse
(the other keeps its static default: 459k and 895k faults per step). On the
2-vCPU Zen 4 guest the steps ran 1.02-1.13x as fast, the most where the
faults were most (benchmarks/results/malloc_tuning_2026-12-01_zen4.md).

The cost is memory the process keeps: up to 256 MiB freed at the heap's top
is not returned. Blocks above 32 MiB are still mapped per allocation (bigger
models' activations): an allocator such as jemalloc or tcmalloc (LD_PRELOAD)
covers those, as vLLM recommends for CPU serving; glibc's settings then do
nothing. FP8SERVE_MALLOC_TUNING=0 leaves glibc's defaults alone."""

from __future__ import annotations

import ctypes
import logging
import sys

from fp8serve.utils.env_switch import env_switch

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 256 << 20

_applied = False


def _glibc():
    """The C library if it is glibc (it has mallopt and says its version), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl, or no symbols
        return None
    version.restype = ctypes.c_char_p
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return libc


def tune_malloc() -> bool:
    """Fixes glibc's mmap and trim thresholds (see the module docstring) once
    per process; True if they are in effect. FP8SERVE_MALLOC_TUNING=0 (or off,
    false, no) skips it; auto (the default) and 1 apply it where the C
    library is glibc."""
    global _applied
    if _applied:
        return True
    if env_switch("FP8SERVE_MALLOC_TUNING") is False:
        return False
    libc = _glibc()
    if libc is None:
        return False
    ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
          and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not ok:
        logger.warning("glibc %s refused the malloc thresholds; large activations may page-fault every step",
                       libc.gnu_get_libc_version().decode())
        return False
    _applied = True
    logger.info("glibc malloc: mmap threshold %d MiB, trim threshold %d MiB, so freed activations are reused "
                "without page faults (FP8SERVE_MALLOC_TUNING=0: glibc's defaults)",
                MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20)
    return True
