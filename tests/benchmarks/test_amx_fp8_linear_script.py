"""benchmarks/amx_fp8_linear.py: the ops table and the engine table on a tiny FP8 checkpoint, the
engines' routing put back afterwards, and bad arguments rejected."""

from __future__ import annotations

import pytest
from benchmark_scripts import assert_rejected, run_table
from checkpoints import write_tiny_llama

from fp8serve.kernels import amx_linear_ops, fp8_linear_ops


def test_ops_and_engine_tables(monkeypatch, tmp_path):
    if not amx_linear_ops.fp8_is_available():
        pytest.skip("no AMX tiles or AVX512-VBMI in this CPU, build or process")
    from fp8serve.calibration.fp8_checkpoint import write_fp8_checkpoint

    src, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    write_tiny_llama(src)
    write_fp8_checkpoint(src, fp8, activation_scheme="dynamic")
    real = amx_linear_ops.fp8_is_available
    text, rows = run_table(monkeypatch, tmp_path, "amx_fp8_linear.py", "--rows", "5,12", "--rounds", "1",
                           "--engine-batches", "6", "--fp8-model", str(fp8), "--decode-context", "8",
                           "--decode-steps", "3", header="| rows")
    assert amx_linear_ops.fp8_is_available is real  # the routing put back
    fp8_linear_ops._fused_rows_by_dtype.cache_clear()
    assert [r[0] for r in rows[:2]] == ["5", "12"] and all(r[3].endswith("x") for r in rows[:2]), rows
    batch = [r for r in rows if r[0] == "6"]
    assert len(batch) == 1 and float(batch[0][1]) > 0 and float(batch[0][2]) > 0 and batch[0][3].endswith("x")
    assert "Engine decode steps, fp8, dtype auto" in text


@pytest.mark.parametrize("argv, message", [(["--rounds", "0"], "--rounds"), (["--rows", "65"], "outside the kernel's"),
                                           (["--engine-batches", "65"], "--engine-batches: at most 64"),
                                           (["--rows", "a"], "--rows: expected comma-separated integers")])
def test_rejects_bad_arguments(argv, message, monkeypatch, tmp_path, capsys):
    assert_rejected(monkeypatch, tmp_path, capsys, "amx_fp8_linear.py", argv, message)
