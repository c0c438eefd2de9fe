"""benchmarks/chunked_prefill.py on a tiny checkpoint: every configuration serves every request,
the chunked ones in more (shorter) steps where prompts are longer than their budget, float32
outputs agree with whole prefills, and bad arguments are rejected."""

from __future__ import annotations

import pytest

from benchmark_scripts import loaded_script
from checkpoints import write_tiny_llama


def test_tiny_run(ops, tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny")
    with loaded_script("chunked_prefill.py") as script:
        assert script.main(["--model", str(model), "--dtype", "float32", "--kv-cache-dtype", "auto",
                            "--kv-cache-memory", "4MiB", "--budgets", "128,16", "--max-num-seqs", "8", "--num-prompts", "5",
                            "--request-rate", "200", "--input-len", "40", "--output-len", "4", "--tokens", "random",
                            "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines() if ln.startswith("| 1 |")
            or ln.startswith("| 2 |")]
    assert [(r[0], r[1]) for r in rows] == [("1", "off"), ("1", "chunked:128"), ("1", "chunked:16"),
                                            ("2", "chunked:16"), ("2", "chunked:128"), ("2", "off")]
    for r in rows:
        assert float(r[4]) > 0 and float(r[5]) > 0 and float(r[8]) >= float(r[7]) > 0
    # 40-token prompts in chunks of at most 16 tokens (less the decodes): at least 3 steps per prompt.
    steps = {(r[0], r[1]): int(r[3]) for r in rows}
    assert steps[("1", "chunked:16")] >= 5 * 3
    assert "round 2, chunked:16 / off: output tok/s" in out
    assert out.count("5/5 requests generated the same tokens") == 4


@pytest.mark.parametrize("bad, message", [
    (["--budgets", "0"], "--budgets takes positive integers"),
    (["--budgets", "x"], "--budgets takes comma-separated integers"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
])
def test_bad_arguments(bad, message, capsys):
    with loaded_script("chunked_prefill.py") as script, pytest.raises(SystemExit):
        script.main(bad)
    assert message in capsys.readouterr().err
