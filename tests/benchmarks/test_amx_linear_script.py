"""benchmarks/amx_linear.py: side by side with a build of the kernel from git,
and bad arguments rejected."""

from __future__ import annotations

import sys

import pytest

from benchmark_scripts import loaded_script
from fp8serve.kernels import amx_linear_ops


def test_baseline_from_git_runs_side_by_side(ops, monkeypatch, tmp_path):
    if not amx_linear_ops.is_available():
        pytest.skip("no AMX tiles in this CPU, build or process")
    out = tmp_path / "table.md"
    monkeypatch.setattr(sys, "argv", ["amx_linear.py", "--rows", "8,20", "--rounds", "1", "--hot",
                                      "--baseline-rev", "HEAD", "--output", str(out)])
    with loaded_script("amx_linear.py") as script:
        script.main()
    rows = [ln for ln in out.read_text().splitlines() if ln.startswith("| ") and not ln.startswith("| rows")]
    assert [r.split("|")[1].strip() for r in rows] == ["8", "20"]
    assert all(r.rstrip(" |").endswith("x") for r in rows)


@pytest.mark.parametrize("bad, message", [(["--rounds", "0"], "must be at least 1"),
                                          (["--rows", "4"], "outside the kernel's 8-64"),
                                          (["--rows", "65"], "outside the kernel's 8-64")])
def test_rejects_bad_arguments(bad, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["amx_linear.py", *bad])
    with loaded_script("amx_linear.py") as script, pytest.raises(SystemExit):
        script.main()
    assert message in capsys.readouterr().err
