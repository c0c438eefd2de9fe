"""benchmarks/cache_write.py: one row per cell, side by side with a build of
the op from git, and bad arguments rejected."""

from __future__ import annotations

import sys

import pytest

from benchmark_scripts import loaded_script


def _run(monkeypatch, tmp_path, *argv):
    out = tmp_path / "table.md"
    monkeypatch.setattr(sys, "argv", ["cache_write.py", *argv, "--output", str(out)])
    with loaded_script("cache_write.py") as script:
        script.main()
    return [ln for ln in out.read_text().splitlines() if ln.startswith("| ") and not ln.startswith("| input")]


def test_table_has_every_cell(ops, monkeypatch, tmp_path):
    rows = _run(monkeypatch, tmp_path, "--tokens", "1,17", "--rounds", "1")
    # 2 input dtypes x 2 token counts x 2 formats x read-back or not
    assert len(rows) == 16
    cells = {tuple(c.strip() for c in r.strip("|").split("|")[:4]) for r in rows}
    assert ("bfloat16", "fp8_e5m2", "17", "yes") in cells and ("float32", "fp8_e4m3", "1", "no") in cells
    assert all(float(r.strip("|").split("|")[4]) > 0 for r in rows)


def test_baseline_from_git_runs_side_by_side(ops, monkeypatch, tmp_path):
    # HEAD's op: the script checks both builds write the same bytes before timing.
    rows = _run(monkeypatch, tmp_path, "--tokens", "33", "--rounds", "1", "--baseline-rev", "HEAD")
    assert len(rows) == 8
    assert all(r.rstrip(" |").endswith("x") for r in rows)


def test_other_formats_for_comparison(ops, monkeypatch, tmp_path):
    rows = _run(monkeypatch, tmp_path, "--tokens", "5", "--rounds", "1", "--formats", "bfloat16,float32,fp8_e4m3")
    assert sorted({r.strip("|").split("|")[1].strip() for r in rows}) == ["bfloat16", "float32", "fp8_e4m3"]


@pytest.mark.parametrize("bad, message", [(["--rounds", "0"], "must be at least 1"),
                                          (["--tokens", "0,4"], "must be at least 1"),
                                          (["--head-size", "-1"], "must be at least 1"),
                                          (["--formats", "fp8,int4"], "unknown format 'fp8'")])
def test_rejects_bad_arguments(bad, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["cache_write.py", *bad])
    with loaded_script("cache_write.py") as script, pytest.raises(SystemExit):
        script.main()
    assert message in capsys.readouterr().err
