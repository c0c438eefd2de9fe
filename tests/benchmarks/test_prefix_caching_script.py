"""benchmarks/prefix_caching.py on a tiny checkpoint: the engine with the cache prefills fewer
tokens at a nonzero hit rate, float32 outputs agree, and bad arguments are rejected."""

from __future__ import annotations

import pytest

from benchmark_scripts import loaded_script
from checkpoints import write_tiny_llama


def test_tiny_run_prefills_less_with_the_cache(ops, tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny")
    with loaded_script("prefix_caching.py") as script:
        assert script.main(["--model", str(model), "--dtype", "float32", "--kv-cache-dtype", "auto",
                            "--kv-cache-memory", "4MiB", "--num-prompts", "4", "--prefix-len", "40",
                            "--suffix-len", "5", "--num-conversations", "2", "--turns", "3", "--turn-len", "6",
                            "--output-len", "3", "--rounds", "2", "--check-accuracy"]) == 0
    out = capsys.readouterr().out
    table = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines()
             if ln.startswith("| shared-prefix ") or ln.startswith("| multi-turn ")]
    assert len(table) == 8
    by = {(r[0], r[1], r[2]): r for r in table}
    for workload in ("shared-prefix", "multi-turn"):
        for rnd in ("1", "2"):
            off, on = by[(workload, rnd, "off")], by[(workload, rnd, "on")]
            assert off[6] == "0.0%" and float(on[6].rstrip("%")) > 0
            assert int(on[5]) < int(off[5]), (workload, on, off)
    # shared-prefix: 4 x 45 tokens without the cache; with it the prefix (40 = 2.5 blocks of 16) once:
    # 2 full blocks are shared, so 45 + 3 x 13.
    assert by[("shared-prefix", "1", "off")][5] == "180" and by[("shared-prefix", "1", "on")][5] == str(45 + 3 * 13)
    assert "shared-prefix round 1: off / on wall" in out
    assert "4/4 requests generated the same tokens" in out and "6/6 requests generated the same tokens" in out
    # float32 engines against a float32 reference: the cached path agrees to rounding.
    acc = {r[0]: r for r in ([c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines()
                             if ln.startswith("| off |") or ln.startswith("| on |"))}
    assert acc["off"][1] == "0" and int(acc["on"][1]) == 3 * 32
    for label in ("off", "on"):
        assert float(acc[label][3]) < 1e-4 and acc[label][4] == "4/4", acc[label]


@pytest.mark.parametrize("bad, message", [(["--rounds", "0"], "--rounds must be >= 1, got 0"),
                                          (["--workloads", "chat"], "--workloads takes shared-prefix and/or multi-turn")])
def test_bad_arguments_are_rejected(bad, message, capsys):
    with loaded_script("prefix_caching.py") as script, pytest.raises(SystemExit):
        script.main(bad)
    assert message in capsys.readouterr().err
