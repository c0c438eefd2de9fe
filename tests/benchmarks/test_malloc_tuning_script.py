"""benchmarks/malloc_tuning.py on a tiny checkpoint: one child process per setting, both settings in
each round, every figure present; bad arguments rejected."""

from __future__ import annotations

import pytest

from benchmark_scripts import loaded_script
from checkpoints import write_tiny_llama


def test_tiny_round_runs_both_settings(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny")
    with loaded_script("malloc_tuning.py") as script:
        assert script.main(["--model", str(model), "--dtype", "float32", "--kv-cache-dtype", "auto",
                            "--kv-cache-memory", "4MiB", "--rounds", "1", "--steps", "1", "--prefill-batch", "2",
                            "--prefill-len", "8", "--decode-batch", "2", "--decode-steps", "2", "--mixed"]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines() if ln.startswith("| 1 ")]
    assert [r[1] for r in rows] == ["0", "1"], out
    for r in rows:
        assert float(r[2]) > 0 and float(r[3]) >= 0 and float(r[4]) > 0 and float(r[5]) >= 0, r
    assert "medians over rounds: prefill step" in out


@pytest.mark.parametrize("bad, message", [(["--rounds", "0"], "--rounds must be >= 1, got 0"),
                                          (["--decode-steps", "-1"], "--decode-steps must be >= 1, got -1")])
def test_bad_arguments_are_rejected(bad, message, capsys):
    with loaded_script("malloc_tuning.py") as script, pytest.raises(SystemExit):
        script.main(bad)
    assert message in capsys.readouterr().err
