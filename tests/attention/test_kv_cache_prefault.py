"""FP8SERVE_KV_CACHE_PREFAULT (AttentionBackend.allocate_kv_cache's `prefault`,
engine/model_runner.py): with it every page of the KV cache is mapped before the
first request; without it only the null block's. Residency is read from the
kernel (mincore), not inferred from the contents: fresh anonymous pages read as
zeros either way."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import sys

import pytest
import torch
from checkpoints import write_tiny_llama

from fp8serve.attention.backends.cpu_paged import CpuPagedBackend
from fp8serve.attention.kv_cache_spec import KVCacheSpec
from fp8serve.engine.llm_engine import LLMEngine
from fp8serve.engine.model_runner import KV_CACHE_PREFAULT_ENV
from fp8serve.errors import ConfigError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore residency is read on Linux")

# Above glibc's largest mmap threshold (32 MiB, also the engine's malloc
# tuning): the cache gets pages of its own that no earlier allocation touched.
CACHE_BYTES = 96 << 20


def resident_fraction(t: torch.Tensor) -> float:
    """The fraction of the whole pages of `t`'s storage that are mapped now."""
    page = os.sysconf("SC_PAGE_SIZE")
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    start, end = -(-ptr // page) * page, (ptr + nbytes) // page * page
    n = (end - start) // page
    assert n > 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    vec = (ctypes.c_ubyte * n)()
    # The range lies inside one live allocation, so mincore has no reason to fail.
    assert libc.mincore(start, end - start, vec) == 0, f"mincore failed: errno {ctypes.get_errno()}"
    return sum(v & 1 for v in vec) / n


def backend(kv_dtype: str) -> tuple[CpuPagedBackend, int]:
    spec = KVCacheSpec(kv_dtype, 16, 2, 64, num_layers=1)
    return CpuPagedBackend(spec, torch.float32), CACHE_BYTES // spec.bytes_per_block


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_prefault_maps_every_page_and_the_default_maps_few(kv_dtype):
    paged, num_blocks = backend(kv_dtype)
    lazy = paged.allocate_kv_cache(num_blocks, torch.device("cpu"))
    # The null block (and the 2 MiB page around it) only.
    assert resident_fraction(lazy) < 0.25
    assert torch.count_nonzero(lazy[:, num_blocks].view(torch.uint8)) == 0
    full = paged.allocate_kv_cache(num_blocks, torch.device("cpu"), prefault=True)
    assert resident_fraction(full) == 1.0
    assert torch.count_nonzero(full.view(torch.uint8)) == 0
    assert full.shape == lazy.shape and full.dtype == lazy.dtype


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("prefault") / "llama")


def engine(model_dir) -> LLMEngine:
    # CACHE_BYTES a layer: each layer's cache is then an allocation of its own.
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    return LLMEngine.from_args(str(model_dir), dtype="float32", device="cpu", kv_cache_memory=CACHE_BYTES * layers,
                               max_model_len=64)


def test_engine_prefaults_its_caches_when_asked(model_dir, monkeypatch, caplog):
    monkeypatch.setenv(KV_CACHE_PREFAULT_ENV, "1")
    with caplog.at_level(logging.INFO, logger="fp8serve.engine.model_runner"):
        runner = engine(model_dir).model_runner
    assert all(resident_fraction(c) == 1.0 for c in runner.kv_caches)
    assert any("every page written at start-up" in r.getMessage() and KV_CACHE_PREFAULT_ENV in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("value", [None, "0", "auto"])
def test_engine_leaves_pages_to_the_first_writes_by_default(model_dir, monkeypatch, caplog, value):
    if value is None:
        monkeypatch.delenv(KV_CACHE_PREFAULT_ENV, raising=False)
    else:
        monkeypatch.setenv(KV_CACHE_PREFAULT_ENV, value)
    with caplog.at_level(logging.INFO, logger="fp8serve.engine.model_runner"):
        runner = engine(model_dir).model_runner
    # Every layer's cache is its own mapping; most of it untouched.
    assert sum(resident_fraction(c) for c in runner.kv_caches) / len(runner.kv_caches) < 0.25
    assert not any("every page written at start-up" in r.getMessage() for r in caplog.records)


def test_a_bad_value_is_a_config_error_naming_the_variable(model_dir, monkeypatch):
    monkeypatch.setenv(KV_CACHE_PREFAULT_ENV, "sometimes")
    with pytest.raises(ConfigError, match=f"{KV_CACHE_PREFAULT_ENV}='sometimes': expected auto, 1 or 0"):
        engine(model_dir)
