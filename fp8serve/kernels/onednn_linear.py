"""float32 linear layers through oneDNN instead of torch's default GEMM, on
the CPUs where that was measured faster: a thin wrapper over
`torch.ops.mkldnn._linear_pointwise` (the op torch's own compiler emits for
CPU linears) and where it runs.

Why: torch 2.13's `F.linear` runs float32 through MKL's sgemm. On an AMD EPYC
Zen 4 (2 vCPUs, AVX-512) MKL reached 181-203 GFLOP/s on the default model's
prefill shapes at 512 rows (the 576 -> 3072 gate_up the slowest) and 126-194
at 24-256 rows; oneDNN ran the same calls at 209-217 and 134-214: 1.02-1.29x
(bf16 already goes to oneDNN through F.linear: no change there). On the 120
decode linears read from memory it ran 1.18-1.33x F.linear at 16-64 rows, and
dense_gemv stays faster up to its 32 rows. Numbers and command:
benchmarks/results/linear_backends_2026-11-30_zen4.md.

Intel CPUs keep F.linear: not measured there.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fp8serve.utils.platform import is_amd_cpu


@functools.cache
def is_available() -> bool:
    """Whether this torch has oneDNN and its pointwise linear op (and the op runs)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        x, w = torch.ones(2, 8), torch.ones(3, 8)
        return bool(torch.equal(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), F.linear(x, w)))
    except RuntimeError:
        return False


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `onednn_linear` is the faster GEMM for this call: float32
    activations and weights on a CPU where it was measured faster (AMD)."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.dim() == 2 and x.dim() >= 1 and is_amd_cpu() and is_available())


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) in float32: [..., K] x [N, K] -> [..., N]."""
    if not is_available():
        raise RuntimeError("oneDNN linear is not available in this torch build")
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        raise ValueError(f"onednn_linear takes float32 tensors, got x {x.dtype}, weight {weight.dtype}"
                         + ("" if bias is None else f", bias {bias.dtype}"))
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: expected [..., K] and [N, K]")
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, or oneDNN where `applies` says it is faster: the GEMM for
    calls that no decode kernel (dense_gemv, amx_linear, fp8_linear) took."""
    if applies(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
