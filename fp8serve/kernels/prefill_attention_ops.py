"""Causal attention for prefills on CPU (fresh, or continuing a cached
context: `cu_seqlens_k`): a thin wrapper over the C++
kernels in `cpu/prefill_attention.cpp` (float32, AVX2/AVX-512) and
`cpu/prefill_attention_amx.cpp` (bf16 on AMX tiles), their float64
reference, and where they pay.

A fresh prefill attends each new token to the K/V of its own sequence's
tokens (no cached context), packed varlen as in `flash_attn_varlen_func`:
no padding to the longest prompt, GQA groups share each K/V load.

`applies(dtype, num_tokens, num_seqs)` says where a kernel replaces
torch's SDPA, measured with `benchmarks/prefill_attention.py`:
- float32 (the dtype `--dtype auto` picks on CPUs without AMX/AVX512-BF16),
  where torch's CPU flash kernel reaches about a third of the matmul peak,
  at every prompt length. From 128 tokens the kernel won on a Zen 4 (1.4x
  at 1 x 128, 1.7x at 1 x 512); at 16 x 32 SDPA was faster there (0.33 vs
  0.43 ms) and they tied at 16 x 64, which on an AVX2-only Zen 2 the kernel
  ran 1.31-1.58x as fast. Below 16 tokens the two are within noise on the
  Zen 2 (SDPA / kernel 0.76-1.08x in one run, 0.95-1.46x in another,
  results/prefill_attention_small_2026-12-05_zen2.md): at most ~0.15 ms a
  layer, well under 1% of such a step's linear layers, paid so that every float32 prefill, fresh or
  continuing a cached prefix (the kernel's context form), computes each row
  in the same order. Torch's SDPA does not: a prompt's first rows came out
  an ulp or so apart when the prompt was 14 tokens long rather than 16, so
  prefix caching changed the output in the last bits, and where the cache is
  FP8, now and then a stored code (tests/engine/test_prefix_caching.py);
- bf16 on CPUs with AMX (where `--dtype auto` picks bf16), for prompts of
  8 tokens or more on average: 1.28x at 64 x 8, 1.13x at 16 x 32, 1.00x at
  16 x 64, 1.38x at 1 x 128, 1.76x at 1 x 512, 1.56x at 1 x 2048, 1.32x at
  8 x 256, 1.38x at 4 x 1024 (results/prefill_attention_2026-11-30_stop15.md);
- bf16 on CPUs without AMX (`--dtype auto` picks bf16 where its matmul
  measures faster, as with AVX512-BF16), the vector kernel (bf16 widened to
  float32 in registers), at every prompt length: torch's SDPA has no AMX to
  use there; on an AMD Zen 4 guest the kernel ran 1.61-2.42x as fast in
  every cell from 64 x 8 to 1 x 2048
  (results/prefill_attention_2026-11-30_stop19_zen4.md), and on the AVX2-only
  Zen 2 1.05-2.15x from 1 x 1 to 64 x 8.
  With AMX, head sizes the AMX kernel cannot take stay on SDPA, which uses AMX.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fp8serve.kernels.cpu_ops import load_cpu_ops

# Paths of the float32/16-bit vector kernel ("amx" is the separate bf16 AMX kernel).
_PATHS = {"best": 0, "avx2": 1, "avx512": 2, "scalar": 3, "bf16dot": 4}
BEST_PATH = _PATHS["best"]  # for callers of the C++ ops themselves (the engine's backend)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Mean prompt lengths per sequence from which a kernel replaces SDPA (see the docstring).
MIN_MEAN_PROMPT_TOKENS = 1  # float32, the vector kernel: every prompt (the same row order, cached prefix or not)
MIN_MEAN_PROMPT_TOKENS_AMX = 8  # bf16, the AMX kernel: below it SDPA, which uses AMX too, is as fast or faster
MIN_MEAN_PROMPT_TOKENS_BF16_VECTOR = 1  # bf16 without AMX, the vector kernel: faster at every measured length


def is_available() -> bool:
    ops = load_cpu_ops()
    return ops is not None and hasattr(ops, "prefill_attention")


@functools.cache
def bf16_dot_available() -> bool:
    """Whether the vector kernel was built with its bf16 dot-product path
    (AVX512-BF16), which "best" takes for bf16 inputs where AMX does not."""
    ops = load_cpu_ops()
    return (ops is not None and hasattr(ops, "prefill_attention_has_bf16_dot")
            and bool(ops.prefill_attention_has_bf16_dot()))


@functools.cache
def amx_available() -> bool:
    """Whether the bf16 AMX kernel is built and this process may use AMX tiles
    (fixed for the process: asked once, not per layer of every prefill)."""
    ops = load_cpu_ops()
    return ops is not None and hasattr(ops, "prefill_attention_amx") and bool(ops.prefill_attention_amx_available())


def applies(dtype: torch.dtype, num_tokens: int, num_seqs: int, head_size: int = 64) -> bool:
    if dtype == torch.float32:
        return num_tokens >= MIN_MEAN_PROMPT_TOKENS * num_seqs and is_available()
    if dtype == torch.bfloat16:
        if amx_available():  # other head sizes would run the vector kernel, slower than SDPA on AMX
            return head_size % 32 == 0 and num_tokens >= MIN_MEAN_PROMPT_TOKENS_AMX * num_seqs
        return num_tokens >= MIN_MEAN_PROMPT_TOKENS_BF16_VECTOR * num_seqs and is_available()
    return False


def applies_with_context(dtype: torch.dtype, num_keys: int, num_seqs: int, head_size: int = 64) -> bool:
    """Where the vector kernel's cached-context form replaces the padded SDPA over the gathered
    context: where `applies` would take the kernel for fresh prompts as long as the sequences'
    contexts plus new tokens, except for bf16 on AMX (the AMX kernel has no context form and
    SDPA there uses AMX; not measured)."""
    if dtype == torch.bfloat16 and amx_available():
        return False
    return applies(dtype, num_keys, num_seqs, head_size) and hasattr(load_cpu_ops(), "prefill_attention_with_context")


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
           cu_seqlens_k: torch.Tensor | None = None) -> None:
    if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size] and key/value "
                         f"[num_tokens, num_kv_heads, head_size]; got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}")
    num_tokens, num_heads, head_size = query.shape
    if (cu_seqlens_k is None and key.shape[0] != num_tokens) or key.shape[2] != head_size:
        raise ValueError(f"key/value {tuple(key.shape)} do not match query {tuple(query.shape)}")
    if cu_seqlens_k is not None:
        if cu_seqlens_k.dim() != 1 or cu_seqlens_k.dtype != torch.int64 or cu_seqlens_k.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_k must be an int64 tensor shaped like cu_seqlens {tuple(cu_seqlens.shape)}, "
                             f"got {tuple(cu_seqlens_k.shape)} {cu_seqlens_k.dtype}")
        if bool(((cu_seqlens_k[1:] - cu_seqlens_k[:-1]) < (cu_seqlens[1:] - cu_seqlens[:-1])).any()):
            raise ValueError("cu_seqlens_k: a sequence has fewer keys than queries (its queries are its last "
                             "positions)")
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
    path: str = "best",  # "amx", "bf16dot", "avx512", "avx2" or "scalar": force one kernel / set of tiles
    cu_seqlens_k: torch.Tensor | None = None,  # [num_seqs + 1] int64: keys/values per sequence, when they differ
) -> torch.Tensor:  # [num_tokens, num_heads, head_size], query's dtype
    """softmax(scale * q k^T + causal mask) v * out_scale per sequence.
    FP8 scales fold in: scale = softmax_scale * k_scale, out_scale = v_scale.
    "best" takes, for bf16, the AMX kernel where it is available (head_size a
    multiple of 32), else the vector kernel's bf16 dot products where it was
    built with them (head_size a multiple of 64; P rounded to bf16 as with
    AMX); float32 and float16 run the vector kernel in float32.

    With `cu_seqlens_k`, sequence s has keys/values [cu_k[s], cu_k[s+1]) and
    its queries are the last of those positions (a prefill continuing a cached
    context: causal from the bottom right). The vector kernel places rows and
    key blocks by absolute position, so a query row's output is bit for bit
    the same as in a fresh prefill of the whole sequence (same path). Not on
    the AMX kernel: "best" takes the vector kernel's best path then."""
    ops = load_cpu_ops()
    if ops is None or not hasattr(ops, "prefill_attention"):
        raise RuntimeError("C++ CPU kernels are not available")
    if path not in _PATHS and path != "amx":
        raise ValueError(f"unknown path {path!r}; expected one of {[*_PATHS, 'amx']}")
    _check(query, key, value, cu_seqlens, cu_seqlens_k)
    if cu_seqlens_k is not None:
        if path == "amx":
            raise ValueError("prefill_attention path 'amx' has no cached-context form (cu_seqlens_k)")
        return ops.prefill_attention_with_context(query, key, value, cu_seqlens.contiguous(), cu_seqlens_k.contiguous(),
                                                  float(scale), float(out_scale), _PATHS[path])
    use_amx = path == "amx" or (path == "best" and query.dtype == torch.bfloat16 and query.shape[2] % 32 == 0
                                and amx_available())
    if use_amx:
        if not amx_available():
            raise RuntimeError("prefill_attention path 'amx': this build or process has no AMX tiles")
        if query.dtype != torch.bfloat16 or query.shape[2] % 32:
            raise ValueError(f"prefill_attention path 'amx' takes bf16 with head_size a multiple of 32; got "
                             f"{query.dtype}, head_size {query.shape[2]}")
        return ops.prefill_attention_amx(query, key, value, cu_seqlens.contiguous(), float(scale), float(out_scale))
    return ops.prefill_attention(query, key, value, cu_seqlens.contiguous(), float(scale), float(out_scale),
                                 _PATHS[path])


