"""CpuPagedBackend (C++ decode kernel) against TorchSDPABackend (gather +
dequantize + SDPA) on one decode step over the same paged cache: same cache
writes (quantize + scatter into the step's slots), same outputs, for every KV
cache dtype with scales != 1. Fresh random data each run; the seed is in every
failure message (FP8SERVE_TEST_SEED replays one)."""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from fp8serve.attention.backends.torch_sdpa import TorchSDPABackend
from fp8serve.attention.kv_cache_spec import KVCacheSpec, read_slots
from fp8serve.attention.metadata import AttentionMetadata
from fp8serve.kernels.cpu_ops import load_cpu_ops
from fp8serve.quantization.fp8 import quantize_fp8

BLOCK_SIZE = 16
NUM_BLOCKS = 41  # odd, more than needed: block ids are scattered
# Context lengths after the decode step: length 1 (the new token only),
# partial last blocks, exactly full blocks, a long one.
SEQ_LENS = [1, 17, 32, 9, 200, 48]
K_SCALE, V_SCALE = 0.05, 0.03


@pytest.fixture(scope="module")
def cpu_paged_backend():
    if load_cpu_ops() is None:
        pytest.skip("C++ CPU kernels unavailable (load_cpu_ops() returned None)")
    from fp8serve.attention.backends.cpu_paged import CpuPagedBackend

    return CpuPagedBackend


@pytest.fixture
def seed():
    return int(os.environ.get("FP8SERVE_TEST_SEED", random.SystemRandom().randrange(2**31)))


def scattered_block_tables(g: torch.Generator, seq_lens: list[int]) -> list[list[int]]:
    """Enough blocks for each length, taken from a random permutation of the pool."""
    ids = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    block_tables, start = [], 0
    for n in seq_lens:
        block_tables.append(ids[start:start + math.ceil(n / BLOCK_SIZE)])
        start += len(block_tables[-1])
    return block_tables


