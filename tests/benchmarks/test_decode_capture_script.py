"""benchmarks/decode_capture.py on a tiny checkpoint: the drain visits every batch size once per
run, the sharing engine compiles fewer forwards than the per-size one, and bad arguments are
rejected."""

from __future__ import annotations

import pytest

from benchmark_scripts import loaded_script
from checkpoints import write_tiny_llama


def rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines()
            if ln.startswith("| 1 ") or ln.startswith("| 2 ")]


def test_tiny_drain_shares_compiles(ops, tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny")
    with loaded_script("decode_capture.py") as script:
        assert script.main(["--model", str(model), "--dtype", "float32", "--kv-cache-dtype", "auto",
                            "--num-prompts", "5", "--input-len", "8", "--first-output", "3",
                            "--steps-per-size", "2", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    table = rows(out)
    assert [(r[0], r[1]) for r in table] == [("1", "shared"), ("1", "per-size"), ("2", "shared"), ("2", "per-size")]
    for r in table:
        assert r[5] == "5", r  # sizes 5, 4, 3, 2, 1: each one's first step counted once
        assert float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) > 0
    compiled = {r[1]: int(r[6]) for r in table}
    assert compiled["per-size"] == 5 and compiled["shared"] < 5, table
    assert "per-size / shared decode seconds by round:" in out


@pytest.mark.parametrize("bad, message", [(["--rounds", "0"], "--rounds must be >= 1, got 0"),
                                          (["--engines", "both"], "--engines takes shared and/or per-size")])
def test_bad_arguments_are_rejected(bad, message, capsys):
    with loaded_script("decode_capture.py") as script, pytest.raises(SystemExit):
        script.main(bad)
    assert message in capsys.readouterr().err
