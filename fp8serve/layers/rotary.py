"""Rotary position embeddings (rotate-half layout, as Llama checkpoints use),
with the linear and Llama 3 / 3.1 frequency scalings."""

from __future__ import annotations

import math

import torch
from torch import nn

from fp8serve.config import RopeConfig
from fp8serve.kernels import cpu_ops


def _inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths are divided by `factor`, short ones are
        # kept, and the band between is interpolated smoothly.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = _inv_freq(head_dim, rope)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim // 2] each; kept out of the state dict.
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
        if (cpu_ops.use_fused_cpu_ops(q) and q.dtype == self.cos.dtype
                and q.stride(-1) == 1 and q.stride(1) == q.shape[2] and k.stride(-1) == 1 and k.stride(1) == k.shape[2]):
            # In place on q and k (views of this layer's qkv output), one pass.
            cpu_ops.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        return self.forward_native(positions, q, k)

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # One module serves every layer of a model, and every layer of a
        # forward pass gets the same `positions` tensor: look cos/sin up once.
        if positions is not self._positions:
            self._positions = positions
            self._cos_sin = (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        cos, sin = self._cos_sin
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
