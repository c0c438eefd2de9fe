"""The greedy argmax kernel (cpu/sampling_ops.cpp) against torch.max(dim=-1).indices,
whose semantics the sampler keeps: first index of the maximum on ties
(-0.0 == +0.0), the first NaN where a row has one. Fresh random data each run;
row widths around the 8/16-lane steps and the 16384-column chunks of a single
row (which two threads share)."""

from __future__ import annotations

import pytest
import torch

from fp8serve.kernels import cpu_ops

WIDTHS = [1, 7, 8, 15, 16, 31, 32, 33, 47, 48, 100, 16383, 16384, 16385, 49152, 65537]


def _logits(g: torch.Generator, rows: int, vocab: int, kind: str) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(rows, vocab, generator=g)
    if kind == "ties":  # few distinct values: the maximum repeats in every row
        return torch.randint(-3, 3, (rows, vocab), generator=g).float()
    if kind == "signed_zeros":
        return torch.where(torch.rand(rows, vocab, generator=g) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
    x = torch.randn(rows, vocab, generator=g)
    if kind == "nan":
        x[torch.rand(rows, vocab, generator=g) < 2.0 / vocab] = float("nan")
    elif kind == "inf":
        x[torch.rand(rows, vocab, generator=g) < 0.05] = float("inf")
        x[torch.rand(rows, vocab, generator=g) < 0.05] = float("-inf")
    return x


@pytest.mark.parametrize("kind", ["normal", "ties", "signed_zeros", "nan", "inf"])
@pytest.mark.parametrize("rows", [1, 2, 5, 64])
def test_matches_torch_max_indices(ops, seed, kind, rows):
    g = torch.Generator().manual_seed(seed)
    for vocab in WIDTHS:
        x = _logits(g, rows, vocab, kind)
        got = ops.greedy_argmax(x)
        assert got.dtype == torch.int64 and got.shape == (rows,)
        assert torch.equal(got, cpu_ops.greedy_argmax_ref(x)), f"seed={seed} vocab={vocab}"


def test_max_in_the_last_tail_element_and_strided_rows(ops, seed):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(6, 49200, generator=g)
    x = wide[:, :49152]  # rows with a stride larger than their width
    x[3, -1] = 100.0  # in the scalar tail after the vector loop
    x[4, 0] = 100.0
    assert torch.equal(cpu_ops.greedy_argmax(x), x.max(dim=-1).indices), f"seed={seed}"


def test_rows_of_one_repeated_special_value(ops):
    """Rows that are all -inf (every token banned), all +inf or all NaN: index 0, as torch gives."""
    for vocab in (5, 40, 49152):
        x = torch.stack([torch.full((vocab,), v) for v in (float("-inf"), float("inf"), float("nan"), 0.0)])
        assert torch.equal(cpu_ops.greedy_argmax(x), x.max(dim=-1).indices)
        assert cpu_ops.greedy_argmax(x).tolist() == [0, 0, 0, 0]


def test_rejects_what_it_does_not_handle(ops):
    with pytest.raises(RuntimeError, match="float32"):
        ops.greedy_argmax(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.greedy_argmax(torch.zeros(8, 2).t())
    with pytest.raises(RuntimeError, match="no columns"):
        ops.greedy_argmax(torch.zeros(2, 0))


def test_wrapper_falls_back_to_torch_for_other_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 300, generator=g)
    for other in (x.bfloat16(), x.t().contiguous().t()):
        assert torch.equal(cpu_ops.greedy_argmax(other), other.max(dim=-1).indices)
