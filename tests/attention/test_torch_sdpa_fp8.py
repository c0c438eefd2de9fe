"""The attention backends with an FP8 KV cache against a float64 reference:
TorchSDPABackend (the reference path) and CpuPagedBackend (the C++ decode
kernel the engine picks on CPU; skipped when the extension cannot be built).

The reference keeps every sequence's K/V history unquantized, applies the
storage contract (x in float32 / scale, saturated, rounded to the nearest
FP8 value by torch's own cast, decoded and multiplied back by the scale) and
runs plain causal attention with grouped KV heads in float64. The backend is
driven as the model runner drives it: paged, non-contiguous blocks, an odd
block count, partially filled last blocks, sequences of different lengths,
a prefill in two chunks (the second with cached context), then decode steps.
Per-KV-head scales (a list per K and V) run through the Attention layer, which
folds them around the backend, against the same reference with each head's scale.
"""

from __future__ import annotations

import math

import pytest
import torch

from fp8serve.attention.backends.torch_sdpa import TorchSDPABackend
from fp8serve.attention.forward_context import set_forward_context
from fp8serve.layers.attention import Attention
from fp8serve.kernels.cpu_ops import load_cpu_ops
from fp8serve.attention.kv_cache_spec import KVCacheSpec, read_slots
from fp8serve.attention.metadata import AttentionMetadata

BLOCK_SIZE = 16
NUM_BLOCKS = 37  # odd, and more than the sequences need, so block ids are scattered
PROMPT_LENS = [5, 16, 23, 1, 37]  # last blocks partially filled; one exactly full
NUM_DECODE_STEPS = 3


def _cpu_paged_backend():
    if load_cpu_ops() is None:
        pytest.skip("C++ CPU kernels unavailable")
    from fp8serve.attention.backends.cpu_paged import CpuPagedBackend

    return CpuPagedBackend


BACKENDS = {"torch_sdpa": lambda: TorchSDPABackend, "cpu_paged": _cpu_paged_backend}
TORCH_FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}


