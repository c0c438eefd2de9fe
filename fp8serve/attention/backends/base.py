"""The attention backend interface: how the KV cache is laid out and how one
layer writes its new K/V and attends over the paged cache.

Quantize-on-write and dequantize-on-read live here, never in model files."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from fp8serve.attention.kv_cache_spec import KVCacheSpec
from fp8serve.attention.metadata import AttentionMetadata
from fp8serve.utils.huge_pages import advise_huge_pages


class AttentionBackend(ABC):
    name: str

    def __init__(self, spec: KVCacheSpec, compute_dtype: torch.dtype) -> None:
        self.spec = spec
        self.compute_dtype = compute_dtype

    def allocate_kv_cache(self, num_blocks: int, device: torch.device, prefault: bool = False) -> torch.Tensor:
        """`num_blocks` usable blocks plus one zeroed null block (id
        `num_blocks`) that padded and masked reads point at: a masked key has
        probability 0, but 0 * NaN from an unwritten slot would still poison
        the output. The rest is left unwritten (torch.empty), so the OS maps
        pages only as blocks are used and start-up does not touch gigabytes;
        `prefault` zeroes all of it instead, so every page is mapped before
        the first request (as vLLM's zeroed caches are): on a 2-vCPU VM the
        first write to a page cost up to ~1.3 s per GiB, inside the steps of
        the first requests that reach it (engine/model_runner.py)."""
        cache = self.spec.empty_layer(num_blocks + 1, device)  # spec.layer_shape, in spec.kv_layout's order
        advise_huge_pages(cache)  # before the first write, so pages are born huge
        if prefault:
            cache.zero_()
        else:
            cache[:, num_blocks].zero_()
        return cache

    @abstractmethod
    def build_metadata(self, metadata: AttentionMetadata) -> None:
        """Precompute per-step tensors every layer shares (masks, gather indices)."""

    def runs_fresh_prefill_kernel(self, metadata: AttentionMetadata) -> bool:
        """Whether `forward` runs this prefill step through one kernel call per
        layer over the step's own K/V, the same ops at any token count: what a
        recorded prefill forward may be replayed over (engine/prefill_capture.py)."""
        return False

    def prefill_capture_inputs(self, metadata: AttentionMetadata) -> tuple[torch.Tensor, ...] | None:
        """The tensors of this prefill step's metadata, besides slot_mapping and
        query_start_loc, that `forward` reads when every layer runs the same
        ops whatever the token count and the cached contexts' lengths: the
        extra inputs of a recorded prefill forward (engine/prefill_capture.py).
        None where the step's ops are not of that kind (it stays eager); ()
        for a fresh prefill run by `runs_fresh_prefill_kernel`."""
        return () if self.runs_fresh_prefill_kernel(metadata) else None

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size] (a view: kv_cache_spec)
        metadata: AttentionMetadata,
        *,
        softmax_scale: float,
        k_scale: float,
        v_scale: float,
        logits_indices: torch.Tensor | None = None,  # [num_seqs] int64
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size], or [num_seqs, ...] with logits_indices
        """Write this step's K/V into the cache at `slot_mapping`, then attend
        causally over each sequence's cached context (the just-written tokens
        included, so prefill sees exactly what decode will see).

        `logits_indices`, when given, is the row of each sequence's last new
        token, in order (query_start_loc[1:] - 1): only those rows' outputs
        are returned (every token's K/V is still written), and a backend may
        compute only those. Any other set of rows is a caller's error."""
