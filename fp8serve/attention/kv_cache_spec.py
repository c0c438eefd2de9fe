"""What one KV cache block holds and costs.

Bytes per block follow from the storage dtype's element size, so an FP8
cache holds exactly 2x the blocks of a 16-bit cache and 4x those of a
float32 cache in the same memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8serve.quantization.fp8 import Fp8Format, fp8_format

_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVCacheSpec:
    kv_cache_dtype: str  # resolved: float32 | bfloat16 | float16 | fp8_e4m3 | fp8_e5m2
    block_size: int
    num_kv_heads: int
    head_size: int
    num_layers: int

    @property
    def fp8(self) -> Fp8Format | None:
        return fp8_format(self.kv_cache_dtype) if self.kv_cache_dtype.startswith("fp8") else None

    @property
    def storage_dtype(self) -> torch.dtype:
        # FP8 is stored as uint8 bit patterns: torch's CPU float8 tensors lack
        # index_copy_ and arithmetic, and their casts are slow.
        return torch.uint8 if self.fp8 is not None else _STORAGE[self.kv_cache_dtype]

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.storage_dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        """K and V of `block_size` tokens in every layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.element_size * self.num_layers

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        # [K/V, num_blocks, block_size, num_kv_heads, head_size]
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)
