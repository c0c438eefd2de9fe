"""benchmarks/narrow_weights.py on a tiny bf16 checkpoint: every cell timed for
both engines, the same tokens from both, the weight bytes reported, and bad
arguments rejected."""

from __future__ import annotations

import re

import pytest
import torch

from benchmark_scripts import assert_rejected, run_table
from checkpoints import write_tiny_llama


def _run(monkeypatch, tmp_path, *argv):
    return run_table(monkeypatch, tmp_path, "narrow_weights.py", *argv, header="| cell")


def test_every_cell_is_timed_and_the_tokens_agree(ops, monkeypatch, tmp_path):
    src = write_tiny_llama(tmp_path / "llama", vocab_size=3000, tie_word_embeddings=True, dtype=torch.bfloat16)
    text, rows = _run(monkeypatch, tmp_path, "--model", str(src), "--decode-batch", "1,3", "--sampled",
                      "--prefill-len", "40", "--decode-context", "20", "--decode-steps", "3", "--rounds", "2",
                      "--kv-cache-memory", "16MiB")
    assert [r[0].split(",")[0] for r in rows] == ["decode step"] * 4 + ["prefill step"]
    assert [r[0].endswith("greedy") for r in rows[:4]] == [True, True, False, False]
    for r in rows:
        assert float(r[1]) > 0 and float(r[2]) > 0 and r[3].endswith("x"), r
    # Bit-identical logits: greedy and seeded sampled tokens agree.
    assert [r[4] for r in rows] == ["yes"] * 4 + ["-"]
    plain = {side: float(m) for side, m in re.findall(r"- (float32|16-bit) weights: plain weights (\d+) MiB", text)}
    assert set(plain) == {"float32", "16-bit"} and "kept as torch.bfloat16" in text


def test_a_float32_checkpoint_is_refused(ops, monkeypatch, tmp_path):
    src = write_tiny_llama(tmp_path / "llama", vocab_size=500, dtype=torch.float32)
    with pytest.raises(SystemExit, match="does not keep this checkpoint's weights at 16 bits"):
        _run(monkeypatch, tmp_path, "--model", str(src), "--decode-batch", "1", "--prefill-len", "0",
             "--decode-context", "8", "--decode-steps", "2", "--rounds", "1", "--kv-cache-memory", "16MiB")


@pytest.mark.parametrize("argv, message", [
    (["--decode-batch", "1,x"], "--decode-batch"),
    (["--rounds", "0"], "--rounds"),
    (["--prefill-len", "-1"], "--prefill-len"),
])
def test_bad_arguments_are_rejected(monkeypatch, tmp_path, capsys, argv, message):
    assert_rejected(monkeypatch, tmp_path, capsys, "narrow_weights.py", argv, message)
