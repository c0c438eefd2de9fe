"""Gated activations over fused projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp8serve.kernels import cpu_ops


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused `[..., 2 * d]` gate_up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.use_fused_cpu_ops(x) and x.dim() == 2 and x.stride(-1) == 1:
            return cpu_ops.silu_and_mul(x)  # one pass, same rounding
        return self.forward_native(x)

    def of_projection(self, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """self(proj(x)) for a [gate, up] projection `proj` (a MergedLinear of two equal halves):
        in one kernel where proj's quantization method has one for x, which then never writes
        the [rows, 2d] projection for this layer to read back."""
        fused = proj.quant_method.apply_silu_and_mul(proj, x, proj.bias)
        return fused if fused is not None else self(proj(x))

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
