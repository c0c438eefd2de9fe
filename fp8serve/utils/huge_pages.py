"""Ask Linux to back large CPU buffers (the KV cache) with 2 MiB pages.

Decode reads every sequence's blocks in every layer each step; with 4 KiB
pages that walk misses the TLB constantly and hardware prefetch stops at
every page boundary. Where transparent huge pages are in `madvise` mode (a
common default) nothing is huge unless asked for. Best effort: any failure
leaves the buffer as it was; FP8SERVE_KV_HUGE_PAGES=0 turns it off."""

from __future__ import annotations

import ctypes
import logging
import os
import sys

import torch

logger = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 * 1024 * 1024


def advise_huge_pages(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) on the 2 MiB-aligned part of `t`'s storage;
    call before the buffer is first written. True if the kernel accepted."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    if os.environ.get("FP8SERVE_KV_HUGE_PAGES", "1") == "0":
        return False
    nbytes = t.numel() * t.element_size()
    start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (t.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False
