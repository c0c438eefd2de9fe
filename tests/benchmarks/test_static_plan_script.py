"""benchmarks/static_plan.py on a tiny checkpoint: both engines are timed at
each batch size, the static-plan engine really replays static plans and the
other TorchScript, both give the same tokens, and bad arguments are rejected
before anything is built."""

from __future__ import annotations

import pytest
import torch

from benchmark_scripts import assert_rejected, run_table
from checkpoints import write_tiny_llama


def test_both_engines_are_timed_at_each_batch_size(ops, monkeypatch, tmp_path):
    src = write_tiny_llama(tmp_path / "llama", vocab_size=3000, dtype=torch.bfloat16)
    _, rows = run_table(monkeypatch, tmp_path, "static_plan.py", "--model", str(src), "--kv-cache-dtype", "fp8",
                        "--batches", "1,2", "--prompt-len", "8", "--steps", "6", "--rounds", "2",
                        "--kv-cache-memory", "16MiB", header="| batch")
    # (From 3 rows a bf16 checkpoint under float32 compute runs bf16_tiled_gemm on AMD CPUs, which no
    # static plan replays: those batches keep the compiled replay.)
    assert [r[0] for r in rows] == ["1", "2"]
    for r in rows:
        assert float(r[1]) > 0 and float(r[2]) > 0
        assert r[5].endswith("of 2") and r[6] == "True"


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds"),
    (["--batches", "1,x"], "--batches"),
    (["--batches", "64"], "--batches: static plans serve batches of up to"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--steps", "-2"], "--steps"),
])
def test_bad_arguments_are_rejected(ops, monkeypatch, tmp_path, capsys, argv, message):
    assert_rejected(monkeypatch, tmp_path, capsys, "static_plan.py", argv, message)
