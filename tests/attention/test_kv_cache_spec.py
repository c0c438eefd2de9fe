"""attention/kv_cache_spec.py: the two memory orders of a layer's cache behind one
[2, num_blocks, block_size, num_kv_heads, head_size] view, the slot helpers, the layout check and
the environment switch."""

from __future__ import annotations

import pytest
import torch

from fp8serve.attention.kv_cache_spec import (
    KV_CACHE_LAYOUTS,
    KVCacheSpec,
    kv_cache_layout_from_env,
    layout_of,
    read_slots,
    storage_rows,
    write_slots,
)
from fp8serve.errors import ConfigError


@pytest.mark.parametrize("kv_layout", KV_CACHE_LAYOUTS)
def test_layer_view_and_memory_order(seed, kv_layout):
    spec = KVCacheSpec("fp8_e4m3", 4, 3, 8, num_layers=1, kv_layout=kv_layout)
    cache = spec.empty_layer(5)
    assert cache.shape == spec.layer_shape(5) == (2, 5, 4, 3, 8)
    assert cache.dtype == torch.uint8 and layout_of(cache[0]) == layout_of(cache[1]) == kv_layout
    # Memory order: HND keeps a kv head's rows of a block together, NHD a token's kv heads.
    flat = storage_rows(cache)
    assert flat.shape == (2 * 5 * 4 * 3, 8) and flat.data_ptr() == cache.data_ptr()
    cache.zero_()
    cache[0, 1, 2, 1] = 7  # block 1, token 2, kv head 1
    row = (1 * 3 + 1) * 4 + 2 if kv_layout == "HND" else (1 * 4 + 2) * 3 + 1
    assert flat[row].eq(7).all() and int(flat.ne(0).sum()) == 8


@pytest.mark.parametrize("kv_layout", KV_CACHE_LAYOUTS)
def test_slots_read_back_what_was_written(seed, kv_layout):
    g = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec("bfloat16", 4, 2, 8, num_layers=1, kv_layout=kv_layout)
    cache = spec.empty_layer(6)[0].zero_()
    slots = torch.randperm(24, generator=g)[:10]
    rows = torch.randn(10, 2, 8, generator=g).bfloat16()
    write_slots(cache, slots, rows)
    assert torch.equal(read_slots(cache, slots), rows)
    # Slot s is block s // 4, token s % 4 of the view; the rest stays zero.
    assert torch.equal(cache[slots // 4, slots % 4], rows)
    assert int(cache.ne(0).any(-1).sum()) == int(rows.ne(0).any(-1).sum())


def test_other_strides_are_not_a_layout():
    with pytest.raises(ValueError, match="laid out as HND"):
        layout_of(torch.zeros(3, 4, 2, 16)[..., :8])
    with pytest.raises(ValueError, match="must be \\[num_blocks"):
        layout_of(torch.zeros(3, 4, 8))


def test_bad_layout_names_are_rejected(monkeypatch):
    with pytest.raises(ConfigError, match="kv_layout: expected one of HND, NHD, got 'hnd'"):
        KVCacheSpec("fp8_e4m3", 16, 2, 64, num_layers=1, kv_layout="hnd")
    monkeypatch.setenv("FP8SERVE_KV_CACHE_LAYOUT", "nhd")
    assert kv_cache_layout_from_env() == "NHD"  # case-insensitive, as vLLM's
    monkeypatch.setenv("FP8SERVE_KV_CACHE_LAYOUT", "HDN")
    with pytest.raises(ConfigError, match="FP8SERVE_KV_CACHE_LAYOUT='HDN': expected one of HND, NHD"):
        kv_cache_layout_from_env()
    monkeypatch.delenv("FP8SERVE_KV_CACHE_LAYOUT")
    assert kv_cache_layout_from_env() == "HND"