def prefill_attention_ref(query, key, value, cu_seqlens, scale, out_scale=1.0, cu_seqlens_k=None) -> torch.Tensor:
    """Plain PyTorch reference with the kernel's contract, in float64."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    cu = cu_seqlens.tolist()
    cu_k = cu if cu_seqlens_k is None else cu_seqlens_k.tolist()
    for a, b, ka, kb in zip(cu[:-1], cu[1:], cu_k[:-1], cu_k[1:]):
        if a == b:
            continue
        q = query[a:b].double().transpose(0, 1)  # [heads, n, d]
        k = key[ka:kb].double().repeat_interleave(group, dim=1).transpose(0, 1)
        v = value[ka:kb].double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) * scale
        # Query i sits at position (kb - ka) - (b - a) + i and sees keys up to it.
        causal = torch.ones(b - a, kb - ka, dtype=torch.bool).tril(diagonal=(kb - ka) - (b - a))
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out[a:b] = (p @ v).transpose(0, 1) * out_scale
    return out


def prefill_attention_sdpa(query, key, value, cu_seqlens, scale, out_scale=1.0) -> torch.Tensor:
    """torch's SDPA per sequence on the inputs' dtype, the result times
    out_scale rounded to that dtype: what the engine runs without the kernel,
    the yardstick the kernels' error is compared with in tests."""
    out = torch.empty_like(query)
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        if a < b:
            o = F.scaled_dot_product_attention(query[a:b].transpose(0, 1), key[a:b].transpose(0, 1),
                                               value[a:b].transpose(0, 1), is_causal=True, scale=scale,
                                               enable_gqa=True)
            out[a:b] = (o.transpose(0, 1).float() * out_scale).to(query.dtype)
    return out
