"""benchmarks/fp8_weight_accuracy.py on a tiny checkpoint: both scale strategies measured against the
16-bit model, per-channel scales taking one float32 per output row, and bad arguments rejected."""

from __future__ import annotations

import pytest

from benchmark_scripts import assert_rejected, run_table
from checkpoints import load_state_dict, write_tiny_llama


def test_both_strategies_are_measured(monkeypatch, tmp_path):
    src = write_tiny_llama(tmp_path / "llama")
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog while the cat sleeps by the fire. " * 20)
    out, rows = run_table(monkeypatch, tmp_path, "fp8_weight_accuracy.py", "--model", str(src), "--text", str(text),
                          "--num-tokens", "200", "--seq-len", "64", header="| weights")
    assert [r[0] for r in rows] == ["per tensor (fp8)", "per channel (compressed-tensors)"]
    for r in rows:
        assert 0 < float(r[1]) < 0.05 and 50 < float(r[2]) <= 100, r  # FP8 weights move the logits a little
    state = load_state_dict(src)
    projections = [t for n, t in state.items() if n.endswith("_proj.weight")]
    rows_total = sum(t.shape[0] for t in projections)
    assert float(rows[0][6]) == pytest.approx(4 * len(projections) / 1024, abs=0.06)
    assert float(rows[1][6]) == pytest.approx(4 * rows_total / 1024, abs=0.06)
    assert "200 tokens in 4 chunks of <= 64" in out


@pytest.mark.parametrize("argv, message", [
    (["--num-tokens", "0"], "--num-tokens"),
    (["--seq-len", "1"], "--seq-len"),
])
def test_bad_arguments_are_rejected(monkeypatch, tmp_path, capsys, argv, message):
    assert_rejected(monkeypatch, tmp_path, capsys, "fp8_weight_accuracy.py", argv, message)
