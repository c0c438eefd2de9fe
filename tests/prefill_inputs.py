"""Inputs of the prefill attention kernels in tests: varlen packed q, k and v as the model hands
them over (strided views of one fused qkv row per token) and cu_seqlens."""

from __future__ import annotations

import torch


def packed_qkv_inputs(g: torch.Generator, lens, num_heads: int, num_kv_heads: int, head_size: int,
                      dtype: torch.dtype, magnitude: float = 2.0):
    """(q [T, num_heads, head_size], k and v [T, num_kv_heads, head_size], cu_seqlens [len(lens) + 1])
    for sequences of `lens` tokens (T their sum): random values of about `magnitude`, in `dtype`."""
    total = sum(lens)
    qkv = (torch.randn(total, (num_heads + 2 * num_kv_heads) * head_size, generator=g) * magnitude).to(dtype)
    q = qkv[:, :num_heads * head_size].view(total, num_heads, head_size)
    k = qkv[:, num_heads * head_size:(num_heads + num_kv_heads) * head_size].view(total, num_kv_heads, head_size)
    v = qkv[:, (num_heads + num_kv_heads) * head_size:].view(total, num_kv_heads, head_size)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    return q, k, v, cu
