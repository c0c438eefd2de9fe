"""benchmarks/silu_and_mul.py: one row per cell with its errors against
float64, side by side with a build of the op from git, and bad arguments
rejected."""

from __future__ import annotations

import sys

import pytest

from benchmark_scripts import loaded_script


def _run(monkeypatch, tmp_path, *argv):
    out = tmp_path / "table.md"
    monkeypatch.setattr(sys, "argv", ["silu_and_mul.py", *argv, "--output", str(out)])
    with loaded_script("silu_and_mul.py") as script:
        script.main()
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in out.read_text().splitlines()
            if ln.startswith("| ") and not ln.startswith("| dtype")]


def test_table_has_every_cell_and_small_errors(ops, monkeypatch, tmp_path):
    rows = _run(monkeypatch, tmp_path, "--rows", "1,7", "--intermediate-size", "40", "--rounds", "1")
    assert [(r[0], r[1]) for r in rows] == [("float32", "1"), ("float32", "7"), ("bfloat16", "1"), ("bfloat16", "7")]
    for r in rows:
        us, err = float(r[2]), float(r[3])
        assert us > 0
        # float32: a few 2^-24; bf16: silu and the product each rounded to bf16 (half an ulp, 2^-8, each).
        assert 0 < err <= (1e-6 if r[0] == "float32" else 2**-7), r


def test_baseline_from_git_runs_side_by_side(ops, monkeypatch, tmp_path):
    rows = _run(monkeypatch, tmp_path, "--rows", "9", "--intermediate-size", "24", "--rounds", "1",
                "--baseline-rev", "HEAD")
    assert len(rows) == 2
    for r in rows:
        # dtype, rows, 2 times, speedup, 2 errors vs float64, difference between builds
        assert len(r) == 8 and r[4].endswith("x") and float(r[2]) > 0 and float(r[3]) > 0
        assert float(r[7]) <= 1e-6 if r[0] == "float32" else float(r[7]) == 0.0


@pytest.mark.parametrize("bad, message", [(["--rounds", "0"], "--rounds must be >= 1"),
                                          (["--rows", "0,4"], "--rows must all be >= 1"),
                                          (["--intermediate-size", "-1"], "--intermediate-size must be >= 1"),
                                          (["--dtypes", "float32,int8"], "unknown dtype 'int8'")])
def test_rejects_bad_arguments(bad, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["silu_and_mul.py", *bad])
    with loaded_script("silu_and_mul.py") as script, pytest.raises(SystemExit):
        script.main()
    assert message in capsys.readouterr().err
