"""Ask Linux to back large CPU buffers (the KV cache, the weights) with 2 MiB
pages.

Decode reads every sequence's blocks in every layer each step, and every
weight once per step; with 4 KiB pages those walks miss the TLB constantly
and hardware prefetch stops at every page boundary. Where transparent huge
pages are in `madvise` mode (a common default) nothing is huge unless asked
for. Best effort: any failure leaves the buffer as it was.
FP8SERVE_HUGE_PAGES=0 turns it off everywhere; FP8SERVE_KV_HUGE_PAGES=0 and
FP8SERVE_WEIGHT_HUGE_PAGES=0 for the KV cache or the weights only.

Measured (2-vCPU Xeon VM, bf16, the default model's 120 linear layers, M=64
rows): 50.1 ms per pass over the layers with 4 KiB pages, 31.3 ms with the
weights packed on 2 MiB pages; 82.4 vs 67.7 ms when the caches are flushed
between layers as a decode step's attention does."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys

import torch

logger = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 * 1024 * 1024


def huge_pages_enabled(kind: str) -> bool:
    """kind: "kv" or "weight"."""
    if os.environ.get("FP8SERVE_HUGE_PAGES", "1") == "0":
        return False
    return os.environ.get(f"FP8SERVE_{kind.upper()}_HUGE_PAGES", "1") != "0"


def advise_huge_pages(t: torch.Tensor, kind: str = "kv") -> bool:
    """madvise(MADV_HUGEPAGE) on the 2 MiB-aligned part of `t`'s storage;
    call before the buffer is first written. True if the kernel accepted."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    if not huge_pages_enabled(kind):
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


class HugePageArena:
    """One buffer from a 2 MiB boundary, advised MADV_HUGEPAGE before its
    first write, handing out 64-byte-aligned tensors in order: where copies
    of the weights made once at load (the packed GEMV layouts, the greedy
    head's int8 screen) belong. Made one at a time with torch.empty, a few
    MiB each, they came from pages the allocator had already handed out,
    which madvise does not make huge: in the engine, none of the bf16
    default model's 256 MiB of packed copies was on a 2 MiB page. On one
    arena, all of it (Zen 4 EPYC guest,
    benchmarks/results/weight_pages_2026-12-07_zen4.md): decode steps at
    batch 16 1.02-1.13x as fast in four runs of five (0.997x in one), an FP8
    checkpoint's at batch 1 1.07x, bf16 batch 1-4 with the screen 1.02-1.04x;
    batch 32-64 within 1%.
    """

    ALIGN = 64

    def __init__(self, raw: torch.Tensor, start: int, nbytes: int) -> None:
        self._buffer = raw[start:start + nbytes]
        self._used = 0

    @classmethod
    def span(cls, nbytes: int) -> int:
        """The bytes a tensor of `nbytes` takes in an arena (its start aligned)."""
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    @classmethod
    def allocate(cls, nbytes: int, kind: str = "weight") -> "HugePageArena | None":
        """An arena of `nbytes` (sum `span` over what it will hold): whole huge
        pages from a 2 MiB boundary, one page more allocated than they need.
        None where huge pages are off for `kind` or madvise is refused."""
        if nbytes <= 0 or not sys.platform.startswith("linux") or not huge_pages_enabled(kind):
            return None
        pages = -(-nbytes // _HUGE_PAGE)
        raw = torch.empty((pages + 1) * _HUGE_PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % _HUGE_PAGE
        if not advise_huge_pages(raw[start:start + pages * _HUGE_PAGE], kind):
            return None
        return cls(raw, start, nbytes)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """The next free bytes of the arena as an uninitialized contiguous tensor."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._used + nbytes > self._buffer.numel():
            raise RuntimeError(f"HugePageArena: {nbytes} bytes asked with {self._buffer.numel() - self._used} of "
                               f"{self._buffer.numel()} left (the arena was sized for less than it is given)")
        out = self._buffer[self._used:self._used + nbytes].view(dtype).view(tuple(shape))
        self._used += self.span(nbytes)
        return out


def pack_parameters_on_huge_pages(model: torch.nn.Module, min_bytes: int = 4096) -> int:
    """Move the CPU parameters of `model` (those of at least `min_bytes`)
    into one 2 MiB-page-backed buffer per dtype, each 64-byte aligned, and
    point the parameters at their slices. Shared (tied) parameters move
    once. Returns the bytes moved (0 when huge pages are off or refused).

    Parameters are laid out in registration order, which for our models is
    execution order, so a decode step streams one region per dtype. The
    threshold was 1 MiB, which left most of an FP8 checkpoint's matrices
    (0.3-0.9 MB of codes: qkv, o_proj, down_proj of SmolLM2) and the bf16
    model's o_proj where the allocator put them. Packing those too
    (measured, two engines in one process alternating decode steps, FP8
    checkpoint at batch 1): 13.4 -> 12.5 and 15.6 -> 13.2 ms per step in
    two runs with bf16 compute, 14.8 -> 13.4 ms with float32 compute; at
    batch 16 50.4 -> 47.7 ms; the bf16 default model 15.1 -> 14.5 ms. The
    same pair with both engines packed alike differed by 1%."""
    if not sys.platform.startswith("linux") or not huge_pages_enabled("weight"):
        return 0
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen or p.device.type != "cpu" or not p.is_contiguous():
            continue
        seen.add(id(p))
        if p.numel() * p.element_size() >= min_bytes:
            by_dtype.setdefault(p.dtype, []).append(p)
    moved = 0
    for dtype, params in by_dtype.items():
        arena = HugePageArena.allocate(sum(HugePageArena.span(p.numel() * p.element_size()) for p in params))
        if arena is None:
            continue  # refused: leave this group where it is
        for p in params:
            dst = arena.empty(p.shape, dtype)
            dst.copy_(p.data)
            p.data = dst
            moved += p.numel() * p.element_size()
    return moved
