"""Embedding / LM head with a weight stored narrower than the compute dtype
(an FP8 checkpoint's bf16 head under float32 compute): the same numbers as
the upcast weight, without the full-width copy. Fresh random data each run
(the seed is in every failure message)."""

from __future__ import annotations

import pytest
import torch

from fp8serve.kernels import onednn_linear
from fp8serve.layers import vocab_embedding
from fp8serve.layers.vocab_embedding import LMHead, VocabEmbedding
from fp8serve.quantization.base import vocab_weight_dtype
from fp8serve.quantization.fp8_linear import Fp8Config


def test_fp8_checkpoints_keep_a_16_bit_head_under_float32_compute():
    fp8 = Fp8Config("dynamic", [])
    assert fp8.vocab_weight_dtype(torch.float32, torch.bfloat16) == torch.bfloat16
    assert fp8.vocab_weight_dtype(torch.float32, torch.float16) == torch.float16
    assert fp8.vocab_weight_dtype(torch.float32, torch.float32) == torch.float32
    assert fp8.vocab_weight_dtype(torch.bfloat16, torch.bfloat16) == torch.bfloat16
    # Unquantized checkpoints compute and store in one dtype.
    assert vocab_weight_dtype(None, torch.float32, torch.bfloat16) == torch.float32


@pytest.mark.parametrize("num_rows", [1, 3, 8, 20, 33, 70, 300])
def test_narrow_head_gives_the_upcast_weights_logits(seed, num_rows, monkeypatch):
    """Up to dense_gemv's rows one dense_gemv call (bf16 weights, float32
    maths), up to 256 rows slices of the rows through it, more rows the
    sliced upcast; all against F.linear on the upcast weight in float64."""
    monkeypatch.setattr(onednn_linear, "UPCAST_ROWS", 96)  # several slices, the last one partial
    g = torch.Generator().manual_seed(seed)
    vocab, hidden = 300, 64
    narrow = LMHead(vocab, hidden, torch.float32, weight_dtype=torch.bfloat16)
    narrow.weight.data.copy_(torch.randn(vocab, hidden, generator=g))
    x = torch.randn(num_rows, hidden, generator=g)
    want = torch.nn.functional.linear(x.double(), narrow.weight.double())
    out = narrow(x)
    assert out.dtype == torch.float32 and out.shape == (num_rows, vocab)
    err = ((out.double() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-6, f"seed={seed}: {err:.2e}"


@pytest.mark.parametrize("num_rows", [9, 33, 70, 256, 257])
def test_narrow_head_takes_dense_gemv_on_row_slices(ops, seed, num_rows, monkeypatch):
    """Past one call's rows a bf16 head under float32 compute runs dense_gemv
    on slices of at most dense_gemv_max_rows rows, each row's logits equal
    to a lone call's on that slice; above _GEMV_SLICES_MAX_ROWS it upcasts
    vocabulary slices instead."""
    from fp8serve.kernels import cpu_ops

    g = torch.Generator().manual_seed(seed)
    vocab, hidden = 500, 64
    narrow = LMHead(vocab, hidden, torch.float32, weight_dtype=torch.bfloat16)
    narrow.weight.data.copy_(torch.randn(vocab, hidden, generator=g) * 0.05)
    x = torch.randn(num_rows, hidden, generator=g)
    calls = []
    real = cpu_ops.dense_gemv
    monkeypatch.setattr(cpu_ops, "dense_gemv", lambda a, w, *args, **kw: calls.append(a.shape[0]) or real(a, w))
    out = narrow(x)
    rows = cpu_ops.dense_gemv_max_rows(torch.float32, torch.bfloat16)
    assert rows in (16, 32)
    if num_rows > vocab_embedding._GEMV_SLICES_MAX_ROWS:
        assert calls == [], seed
    else:
        assert sum(calls) == num_rows and max(calls) <= rows and len(calls) == -(-num_rows // rows), (seed, calls)
        first = real(x[:calls[0]], narrow.weight)
        assert torch.equal(out[:calls[0]], first), seed
    want = torch.nn.functional.linear(x.double(), narrow.weight.double())
    err = ((out.double() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-6, f"seed={seed}: {err:.2e}"


def test_narrow_embedding_returns_compute_dtype_rows(seed):
    g = torch.Generator().manual_seed(seed)
    emb = VocabEmbedding(100, 32, torch.float32, weight_dtype=torch.bfloat16)
    emb.weight.data.copy_(torch.randn(100, 32, generator=g))
    ids = torch.randint(0, 100, (7,), generator=g)
    rows = emb(ids)
    assert rows.dtype == torch.float32
    assert torch.equal(rows, emb.weight[ids].float()), f"seed={seed}"


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_the_argmax_of_the_heads_logits(ops, seed, weight_dtype):
    """With a screen (kernels/screened_argmax.py), the float32 rows it pays
    for get the argmax of forward's logits; without one, or for rows the
    screen does not take, None (the caller computes the logits)."""
    from fp8serve.kernels import cpu_ops, screened_argmax
    from fp8serve.kernels.screened_argmax import build_screen

    g = torch.Generator().manual_seed(seed)
    lm = LMHead(1500, 96, torch.float32, weight_dtype=weight_dtype)
    lm.weight.data.copy_(torch.randn(1500, 96, generator=g) * 0.05)
    rows = screened_argmax.engine_rows(weight_dtype)
    assert rows == (8 if weight_dtype == torch.float32 else 4)
    x = torch.randn(rows, 96, generator=g)
    assert lm.greedy_tokens(x) is None
    lm.greedy_screen = build_screen(lm.weight)
    assert torch.equal(lm.greedy_tokens(x), cpu_ops.greedy_argmax(lm(x))), seed
    assert lm.greedy_tokens(torch.randn(rows + 1, 96, generator=g)) is None  # past the rows it pays for
    if weight_dtype == torch.float32:
        assert lm.greedy_tokens(x.bfloat16()) is None  # no bf16 rows against a float32 head
    else:  # bf16 compute: bf16 dot products, logits rounded to bf16; fewer rows
        bf16_rows = screened_argmax.engine_rows(torch.bfloat16, torch.bfloat16)
        assert 1 <= bf16_rows < rows
        xb = x[:bf16_rows].bfloat16()
        assert torch.equal(lm.greedy_tokens(xb), cpu_ops.greedy_argmax(lm(xb))), seed
        assert lm.greedy_tokens(x[:bf16_rows + 1].bfloat16()) is None
