"""fp8serve/utils/weight_copies.py: the memory budget of a weight copy, and one copy per shared weight."""

from __future__ import annotations

import logging

import torch
from torch import nn

from fp8serve.utils import weight_copies


def test_copy_fits_within_a_quarter_of_the_available_memory(monkeypatch, caplog):
    monkeypatch.setattr(weight_copies, "available_memory_bytes", lambda: 4 << 20)  # budget 1 MiB
    log = logging.getLogger("test.weight_copies")
    assert weight_copies.copy_fits(1 << 20, "x", log)  # exactly the budget
    assert caplog.text == ""
    with caplog.at_level("INFO", logger="test.weight_copies"):
        assert not weight_copies.copy_fits((1 << 20) + 1, "oneDNN: bfloat16 weights", log)
    assert "oneDNN: bfloat16 weights not packed: the copy needs 1 MiB, over a quarter of the memory available " \
           "(1 MiB)" in caplog.text


def test_a_shared_weight_is_packed_once():
    embed, head, other = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(4, 3)
    head.weight = embed.weight  # tied
    calls = []

    def pack(w):
        calls.append(w)
        return w.detach() * 2

    assert weight_copies.pack_each_weight_once([embed, other, head], "weight_packed", pack) == 2
    assert len(calls) == 2 and calls[0] is embed.weight and calls[1] is other.weight
    assert head.weight_packed is embed.weight_packed  # the same copy, not a second one
    assert torch.equal(other.weight_packed, other.weight.detach() * 2)
