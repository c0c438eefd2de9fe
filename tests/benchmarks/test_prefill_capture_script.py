"""benchmarks/prefill_capture.py on a tiny checkpoint: one row per count, the
random counts marked as never recorded, every timed step of the replayed
engine a replay (the script checks it and would stop), the same first tokens
as the eager engine; bad arguments are rejected."""

from __future__ import annotations

import pytest

from benchmark_scripts import loaded_script
from checkpoints import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # head_size 64: the bf16 prefill kernel takes these prompts (the route a replay needs).
    return write_tiny_llama(tmp_path_factory.mktemp("pc") / "tiny", hidden_size=256, num_heads=4, num_kv_heads=2,
                            intermediate_size=384, max_position_embeddings=1024)


def test_tiny_run(ops, tiny, tmp_path, capsys):
    out_file = tmp_path / "table.md"
    with loaded_script("prefill_capture.py") as script:
        assert script.main(["--model", str(tiny), "--dtype", "bfloat16", "--lengths", "100,300", "--random", "2",
                            "--random-min", "270", "--random-max", "400", "--rounds", "2",
                            "--output", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert out_file.read_text().strip() == out.strip()
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines()
            if ln.startswith("| ") and ln.split("|")[1].strip().isdigit()]
    by_count = {int(r[0]): r for r in rows}
    assert {100, 300} <= set(by_count) and 3 <= len(by_count) <= 4
    for n, r in by_count.items():
        assert r[1] == ("yes" if n in (100, 300) else "no")
        assert float(r[2]) > 0 and float(r[3]) > 0
        assert r[6] == "True"
    # Each count and the one below it, trunk and head (engine/prefill_capture.py).
    assert "8 recordings before timing, trunks and heads (2 trunk and 2 head segments generalized)" in out


def test_tiny_run_over_a_cached_prefix(ops, tiny, capsys):
    """--context: every timed replay continues the cached prefix (the script
    stops otherwise), and the tokens are the eager engine's. float32: the
    context kernel takes these steps on every CPU (bf16 on AMX takes SDPA)."""
    with loaded_script("prefill_capture.py") as script:
        assert script.main(["--model", str(tiny), "--dtype", "float32", "--context", "160", "--lengths", "40,100",
                            "--random", "1", "--random-min", "70", "--random-max", "200", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "continues a cached 160-token prefix" in out and "| new tokens |" in out
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines()
            if ln.startswith("| ") and ln.split("|")[1].strip().isdigit()]
    assert {40, 100} <= {int(r[0]) for r in rows} and all(r[6] == "True" for r in rows)


@pytest.mark.parametrize("argv,message", [
    (["--context", "100"], "--context"),
    (["--lengths", "2"], "--lengths"),
    (["--random", "-1"], "--random"),
    (["--random-min", "10", "--random-max", "5"], "--random-min"),
    (["--rounds", "0"], "--rounds"),
    (["--output", "/nonexistent/dir/t.md"], "--output"),
])
def test_bad_arguments(argv, message, capsys):
    with loaded_script("prefill_capture.py") as script, pytest.raises(SystemExit):
        script.main(argv)
    assert message in capsys.readouterr().err
