"""RMSNorm with an optional fused residual add (Llama's pre-norm blocks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp8serve.kernels import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op instead of six (this runs twice per layer per step),
        # normalising in float32 whatever the compute dtype, as the reference does.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if cpu_ops.use_fused_cpu_ops(x) and x.dim() == 2 and self.weight.dtype == x.dtype:
            return self.forward_cpu(x, residual)
        return self.forward_native(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One C++ pass, same rounding as forward_native. With a residual it
        works in place, as vLLM's fused_add_rms_norm: `x` becomes the
        normalised output and `residual` the sum (both are this layer's own
        intermediates)."""
        if residual is None:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        cpu_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual
