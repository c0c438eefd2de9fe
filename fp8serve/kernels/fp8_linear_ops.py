"""Linear layers over FP8 e4m3 weights kept at one byte per element on CPU:
a thin wrapper over the C++ kernels in `cpu/fp8_gemm.cpp` and
`cpu/fp8_tiled_gemm.cpp`, their float64 reference, and the choice between
the ways to run them.

- Few activation rows (decode): `fp8_linear` decodes the weights in registers
  and multiplies them with up to 8 rows at once. The call is bound by reading
  the weights, so one byte per weight beats a float32 matmul.
- Many rows (prefill) with bf16 activations, or float32 on AVX-512 builds:
  the matmul is bound by arithmetic, which a float GEMM library does better
  than the GEMV's FMA loops. Weights are decoded block by block
  into a small buffer in x's dtype and multiplied there, so the full-size
  float weight never exists.
- In between, on CPUs with AMX and bf16 activations (decode batches of 3-64
  rows): `amx_fp8_linear` (`cpu/amx_fp8_linear.cpp`), which decodes each AMX
  weight tile to bf16 right before it multiplies it, so the weight is read at
  one byte per element (1.3-3.6x the path before it at 3-64 rows: see
  `amx_linear_ops.MIN_FP8_ROWS`). Builds with AMX but without AVX512-VBMI
  dequantize the whole weight to a bf16 buffer and run `amx_linear` over it
  at 13-64 rows.
- On AVX2 CPUs without AVX-512, float32 activations past 24 rows (decode
  batches and prefills): `fp8_tiled_gemm` (`cpu/fp8_tiled_gemm.cpp`), a GEMM
  that decodes 16 weight rows at a time into a cache-sized panel, so neither
  the float weight nor oneDNN's per-call reorder of it exists. On the AVX2-only
  Zen 3 EPYC it ran the default model's shapes 1.23-2.44x as fast as
  dequantize + oneDNN at 16-128 rows and 0.89-1.21x at 512, and engine decode
  steps at batch 64 1.28x (benchmarks/results/fp8_tiled_gemm_2026-12-02_zen3.md,
  fp8_weight_paths_2026-12-02_zen3.md). AVX-512 builds keep
  oneDNN, whose 16-lane kernels this 8-lane GEMM does not match.
  FP8SERVE_FP8_TILED_GEMM=0 / 1 turns it off / on regardless of the CPU.

`max_fused_rows` says where the switch happens; the numbers come from
`benchmarks/fp8_linear.py` (see benchmarks/results/fp8_linear_*.md).
"""

from __future__ import annotations

import functools

import torch

from fp8serve.kernels import amx_linear_ops, onednn_linear
from fp8serve.kernels.cpu_ops import load_cpu_ops
from fp8serve.utils.env_switch import env_switch

_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)

# Largest M that runs the fused kernel, per activation dtype. Measured with
# benchmarks/fp8_linear.py on a shared 2-core Xeon (one thread, CPU time): the
# fused kernel wins at M <= 16 on every shape, dequantize + GEMM at M = 512,
# and they are within ~30% of each other at M = 32..64 (float32 and bf16 x;
# the bf16 GEMM ran on AMX, yet decoding to bf16 costs more than to float32).
_MAX_FUSED_ROWS = {torch.float32: 32, torch.bfloat16: 16}
# Where the AMX linear kernel runs (bf16 x) but amx_fp8_linear does not (a build
# without AVX512-VBMI), decode batches of 13-64 rows
# dequantize to bf16 and multiply there instead (`_dequantize_and_matmul`):
# the fused kernel's cost grows with its 8-row register tiles, and torch's
# GEMM repacks the weight and allocates its own buffers on every call.
# Engine decode steps, FP8 checkpoint (SmolLM2-135M, bf16, FP8 KV, ~300-token
# prompts), two engines alternating in one process, medians, ms:
#   batch        8     10     12     14     16     20     32     64
#   before     26.3   33.5   36.6   37.1   49.0   55.2   61.0   83.0
#   AMX        33.4   35.8   35.6   33.6   37.4   41.3   48.9   69.5
# (before: fused kernel up to 16 rows, dequantize + torch.mm above.)
_MAX_FUSED_ROWS_AMX_BF16 = 12
# Where fp8_tiled_gemm runs (float32 x), the fused kernel keeps decode batches
# up to 24 rows: on the Zen 3 EPYC the tiled GEMM ran 0.70-0.97x the fused
# kernel at 16 rows, 0.93-1.11x at 24, 0.85-1.16x at 32 and 1.11-1.35x at 64
# (benchmarks/results/fp8_tiled_gemm_2026-12-02_zen3.md).
_MAX_FUSED_ROWS_TILED = 24
TILED_GEMM_ENV = "FP8SERVE_FP8_TILED_GEMM"

