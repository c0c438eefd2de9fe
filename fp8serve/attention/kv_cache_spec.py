"""What one KV cache block holds and costs, and how it is laid out.

Bytes per block follow from the storage dtype's element size, so an FP8
cache holds exactly 2x the blocks of a 16-bit cache and 4x those of a
float32 cache in the same memory.

Layout. Every layer's cache is seen as [2, num_blocks, block_size,
num_kv_heads, head_size] (K/V, block, token in the block, kv head, element):
code indexes it that way whatever the memory order underneath, which is one
of FlashInfer's / vLLM's two (`kv_layout`, VLLM_KV_CACHE_LAYOUT):

- "HND" (the default): a block holds each kv head's block_size rows together,
  [2, num_blocks, num_kv_heads, block_size, head_size] in memory; the view
  above is a transpose of it.
- "NHD": a block holds each token's kv heads together, the view's own order.

Why HND: the CPU decode kernel attends one kv head at a time over a tile of
tokens, so under NHD it reads one head_size row per token at a stride of
num_kv_heads rows, and under HND consecutive rows. Measured side by side on a
Zen 4 EPYC (2 vCPUs; benchmarks/kv_cache_layout.py, the same contents both
ways, outputs bit for bit the same; benchmarks/results/kv_cache_layout_*.md):
on the engine's 2 MiB pages, FP8 decode attention 1.12-1.18x as fast under
HND with Llama-3-8B's heads (32 over 8, head size 128) from 64 MiB of K+V
on, 1.00-1.16x with the default model's (9 over 3, 64), bf16 caches
0.98-1.13x; on 4 KiB pages FP8 with Llama-3-8B's heads 1.22-1.43x. The
default model's engine decode steps run the same either way.
FP8SERVE_KV_CACHE_LAYOUT=NHD keeps the token-major order (A/B runs).

Because the view is not contiguous under HND, code never flattens it with
`.view`: slots are read and written through `read_slots` / `write_slots`
(block = slot // block_size, offset = slot % block_size), and the C++ ops
take the strides of the view (kernels/cpu/kv_layout.h)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fp8serve.errors import ConfigError
from fp8serve.quantization.fp8 import Fp8Format, fp8_format

KV_CACHE_LAYOUTS = ("HND", "NHD")
KV_CACHE_LAYOUT_ENV = "FP8SERVE_KV_CACHE_LAYOUT"


def kv_cache_layout_from_env() -> str:
    """The layout FP8SERVE_KV_CACHE_LAYOUT asks for (HND when unset); a
    ConfigError naming the variable and the accepted values otherwise."""
    value = os.environ.get(KV_CACHE_LAYOUT_ENV, "HND").strip().upper()
    if value not in KV_CACHE_LAYOUTS:
        raise ConfigError(f"environment variable {KV_CACHE_LAYOUT_ENV}={os.environ[KV_CACHE_LAYOUT_ENV]!r}: "
                          f"expected one of {', '.join(KV_CACHE_LAYOUTS)}")
    return value

_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVCacheSpec:
    kv_cache_dtype: str  # resolved: float32 | bfloat16 | float16 | fp8_e4m3 | fp8_e5m2
    block_size: int
    num_kv_heads: int
    head_size: int
    num_layers: int
    kv_layout: str = "HND"  # memory order of a block: see the module docstring

    def __post_init__(self) -> None:
        if self.kv_layout not in KV_CACHE_LAYOUTS:
            raise ConfigError(f"KVCacheSpec.kv_layout: expected one of {', '.join(KV_CACHE_LAYOUTS)}, "
                              f"got {self.kv_layout!r}")

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
        """The shape every layer's cache is indexed by: [K/V, num_blocks,
        block_size, num_kv_heads, head_size], whatever `kv_layout`."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def storage_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape of a layer's cache in memory order."""
        if self.kv_layout == "HND":
            return (2, num_blocks, self.num_kv_heads, self.block_size, self.head_size)
        return self.layer_shape(num_blocks)

    def empty_layer(self, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """An unwritten layer cache of `num_blocks` blocks: the layer_shape
        view of storage_shape memory."""
        storage = torch.empty(self.storage_shape(num_blocks), dtype=self.storage_dtype, device=device)
        return as_layer_view(storage, self.kv_layout)


def as_layer_view(storage: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """A cache in memory order ([2, num_blocks, ...] or one of K/V without the
    leading 2) as the [..., num_blocks, block_size, num_kv_heads, head_size]
    view code indexes."""
    return storage.transpose(-3, -2) if kv_layout == "HND" else storage


def read_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows [n, num_kv_heads, head_size] of slots `slots` ([n] int64) of one
    K or V cache view [num_blocks, block_size, num_kv_heads, head_size] (a copy)."""
    block_size = cache.shape[1]
    return cache[slots // block_size, slots % block_size]


def write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Stores rows [n, num_kv_heads, head_size] into slots `slots` of one K or V
    cache view, in place (through the view, whatever the memory order)."""
    block_size = cache.shape[1]
    cache.index_put_((slots // block_size, slots % block_size), rows)


def storage_rows(cache: torch.Tensor) -> torch.Tensor:
    """Every head_size row of a cache view ([..., num_blocks, block_size,
    num_kv_heads, head_size]) as one [rows, head_size] view of its memory, in
    memory order: for filling or scanning a whole cache, where which row is
    which does not matter."""
    if not cache.is_contiguous():
        cache = cache.transpose(-3, -2)  # HND memory order
    return cache.view(-1, cache.shape[-1])


def layout_of(cache: torch.Tensor) -> str:
    """"HND" or "NHD": the memory order of a K or V cache view [num_blocks,
    block_size, num_kv_heads, head_size] (either when num_kv_heads or
    block_size is 1); a ValueError for any other strides (the C++ ops walk
    raw block strides: kernels/cpu/kv_layout.h)."""
    if cache.dim() != 4:
        raise ValueError(f"a K or V cache must be [num_blocks, block_size, num_kv_heads, head_size], "
                         f"got {tuple(cache.shape)}")
    _, bs, nkv, hs = cache.shape
    st = cache.stride()
    if st[3] == 1 and st[0] == bs * nkv * hs:
        if st[2] == hs and st[1] == nkv * hs:
            return "NHD"
        if st[1] == hs and st[2] == bs * hs:
            return "HND"
    raise ValueError(f"a K or V cache must be laid out as HND ([num_blocks, num_kv_heads, block_size, head_size] "
                     f"in memory) or NHD ([num_blocks, block_size, num_kv_heads, head_size]), got shape "
                     f"{tuple(cache.shape)} with strides {tuple(st)}")