def reference_qdq(x: torch.Tensor, scale: float, kv_cache_dtype: str) -> torch.Tensor:
    """float64 value the cache gives back for `x` stored with `scale`."""
    dtype, max_finite = TORCH_FP8[kv_cache_dtype]
    codes = (x.to(torch.float32) / scale).clamp(-max_finite, max_finite).to(dtype)
    return codes.to(torch.float64) * scale


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int],
                        softmax_scale: float) -> torch.Tensor:
    """q [n, H, D] at absolute positions q_pos; k, v [L, Hkv, D]; float64 causal attention."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->nhl", q.double(), k) * softmax_scale
    future = torch.arange(k.shape[0])[None, :] > torch.tensor(q_pos)[:, None]  # [n, L]
    scores = scores.masked_fill(future[:, None, :], float("-inf"))
    return torch.einsum("nhl,lhd->nhd", scores.softmax(dim=-1), v)


class PagedSequences:
    """Block tables and the unquantized K/V history of a few sequences."""

    def __init__(self, total_lens: list[int], generator: torch.Generator) -> None:
        needed = [math.ceil(n / BLOCK_SIZE) for n in total_lens]
        ids = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
        self.block_tables, start = [], 0
        for n in needed:
            self.block_tables.append(ids[start:start + n])
            start += n
        self.num_tokens = [0] * len(total_lens)
        self.keys: list[list[torch.Tensor]] = [[] for _ in total_lens]
        self.values: list[list[torch.Tensor]] = [[] for _ in total_lens]

    def metadata(self, seq_ids: list[int], q_lens: list[int],
                 device: torch.device | str = "cpu") -> tuple[AttentionMetadata, list[list[int]]]:
        """Metadata for a step adding q_lens[i] tokens to sequence seq_ids[i]; and
        the absolute positions of each sequence's new tokens."""
        slots, positions = [], []
        for s, n in zip(seq_ids, q_lens):
            pos = list(range(self.num_tokens[s], self.num_tokens[s] + n))
            positions.append(pos)
            slots += [self.block_tables[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
            self.num_tokens[s] += n
        seq_lens = [self.num_tokens[s] for s in seq_ids]
        width = max(len(self.block_tables[s]) for s in seq_ids)
        tables = [self.block_tables[s] + [NUM_BLOCKS] * (width - len(self.block_tables[s])) for s in seq_ids]
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            block_tables=torch.tensor(tables, device=device),
            seq_lens=torch.tensor(seq_lens, device=device),
            query_start_loc=torch.tensor(starts, device=device),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            num_seqs=len(seq_ids),
            num_tokens=sum(q_lens),
            null_block_id=NUM_BLOCKS,
        )
        return md, positions


def run_and_compare(backend_cls, kv_cache_dtype, num_kv_heads, group, head_size, k_scale, v_scale, k_std, v_std, seed,
                    device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    softmax_scale = head_size**-0.5
    spec = KVCacheSpec(kv_cache_dtype, BLOCK_SIZE, num_kv_heads, head_size, num_layers=1)
    backend = backend_cls(spec, torch.float32)
    cache = backend.allocate_kv_cache(NUM_BLOCKS, torch.device(device))
    seqs = PagedSequences([n + NUM_DECODE_STEPS for n in PROMPT_LENS], gen)

    first_chunk = [math.ceil(n / 2) for n in PROMPT_LENS]
    steps = [(list(range(len(PROMPT_LENS))), first_chunk)]
    rest = [(i, n - c) for i, (n, c) in enumerate(zip(PROMPT_LENS, first_chunk)) if n - c > 0]
    steps.append(([i for i, _ in rest], [n for _, n in rest]))
    steps += [(list(range(len(PROMPT_LENS))), [1] * len(PROMPT_LENS))] * NUM_DECODE_STEPS

    layer = None
    if isinstance(k_scale, list):
        # One scale per KV head: through the Attention layer, which the backend serves with scale 1.
        layer = Attention(num_heads, head_size, softmax_scale, num_kv_heads, prefix="test.attn")
        layer.bind(backend, cache)
        layer.set_kv_scales(max(k_scale), max(v_scale), "test", tuple(k_scale), tuple(v_scale))
        k_scale = torch.tensor(k_scale, dtype=torch.float32)[:, None]  # [num_kv_heads, 1]: broadcasts over tokens
        v_scale = torch.tensor(v_scale, dtype=torch.float32)[:, None]
    worst_vs_qdq, worst_vs_exact = 0.0, 0.0
    for seq_ids, q_lens in steps:
        md, positions = seqs.metadata(seq_ids, q_lens, device)
        backend.build_metadata(md)
        n = md.num_tokens
        q = torch.randn(n, num_heads, head_size, generator=gen)
        k = torch.randn(n, num_kv_heads, head_size, generator=gen) * k_std
        v = torch.randn(n, num_kv_heads, head_size, generator=gen) * v_std
        if layer is None:
            out = backend.forward(q.to(device), k.to(device), v.to(device), cache, md, softmax_scale=softmax_scale,
                                  k_scale=k_scale, v_scale=v_scale)
        else:
            with set_forward_context(md):
                out = layer(q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)).view(n, num_heads, head_size)
        assert out.shape == (n, num_heads, head_size) and out.dtype == torch.float32 and out.device == cache.device
        out = out.cpu()
        assert torch.isfinite(out).all()

        # What was written: the codes at each new slot decode to x / scale (x / its head's scale).
        dtype, _ = TORCH_FP8[kv_cache_dtype]
        stored_k = read_slots(cache[0], md.slot_mapping).view(dtype).cpu().double()
        stored_v = read_slots(cache[1], md.slot_mapping).view(dtype).cpu().double()
        assert torch.equal(stored_k * k_scale, reference_qdq(k, k_scale, kv_cache_dtype))
        assert torch.equal(stored_v * v_scale, reference_qdq(v, v_scale, kv_cache_dtype))

        start = 0
        for s, pos in zip(seq_ids, positions):
            rows = slice(start, start + len(pos))
            start += len(pos)
            seqs.keys[s].append(k[rows].double())
            seqs.values[s].append(v[rows].double())
            k_hist, v_hist = torch.cat(seqs.keys[s]), torch.cat(seqs.values[s])
            want = reference_attention(q[rows], reference_qdq(k_hist, k_scale, kv_cache_dtype),
                                       reference_qdq(v_hist, v_scale, kv_cache_dtype), pos, softmax_scale)
            exact = reference_attention(q[rows], k_hist, v_hist, pos, softmax_scale)
            got = out[rows].double()
            worst_vs_qdq = max(worst_vs_qdq, float((got - want).abs().max() / v_std))
            worst_vs_exact = max(worst_vs_exact, float((got - exact).abs().max() / v_std))
    return worst_vs_qdq, worst_vs_exact


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("kv_cache_dtype, k_scale, v_scale", [
    # k_std / k_scale ~ 200 puts a few percent of keys past 448: saturation is exercised.
    ("fp8_e4m3", 0.01, 0.02),
    ("fp8_e4m3", 1.0, 1.0),
    ("fp8_e5m2", 1.0, 1.0),
    ("fp8_e5m2", 0.3, 3.0),
])
def test_fp8_attention_matches_float64_reference(kv_cache_dtype, k_scale, v_scale, group, head_size, backend):
    k_std, v_std = 2.0, 3.0
    worst_vs_qdq, worst_vs_exact = run_and_compare(
        BACKENDS[backend](), kv_cache_dtype, num_kv_heads=2, group=group, head_size=head_size,
        k_scale=k_scale, v_scale=v_scale, k_std=k_std, v_std=v_std, seed=head_size * 10 + group,
    )
    print(f"{backend} {kv_cache_dtype} k_scale={k_scale} v_scale={v_scale} group={group} head_size={head_size}: "
          f"max |engine - qdq reference| / v_std = {worst_vs_qdq:.2e}, vs unquantized = {worst_vs_exact:.2e}")
    # float32 arithmetic against float64, relative to the values' scale.
    assert worst_vs_qdq < 2e-5, worst_vs_qdq
    # The reference is sensitive: FP8 rounding moves the output by far more.
    assert worst_vs_exact > 50 * max(worst_vs_qdq, 1e-7), (worst_vs_exact, worst_vs_qdq)


@pytest.mark.cuda
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("kv_cache_dtype, k_scale, v_scale", [("fp8_e4m3", 0.01, 0.02), ("fp8_e5m2", 0.3, 3.0)])
def test_fp8_attention_on_cuda_matches_float64_reference(kv_cache_dtype, k_scale, v_scale, group, head_size):
    """The reference backend is the engine's attention on CUDA: the same
    contract (codes written, values read back) on the GPU."""
    worst_vs_qdq, worst_vs_exact = run_and_compare(
        TorchSDPABackend, kv_cache_dtype, num_kv_heads=2, group=group, head_size=head_size,
        k_scale=k_scale, v_scale=v_scale, k_std=2.0, v_std=3.0, seed=head_size * 10 + group, device="cuda",
    )
    print(f"cuda {kv_cache_dtype} group={group} head_size={head_size}: max |engine - qdq reference| / v_std = "
          f"{worst_vs_qdq:.2e}, vs unquantized = {worst_vs_exact:.2e}")
    assert worst_vs_qdq < 2e-5, worst_vs_qdq
    assert worst_vs_exact > 50 * max(worst_vs_qdq, 1e-7), (worst_vs_exact, worst_vs_qdq)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_scale_of_two_halves_stored_values(kv_cache_dtype, backend):
    """value = code * scale: with scale 2 the stored codes hold x / 2."""
    spec = KVCacheSpec(kv_cache_dtype, BLOCK_SIZE, 1, 64, num_layers=1)
    backend = BACKENDS[backend]()(spec, torch.float32)
    cache = backend.allocate_kv_cache(NUM_BLOCKS, torch.device("cpu"))
    seqs = PagedSequences([5], torch.Generator().manual_seed(0))
    md, _ = seqs.metadata([0], [4])
    backend.build_metadata(md)
    # Values exact in both formats (and after halving), so the check is exact.
    k = torch.tensor([1.0, -2.0, 4.0, 8.0]).repeat_interleave(64).view(4, 1, 64)
    v = torch.full((4, 1, 64), 6.0)
    out = backend.forward(torch.zeros(4, 1, 64), k, v, cache, md, softmax_scale=0.125, k_scale=2.0, v_scale=2.0)
    dtype, _ = TORCH_FP8[kv_cache_dtype]
    stored_k = read_slots(cache[0], md.slot_mapping).view(dtype).float()
    stored_v = read_slots(cache[1], md.slot_mapping).view(dtype).float()
    assert torch.equal(stored_k, k / 2)
    assert torch.equal(stored_v, v / 2)
    # ...and reading multiplies the scale back in.
    torch.testing.assert_close(out, torch.full((4, 1, 64), 6.0))
    # A decode step (cpu_paged's C++ kernel) reads the same way: q = 0 averages V uniformly.
    md, _ = seqs.metadata([0], [1])
    backend.build_metadata(md)
    out = backend.forward(torch.zeros(1, 1, 64), torch.ones(1, 1, 64), torch.full((1, 1, 64), 10.0), cache, md,
                          softmax_scale=0.125, k_scale=2.0, v_scale=2.0)
    torch.testing.assert_close(out, torch.full((1, 1, 64), (4 * 6.0 + 10.0) / 5))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_per_head_scales_match_float64_reference(group, head_size, backend):
    """compressed-tensors' kv_cache_scheme strategy "attn_head": one k and v scale per KV head,
    the two heads' scales ~20x apart (so one head saturates where the other keeps its range, and
    the reference, with each head's own scale, is sensitive to a head read with the other's).
    Fresh seeds: scales and data differ every run."""
    seed = int(torch.randint(0, 2**31, ()).item())
    gen = torch.Generator().manual_seed(seed)
    k_scale = (torch.rand(2, generator=gen) * 0.02 + torch.tensor([0.001, 0.02])).tolist()
    v_scale = (torch.rand(2, generator=gen) * 0.02 + torch.tensor([0.02, 0.001])).tolist()
    worst_vs_qdq, worst_vs_exact = run_and_compare(
        BACKENDS[backend](), "fp8_e4m3", num_kv_heads=2, group=group, head_size=head_size,
        k_scale=k_scale, v_scale=v_scale, k_std=2.0, v_std=3.0, seed=seed,
    )
    print(f"{backend} per-head seed={seed} group={group} head_size={head_size}: max |engine - qdq reference| / "
          f"v_std = {worst_vs_qdq:.2e}, vs unquantized = {worst_vs_exact:.2e}")
    assert worst_vs_qdq < 2e-5, (seed, worst_vs_qdq)
    assert worst_vs_exact > 50 * max(worst_vs_qdq, 1e-7), (seed, worst_vs_exact, worst_vs_qdq)
