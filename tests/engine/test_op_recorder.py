"""fp8serve/engine/op_recorder.py: what a recording keeps alive, and a recording abandoned past
its byte budget (the forward's result unchanged, nothing recorded, the intermediates let go)."""

from __future__ import annotations

import pytest
import torch

from fp8serve.engine.op_recorder import SLOT, OpRecorder, record


def _forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.mm(x, w)  # [4, 64] float32: 1 KiB
    v = h.view(-1)  # a view: the same storage, counted once
    g = torch.relu(v) + 1.0
    return torch.mm(g.view(4, 64), w.t())


def test_recording_keeps_every_output_and_counts_distinct_storages(seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(4, 32, generator=g), torch.randn(32, 64, generator=g)
    out, rec = record(lambda: _forward(x, w), [x], max_retained_bytes=1 << 30)
    assert not rec.abandoned and torch.equal(out, _forward(x, w))
    names = [f._schema.name for f, *_ in rec.calls]
    assert names[0] == "aten::mm" and names[-1] == "aten::mm" and "aten::relu" in names, names
    assert rec.calls[0][1][0] == (SLOT, 0)  # x is the input
    # Every output alive (inputs first), each storage's bytes counted once: views add nothing.
    assert len(rec.alive) == rec.num_slots
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in rec.alive[1:]}
    assert rec.retained_bytes == sum(storages.values()) and rec.retained_bytes >= 4 * 64 * 4 * 2


def test_a_recording_past_its_budget_is_abandoned(seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(4, 32, generator=g), torch.randn(32, 64, generator=g)
    # 1.5 KiB: the first mm's 1 KiB output fits, the relu's does not.
    out, rec = record(lambda: _forward(x, w), [x], max_retained_bytes=1536)
    assert rec.abandoned and torch.equal(out, _forward(x, w))
    assert rec.calls == [] and rec.alive == [x]
    unlimited = OpRecorder([x])
    assert unlimited.max_retained_bytes is None and not unlimited.abandoned
    with pytest.raises(ValueError, match="max_retained_bytes"):
        OpRecorder([x], max_retained_bytes=-1)


def test_an_output_in_a_constant_s_memory_is_not_new_memory(seed):
    """An op that writes into a constant (as the cache write does into the KV cache) and returns
    it holds no memory of the recording's own: a 1 MiB buffer does not pass a 16 KiB budget."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(4, 32, generator=g), torch.randn(32, 64, generator=g)
    cache = torch.zeros(1024, 256)

    def forward():
        h = torch.mm(x, w)
        return cache[:4, :64].copy_(h).sum()

    out, rec = record(forward, [x], max_retained_bytes=16 << 10)
    assert not rec.abandoned and torch.equal(cache[:4, :64], x @ w)
    assert rec.retained_bytes < 16 << 10
    assert [f._schema.name for f, *_ in rec.calls] == ["aten::mm", "aten::copy_", "aten::sum"]
    assert torch.equal(out, cache[:4, :64].sum())
