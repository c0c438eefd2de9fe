"""bf16 linear layers for decode batches on AMX tiles: a thin wrapper over
`cpu/amx_linear.cpp` and where it runs.

`applies(x, weight, packed)` picks it for bf16 activations and weights at 8-64
rows (8-32 where the layer has oneDNN's packed bf16 copy: MAX_ROWS_WITH_PACKED),
from `benchmarks/dense_gemv.py` (the default model's 120 decode linears, 270 MB
of bf16 weights on 2 MiB pages, read from memory every pass; 2-vCPU Xeon with
AMX; benchmarks/results/dense_gemv_2026-11-30.md, stop 12), ms per pass:

| rows | 4 | 8 | 12 | 16 | 24 | 32 | 48 | 64 |
|---|---|---|---|---|---|---|---|---|
| amx_linear | 10.8 | 10.7 | 11.4 | 11.7 | 14.8 | 15.4 | 18.4 | 24.2 |
| AVX512-BF16 GEMV | 10.4 | 13.0 | 20.0 | 24.8 | - | - | - | - |
| F.linear | 20.0 | 20.2 | 21.0 | 21.4 | 22.8 | 22.2 | 25.8 | 27.8 |

At 1-4 rows the GEMV streams as fast or faster and keeps them. Since then the kernel
runs weight blocks in pairs at 8-32 rows (1.06-1.11x from memory;
benchmarks/results/amx_linear_2026-11-30.md).
"""

from __future__ import annotations

import functools

import torch

from fp8serve.kernels.cpu_ops import load_cpu_ops

MIN_ROWS, MAX_ROWS = 8, 64
# Where the layer has a packed bf16 copy (onednn_linear.pack_weights: AMX CPUs),
# oneDNN's packed GEMM takes the calls past this many rows. The default model's
# 120 decode linears from memory, 2-vCPU Xeon (stop 69), ms per pass amx_linear
# / packed: 8 rows 9.35 / 11.89, 16 9.77 / 12.32, 32 12.26 / 14.31 (the
# weight-block pairs of run_blocks), 33 15.79 / 14.05, 48 15.74 / 14.77, 56
# 19.29 / 15.27, 64 19.50 / 15.82: 1.03-1.26x for packed at 33-64 rows, where
# amx_linear runs three or four C tiles per weight block and no pairs.
MAX_ROWS_WITH_PACKED = 32


@functools.cache
def is_available() -> bool:
    """Whether the build has the AMX kernel and Linux granted this process the tiles."""
    ops = load_cpu_ops()
    return ops is not None and hasattr(ops, "amx_linear") and bool(ops.amx_linear_available())


def applies(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None) -> bool:
    """Whether amx_linear serves this call; `packed`: the layer's oneDNN copy
    (onednn_linear), which serves bf16 calls past MAX_ROWS_WITH_PACKED rows."""
    max_rows = MAX_ROWS if packed is None or packed.dtype != torch.bfloat16 else MAX_ROWS_WITH_PACKED
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.dim() == 2 and weight.dim() == 2 and MIN_ROWS <= x.shape[0] <= max_rows
            and x.shape[1] % 32 == 0 and x.stride(1) == 1 and weight.is_contiguous() and is_available())


# Rows amx_fp8_linear serves: FP8 (e4m3) layers with bf16 x, from 3 rows (at 1-2 the fused FP8
# kernel of fp8_gemm.cpp reads the codes about as fast: 0.90x / 1.06x) to a call's four C tiles. The
# default model's 120 FP8 decode linears, distinct codes, 2-core Xeon with AMX, ms per pass against the
# path before (fused kernel to 12 rows, then dequantize to bf16 + amx_linear), ABBA medians of 8
# (benchmarks/results/amx_fp8_linear_2026-12-06_xeon_amx.md, second run):
#   rows             1     2     3     4     5     8     12    16    32    48    64
#   before          3.71  4.34  5.49  6.33  8.62  13.2  17.9  14.8  17.0  22.1  23.6
#   amx_fp8_linear  4.10  4.09  4.24  4.28  4.42  4.50  4.94  5.18  9.07  14.1  15.3
# Engine decode steps of the FP8 checkpoint: 1.03-1.13x at batch 3-5, 1.31-1.65x at 8-32, 1.21x at 64.
MIN_FP8_ROWS = 3


@functools.cache
def fp8_is_available() -> bool:
    """Whether the build has the FP8 AMX kernel (AMX and AVX512-VBMI) and Linux granted the tiles."""
    ops = load_cpu_ops()
    return ops is not None and hasattr(ops, "amx_fp8_linear") and bool(ops.amx_fp8_linear_available())


def fp8_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `amx_fp8_linear` serves bf16 x against a layer's [N, K] e4m3 codes."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.uint8 and x.device.type == "cpu"
            and x.dim() == 2 and weight.dim() == 2 and MIN_FP8_ROWS <= x.shape[0] <= MAX_ROWS
            and x.shape[1] % 64 == 0 and x.stride(1) == 1 and weight.is_contiguous() and fp8_is_available())


def amx_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (e4m3(weight) * weight_scale[:, None]).T (+ bias): bf16 [M, K] x, [N, K] uint8 codes,
    float32 [N] scales -> [M, N] bf16; the codes decoded to bf16 tile by tile in registers (one
    byte read per weight), products summed in float32 and scaled once (cpu/amx_fp8_linear.cpp)."""
    if not fp8_is_available():
        raise RuntimeError("the FP8 AMX linear kernel is not available (no AMX or AVX512-VBMI in this build, "
                           "CPU or process)")
    return load_cpu_ops().amx_fp8_linear(x, weight, weight_scale, bias)


def amx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               float_out: bool = False) -> torch.Tensor:
    """x @ weight.T (+ bias): [M, K] bf16 x [N, K] bf16 -> [M, N] bf16, float32 accumulation.
    float_out: return float32 holding the same bf16-rounded values (what `.float()` of the bf16
    result holds), written in the kernel's own pass (the LM head's logits)."""
    if not is_available():
        raise RuntimeError("the AMX linear kernel is not available (no AMX in this build, CPU or process)")
    ops = load_cpu_ops()
    return (ops.amx_linear_float_out if float_out else ops.amx_linear)(x, weight, bias)
