"""The shared Attention layer: owns the per-layer KV scales and delegates the
cache arithmetic to the attention backend bound by the model runner.

A model that uses this layer gets the FP8 KV cache, checkpoint scales and
`--calculate-kv-scales` without a line of FP8 code of its own."""

from __future__ import annotations

import torch
from torch import nn

from fp8serve.attention.backends.base import AttentionBackend
from fp8serve.attention.forward_context import get_attn_metadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, prefix: str = "") -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.softmax_scale = scale
        self.prefix = prefix
        # Scalars, float32, default 1.0: set from checkpoint or JSON scales
        # by the loader, or from the first prefill (--calculate-kv-scales).
        self.k_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
        self.v_scale = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
        self._k_scale = 1.0  # python copies: no tensor->float sync per step
        self._v_scale = 1.0
        self._scales_key = (1.0, 1.0)
        self.kv_scale_source = "default"
        # Per-KV-head scales (compressed-tensors' kv_cache_scheme strategy "attn_head"):
        # None, or float32 [num_kv_heads, 1] tensors; k_scale/v_scale above then hold their max.
        self.k_head_scales: torch.Tensor | None = None
        self.v_head_scales: torch.Tensor | None = None
        self.calculate_kv_scales = False
        # Calibration tools watch K (after RoPE, as stored) and V through this
        # hook: fn(layer, key, value) with [num_tokens, num_kv_heads, head_size].
        self.kv_observer = None
        self.backend: AttentionBackend | None = None
        self.kv_cache: torch.Tensor | None = None

    def bind(self, backend: AttentionBackend, kv_cache: torch.Tensor) -> None:
        self.backend = backend
        self.kv_cache = kv_cache

    def set_kv_scales(self, k_scale: float, v_scale: float, source: str,
                      k_head_scales: tuple[float, ...] | None = None,
                      v_head_scales: tuple[float, ...] | None = None) -> None:
        """Per-tensor scales, or with `k_head_scales`/`v_head_scales` one per KV head
        (`k_scale`/`v_scale` are then their max, what logs and captures key on)."""
        self.k_scale.fill_(k_scale)
        self.v_scale.fill_(v_scale)
        self._k_scale, self._v_scale = float(k_scale), float(v_scale)
        self.kv_scale_source = source
        if (k_head_scales is None) != (v_head_scales is None):
            raise ValueError("per-head KV scales need both k_head_scales and v_head_scales")
        if k_head_scales is None:
            self.k_head_scales = self.v_head_scales = None
            self._scales_key = (self._k_scale, self._v_scale)
            return
        for name, values in (("k_head_scales", k_head_scales), ("v_head_scales", v_head_scales)):
            if len(values) != self.num_kv_heads:
                raise ValueError(f"{self.prefix}: {name} has {len(values)} values; expected one per KV head "
                                 f"({self.num_kv_heads})")
        k_head_scales, v_head_scales = tuple(map(float, k_head_scales)), tuple(map(float, v_head_scales))
        self._scales_key = (self._k_scale, self._v_scale, k_head_scales, v_head_scales)
        self.k_head_scales = torch.tensor(k_head_scales, dtype=torch.float32).view(-1, 1)
        self.v_head_scales = torch.tensor(v_head_scales, dtype=torch.float32).view(-1, 1)
        # The same per query head: query head h reads KV head h // group.
        group = self.num_heads // self.num_kv_heads
        self._k_query_scales = self.k_head_scales.repeat_interleave(group, dim=0)
        self._v_query_scales = self.v_head_scales.repeat_interleave(group, dim=0)
        self._fold_factors: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, ...]] = {}

    def _factors(self, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The per-head factors in the activations' dtype and on their device (one native op
        per tensor, no float32 round trips), held as non-persistent buffers: decode and
        prefill captures replay only tensors that are inputs or model state."""
        dtype = like.dtype
        factors = self._fold_factors.get((dtype, like.device))
        if factors is None:
            factors = tuple(t.to(device=like.device, dtype=dtype) for t in (
                self.k_head_scales, self.v_head_scales, self._k_query_scales, self._v_query_scales))
            for i, t in enumerate(factors):
                self.register_buffer(f"_kv_fold_{str(dtype).removeprefix('torch.')}_{i}", t, persistent=False)
            self._fold_factors[(dtype, like.device)] = factors
        return factors

    def scales_key(self) -> tuple:
        """What a recorded forward bakes in of this layer's scales (the captures' cache key)."""
        return self._scales_key

    def _calculate_scales(self, key: torch.Tensor, value: torch.Tensor) -> None:
        fmt = self.backend.spec.fp8
        k_amax = key.abs().max().float().item()
        v_amax = value.abs().max().float().item()
        # An all-zero batch would give scale 0 (division by zero on write).
        k = max(k_amax / fmt.max_finite, 1e-12)
        v = max(v_amax / fmt.max_finite, 1e-12)
        self.set_kv_scales(k, v, "calculated")
        self.calculate_kv_scales = False

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        # query: [num_tokens, num_heads * head_size]; key/value: [num_tokens, num_kv_heads * head_size].
        # logits_indices: None (every token's output), or each sequence's last token (see the backend).
        metadata = get_attn_metadata()
        n = query.shape[0]
        q = query.view(n, self.num_heads, self.head_size)
        k = key.view(n, self.num_kv_heads, self.head_size)
        v = value.view(n, self.num_kv_heads, self.head_size)
        if self.kv_observer is not None:
            self.kv_observer(self, k, v)
        if self.calculate_kv_scales:
            self._calculate_scales(k, v)
        # Scales only mean something for FP8 storage; a 16-bit cache stores
        # values as they are.
        is_fp8 = self.backend.spec.fp8 is not None
        if is_fp8 and self.k_head_scales is not None:
            return self._forward_per_head_scales(q, k, v, metadata, logits_indices)
        out = self.backend.forward(
            q, k, v, self.kv_cache, metadata,
            softmax_scale=self.softmax_scale,
            k_scale=self._k_scale if is_fp8 else 1.0,
            v_scale=self._v_scale if is_fp8 else 1.0,
            logits_indices=logits_indices,
        )
        return out.reshape(out.shape[0], self.num_heads * self.head_size)

    def _forward_per_head_scales(self, q, k, v, metadata, logits_indices) -> torch.Tensor:
        """Per-KV-head scales folded around a backend that takes one scale per layer:
        K and V are divided by their head's scale (a float32 model stores exactly the codes
        a per-head kernel would; a 16-bit one rounds k / s to its dtype first), the backend
        runs with scale 1, and each query head is multiplied by its KV head's k scale
        (q . (k / s) * s = q . k), each output head by its v scale. Every kernel, fused
        decode, prefill and cached-prefix path reads the same codes the same way.
        Costs four elementwise ops per layer (benchmarks/per_head_kv_scales.py)."""
        k_heads, v_heads, k_queries, v_queries = self._factors(q)
        k, v, q = torch.div(k, k_heads), torch.div(v, v_heads), torch.mul(q, k_queries)
        out = self.backend.forward(q, k, v, self.kv_cache, metadata, softmax_scale=self.softmax_scale,
                                   k_scale=1.0, v_scale=1.0, logits_indices=logits_indices)
        out = torch.mul(out, v_queries)
        return out.reshape(out.shape[0], self.num_heads * self.head_size)
