"""Extra copies of weights made once at load (oneDNN's blocked layout, the
packed GEMV layouts): whether a copy fits, and one copy per weight however
many layers share it.

Why a quarter of the available memory: the copies are a speed-up, not a
need; the KV cache and the activations come first (the KV cache's default is
sized from the same figure, `CacheConfig.default_kv_cache_memory`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from fp8serve.utils.platform import available_memory_bytes


def copy_fits(total_bytes: int, what: str, log: logging.Logger) -> bool:
    """Whether a copy of `total_bytes` fits in a quarter of the memory available now; logs why
    not (as "<what> not packed: ...") when it does not."""
    budget = available_memory_bytes() // 4
    if total_bytes > budget:
        log.info("%s not packed: the copy needs %.0f MiB, over a quarter of the memory available (%.0f MiB)",
                 what, total_bytes / 2**20, budget / 2**20)
        return False
    return True


def pack_each_weight_once(layers: Iterable[nn.Module], slot: str, pack: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Sets `layer.<slot> = pack(layer.weight)` on every layer, packing a weight that several layers
    share (a tied LM head and its embedding) once. Returns the number of distinct weights packed."""
    packed: dict[int, torch.Tensor] = {}
    for m in layers:
        if id(m.weight) not in packed:
            packed[id(m.weight)] = pack(m.weight)
        setattr(m, slot, packed[id(m.weight)])
    return len(packed)
