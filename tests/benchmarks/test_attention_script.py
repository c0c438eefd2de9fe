"""benchmarks/attention.py: the baseline options."""

from __future__ import annotations

import sys

import pytest

from benchmark_scripts import loaded_script


def test_baseline_lib_and_rev_are_exclusive(ops, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["attention.py", "--baseline-lib", "/tmp/x.so", "--baseline-rev", "HEAD",
                                      "--no-save"])
    with loaded_script("attention.py") as script, pytest.raises(SystemExit):
        script.main()
    assert "not both" in capsys.readouterr().err


def test_unknown_revision_is_a_clear_error(ops, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["attention.py", "--baseline-rev", "no-such-revision-xyz", "--no-save"])
    with loaded_script("attention.py") as script, pytest.raises(SystemExit) as excinfo:
        script.main()
    assert "--baseline-rev no-such-revision-xyz: git cannot list fp8serve/kernels/cpu" in str(excinfo.value)
