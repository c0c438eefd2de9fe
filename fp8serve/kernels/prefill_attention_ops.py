"""Causal attention for fresh prefills on CPU: a thin wrapper over the C++
kernel in `cpu/prefill_attention.cpp`, its float64 reference, and where it
pays.

A fresh prefill attends each new token to the K/V of its own sequence's
tokens (no cached context), packed varlen as in `flash_attn_varlen_func`:
no padding to the longest prompt, GQA groups share each K/V load.

`applies(dtype, num_tokens, num_seqs)` says where the kernel replaces
torch's SDPA, measured with `benchmarks/prefill_attention.py`:
- float32 (the dtype `--dtype auto` picks on CPUs without AMX/AVX512-BF16),
  where torch's CPU flash kernel reaches about a third of the matmul peak;
  for bf16 torch's flash kernel runs on AMX tiles and is faster than ours;
- prompts of 64 tokens or more on average: at 16 x 32 tokens SDPA was faster
  (0.33 vs 0.43 ms), at 16 x 64 they tied, from 128 tokens the kernel won
  (1.4x at 1 x 128, 1.7x at 1 x 512).
"""

from __future__ import annotations

import torch

from fp8serve.kernels.cpu_ops import load_cpu_ops

_PATHS = {"best": 0, "avx2": 1, "avx512": 2, "scalar": 3}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Compute dtypes where the kernel is faster than F.scaled_dot_product_attention.
_FASTER_THAN_SDPA = (torch.float32,)
# Below this mean prompt length per sequence SDPA is as fast or faster.
MIN_MEAN_PROMPT_TOKENS = 64


def is_available() -> bool:
    ops = load_cpu_ops()
    return ops is not None and hasattr(ops, "prefill_attention")


def applies(dtype: torch.dtype, num_tokens: int, num_seqs: int) -> bool:
    return (dtype in _FASTER_THAN_SDPA and num_tokens >= MIN_MEAN_PROMPT_TOKENS * num_seqs
            and is_available())


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size] and key/value "
                         f"[num_tokens, num_kv_heads, head_size]; got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}")
    num_tokens, num_heads, head_size = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_size:
        raise ValueError(f"key/value {tuple(key.shape)} do not match query {tuple(query.shape)}")
    if num_heads % key.shape[1]:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {key.shape[1]}")
    if query.dtype not in _DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"query/key/value must share one of {_DTYPES}; got {query.dtype}/{key.dtype}/{value.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int64 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a [num_seqs + 1] int64 tensor, got {tuple(cu_seqlens.shape)} "
                         f"{cu_seqlens.dtype}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.device.type != "cpu":
            raise ValueError(f"prefill_attention is a CPU kernel; {name} is on {t.device}")
        if t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(1) != head_size):
            raise ValueError(f"{name}'s heads must be contiguous (strides {t.stride()})")


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]; rows may be strided (a view of fused qkv)
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    cu_seqlens: torch.Tensor,  # [num_seqs + 1] int64: sequence s is tokens [cu[s], cu[s+1])
    scale: float,
    out_scale: float = 1.0,
    *,
    path: str = "best",  # "avx512", "avx2" or "scalar": force one set of tiles (tests, benchmarks)
) -> torch.Tensor:  # [num_tokens, num_heads, head_size], query's dtype
    """softmax(scale * q k^T + causal mask) v * out_scale per sequence.
    FP8 scales fold in: scale = softmax_scale * k_scale, out_scale = v_scale."""
    ops = load_cpu_ops()
    if ops is None or not hasattr(ops, "prefill_attention"):
        raise RuntimeError("C++ CPU kernels are not available")
    if path not in _PATHS:
        raise ValueError(f"unknown path {path!r}; expected one of {list(_PATHS)}")
    _check(query, key, value, cu_seqlens)
    return ops.prefill_attention(query, key, value, cu_seqlens.contiguous(), float(scale), float(out_scale),
                                 _PATHS[path])


def prefill_attention_ref(query, key, value, cu_seqlens, scale, out_scale=1.0) -> torch.Tensor:
    """Plain PyTorch reference with the kernel's contract, in float64."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        if a == b:
            continue
        q = query[a:b].double().transpose(0, 1)  # [heads, n, d]
        k = key[a:b].double().repeat_interleave(group, dim=1).transpose(0, 1)
        v = value[a:b].double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) * scale
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out[a:b] = (p @ v).transpose(0, 1) * out_scale
    return out
