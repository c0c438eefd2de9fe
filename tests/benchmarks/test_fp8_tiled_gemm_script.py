"""benchmarks/fp8_tiled_gemm.py (every variant timed per cell, the tiled
result checked against float64) and benchmarks/fp8_weight_paths.py (an FP8
checkpoint in the engine with the large-M path switched between rounds), on
small inputs; bad arguments rejected."""

from __future__ import annotations

import os
import sys

import pytest

from benchmark_scripts import loaded_script
from checkpoints import write_tiny_llama
from fp8serve.kernels import fp8_linear_ops

pytestmark = pytest.mark.skipif(not fp8_linear_ops.is_available(), reason="C++ CPU kernels unavailable")


def _rows(path):
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in path.read_text().splitlines()
            if ln.startswith("| ") and not ln.startswith("| shape") and not ln.startswith("| phase")]


def test_kernel_table_has_every_cell(ops, monkeypatch, tmp_path):
    if not ops.fp8_tiled_gemm_available():
        pytest.skip("fp8_tiled_gemm needs AVX2, FMA and F16C")
    out = tmp_path / "t.md"
    monkeypatch.setattr(sys, "argv", ["fp8_tiled_gemm.py", "--rows", "3,30", "--rounds", "1", "--output", str(out)])
    with loaded_script("fp8_tiled_gemm.py") as script:
        monkeypatch.setattr(script, "SHAPES", {"smollm2": [("o", 40, 24), ("down", 70, 33)]})
        script.main()
    rows = _rows(out)
    assert [(r[0], r[1], r[2]) for r in rows] == [("o", "40 -> 24", "3"), ("o", "40 -> 24", "30"),
                                                  ("down", "70 -> 33", "3"), ("down", "70 -> 33", "30")]
    for r in rows:
        assert all(float(v) > 0 for v in r[3:7]) and all(v.endswith("x") for v in r[7:10]), r


def test_weight_paths_switch_inside_one_engine(ops, monkeypatch, tmp_path):
    if not ops.fp8_tiled_gemm_available():
        pytest.skip("fp8_tiled_gemm needs AVX2, FMA and F16C")
    from fp8serve.calibration.fp8_checkpoint import write_fp8_checkpoint

    src, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    write_tiny_llama(src)
    write_fp8_checkpoint(src, fp8, activation_scheme="dynamic")
    out = tmp_path / "p.md"
    monkeypatch.delenv(fp8_linear_ops.TILED_GEMM_ENV, raising=False)
    monkeypatch.setattr(sys, "argv", ["fp8_weight_paths.py", "--fp8-model", str(fp8), "--prompt-len", "40",
                                      "--prefills", "1", "--decode-batch", "30", "--decode-context", "8",
                                      "--decode-steps", "7", "--rounds", "2", "--output", str(out)])
    try:
        with loaded_script("fp8_weight_paths.py") as script:
            script.main()
    finally:
        os.environ.pop(fp8_linear_ops.TILED_GEMM_ENV, None)  # the script set it (monkeypatch would restore it)
        fp8_linear_ops.tiled_gemm_enabled.cache_clear()
        fp8_linear_ops._fused_rows_by_dtype.cache_clear()
    rows = _rows(out)
    assert [r[0] for r in rows] == ["prefill", "decode step"]
    assert rows[1][1] == "batch 30 x ~8 tokens"
    assert all(float(r[2]) > 0 and float(r[3]) > 0 and r[4].endswith("x") for r in rows)


@pytest.mark.parametrize("script, bad, message", [
    ("fp8_tiled_gemm.py", ["--rounds", "0"], "--rounds must be >= 1"),
    ("fp8_tiled_gemm.py", ["--rows", "0,4"], "--rows must all be >= 1"),
    ("fp8_weight_paths.py", ["--decode-batch", "0"], "--decode-batch must be >= 1"),
])
def test_rejects_bad_arguments(script, bad, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, *bad])
    with loaded_script(script) as module, pytest.raises(SystemExit):
        module.main()
    assert message in capsys.readouterr().err


def test_weight_paths_refuses_a_preset_switch(monkeypatch, capsys):
    monkeypatch.setenv(fp8_linear_ops.TILED_GEMM_ENV, "1")
    monkeypatch.setattr(sys, "argv", ["fp8_weight_paths.py"])
    with loaded_script("fp8_weight_paths.py") as module, pytest.raises(SystemExit):
        module.main()
    assert "unset FP8SERVE_FP8_TILED_GEMM" in capsys.readouterr().err
