"""benchmarks/sampler.py on a tiny checkpoint: every cell timed for both
sampler paths, and bad arguments rejected."""

from __future__ import annotations


import pytest
import torch

from benchmark_scripts import assert_rejected, run_table
from checkpoints import write_tiny_llama


def _run(monkeypatch, tmp_path, *argv):
    return run_table(monkeypatch, tmp_path, "sampler.py", *argv, header="| cell")


def test_every_cell_is_timed(ops, monkeypatch, tmp_path):
    src = tmp_path / "llama"
    write_tiny_llama(src, vocab_size=3000, dtype=torch.float32)
    text, rows = _run(monkeypatch, tmp_path, "--model", str(src), "--batch", "1,5",
                      "--params", "t=1.0,t=0.7 top_p=0.9", "--decode-batch", "2", "--decode-context", "16",
                      "--decode-steps", "3", "--sample-steps", "4", "--calls", "1", "--rounds", "2")
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("sampler alone", "1", "t=1.0"), ("sampler alone", "1", "t=0.7 top_p=0.9"),
        ("sampler alone", "5", "t=1.0"), ("sampler alone", "5", "t=0.7 top_p=0.9"),
        ("penalties alone (dense vs seen tokens only)", "1", "repetition 1.1, frequency 0.2, presence 0.1"),
        ("penalties alone (dense vs seen tokens only)", "5", "repetition 1.1, frequency 0.2, presence 0.1"),
        ("rejection sampling alone (1 x 4 drafts, 5 rows)", "5", "t=0.7 top_p=0.9"),
        ("rejection sampling alone (5 x 4 drafts, 25 rows)", "25", "t=0.7 top_p=0.9"),
        ("engine decode step, batch 2 x ~16", "2", "t=0.7 top_p=0.9")]
    for r in rows:
        assert float(r[3]) > 0 and float(r[4]) > 0 and r[5].endswith("x"), r
    assert "3000 tokens" in text


@pytest.mark.parametrize("argv, message", [
    (["--params", "t=1.0,greedy"], "--params"),
    (["--batch", "1,x"], "--batch"),
    (["--decode-batch", "0"], "--decode-batch"),
    (["--rounds", "0"], "--rounds"),
])
def test_bad_arguments_are_rejected(monkeypatch, tmp_path, capsys, argv, message):
    assert_rejected(monkeypatch, tmp_path, capsys, "sampler.py", argv, message)