def decode_metadata(block_tables: list[list[int]], seq_lens: list[int]) -> AttentionMetadata:
    last = [n - 1 for n in seq_lens]
    slots = [bt[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for bt, p in zip(block_tables, last)]
    width = max(len(bt) for bt in block_tables) + 1  # padded with the null block, as the runner does
    tables = [bt + [NUM_BLOCKS] * (width - len(bt)) for bt in block_tables]
    n = len(seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables), seq_lens=torch.tensor(seq_lens),
        query_start_loc=torch.arange(n + 1), max_query_len=1, max_seq_len=max(seq_lens),
        num_seqs=n, num_tokens=n, null_block_id=NUM_BLOCKS,
    )


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"])
def test_decode_step_matches_torch_sdpa(cpu_paged_backend, seed, kv_cache_dtype, group):
    g = torch.Generator().manual_seed(seed)
    num_kv_heads, head_size = 3, 64
    num_heads = num_kv_heads * group
    spec = KVCacheSpec(kv_cache_dtype, BLOCK_SIZE, num_kv_heads, head_size, num_layers=1)
    paged = cpu_paged_backend(spec, torch.float32)
    reference = TorchSDPABackend(spec, torch.float32)

    # The context before this step, written as the engine writes it (quantize-on-write).
    cache = paged.allocate_kv_cache(NUM_BLOCKS, torch.device("cpu"))
    block_tables = scattered_block_tables(g, SEQ_LENS)
    history = [(bt[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE) for bt, n in zip(block_tables, SEQ_LENS)
               for p in range(n - 1)]
    if history:
        slots = torch.tensor(history)
        k = torch.randn(len(history), num_kv_heads, head_size, generator=g) * 2
        v = torch.randn(len(history), num_kv_heads, head_size, generator=g) * 2
        paged.write_kv_cache(k, v, cache, slots, K_SCALE, V_SCALE)

    md = decode_metadata(block_tables, SEQ_LENS)
    query = torch.randn(len(SEQ_LENS), num_heads, head_size, generator=g)
    key = torch.randn(len(SEQ_LENS), num_kv_heads, head_size, generator=g) * 2
    value = torch.randn(len(SEQ_LENS), num_kv_heads, head_size, generator=g) * 2
    kwargs = dict(softmax_scale=head_size**-0.5, k_scale=K_SCALE, v_scale=V_SCALE)

    cache_ref = cache.clone()
    paged.build_metadata(md)
    out = paged.forward(query, key, value, cache, md, **kwargs)
    md.backend_data = None
    reference.build_metadata(md)
    want = reference.forward(query, key, value, cache_ref, md, **kwargs)

    # The write: bit-identical caches (compared as bytes: never-written slots may hold NaN
    # patterns), holding the new tokens in the storage format.
    assert torch.equal(cache.view(torch.uint8), cache_ref.view(torch.uint8)), \
        f"seed={seed}: the backends wrote different caches"
    written_k = read_slots(cache[0], md.slot_mapping)
    written_v = read_slots(cache[1], md.slot_mapping)
    if spec.fp8 is not None:
        assert torch.equal(written_k, quantize_fp8(key, K_SCALE, spec.fp8)), f"seed={seed}"
        assert torch.equal(written_v, quantize_fp8(value, V_SCALE, spec.fp8)), f"seed={seed}"
    else:
        assert torch.equal(written_k, key.to(spec.storage_dtype)), f"seed={seed}"
        assert torch.equal(written_v, value.to(spec.storage_dtype)), f"seed={seed}"

    # The attention: both in float32 over the same stored values.
    assert out.shape == want.shape == (len(SEQ_LENS), num_heads, head_size) and out.dtype == torch.float32
    err = ((out - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, f"seed={seed}: CpuPagedBackend differs from TorchSDPABackend by {err:.2e} (relative)"


def prefill_metadata(block_tables: list[list[int]], prompt_lens: list[int]) -> AttentionMetadata:
    slots = [bt[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for bt, n in zip(block_tables, prompt_lens)
             for p in range(n)]
    width = max(len(bt) for bt in block_tables) + 1
    tables = [bt + [NUM_BLOCKS] * (width - len(bt)) for bt in block_tables]
    starts = [0]
    for n in prompt_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables), seq_lens=torch.tensor(prompt_lens),
        query_start_loc=torch.tensor(starts), max_query_len=max(prompt_lens), max_seq_len=max(prompt_lens),
        num_seqs=len(prompt_lens), num_tokens=sum(prompt_lens), null_block_id=NUM_BLOCKS,
    )


def run_fresh_prefill(cpu_paged_backend, seed, monkeypatch, kv_cache_dtype, compute_dtype, prompt_lens, group):
    """A fresh prefill of `prompt_lens` through CpuPagedBackend and through the
    reference backend (padded SDPA) on copies of one scattered cache; asserts
    the paged one ran the C++ prefill kernel once and both wrote the same
    bytes. Returns (paged output, reference output)."""
    from fp8serve.kernels import prefill_attention_ops

    g = torch.Generator().manual_seed(seed)
    num_kv_heads, head_size = 2, 64
    num_heads = num_kv_heads * group
    spec = KVCacheSpec(kv_cache_dtype, BLOCK_SIZE, num_kv_heads, head_size, num_layers=1)
    paged = cpu_paged_backend(spec, compute_dtype)
    reference = TorchSDPABackend(spec, compute_dtype)
    cache = paged.allocate_kv_cache(NUM_BLOCKS, torch.device("cpu"))
    block_tables = scattered_block_tables(g, prompt_lens)
    md = prefill_metadata(block_tables, prompt_lens)
    # q as the model passes it: a strided view of a fused qkv row.
    qkv = (torch.randn(md.num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=g) * 2).to(compute_dtype)
    query = qkv[:, :num_heads * head_size].view(md.num_tokens, num_heads, head_size)
    key = (torch.randn(md.num_tokens, num_kv_heads, head_size, generator=g) * 2).to(compute_dtype)
    value = (torch.randn(md.num_tokens, num_kv_heads, head_size, generator=g) * 2).to(compute_dtype)
    kwargs = dict(softmax_scale=head_size**-0.5, k_scale=K_SCALE, v_scale=V_SCALE)

    cache_ref = cache.clone()
    paged.build_metadata(md)
    calls = []
    real = prefill_attention_ops.prefill_attention
    monkeypatch.setattr(prefill_attention_ops, "prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = paged.forward(query, key, value, cache, md, **kwargs)
    assert calls == [1], f"the fresh {compute_dtype} prefill did not run the C++ prefill kernel"
    md.backend_data = None
    reference.build_metadata(md)
    want = reference.forward(query, key, value, cache_ref, md, **kwargs)

    assert torch.equal(cache.view(torch.uint8), cache_ref.view(torch.uint8)), \
        f"seed={seed}: the backends wrote different caches"
    assert out.shape == want.shape == (md.num_tokens, num_heads, head_size) and out.dtype == compute_dtype
    return out, want


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_fresh_prefill_matches_torch_sdpa(cpu_paged_backend, seed, kv_cache_dtype, group, monkeypatch):
    """A float32 fresh prefill of prompts of different lengths runs the C++
    prefill kernel (packed, no padding) and matches the reference backend's
    padded SDPA: same cache writes, same outputs, scales folded."""
    from fp8serve.kernels import prefill_attention_ops

    if not prefill_attention_ops.is_available():
        pytest.skip("the C++ prefill kernel is unavailable")
    # partial / single token / several key blocks / one full block
    out, want = run_fresh_prefill(cpu_paged_backend, seed, monkeypatch, kv_cache_dtype, torch.float32,
                                  [33, 1, 150, 16, 200], group)
    err = ((out - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, f"seed={seed}: prefill kernel differs from TorchSDPABackend by {err:.2e} (relative)"


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e4m3"])
def test_bf16_fresh_prefill_runs_the_amx_kernel(cpu_paged_backend, seed, kv_cache_dtype, monkeypatch):
    """bf16 compute with prompts of 8+ tokens on average: the backend runs
    the AMX prefill kernel on the K/V as stored (decoded FP8 included) and
    agrees with the reference backend's bf16 SDPA to bf16 precision; the
    cache writes are the same bytes."""
    from fp8serve.kernels import prefill_attention_ops

    if not prefill_attention_ops.amx_available():
        pytest.skip("no AMX tiles in this build or process")
    # mean 150 tokens, 40 of the 41 blocks
    out, want = run_fresh_prefill(cpu_paged_backend, seed, monkeypatch, kv_cache_dtype, torch.bfloat16,
                                  [250, 1, 200, 150], group=3)
    err = ((out.double() - want.double()).abs().max() / want.double().abs().max()).item()
    # Each side rounds its output to bf16 and the kernel P too: a few 2^-9.
    assert err < 2**-6, f"seed={seed}: AMX prefill differs from TorchSDPABackend by {err:.2e} (relative)"


def context_spec(kv_cache_dtype: str, compute_dtype: torch.dtype) -> tuple[str, KVCacheSpec]:
    """The cache of the cached-context tests: 3 KV heads of 64 (9 query heads), "auto" storing the
    compute dtype."""
    kv = compute_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    kv_name = str(kv).removeprefix("torch.") if isinstance(kv, torch.dtype) else kv
    return kv_name, KVCacheSpec(kv_name, BLOCK_SIZE, 3, 64, num_layers=1)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_prefill_over_a_cached_context(cpu_paged_backend, seed, kv_cache_dtype, compute_dtype, monkeypatch):
    """Prefix caching: new tokens continuing contexts already in the cache. Where the C++ kernel's
    context form applies it runs (the context read back from the cache as stored, packed, no
    padding) and matches the reference backend's padded SDPA over the same cache; the new tokens'
    cache writes are the same bytes."""
    import fp8serve.attention.backends.cpu_paged as cpu_paged_module
    from fp8serve.kernels import prefill_attention_ops

    kv_name, spec = context_spec(kv_cache_dtype, compute_dtype)
    g = torch.Generator().manual_seed(seed)
    num_kv_heads, head_size = spec.num_kv_heads, spec.head_size
    num_heads = num_kv_heads * 3
    paged = cpu_paged_backend(spec, compute_dtype)
    reference = TorchSDPABackend(spec, compute_dtype)
    cache = paged.allocate_kv_cache(NUM_BLOCKS, torch.device("cpu"))
    contexts, new = [64, 16, 130, 48], [9, 1, 77, 16]  # whole and partial blocks cached; 1 to 77 new tokens
    seq_lens = [c + n for c, n in zip(contexts, new)]
    block_tables = scattered_block_tables(g, seq_lens)
    # The cached contexts, written as an earlier prefill would have.
    ctx_slots = torch.tensor([bt[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                              for bt, c in zip(block_tables, contexts) for p in range(c)])
    ck = (torch.randn(len(ctx_slots), num_kv_heads, head_size, generator=g) * 2).to(compute_dtype)
    cv = (torch.randn(len(ctx_slots), num_kv_heads, head_size, generator=g) * 2).to(compute_dtype)
    paged.write_kv_cache(ck, cv, cache, ctx_slots, K_SCALE, V_SCALE)

    width = max(len(bt) for bt in block_tables) + 1
    slots = [bt[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for bt, c, n in zip(block_tables, contexts, new)
             for p in range(c, c + n)]
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor([bt + [NUM_BLOCKS] * (width - len(bt))
                                                                     for bt in block_tables]),
        seq_lens=torch.tensor(seq_lens), query_start_loc=torch.tensor([0] + torch.tensor(new).cumsum(0).tolist()),
        max_query_len=max(new), max_seq_len=max(seq_lens), num_seqs=len(new), num_tokens=sum(new),
        null_block_id=NUM_BLOCKS,
    )
    query = (torch.randn(md.num_tokens, num_heads, head_size, generator=g)).to(compute_dtype)
    key = (torch.randn(md.num_tokens, num_kv_heads, head_size, generator=g) * 2).to(compute_dtype)
    value = (torch.randn(md.num_tokens, num_kv_heads, head_size, generator=g) * 2).to(compute_dtype)
    scales = (K_SCALE, V_SCALE) if spec.fp8 is not None else (1.0, 1.0)
    kwargs = dict(softmax_scale=head_size**-0.5, k_scale=scales[0], v_scale=scales[1])

    cache_ref = cache.clone()
    paged.build_metadata(md)
    calls = []
    real = prefill_attention_ops.prefill_attention
    monkeypatch.setattr(prefill_attention_ops, "prefill_attention",
                        lambda *a, **k: calls.append(k.get("cu_seqlens_k") is not None) or real(*a, **k))

    class CountingOps:  # the backend calls the context kernel's op itself, not the checking wrapper
        def __getattr__(self, name):
            op = getattr(load_cpu_ops(), name)
            return (lambda *a: calls.append(True) or op(*a)) if name == "prefill_attention_with_context" else op

    monkeypatch.setattr(cpu_paged_module, "load_cpu_ops", CountingOps)
    out = paged.forward(query, key, value, cache, md, **kwargs)
    expect_kernel = prefill_attention_ops.applies_with_context(compute_dtype, sum(seq_lens), len(new), head_size)
    assert calls == ([True] if expect_kernel else []), calls
    md.backend_data = None
    reference.build_metadata(md)
    want = reference.forward(query, key, value, cache_ref, md, **kwargs)

    assert torch.equal(cache.view(torch.uint8), cache_ref.view(torch.uint8)), f"seed={seed}"
    assert out.shape == want.shape == (md.num_tokens, num_heads, head_size) and out.dtype == compute_dtype
    err = ((out.double() - want.double()).abs().max() / want.double().abs().max()).item()
    # float32: rounding only; bf16: each side rounds its output (and the kernel P) to bf16.
    assert err < (1e-5 if compute_dtype == torch.float32 else 2**-6), f"seed={seed}: {err:.2e} relative"


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("cached", [False, True])
def test_logits_indices_return_the_last_rows_of_the_full_output(cpu_paged_backend, seed, kv_cache_dtype,
                                                                compute_dtype, cached):
    """The last layer of a pruned prefill (`logits_indices`: each sequence's last new token) writes
    every token's K/V as the full forward does, and returns the full output's rows at those indices:
    bit for bit where the full forward ran the vector kernel (its context form with one query per
    sequence takes the same keys in the same order), to bf16 rounding where it ran the AMX kernel;
    the reference backend's rows bit for bit. Fresh prompts and prompts continuing cached contexts."""
    from fp8serve.kernels import prefill_attention_ops

    kv_name, spec = context_spec(kv_cache_dtype, compute_dtype)
    g = torch.Generator().manual_seed(seed)
    num_kv_heads, head_size = spec.num_kv_heads, spec.head_size
    num_heads = num_kv_heads * 3
    contexts = [64, 16, 130, 48, 0] if cached else [0] * 5
    new = [9, 1, 77, 16, 40] if cached else [33, 1, 150, 16, 200]
    seq_lens = [c + n for c, n in zip(contexts, new)]
    block_tables = scattered_block_tables(g, seq_lens)
    width = max(len(bt) for bt in block_tables) + 1
    slots = [bt[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for bt, c, n in zip(block_tables, contexts, new)
             for p in range(c, c + n)]
    query_start_loc = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist())

    def metadata() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=torch.tensor([bt + [NUM_BLOCKS] * (width - len(bt))
                                                                         for bt in block_tables]),
            seq_lens=torch.tensor(seq_lens), query_start_loc=query_start_loc, max_query_len=max(new),
            max_seq_len=max(seq_lens), num_seqs=len(new), num_tokens=sum(new), null_block_id=NUM_BLOCKS,
        )

    n = sum(new)
    query = torch.randn(n, num_heads, head_size, generator=g).to(compute_dtype)
    key = (torch.randn(n, num_kv_heads, head_size, generator=g) * 2).to(compute_dtype)
    value = (torch.randn(n, num_kv_heads, head_size, generator=g) * 2).to(compute_dtype)
    scales = (K_SCALE, V_SCALE) if spec.fp8 is not None else (1.0, 1.0)
    kwargs = dict(softmax_scale=head_size**-0.5, k_scale=scales[0], v_scale=scales[1])
    logits_indices = query_start_loc[1:] - 1

    for backend in (cpu_paged_backend(spec, compute_dtype), TorchSDPABackend(spec, compute_dtype)):
        cache = backend.allocate_kv_cache(NUM_BLOCKS, torch.device("cpu"))
        ctx_slots = torch.tensor([bt[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                  for bt, c in zip(block_tables, contexts) for p in range(c)], dtype=torch.int64)
        ck = (torch.randn(len(ctx_slots), num_kv_heads, head_size, generator=g) * 2).to(compute_dtype)
        cv = (torch.randn(len(ctx_slots), num_kv_heads, head_size, generator=g) * 2).to(compute_dtype)
        backend.write_kv_cache(ck, cv, cache, ctx_slots, *scales)
        cache_last = cache.clone()
        md = metadata()
        backend.build_metadata(md)
        full = backend.forward(query, key, value, cache, md, **kwargs)
        md = metadata()
        backend.build_metadata(md)
        last = backend.forward(query, key, value, cache_last, md, logits_indices=logits_indices, **kwargs)
        where = f"seed={seed} {backend.name} {compute_dtype} {kv_name} cached={cached}"
        assert torch.equal(cache.view(torch.uint8), cache_last.view(torch.uint8)), f"{where}: caches differ"
        assert last.shape == (len(new), num_heads, head_size) and last.dtype == compute_dtype, where
        want = full.index_select(0, logits_indices)
        amx_full = (backend.name == "cpu_paged" and not cached and compute_dtype == torch.bfloat16
                    and prefill_attention_ops.amx_available())
        if amx_full:
            err = ((last.double() - want.double()).abs().max() / want.double().abs().max()).item()
            assert err < 2**-6, f"{where}: {err:.2e} relative"
        else:
            assert torch.equal(last, want), f"{where}: max diff {(last.float() - want.float()).abs().max():.3e}"
        if backend.name == "cpu_paged":
            md = metadata()
            backend.build_metadata(md)
            if backend.prefill_capture_inputs(md) is None:  # the reference path: it takes any rows
                assert cached and compute_dtype == torch.bfloat16 and prefill_attention_ops.amx_available(), \
                    f"{where}: the C++ kernels did not run"
                continue
            with pytest.raises(ValueError, match="each sequence's last token"):
                backend.forward(query, key, value, cache_last.clone(), md, logits_indices=logits_indices[:-1],
                                **kwargs)
