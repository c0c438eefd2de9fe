"""The bf16 AMX prefill kernel (cpu/prefill_attention_amx.cpp) against the
float64 reference and against torch's own bf16 SDPA on the same inputs:
packed batches of uneven lengths (empty, single token, exactly one key
block, partial and several blocks), GQA groups 1/3/8, head sizes 64 (O^T in
tiles) and 128 (O^T through memory), strided query rows, large scores (the
deferred rescaling), causality, thread counts. Skipped where this machine or
build has no AMX. Fresh random data each run; the seed is in every failure."""

from __future__ import annotations

import pytest
import torch

from prefill_inputs import packed_qkv_inputs
from fp8serve.kernels import prefill_attention_ops
from fp8serve.kernels.prefill_attention_ops import prefill_attention, prefill_attention_ref, prefill_attention_sdpa


@pytest.fixture(scope="module")
def amx(ops):
    if not prefill_attention_ops.amx_available():
        pytest.skip("no AMX tiles in this build or process")


def _inputs(g, lens, num_heads, num_kv_heads, head_size, magnitude=2.0):
    return packed_qkv_inputs(g, lens, num_heads, num_kv_heads, head_size, torch.bfloat16, magnitude)


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_matches_reference_as_well_as_torch_sdpa(amx, seed, head_size, num_heads, num_kv_heads):
    g = torch.Generator().manual_seed(seed)
    lens = [37, 1, 0, 300, 32, 129, 16]
    q, k, v, cu = _inputs(g, lens, num_heads, num_kv_heads, head_size)
    scale, out_scale = head_size**-0.5 * 0.7, 1.3
    want = prefill_attention_ref(q, k, v, cu, scale, out_scale)
    out = prefill_attention(q, k, v, cu, scale, out_scale, path="amx")
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert torch.equal(out, prefill_attention(q, k, v, cu, scale, out_scale)), "'best' takes the AMX kernel for bf16"
    top = want.abs().max().item()
    err = (out.double() - want).abs().max().item() / top
    sdpa_err = (prefill_attention_sdpa(q, k, v, cu, scale, out_scale).double() - want).abs().max().item() / top
    # Both round the output to bf16 (2^-9 relative at the top of the range);
    # the kernel also rounds P to bf16. Measured over 40 seeds (these lens, GQA
    # 9/3 at 64 and 8/1 at 128): at most 2.8 x 2^-9, median 0.9x and at most
    # 1.3x torch SDPA's error on the same inputs.
    assert err <= 2**-7, f"seed={seed}: {err:.2e} (torch SDPA: {sdpa_err:.2e})"


def test_large_scores_stay_finite_and_accurate(amx, seed):
    """Scores in the hundreds grow the running max by far more than the
    rescaling slack, block after block: every rescale must land."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, cu = _inputs(g, [260, 70], 3, 1, 64, magnitude=6.0)
    want = prefill_attention_ref(q, k, v, cu, 1.0)
    out = prefill_attention(q, k, v, cu, 1.0, path="amx")
    assert torch.isfinite(out).all(), f"seed={seed}"
    top = want.abs().max().item()
    err = (out.double() - want).abs().max().item() / top
    sdpa_err = (prefill_attention_sdpa(q, k, v, cu, 1.0, 1.0).double() - want).abs().max().item() / top
    # Over 40 seeds: at most 2.5 x 2^-9 (torch SDPA's error there is smaller,
    # the kernel's at most 2.4x it: few keys dominate, and P's bf16 rounding
    # is relative to them).
    assert err <= 2**-7, f"seed={seed}: {err:.2e} (torch SDPA: {sdpa_err:.2e})"


def test_token_only_sees_its_own_prefix(amx, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, cu = _inputs(g, [50, 40], 9, 3, 64)
    base = prefill_attention(q, k, v, cu, 0.125, path="amx")
    k2, v2 = k.clone(), v.clone()
    k2[30:] += torch.randn(k2[30:].shape, generator=g).bfloat16()
    v2[30:] += torch.randn(v2[30:].shape, generator=g).bfloat16()
    out = prefill_attention(q, k2, v2, cu, 0.125, path="amx")
    assert torch.equal(out[:30], base[:30]), f"seed={seed}: a token attended to a later one"
    assert not torch.equal(out[30:50], base[30:50]), f"seed={seed}: the change did not reach the tokens that see it"


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_thread_counts_give_identical_results(amx, seed, num_threads):
    g = torch.Generator().manual_seed(seed)
    q, k, v, cu = _inputs(g, [90, 17, 33], 9, 3, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = prefill_attention(q, k, v, cu, 0.125, path="amx")
        torch.set_num_threads(num_threads)
        out = prefill_attention(q, k, v, cu, 0.125, path="amx")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, want), f"seed={seed}: {num_threads} threads changed the result"


def test_amx_path_rejects_what_it_cannot_run(amx):
    q, k, v, cu = _inputs(torch.Generator().manual_seed(0), [8], 2, 1, 64)
    with pytest.raises(ValueError, match="takes bf16"):
        prefill_attention(q.float(), k.float(), v.float(), cu, 1.0, path="amx")
    q48, k48, v48, _ = _inputs(torch.Generator().manual_seed(0), [8], 2, 1, 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        prefill_attention(q48, k48, v48, cu, 1.0, path="amx")
    # "best" keeps such shapes on the vector kernel instead of failing.
    assert prefill_attention(q48, k48, v48, cu, 1.0).shape == q48.shape
