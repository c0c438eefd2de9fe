"""The C++ causal prefill kernel (cpu/prefill_attention.cpp) against its
float64 reference: every lane width it was built with (AVX-512, AVX2, scalar),
GQA groups 1/3/8, head sizes 64/128, packed batches of uneven lengths
(single tokens, partial and several key blocks, an empty sequence), strided
query rows, float32/bf16/fp16, scales folded in. Fresh random data each run;
the seed is in every failure message (FP8SERVE_TEST_SEED replays one)."""

from __future__ import annotations

import pytest
import torch

from prefill_inputs import packed_qkv_inputs
from fp8serve.kernels.prefill_attention_ops import (
    _PATHS,
    amx_available,
    bf16_dot_available,
    prefill_attention,
    prefill_attention_ref,
    prefill_attention_sdpa,
)


def _paths(ops, head_size):
    paths = ["best", "scalar"]
    if ops.has_avx2() and head_size % 32 == 0:
        paths.append("avx2")
    if ops.has_avx512() and head_size % 64 == 0:
        paths.append("avx512")
    return paths


_inputs = packed_qkv_inputs  # (g, lens, num_heads, num_kv_heads, head_size, dtype, magnitude=2.0)


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_matches_reference_on_every_path(ops, seed, head_size, num_heads, num_kv_heads):
    g = torch.Generator().manual_seed(seed)
    lens = [37, 1, 0, 300, 16, 129]  # partial tiles, a lone token, an empty sequence, several key blocks
    q, k, v, cu = _inputs(g, lens, num_heads, num_kv_heads, head_size, torch.float32)
    scale, out_scale = head_size**-0.5 * 0.7, 1.3
    want = prefill_attention_ref(q, k, v, cu, scale, out_scale)
    for path in _paths(ops, head_size):
        out = prefill_attention(q, k, v, cu, scale, out_scale, path=path)
        assert out.shape == q.shape and out.dtype == torch.float32
        err = ((out.double() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, f"seed={seed} path={path}: {err:.2e} relative to the float64 reference"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_are_read_and_written_in_their_dtype(ops, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    q, k, v, cu = _inputs(g, [70, 5, 200], 6, 2, 64, dtype)
    want = prefill_attention_ref(q, k, v, cu, 0.125)
    # The vector kernel's float32 paths ("best" means, for bf16, the AMX kernel or the bf16
    # dot products where there are: tests/kernels/test_prefill_attention_amx.py and the bf16
    # dot-product tests below, which round P to bf16).
    bf16_p = dtype == torch.bfloat16 and (amx_available() or bf16_dot_available())
    for path in [p for p in _paths(ops, 64) if not (bf16_p and p == "best")]:
        out = prefill_attention(q, k, v, cu, 0.125, path=path)
        assert out.dtype == dtype and out.shape == q.shape
        # Float32 maths over the 16-bit inputs; only the output rounding differs.
        err = ((out.double() - want).abs() / (want.abs() + 1e-3)).max().item()
        assert err < 2 ** -7, f"seed={seed} path={path} {dtype}: {err:.2e}"


def test_large_scores_stay_finite_and_exact(ops, seed):
    """Scores in the hundreds: the running max keeps every exp in range, and
    the error is float32's (compared with torch's float32 SDPA on the same
    inputs: scores this large lose ~1e-5 relative to rounding alone)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, cu = _inputs(g, [260], 3, 1, 64, torch.float32, magnitude=6.0)
    want = prefill_attention_ref(q, k, v, cu, 1.0)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=1.0, enable_gqa=True,
    ).transpose(0, 1)
    sdpa_err = ((sdpa.double() - want).abs().max() / want.abs().max()).item()
    for path in _paths(ops, 64):
        out = prefill_attention(q, k, v, cu, 1.0, path=path)
        assert torch.isfinite(out).all(), f"seed={seed} path={path}"
        err = ((out.double() - want).abs().max() / want.abs().max()).item()
        # Over 60 seeds the vector paths' worst was 1.0x SDPA's error, the
        # scalar path's (no FMAs, so its dot products round more) 2.5x.
        bound = (4 if path == "scalar" else 2) * sdpa_err
        assert err < max(bound, 1e-5), f"seed={seed} path={path}: {err:.2e} (torch SDPA: {sdpa_err:.2e})"


def test_token_only_sees_its_own_prefix(ops, seed):
    """Changing a later token's K/V (or another sequence's) leaves earlier outputs bit-identical."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, cu = _inputs(g, [50, 40], 9, 3, 64, torch.float32)
    base = prefill_attention(q, k, v, cu, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[30:] += torch.randn(k2[30:].shape, generator=g)
    v2[30:] += torch.randn(v2[30:].shape, generator=g)
    out = prefill_attention(q, k2, v2, cu, 0.125)
    assert torch.equal(out[:30], base[:30]), f"seed={seed}: a token attended to a later one"
    assert not torch.equal(out[30:50], base[30:50]), f"seed={seed}: the change did not reach the tokens that see it"


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_thread_counts_give_identical_results(ops, seed, num_threads):
    g = torch.Generator().manual_seed(seed)
    q, k, v, cu = _inputs(g, [90, 17, 33], 9, 3, 64, torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = prefill_attention(q, k, v, cu, 0.125)
        torch.set_num_threads(num_threads)
        out = prefill_attention(q, k, v, cu, 0.125)
    finally:
        torch.set_num_threads(before)
    # Each work item is computed by one thread in a fixed order: no reduction depends on the split.
    assert torch.equal(out, want), f"seed={seed}"


def test_rejects_bad_inputs(ops, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, cu = _inputs(g, [8, 8], 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="num_kv_heads"):
        prefill_attention(q, k[:, :1].expand(16, 3, 64), v[:, :1].expand(16, 3, 64), cu, 1.0)
    with pytest.raises(TypeError, match="share one of"):
        prefill_attention(q, k.double(), v.double(), cu, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        prefill_attention(q, k, v, cu.int(), 1.0)
    with pytest.raises(ValueError, match="heads must be contiguous"):
        prefill_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cu, 1.0)
    with pytest.raises(ValueError, match="unknown path"):
        prefill_attention(q, k, v, cu, 1.0, path="amx512")
    with pytest.raises(RuntimeError, match="from 0 to num_tokens"):
        prefill_attention(q, k, v, torch.tensor([0, 8, 15]), 1.0)
    with pytest.raises(RuntimeError, match="must not decrease"):
        prefill_attention(q, k, v, torch.tensor([0, 9, 8, 16]), 1.0)


def test_engine_uses_it_where_it_was_measured_faster(ops):
    from fp8serve.kernels.prefill_attention_ops import (MIN_MEAN_PROMPT_TOKENS_AMX, amx_available, applies,
                                                        applies_with_context)

    # float32: every prompt, one token long included, fresh or continuing a cached context, so that a
    # row's sums do not depend on the prompt's length (SDPA's do: see the module's docstring).
    assert applies(torch.float32, 4, 4) and applies(torch.float32, 1, 1) and applies(torch.float32, 4096, 1)
    assert applies_with_context(torch.float32, 5, 5)
    if amx_available():
        # bf16: the AMX kernel for prompts of 8+ tokens on average; SDPA (on AMX) for other head sizes.
        assert applies(torch.bfloat16, MIN_MEAN_PROMPT_TOKENS_AMX * 4, 4)
        assert not applies(torch.bfloat16, MIN_MEAN_PROMPT_TOKENS_AMX * 4 - 1, 4)
        assert not applies(torch.bfloat16, MIN_MEAN_PROMPT_TOKENS_AMX * 4, 4, head_size=80), "AMX needs % 32"
    else:
        # bf16 without AMX: the vector kernel for every prompt (faster at every length measured), any head size.
        assert applies(torch.bfloat16, 4, 4) and applies(torch.bfloat16, 1, 1)
        assert applies(torch.bfloat16, 4, 4, head_size=80)
    assert not applies(torch.float16, 1 << 20, 1)


# ------------------------------------------------------- bf16 dot products (AVX512-BF16 builds)
needs_bf16_dot = pytest.mark.skipif(not bf16_dot_available(), reason="built without AVX512-BF16")


@needs_bf16_dot
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_bf16_dot_matches_reference_as_well_as_torch_sdpa(ops, seed, head_size, num_heads, num_kv_heads):
    """bf16 Q/K/V, float32 scores and sums, P rounded to bf16 before P V and
    a bf16 output: within 2^-7 of the largest reference output, the bound
    the AMX kernel (which rounds P the same way) meets."""
    g = torch.Generator().manual_seed(seed)
    lens = [37, 1, 0, 300, 32, 129, 16, 1100]  # 1100: packed in three units of up to 512 keys
    q, k, v, cu = _inputs(g, lens, num_heads, num_kv_heads, head_size, torch.bfloat16)
    scale, out_scale = head_size**-0.5 * 0.7, 1.3
    want = prefill_attention_ref(q, k, v, cu, scale, out_scale)
    out = prefill_attention(q, k, v, cu, scale, out_scale, path="bf16dot")
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    top = want.abs().max().item()
    err = (out.double() - want).abs().max().item() / top
    sdpa_err = (prefill_attention_sdpa(q, k, v, cu, scale, out_scale).double() - want).abs().max().item() / top
    print(f"bf16dot {num_heads}/{num_kv_heads} x {head_size}: {err:.2e} of the top output (torch SDPA {sdpa_err:.2e})")
    assert err <= 2**-7, f"seed={seed}: {err:.2e} (torch SDPA: {sdpa_err:.2e})"
    # The float32 path on the same inputs, to show the check sees P's rounding but little else.
    f32_err = (prefill_attention(q, k, v, cu, scale, out_scale, path="scalar").double() - want).abs().max().item() / top
    assert f32_err <= 2**-8, f"seed={seed}: {f32_err:.2e}"


@needs_bf16_dot
def test_bf16_dot_is_what_best_runs_for_bf16_without_amx(ops, seed):
    if amx_available():
        pytest.skip("with AMX, 'best' runs the AMX kernel for bf16")
    g = torch.Generator().manual_seed(seed)
    q, k, v, cu = _inputs(g, [70, 5, 200], 9, 3, 64, torch.bfloat16)
    assert torch.equal(prefill_attention(q, k, v, cu, 0.125), prefill_attention(q, k, v, cu, 0.125, path="bf16dot"))
    # Head sizes it does not take run a float32 path (at 32: the AVX2 tiles).
    q, k, v, cu = _inputs(g, [40, 9], 4, 2, 32, torch.bfloat16)
    assert torch.equal(prefill_attention(q, k, v, cu, 0.2), prefill_attention(q, k, v, cu, 0.2, path="avx2"))


@needs_bf16_dot
def test_bf16_dot_token_only_sees_its_own_prefix(ops, seed):
    """Changing a later token's K/V leaves every earlier token's output as it was."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, cu = _inputs(g, [150], 9, 3, 64, torch.bfloat16)
    out = prefill_attention(q, k, v, cu, 0.125, path="bf16dot")
    k2, v2 = k.clone(), v.clone()
    k2[100:] += 3.0
    v2[100:] -= 5.0
    out2 = prefill_attention(q, k2, v2, cu, 0.125, path="bf16dot")
    assert torch.equal(out[:100], out2[:100]) and not torch.equal(out[100:], out2[100:])


@needs_bf16_dot
def test_bf16_dot_path_rejects_what_it_cannot_run(ops):
    g = torch.Generator().manual_seed(0)
    q, k, v, cu = _inputs(g, [20], 4, 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="bf16 dot-product path needs"):
        prefill_attention(q, k, v, cu, 0.125, path="bf16dot")
    q, k, v, cu = _inputs(g, [20], 4, 2, 32, torch.bfloat16)
    with pytest.raises(RuntimeError, match="head_size % 64 == 0"):
        prefill_attention(q, k, v, cu, 0.125, path="bf16dot")


# ------------------------------------------------------------------ cached context (cu_seqlens_k)


def _vector_best(ops, dtype, head_size) -> str:
    """The path the vector kernel's "best" runs (the context form never takes the AMX kernel)."""
    if dtype == torch.bfloat16 and bf16_dot_available() and head_size % 64 == 0:
        return "bf16dot"
    if ops.has_avx512() and head_size % 64 == 0:
        return "avx512"
    return "avx2" if ops.has_avx2() and head_size % 32 == 0 else "scalar"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_context_rows_equal_the_fresh_prefill_bit_for_bit(ops, seed, dtype, head_size, num_heads, num_kv_heads):
    """A prefill continuing a cached context: each sequence's last rows, attending to all its
    keys, give exactly what a fresh prefill of the whole sequence gives for those rows, on every
    path (rows and key blocks sit at absolute positions); and both match the float64 reference."""
    g = torch.Generator().manual_seed(seed)
    # Whole sequences; 1100 keys are packed in three units of up to 512 (the last with a partial group of 16).
    lens = [37, 1, 300, 16, 129, 200, 1100]
    ctxs = [20, 0, 250, 15, 128, 57, 1070]  # cached context of each: 0, mid-tile, at and past key-block edges
    q, k, v, cu = _inputs(g, lens, num_heads, num_kv_heads, head_size, dtype)
    rows = torch.cat([torch.arange(a + c, b) for a, b, c in zip(cu[:-1].tolist(), cu[1:].tolist(), ctxs)])
    cu_q = torch.tensor([0] + torch.tensor([n - c for n, c in zip(lens, ctxs)]).cumsum(0).tolist())
    scale, out_scale = head_size**-0.5 * 0.7, 1.3
    want = prefill_attention_ref(q[rows], k, v, cu_q, scale, out_scale, cu_seqlens_k=cu)
    paths = _paths(ops, head_size) + (["bf16dot"] if _vector_best(ops, dtype, head_size) == "bf16dot" else [])
    for path in paths:
        fresh = prefill_attention(q, k, v, cu, scale, out_scale,
                                  path=_vector_best(ops, dtype, head_size) if path == "best" else path)
        out = prefill_attention(q[rows], k, v, cu_q, scale, out_scale, path=path, cu_seqlens_k=cu)
        assert out.shape == (len(rows), num_heads, head_size) and out.dtype == dtype
        assert torch.equal(out, fresh[rows]), f"seed={seed} path={path}: context rows differ from the fresh ones"
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        err = ((out.double() - want).abs().max() / want.abs().max()).item()
        assert err < tol, f"seed={seed} path={path}: {err:.2e} relative to the float64 reference"


def test_context_form_rejects_inconsistent_lengths(ops, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, cu = _inputs(g, [8, 8], 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="fewer keys than queries"):
        prefill_attention(q, k[:12], v[:12], cu, 0.1, cu_seqlens_k=torch.tensor([0, 4, 12]))
    with pytest.raises(ValueError, match="cu_seqlens_k must be an int64 tensor shaped like"):
        prefill_attention(q, k, v, cu, 0.1, cu_seqlens_k=torch.tensor([0, 16]))
    with pytest.raises(RuntimeError, match="cu_seqlens_k must run from 0 to the number of keys"):
        prefill_attention(q, k, v, cu, 0.1, cu_seqlens_k=torch.tensor([0, 8, 20]))
    with pytest.raises(ValueError, match="no cached-context form"):
        prefill_attention(q, k, v, cu, 0.1, path="amx", cu_seqlens_k=cu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_prefix_form_is_unmasked_attention_with_its_log_sum_exp(ops, seed, dtype, head_size, num_heads,
                                                                num_kv_heads):
    """prefill_attention_over_prefix (cascade attention's prefix phase, paged_attention.cpp): each
    sequence's query rows attend to all of its keys, however many rows (1 to 70 here: more rows
    than keys too), the output is float32 times out_scale, and lse holds each row's log of the sum
    of exp(scaled score): against float64."""
    g = torch.Generator().manual_seed(seed)
    num_q, num_k = [1, 70, 5, 19], [300, 3, 129, 16]
    q = (torch.randn(sum(num_q), num_heads, head_size, generator=g) * 2).to(dtype)
    k = (torch.randn(sum(num_k), num_kv_heads, head_size, generator=g) * 2).to(dtype)
    v = (torch.randn(sum(num_k), num_kv_heads, head_size, generator=g) * 2).to(dtype)
    cu_q = torch.tensor([0] + torch.tensor(num_q).cumsum(0).tolist(), dtype=torch.int64)
    cu_k = torch.tensor([0] + torch.tensor(num_k).cumsum(0).tolist(), dtype=torch.int64)
    scale, out_scale = head_size**-0.5 * 0.7, 0.25
    group = num_heads // num_kv_heads
    want = torch.empty(sum(num_q), num_heads, head_size, dtype=torch.float64)
    want_lse = torch.empty(sum(num_q), num_heads, dtype=torch.float64)
    for s in range(len(num_q)):
        qs = q[cu_q[s]:cu_q[s + 1]].double()
        ks = k[cu_k[s]:cu_k[s + 1]].double().repeat_interleave(group, 1)
        vs = v[cu_k[s]:cu_k[s + 1]].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        want_lse[cu_q[s]:cu_q[s + 1]] = scores.logsumexp(-1).T
        want[cu_q[s]:cu_q[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs) * out_scale
    paths = _paths(ops, head_size) + (["bf16dot"] if dtype == torch.bfloat16 and bf16_dot_available() else [])
    for path in paths:
        lse = torch.full((sum(num_q), num_heads), float("nan"))
        out = ops.prefill_attention_over_prefix(q, k, v, cu_q, cu_k, scale, out_scale, _PATHS[path], lse)
        assert out.dtype == torch.float32 and out.shape == q.shape
        # bf16 dot products round P to bf16 before P V (2^-8 relative per weight).
        tol = 1e-2 if path in ("bf16dot", "best") and dtype == torch.bfloat16 and bf16_dot_available() else 1e-5
        err = ((out.double() - want).abs().max() / want.abs().max()).item()
        assert err < tol, f"seed={seed} path={path}: {err:.2e}"
        lse_err = (lse.double() - want_lse).abs().max().item()
        assert lse_err < 1e-4 * want_lse.abs().max().item() + 1e-5, f"seed={seed} path={path}: lse {lse_err:.2e}"
    with pytest.raises(RuntimeError, match="a sequence has no keys"):
        ops.prefill_attention_over_prefix(q[:1], k[:0], v[:0], torch.tensor([0, 1]), torch.tensor([0, 0]), scale,
                                          1.0, 0, torch.empty(1, num_heads))
    with pytest.raises(RuntimeError, match="lse must be a contiguous float32"):
        ops.prefill_attention_over_prefix(q, k, v, cu_q, cu_k, scale, 1.0, 0, torch.empty(sum(num_q), num_heads + 1))

