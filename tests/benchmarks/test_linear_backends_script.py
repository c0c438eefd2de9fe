"""benchmarks/linear_backends.py: every GEMM of a cell timed side by side, bad arguments rejected."""

from __future__ import annotations

import sys

import pytest

from benchmark_scripts import loaded_script


def _rows(out: str, first: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in out.splitlines()
            if ln.startswith("| ") and not ln.startswith(first)]


def test_tables(ops, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["linear_backends.py", "--rows", "40", "--decode-rows", "16,40", "--rounds", "1",
                                      "--layers", "1", "--min-time", "0.001"])
    with loaded_script("linear_backends.py") as script:
        script.main()
    out = capsys.readouterr().out
    hot = [r for r in _rows(out, "| M |") if "->" in r[1]]
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert {(r[0], r[1].split()[0]) for r in hot} == {("40", n) for n in names}
    assert len(hot) == 8  # float32 and bf16
    assert all(float(r[2]) > 0 for r in hot)
    cold = [r for r in _rows(out, "| M |") if "->" not in r[1]]
    assert [r[0] for r in cold] == ["16", "40", "16", "40"]
    assert all(float(r[1]) > 0 for r in cold)
    # dense_gemv takes up to 32 rows: timed at 16, not at 40 (its column is the last "ms" one of each table).
    headers = [ln for ln in out.splitlines() if ln.startswith("| M | F.linear ms")]
    assert len(headers) == 2
    for header, rows in zip(headers, (cold[:2], cold[2:])):
        cols = [c.strip() for c in header.strip("|").split("|")]
        g = cols.index("dense_gemv ms")
        assert rows[0][g] != "-" and rows[1][g] == "-"
    # Also oneDNN on packed weights where this torch can pack them.
    import torch

    from fp8serve.kernels import onednn_linear

    assert ("oneDNN packed ms" in headers[0]) == onednn_linear.packing_available(torch.float32)
    assert ("oneDNN packed ms" in headers[1]) == onednn_linear.packing_available(torch.bfloat16)
    assert "- F.linear:" in out


@pytest.mark.parametrize("bad, message", [(["--rounds", "0"], "--rounds must be >= 1, got 0"),
                                          (["--rows", "4,x"], "expected comma-separated integers"),
                                          (["--decode-rows", "0"], "expected integers >= 1"),
                                          (["--min-time", "0"], "--min-time must be > 0")])
def test_rejects_bad_arguments(bad, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["linear_backends.py", *bad])
    with loaded_script("linear_backends.py") as script, pytest.raises(SystemExit):
        script.main()
    assert message in capsys.readouterr().err
