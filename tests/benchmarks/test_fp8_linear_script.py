"""benchmarks/fp8_linear.py --walks: both row walks of the fused kernel side by side, bad arguments rejected."""

from __future__ import annotations

import sys

import pytest

from benchmark_scripts import loaded_script


def test_walks_table(ops, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fp8_linear.py", "--walks", "--rounds", "1", "--layers", "1"])
    with loaded_script("fp8_linear.py") as script:
        script.main()
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and not ln.startswith("| x dtype")]
    assert len(rows) == 8  # 2 x dtypes x 2 M x 2 loops
    cells = {tuple(c.strip() for c in r.strip("|").split("|")[:3]) for r in rows}
    assert ("float32", "1", "32-code (AVX-512)") in cells and ("bfloat16", "2", "16-code (AVX2)") in cells
    assert all(r.rstrip(" |").split("|")[-2].strip().endswith("x") for r in rows)


def test_baseline_rev_table(ops, monkeypatch, capsys):
    """Against HEAD's fp8_gemm.cpp: one row per activation dtype and M, both sides timed, and the
    two builds' outputs compared (the same source here: bit-identical)."""
    monkeypatch.setattr(sys, "argv", ["fp8_linear.py", "--baseline-rev", "HEAD", "--rounds", "1", "--layers", "1"])
    with loaded_script("fp8_linear.py") as script:
        script.main()
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and not ln.startswith("| x dtype")]
    cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
    assert {(c[0], c[1]) for c in cells} == {(d, str(m)) for d in ("float32", "bfloat16") for m in (1, 2, 4, 8, 16)}
    assert all(float(c[2]) > 0 and float(c[4]) > 0 and c[6].endswith("x") and float(c[7]) == 0 for c in cells)


def test_modes_are_exclusive(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fp8_linear.py", "--walks", "--baseline-rev", "HEAD"])
    with loaded_script("fp8_linear.py") as script, pytest.raises(SystemExit):
        script.main()
    assert "give one of --walks and --baseline-rev" in capsys.readouterr().err


def test_unknown_revision_is_reported(ops, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fp8_linear.py", "--baseline-rev", "no-such-revision-xyz"])
    with loaded_script("fp8_linear.py") as script, pytest.raises(SystemExit) as excinfo:
        script.main()
    assert "--baseline-rev no-such-revision-xyz: git cannot list fp8serve/kernels/cpu" in str(excinfo.value)


@pytest.mark.parametrize("bad, message", [(["--rounds", "0"], "--rounds must be >= 1, got 0"),
                                          (["--layers", "0"], "--layers must be >= 1, got 0")])
def test_rejects_bad_arguments(bad, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fp8_linear.py", "--walks", *bad])
    with loaded_script("fp8_linear.py") as script, pytest.raises(SystemExit):
        script.main()
    assert message in capsys.readouterr().err
