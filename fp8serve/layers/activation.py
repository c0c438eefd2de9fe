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

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