# Weight rows decoded per GEMM call on the large-M path: as many as fit in
# 8 MiB of the activation dtype (at least 128). One GEMM per layer for small
# models (SmolLM2's largest FP8 weight is 3.4 MiB in bf16), 1024-row tiles for
# Llama-3-8B's K = 4096: the full-size float weight of a big layer never exists,
# and a 512-token prefill is not cut into dozens of small GEMMs (which made it
# 2.4x slower than bf16 weights).
_DEQUANT_BYTES = 8 << 20


def _dequant_rows(k: int, dtype: torch.dtype) -> int:
    return max(128, _DEQUANT_BYTES // (k * torch.empty((), dtype=dtype).element_size()))


def max_fused_rows(dtype: torch.dtype) -> int:
    """Largest number of activation rows the fused kernel takes for x of `dtype`."""
    if dtype == torch.bfloat16 and amx_linear_ops.fp8_is_available():
        return amx_linear_ops.MIN_FP8_ROWS - 1
    if dtype == torch.bfloat16 and amx_linear_ops.is_available():
        return _MAX_FUSED_ROWS_AMX_BF16
    if dtype == torch.float32 and tiled_gemm_enabled():
        return _MAX_FUSED_ROWS_TILED
    return _MAX_FUSED_ROWS[dtype]


@functools.cache
def tiled_gemm_enabled() -> bool:
    """Whether float32 activations past the fused kernel's rows run
    `fp8_tiled_gemm`: where the kernels were built with it (AVX2, FMA, F16C)
    and not for AVX-512 (oneDNN is faster there), unless FP8SERVE_FP8_TILED_GEMM
    says otherwise (asked once per process)."""
    wanted = env_switch(TILED_GEMM_ENV)  # a bad value is an error on any build
    ops = load_cpu_ops()
    if ops is None or not hasattr(ops, "fp8_tiled_gemm_available") or not ops.fp8_tiled_gemm_available():
        return False
    return (not ops.fp8_gemm_has_avx512()) if wanted is None else wanted


@functools.cache
def _fused_rows_by_dtype() -> dict[torch.dtype, int]:
    return {dtype: max_fused_rows(dtype) for dtype in _ACTIVATION_DTYPES}


def is_available() -> bool:
    ops = load_cpu_ops()
    return ops is not None and hasattr(ops, "fp8_linear")


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"x must be [M, K] float32 or bfloat16, got {tuple(x.shape)} {x.dtype}")
    if weight.dim() != 2 or weight.dtype != torch.uint8:
        raise ValueError(f"weight must be [N, K] uint8 e4m3 codes, got {tuple(weight.shape)} {weight.dtype}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"x has K = {x.shape[1]} columns, weight has {weight.shape[1]}")
    n = weight.shape[0]
    if weight_scale.shape != (n,) or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be float32 [{n}] (one per output row), got "
                         f"{tuple(weight_scale.shape)} {weight_scale.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if not all(t.device.type == "cpu" for t in (x, weight, weight_scale)):
        raise ValueError("fp8_linear runs on CPU tensors")


def fp8_linear(
    x: torch.Tensor,  # [M, K] float32 or bfloat16
    weight: torch.Tensor,  # [N, K] uint8 e4m3 codes
    weight_scale: torch.Tensor,  # [N] float32, the true scale of each output row
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ (e4m3(weight) * weight_scale[:, None]).T + bias``, accumulated in
    float32. Weight codes must not be NaN (0x7f, 0xff); loaders reject them."""
    _check(x, weight, weight_scale, bias)
    ops = load_cpu_ops()
    if ops is None:
        raise RuntimeError("C++ CPU kernels are not available")
    x = x.contiguous()
    weight = weight.contiguous()
    if x.shape[0] <= _fused_rows_by_dtype()[x.dtype]:
        return ops.fp8_linear(x, weight, weight_scale.contiguous(), None if bias is None else bias.float().contiguous())
    if amx_linear_ops.fp8_applies(x, weight):
        return amx_linear_ops.amx_fp8_linear(x, weight, weight_scale.contiguous(), bias)
    if x.dtype == torch.float32 and tiled_gemm_enabled():
        return ops.fp8_tiled_gemm(x, weight, weight_scale.contiguous(), None if bias is None else bias.float().contiguous())
    return _dequantize_and_matmul(ops, x, weight, weight_scale.contiguous(), bias)


def fp8_linear_loaded(
    x: torch.Tensor,  # [M, K] float32 or bfloat16
    weight: torch.Tensor,  # [N, K] uint8 e4m3 codes, checked when loaded
    weight_scale: torch.Tensor,  # [N] float32, checked when loaded
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fp8_linear` for a layer's own weights, which the loader checked once:
    the decode path goes straight to the C++ op, which still TORCH_CHECKs
    every shape and dtype. The Python checks cost ~13 us a call, 1.5 ms of a
    batch-1 decode step of the default model (120 linears)."""
    if x.shape[0] <= _fused_rows_by_dtype().get(x.dtype, -1):
        return load_cpu_ops().fp8_linear(
            x if x.is_contiguous() else x.contiguous(), weight, weight_scale,
            None if bias is None else bias.float(),
        )
    if amx_linear_ops.fp8_applies(x, weight):
        return load_cpu_ops().amx_fp8_linear(x, weight, weight_scale, bias)
    return fp8_linear(x, weight, weight_scale, bias)


def fp8_linear_silu_and_mul_loaded(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [2d, K] uint8 e4m3 codes of a [gate; up] projection, checked when loaded
    weight_scale: torch.Tensor,  # [2d] float32, checked when loaded
    bias: torch.Tensor | None = None,
) -> torch.Tensor | None:  # [M, d] float32, or None
    """silu(g) * u for [g, u] = `fp8_linear_loaded(x, ...)`, in one kernel where that would run
    `fp8_tiled_gemm` (float32 x past the fused kernel's rows): `fp8_tiled_gemm_silu_and_mul`,
    the two steps' bits on builds without AVX-512, with no [M, 2d] projection written and read
    back. None elsewhere: the caller runs the linear and then the activation."""
    if (x.dim() != 2 or x.dtype != torch.float32 or x.shape[0] <= _fused_rows_by_dtype()[torch.float32]
            or not tiled_gemm_enabled()):
        return None
    return load_cpu_ops().fp8_tiled_gemm_silu_and_mul(
        x.contiguous(), weight, weight_scale, None if bias is None else bias.float().contiguous())


def _dequantize_and_matmul(ops, x, weight, weight_scale, bias) -> torch.Tensor:
    n, k = weight.shape
    rows = _dequant_rows(k, x.dtype)
    buf = torch.empty(min(n, rows), k, dtype=x.dtype)
    # Decode batches with bf16 x on AMX: the weight tile as it lies in the
    # buffer, bias added in float32 before the one rounding to bf16.
    on_amx = amx_linear_ops.applies(x, buf)
    if n <= rows:
        # One tile (every layer of small models): the GEMM writes [M, N] as is.
        # The earlier layout (out^T tiles, then .t().contiguous()) spent a
        # third of a float32 prefill in that transpose copy.
        ops.fp8_dequantize(buf, weight, weight_scale)
        if on_amx:
            return amx_linear_ops.amx_linear(x, buf, bias)
        out = onednn_linear.linear(x, buf)
    else:
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            w = buf[: n1 - n0]
            ops.fp8_dequantize(w, weight[n0:n1], weight_scale[n0:n1])
            if on_amx:
                out[:, n0:n1] = amx_linear_ops.amx_linear(x, w, None if bias is None else bias[n0:n1])
            else:
                out[:, n0:n1] = onednn_linear.linear(x, w)  # contiguous row pieces, not a transpose
        if on_amx:
            return out
    if bias is not None:
        out += bias.to(x.dtype)
    return out


def fp8_linear_ref(x, weight, weight_scale, bias=None) -> torch.Tensor:
    """float64 reference of `fp8_linear` (decode with the cache's table,
    matmul in float64), returned in float64."""
    from fp8serve.quantization.fp8 import FP8_E4M3, dequantize_fp8

    w = dequantize_fp8(weight, 1.0, FP8_E4M3, torch.float32).double() * weight_scale.double()[:, None]
    out = x.double() @ w.t()
    return out if bias is None else out + bias.double()


def expand_shard_scales(shard_scales: torch.Tensor, output_sizes: list[int]) -> torch.Tensor:
    """[num_shards] scales -> [sum(output_sizes)] float32, one per output row,
    so fused shards with different scales share one kernel call."""
    sizes = torch.tensor(output_sizes, device=shard_scales.device)
    return shard_scales.float().repeat_interleave(sizes).contiguous()

