"""benchmarks/gate_up_silu.py: bad values refused with a message that names the flag, the ops
table (the fused kernel against the two steps, with whether the bits agree) and a small engine
table (prefill and decode steps of the two engines, with whether their tokens agree)."""

from __future__ import annotations

import pytest

from benchmark_scripts import assert_rejected, run_table
from fp8serve.kernels import cpu_ops, fp8_linear_ops, gemv_packing
from fp8serve.utils.platform import cpu_flags

# Where silu_and_mul runs its 8-lane loop (no AVX-512) the fused kernel gives its bits.
SAME_BITS = "avx512f" not in cpu_flags()


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--prefill-len", "-1"], "--prefill-len must be >= 0, got -1"),
    (["--rows", "12,0"], "--rows: expected sizes >= 1, got '12,0'"),
    (["--batch-sizes", "x"], "--batch-sizes: expected comma-separated integers, got 'x'"),
    (["--weights", "int8"], "argument --weights: invalid choice: 'int8'"),
    (["--shape", "576"], "--shape: expected HIDDENxINTERMEDIATE with two integers >= 1 (e.g. 576x1536), got '576'"),
    (["--shape", "576x0"], "--shape: expected HIDDENxINTERMEDIATE with two integers >= 1 (e.g. 576x1536), got "
                           "'576x0'"),
    (["--layers", "0"], "--layers must be >= 1, got 0"),
])
def test_bad_values_are_refused(monkeypatch, tmp_path, capsys, argv, message):
    assert_rejected(monkeypatch, tmp_path, capsys, "gate_up_silu.py", argv, message)


def _assert_timed(rows: list[list[str]], ops_row: str, engine_cells: list[str]) -> None:
    """One ops row and the engine cells, in order, each with both times, a ratio and (where the
    build gives the two steps' bits) the same results."""
    ops_rows = [r for r in rows if r[0] == ops_row]
    engine_rows = [r for r in rows if r[0] in engine_cells]
    assert len(ops_rows) == 1 and [r[0] for r in engine_rows] == engine_cells
    for r in ops_rows + engine_rows:
        assert float(r[1]) > 0 and float(r[2]) > 0 and r[3].endswith("x"), r
        if SAME_BITS:
            assert r[4] == "yes", r


@pytest.mark.skipif(not cpu_ops.bf16_tiled_gemm_built(), reason="needs bf16_tiled_gemm (AVX2 + FMA)")
def test_ops_and_engine_tables(monkeypatch, tmp_path):
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")  # the packed copies on any AVX2 CPU
    text, rows = run_table(monkeypatch, tmp_path, "gate_up_silu.py", "--rows", "12", "--batch-sizes", "12",
                           "--prefill-len", "24", "--prompt-len", "8", "--steps", "2", "--prefills", "1",
                           "--rounds", "1", header="| rows")
    assert "## Ops" in text and "## Engine steps" in text
    _assert_timed(rows, "12", ["prefill 1 x 24", "decode batch 12"])


@pytest.mark.skipif(not fp8_linear_ops.tiled_gemm_enabled(),
                    reason="needs fp8_tiled_gemm (AVX2 + FMA + F16C, no AVX-512)")
def test_fp8_weights_ops_and_engine_tables(monkeypatch, tmp_path):
    """--weights fp8: e4m3 gate_up weights in the ops table, the default model's FP8 checkpoint
    (written once into the cache) in the engine table; 25 rows and more take the gated form."""
    text, rows = run_table(monkeypatch, tmp_path, "gate_up_silu.py", "--weights", "fp8", "--rows", "25",
                           "--batch-sizes", "25", "--prefill-len", "30", "--prompt-len", "8", "--steps", "2",
                           "--prefills", "1", "--rounds", "1", header="| rows")
    assert "## Ops: 30 fp8 gate_up weights" in text and "on the fp8 weights" in text and "-FP8" in text
    _assert_timed(rows, "25", ["prefill 1 x 30", "decode batch 25"])


@pytest.mark.skipif(not fp8_linear_ops.tiled_gemm_enabled(),
                    reason="needs fp8_tiled_gemm (AVX2 + FMA + F16C, no AVX-512)")
def test_fp8_ops_table_of_another_shape(monkeypatch, tmp_path):
    """--shape / --layers: the ops table's weights, here with K past one K block of the FP8
    kernel (640), so the gated form sums its K blocks before the SiLU; no engine table."""
    text, rows = run_table(monkeypatch, tmp_path, "gate_up_silu.py", "--weights", "fp8", "--shape", "700x32",
                           "--layers", "2", "--rows", "25", "--batch-sizes", "", "--prefill-len", "0",
                           "--rounds", "1", header="| rows")
    assert "## Ops: 2 fp8 gate_up weights 700 -> 2 x 32" in text and "## Engine steps" not in text
    _assert_timed(rows, "25", [])


def _dense_gemv_packed_built() -> bool:
    ops = cpu_ops.load_cpu_ops()
    return ops is not None and bool(ops.dense_gemv_has_packed())


@pytest.mark.skipif(not _dense_gemv_packed_built(), reason="needs dense_gemv_packed (AVX512-BF16)")
def test_bf16_compute_ops_and_engine_tables(monkeypatch, tmp_path):
    """--weights bf16-compute: the packed GEMV's gated form against dense_gemv_packed then
    silu_and_mul (the same bits on every build), and bf16-compute engines whose 13-row decode
    batches take it."""
    monkeypatch.setenv(gemv_packing.PACKED_WEIGHTS_ENV, "1")
    text, rows = run_table(monkeypatch, tmp_path, "gate_up_silu.py", "--weights", "bf16-compute", "--rows", "13",
                           "--batch-sizes", "13", "--prefill-len", "0", "--prompt-len", "8", "--steps", "2",
                           "--rounds", "1", header="| rows")
    assert "## Ops: 30 bf16-compute gate_up weights" in text and "bfloat16 compute on the bf16 weights" in text
    ops_rows = [r for r in rows if r[0] in ("13", "decode batch 13")]
    assert [r[0] for r in ops_rows] == ["13", "decode batch 13"]
    for r in ops_rows:
        assert float(r[1]) > 0 and float(r[2]) > 0 and r[3].endswith("x") and r[4] == "yes", r
