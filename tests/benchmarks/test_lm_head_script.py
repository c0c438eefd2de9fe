"""benchmarks/lm_head.py on a tiny tied bf16 checkpoint's FP8 copy: every
cell timed, the engine path named by row count, both paths' logits close
to float64, and bad arguments rejected."""

from __future__ import annotations


import pytest
import torch

from benchmark_scripts import assert_rejected, run_table
from checkpoints import write_tiny_llama


def _run(monkeypatch, tmp_path, *argv):
    return run_table(monkeypatch, tmp_path, "lm_head.py", *argv, header="| cell")


def test_every_cell_is_timed_and_named(ops, monkeypatch, tmp_path):
    from fp8serve.calibration.fp8_checkpoint import write_fp8_checkpoint
    from fp8serve.kernels import cpu_ops

    src, fp8 = tmp_path / "llama", tmp_path / "fp8"
    write_tiny_llama(src, vocab_size=3000, tie_word_embeddings=True, dtype=torch.bfloat16)
    write_fp8_checkpoint(src, fp8, activation_scheme="dynamic")
    text, rows = _run(monkeypatch, tmp_path, "--fp8-model", str(fp8), "--rows", "3,40,300", "--decode-batch", "2,20",
                      "--decode-context", "20", "--decode-steps", "3", "--sample-steps", "4", "--calls", "1",
                      "--rounds", "2")
    slice_rows = cpu_ops.dense_gemv_max_rows(torch.float32, torch.bfloat16)
    assert [(r[1], r[2]) for r in rows] == [
        ("3", "dense_gemv"), ("40", f"dense_gemv x {-(-40 // slice_rows)} row slices"), ("300", "upcast"),
        ("2", "dense_gemv"), ("20", "dense_gemv" if slice_rows >= 20 else "dense_gemv x 2 row slices")]
    for r in rows:
        assert float(r[3]) > 0 and float(r[4]) > 0 and r[5].endswith("x"), r
    for r in rows[:3]:
        assert float(r[6]) < 1e-5 and float(r[7]) < 1e-5, r  # float32 sums of 64-term dot products
    for r in rows[3:]:
        assert r[8] in ("yes", "no"), r
    assert "torch.bfloat16" in text


def test_a_float32_head_is_refused(ops, monkeypatch, tmp_path):
    src = tmp_path / "llama"
    write_tiny_llama(src, vocab_size=500, tie_word_embeddings=True, dtype=torch.float32)
    with pytest.raises(SystemExit, match="float32"):
        _run(monkeypatch, tmp_path, "--fp8-model", str(src), "--rows", "3", "--decode-batch", "2",
             "--decode-context", "8", "--decode-steps", "2", "--sample-steps", "3", "--calls", "1", "--rounds", "1")


@pytest.mark.parametrize("argv, message", [
    (["--rows", "1,x"], "--rows"),
    (["--decode-batch", "0"], "--decode-batch"),
    (["--rounds", "0"], "--rounds"),
])
def test_bad_arguments_are_rejected(monkeypatch, tmp_path, capsys, argv, message):
    assert_rejected(monkeypatch, tmp_path, capsys, "lm_head.py", argv, message)
