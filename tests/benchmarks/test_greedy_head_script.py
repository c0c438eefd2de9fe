"""benchmarks/greedy_head.py on a tiny tied checkpoint and its FP8 copy:
every cell timed, the screened and full heads agreeing on every token, and
bad arguments rejected."""

from __future__ import annotations


import pytest
import torch

from benchmark_scripts import assert_rejected, run_table
from checkpoints import write_tiny_llama


def _run(monkeypatch, tmp_path, *argv):
    return run_table(monkeypatch, tmp_path, "greedy_head.py", *argv, header="| config")


def test_every_cell_is_timed_and_the_tokens_agree(ops, monkeypatch, tmp_path):
    from fp8serve.calibration.fp8_checkpoint import write_fp8_checkpoint

    src, fp8 = tmp_path / "llama", tmp_path / "fp8"
    # bf16 like SmolLM2: the FP8 checkpoint keeps a bf16 head (1-4 rows screened), the base model's becomes float32.
    write_tiny_llama(src, vocab_size=3000, tie_word_embeddings=True, dtype=torch.bfloat16)
    write_fp8_checkpoint(src, fp8, activation_scheme="dynamic")
    monkeypatch.delenv("FP8SERVE_SCREENED_ARGMAX", raising=False)
    text, rows = _run(monkeypatch, tmp_path, "--model", str(src), "--fp8-model", str(fp8), "--decode-batch", "1,3",
                      "--decode-context", "20", "--decode-steps", "3", "--sample-steps", "4", "--calls", "1",
                      "--rounds", "2", "--prompts", "random")
    assert [(r[0], r[2]) for r in rows] == [(c, m) for c in ("base", "fp8") for m in ("1", "2", "4", "8", "1", "3")]
    for r in rows:
        assert float(r[4]) > 0 and float(r[5]) > 0 and r[6].endswith("x"), r
        assert r[7] == "yes", r
    # A float32 head is screened at 1-8 rows, a bf16 one at 1-4.
    assert [r[3] for r in rows] == ["yes"] * 6 + ["yes", "yes", "yes", "no", "yes", "yes"]
    assert "candidates per row" in text and "torch.float32" in text and "torch.bfloat16" in text


def _run_base(monkeypatch, tmp_path, *argv):
    """The base config of a tiny bf16 tied checkpoint, batch-1 decode steps, the shortest settings."""
    src = tmp_path / "llama"
    write_tiny_llama(src, vocab_size=3000, tie_word_embeddings=True, dtype=torch.bfloat16)
    monkeypatch.delenv("FP8SERVE_SCREENED_ARGMAX", raising=False)
    return _run(monkeypatch, tmp_path, "--model", str(src), "--configs", "base", "--decode-batch", "1",
                "--decode-context", "20", "--decode-steps", "3", "--sample-steps", "4", "--calls", "1",
                "--rounds", "2", "--prompts", "random", *argv)


def test_bf16_compute_screens_the_bf16_head(ops, monkeypatch, tmp_path):
    """--dtype bfloat16: the head stays bf16 under bf16 activations; every
    cell's screened tokens equal the full head's (logits rounded to bf16)."""
    text, rows = _run_base(monkeypatch, tmp_path, "--dtype", "bfloat16")
    from fp8serve.kernels import amx_linear_ops

    assert [r[2] for r in rows] == ["1", "2", "4", "8", "1"]
    # On AMX CPUs the bf16 head runs AMX tiles at 8-64 rows: no per-row path, no screen, no timing there.
    untimed = [r for r in rows if r[5] == "-"]
    assert all(r[2] == "8" for r in untimed) and (not untimed or amx_linear_ops.is_available()), rows
    assert all(r[7] == "yes" for r in rows if r not in untimed), rows
    assert [r[3] for r in rows] == ["yes", "yes", "no", "no", "yes"]  # bf16 compute: 1-2 rows
    assert "bfloat16 activations" in text and "torch.bfloat16" in text


def test_baseline_rev_times_the_kernel_of_another_commit(ops, monkeypatch, tmp_path):
    """--baseline-rev HEAD: the committed screen kernel built under another
    namespace, timed beside this tree's in every head-alone cell, and its
    tokens the full head's (the engine rows have no baseline side)."""
    text, rows = _run_base(monkeypatch, tmp_path, "--baseline-rev", "HEAD")
    assert [r[1] for r in rows] == ["head alone, cold"] * 4 + ["engine decode step, batch 1 x ~20"]
    for r in rows[:4]:
        assert float(r[8]) > 0 and r[9].endswith("x") and r[10] == "yes", r
    assert rows[4][8:] == ["-", "-", "-"], rows[4]
    assert "baseline: cpu/screened_argmax.cpp as of HEAD" in text


def test_a_baseline_rev_git_cannot_find_is_an_error(ops, monkeypatch, tmp_path):
    src = tmp_path / "llama"
    write_tiny_llama(src, vocab_size=3000, tie_word_embeddings=True, dtype=torch.bfloat16)
    with pytest.raises(SystemExit, match="--baseline-rev no-such-revision-xyz: git cannot list"):
        _run(monkeypatch, tmp_path, "--model", str(src), "--configs", "base", "--baseline-rev", "no-such-revision-xyz")


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float16"], "--dtype"),
    (["--configs", "base,int4"], "--configs"),
    (["--decode-batch", "1,x"], "--decode-batch"),
    (["--decode-batch", "0"], "--decode-batch"),
    (["--rounds", "0"], "--rounds"),
])
def test_bad_arguments_are_rejected(monkeypatch, tmp_path, capsys, argv, message):
    assert_rejected(monkeypatch, tmp_path, capsys, "greedy_head.py", argv, message)
