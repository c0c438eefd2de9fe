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


def drain_tiny(tmp_path, *args: str) -> None:
    """The script on a tiny checkpoint: 5 requests of 8 prompt tokens, the first stopping after 3 tokens."""
    model = write_tiny_llama(tmp_path / "tiny")
    with loaded_script("decode_capture.py") as script:
        assert script.main(["--model", str(model), "--dtype", "float32", "--kv-cache-dtype", "auto",
                            "--num-prompts", "5", "--input-len", "8", "--first-output", "3", *args]) == 0


def test_tiny_drain_shares_compiles(ops, tmp_path, capsys):
    drain_tiny(tmp_path, "--steps-per-size", "3", "--rounds", "2", "--engines", "shared:r1:f0,per-size:r1:f0")
    out = capsys.readouterr().out
    table = rows(out)
    # ABBA: the second round runs the engines in the other order.
    assert [(r[0], r[1]) for r in table] == [("1", "shared:r1:f0"), ("1", "per-size:r1:f0"),
                                             ("2", "per-size:r1:f0"), ("2", "shared:r1:f0")]
    for r in table:
        assert r[6] == "5", r  # sizes 5, 4, 3, 2, 1: each one's first step counted once
        assert float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) > 0 and float(r[5]) > 0
        assert r[7] == "5", r  # every size lives 2+ steps: recorded after its one eager step (:r1)
    compiled = {r[1]: int(r[8]) for r in table}
    assert compiled["per-size:r1:f0"] == 5 and compiled["shared:r1:f0"] < 5, table
    assert "per-size:r1:f0 / shared:r1:f0 decode seconds by round:" in out


def test_sizes_that_live_one_step_are_not_recorded_after_an_eager_step(ops, tmp_path, capsys):
    """--steps-per-size 1: the first size lives 2 decode steps, the others 1. Recorded at once (:r0:f0),
    every size is recorded; after one eager step (:r1:f0), only the first."""
    drain_tiny(tmp_path, "--steps-per-size", "1", "--rounds", "1", "--engines", "shared:r0:f0,shared:r1:f0")
    out = capsys.readouterr().out
    recorded = {r[1]: int(r[7]) for r in rows(out)}
    assert recorded == {"shared:r0:f0": 5, "shared:r1:f0": 1}, out
    assert "shared:r1:f0 / shared:r0:f0 decode seconds by round:" in out


@pytest.mark.parametrize("bad, message", [(["--rounds", "0"], "--rounds must be >= 1, got 0"),
                                          (["--engines", "both"], "an engine is shared or per-size, optionally with :rN and :fM"),
                                          (["--engines", "shared:x1"], "got 'shared:x1'"),
                                          (["--engines", "shared,shared"], "--engines takes distinct engines")])
def test_bad_arguments_are_rejected(bad, message, capsys):
    with loaded_script("decode_capture.py") as script, pytest.raises(SystemExit):
        script.main(bad)
    assert message in capsys.readouterr().err
