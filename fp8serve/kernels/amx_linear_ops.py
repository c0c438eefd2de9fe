"""bf16 linear layers for decode batches on AMX tiles: a thin wrapper over
`cpu/amx_linear.cpp` and where it runs.

`applies(x, weight)` picks it for bf16 activations and weights at 8-24 rows,
from `benchmarks/dense_gemv.py` (the default model's 120 decode linears, 270 MB
of bf16 weights on 2 MiB pages, read from memory every pass; 2-vCPU Xeon with
AMX; benchmarks/results/dense_gemv_2026-11-30.md, stop 12): 11.8 / 12.6 / 12.9 /
17.2 ms at 8 / 12 / 16 / 24 rows, against 12.8 / 19.6 / 23.4 ms for the
AVX512-BF16 GEMV and 20.1 / 19.8 / 19.8 / 21.4 ms for F.linear. At 1-4 rows
the GEMV streams faster (8.3-10.1 vs 9.8-11.3 ms) and keeps them; at 32 rows
F.linear tied (22.1 vs 22.7 ms) and keeps them.
"""

from __future__ import annotations

import functools

import torch

from fp8serve.kernels.cpu_ops import load_cpu_ops

MIN_ROWS, MAX_ROWS = 8, 24


@functools.cache
def is_available() -> bool:
    """Whether the build has the AMX kernel and Linux granted this process the tiles."""
    ops = load_cpu_ops()
    return ops is not None and hasattr(ops, "amx_linear") and bool(ops.amx_linear_available())


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.dim() == 2 and weight.dim() == 2 and MIN_ROWS <= x.shape[0] <= MAX_ROWS
            and x.shape[1] % 32 == 0 and x.stride(1) == 1 and weight.is_contiguous() and is_available())


def amx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): [M, K] bf16 x [N, K] bf16 -> [M, N] bf16, float32 accumulation."""
    if not is_available():
        raise RuntimeError("the AMX linear kernel is not available (no AMX in this build, CPU or process)")
    return load_cpu_ops().amx_linear(x, weight, bias)
