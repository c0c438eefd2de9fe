"""benchmarks/bf16_tiled_gemm.py's flags: bad values are refused with a message
that names the flag (before anything is built or loaded), and the cell lists
of bench_common.parse_cells."""

from __future__ import annotations

import argparse
import sys

import pytest

from benchmark_scripts import loaded_script


@pytest.mark.parametrize("argv, message", [
    (["--engine-prefills", "2y3"], "--engine-prefills: expected comma-separated SEQSxTOKENS like 1x512,4x256, got '2y3'"),
    (["--engine-prefills", "0x512"], "--engine-prefills: sequences and tokens must be >= 1, got '0x512'"),
    (["--engine-temperature", "-0.5"], "--engine-temperature must be >= 0, got -0.5"),
    (["--head-rows", "12,x"], "--head-rows: expected comma-separated integers, got '12,x'"),
    (["--llama-rows", "0"], "--llama-rows: expected sizes >= 1, got '0'"),
    (["--baseline-rev", "HEAD", "--rows", ""], "--baseline-rev adds columns to the ops table: give it --rows"),
])
def test_bad_values_are_refused(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["bf16_tiled_gemm.py", *argv])
    with loaded_script("bf16_tiled_gemm.py") as script, pytest.raises(SystemExit) as exit_info:
        script.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_cells():
    with loaded_script("bf16_tiled_gemm.py"):
        from bench_common import parse_cells

        parser = argparse.ArgumentParser()
        assert parse_cells(parser, "--cells", "1x512, 4X256,") == [(1, 512), (4, 256)]
        assert parse_cells(parser, "--cells", "") == []
