"""benchmarks/dense_gemv.py --walks: both row walks side by side, bad arguments rejected."""

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
