"""Pick the attention backend for a device."""

from __future__ import annotations

import logging

import torch

from fp8serve.attention.backends.base import AttentionBackend
from fp8serve.attention.backends.torch_sdpa import TorchSDPABackend
from fp8serve.attention.kv_cache_spec import KVCacheSpec

logger = logging.getLogger(__name__)


def select_backend(spec: KVCacheSpec, compute_dtype: torch.dtype, device: torch.device) -> AttentionBackend:
    if device.type == "cpu":
        from fp8serve.kernels.cpu_ops import load_cpu_ops

        if load_cpu_ops() is not None:
            from fp8serve.attention.backends.cpu_paged import CpuPagedBackend

            logger.info("Attention backend: cpu_paged (C++ decode kernel over the paged cache)")
            return CpuPagedBackend(spec, compute_dtype)
    logger.info("Attention backend: torch_sdpa (reference)")
    return TorchSDPABackend(spec, compute_dtype)
