"""benchmarks/fp8_online.py on the tiny Llama: a row per weights kind with every cell measured, and
the FP8 checkpoint and --quantization fp8 giving the same tokens; bad arguments rejected."""

from __future__ import annotations

import pytest

from benchmark_scripts import run_table
from checkpoints import write_tiny_llama


def test_every_cell_and_the_same_tokens(monkeypatch, tmp_path):
    from fp8serve.calibration.fp8_checkpoint import write_fp8_checkpoint

    model, fp8 = write_tiny_llama(tmp_path / "llama"), tmp_path / "fp8"
    write_fp8_checkpoint(model, fp8, activation_scheme="dynamic")
    text, rows = run_table(monkeypatch, tmp_path, "fp8_online.py", "--model", str(model), "--fp8-model", str(fp8),
                           "--dtype", "float32",
                           "--prompt-len", "12", "--steps", "5", "--rounds", "2", "--batch-sizes", "1,3",
                           header="| weights")
    assert [r[0] for r in rows] == ["16-bit weights", "FP8 checkpoint", "--quantization fp8"]
    for r in rows:
        assert len(r) == 2 + 2 * 2 and all(float(v) > 0 for v in r[1:]), r
    assert text.count("the two FP8 runs' tokens identical: True") == 2


@pytest.mark.parametrize("argv", [["--batch-sizes", "0"], ["--batch-sizes", "x"], ["--steps", "0"]])
def test_bad_arguments(monkeypatch, tmp_path, argv):
    with pytest.raises(SystemExit):
        run_table(monkeypatch, tmp_path, "fp8_online.py", *argv, header="| weights")
