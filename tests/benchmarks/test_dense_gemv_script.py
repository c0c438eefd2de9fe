"""benchmarks/dense_gemv.py --walks, --baseline-rev and --packed: variants side by side, bad arguments rejected."""

from __future__ import annotations

import sys

import pytest

from benchmark_scripts import loaded_script


def test_walks_table(ops, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dense_gemv.py", "--walks", "--rounds", "1", "--layers", "1"])
    with loaded_script("dense_gemv.py") as script:
        script.main()
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and not ln.startswith("| weights")]
    cells = {tuple(c.strip() for c in r.strip("|").split("|")[:4]) for r in rows}
    assert ("float32", "4 decode linears", "1", "best") in cells and ("bfloat16", "lm_head", "2", "best") in cells
    assert all(r.rstrip(" |").split("|")[-2].strip().endswith("x") for r in rows)
    assert all(float(r.strip("|").split("|")[4]) > 0 and float(r.strip("|").split("|")[6]) > 0 for r in rows)


@pytest.mark.parametrize("bad, message", [(["--rounds", "0"], "--rounds must be >= 1, got 0"),
                                          (["--layers", "-2"], "--layers must be >= 1, got -2")])
def test_rejects_bad_arguments(bad, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dense_gemv.py", "--walks", *bad])
    with loaded_script("dense_gemv.py") as script, pytest.raises(SystemExit):
        script.main()
    assert message in capsys.readouterr().err


def test_baseline_rev_table(ops, monkeypatch, capsys):
    """Against HEAD's dense_gemv.cpp: one row per weight dtype and M, both sides timed."""
    monkeypatch.setattr(sys, "argv", ["dense_gemv.py", "--baseline-rev", "HEAD", "--rounds", "1", "--layers", "1",
                                      "--model-shapes", "smollm2-135m"])
    with loaded_script("dense_gemv.py") as script:
        script.main()
    out = capsys.readouterr().out
    assert "decode linears of smollm2-135m" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and not ln.startswith("| weights")]
    cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
    assert {(c[0], c[1], c[2]) for c in cells} == {(d, d, str(m)) for d in ("float32", "bfloat16")
                                                   for m in (1, 2, 4, 8, 12, 16, 24, 32)}
    assert all(float(c[3]) > 0 and float(c[5]) > 0 and c[7].endswith("x") for c in cells)


def test_baseline_rev_rows_dtypes_and_float32_activations(ops, monkeypatch, capsys):
    """--rows, --weight-dtypes and --x-float32 choose the table's cells: 16-bit weights with float32
    activations, as the engine runs a 16-bit checkpoint under float32 compute."""
    monkeypatch.setattr(sys, "argv", ["dense_gemv.py", "--baseline-rev", "HEAD", "--rounds", "1", "--layers", "1",
                                      "--rows", "1,3", "--weight-dtypes", "bfloat16,float16", "--x-float32"])
    with loaded_script("dense_gemv.py") as script:
        script.main()
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and not ln.startswith("| weights")]
    cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
    assert [(c[0], c[1], c[2]) for c in cells] == [(d, "float32", m) for d in ("bfloat16", "float16") for m in ("1", "3")]
    assert all(float(c[3]) > 0 and float(c[5]) > 0 for c in cells)


@pytest.mark.parametrize("bad, message", [
    (["--rows", "0,2"], "--rows takes comma-separated activation rows from 1 to 32, got '0,2'"),
    (["--rows", "1,x"], "--rows takes comma-separated activation rows from 1 to 32, got '1,x'"),
    (["--weight-dtypes", "bfloat16,int8"], "--weight-dtypes takes comma-separated names of float32, bfloat16, float16"),
])
def test_baseline_rev_rejects_bad_rows_and_dtypes(bad, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dense_gemv.py", "--baseline-rev", "HEAD", *bad])
    with loaded_script("dense_gemv.py") as script, pytest.raises(SystemExit):
        script.main()
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("modes", [["--walks", "--baseline-rev", "HEAD"], ["--packed", "--walks"],
                                   ["--packed", "--baseline-rev", "HEAD"]])
def test_modes_are_exclusive(modes, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dense_gemv.py", *modes])
    with loaded_script("dense_gemv.py") as script, pytest.raises(SystemExit):
        script.main()
    assert "give one of --walks, --baseline-rev and --packed" in capsys.readouterr().err


def test_packed_tables(ops, monkeypatch, capsys):
    """bf16: a row per call set and M with the packed kernel timed; FP8 codes: a row per M."""
    if not bool(ops.dense_gemv_has_packed()):
        pytest.skip("dense_gemv_packed is not built here")
    monkeypatch.setattr(sys, "argv", ["dense_gemv.py", "--packed", "--rounds", "1", "--layers", "1"])
    with loaded_script("dense_gemv.py") as script:
        script.main()
        rows_m = script.PACKED_ROWS
    out = capsys.readouterr().out
    bf16, fp8 = out.split("### FP8") if "### FP8" in out else (out, "")
    cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in bf16.splitlines()
             if r.startswith("| ") and not r.startswith("| calls")]
    assert {(c[0], c[1]) for c in cells} == {(calls, str(m)) for calls in ("4 decode linears", "lm_head")
                                             for m in rows_m}
    assert all(float(c[4]) > 0 and float(c[8]) < 2**-7 for c in cells)  # packed ms; bf16-sized error
    if bool(ops.fp8_gemv_has_packed()):
        fcells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in fp8.splitlines()
                  if r.startswith("| ") and not r.startswith("| calls")]
        assert [c[1] for c in fcells] == [str(m) for m in rows_m]
        assert all(float(c[2]) > 0 and float(c[3]) > 0 and c[5].endswith("x") and float(c[6]) < 2**-7 for c in fcells)


def test_unknown_revision_is_reported(ops, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["dense_gemv.py", "--baseline-rev", "no-such-revision-xyz"])
    with loaded_script("dense_gemv.py") as script, pytest.raises(SystemExit) as excinfo:
        script.main()
    assert "--baseline-rev no-such-revision-xyz: git cannot list fp8serve/kernels/cpu" in str(excinfo.value)


def test_unknown_model_shapes_are_rejected(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dense_gemv.py", "--baseline-rev", "HEAD", "--model-shapes", "gpt-2"])
    with loaded_script("dense_gemv.py") as script, pytest.raises(SystemExit):
        script.main()
    assert "--model-shapes" in capsys.readouterr().err
