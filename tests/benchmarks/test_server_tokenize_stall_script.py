"""benchmarks/server_tokenize_stall.py on a tiny checkpoint: the server starts, the big request is
refused after tokenizing (longer than --max-model-len), /health answers throughout, and bad
arguments are rejected."""

from __future__ import annotations

import pytest

from benchmark_scripts import loaded_script
from checkpoints import write_tiny_llama


def test_tiny_run(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny")
    with loaded_script("server_tokenize_stall.py") as script:
        assert script.main(["--model", str(model), "--prompt-chars", "200000", "--max-model-len", "128",
                            "--kv-cache-memory", "1MiB", "--dtype", "float32", "--poll-interval", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "big request: 200000 characters, HTTP 400 after" in out
    rows = {r[0]: r for r in ([c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines()
                              if ln.startswith("| idle") or ln.startswith("| during"))}
    assert int(rows["idle"][1]) == 20 and float(rows["idle"][3]) > 0
    assert int(rows["during the big request"][1]) >= 1


@pytest.mark.parametrize("bad, message", [
    (["--prompt-chars", "0"], "--prompt-chars must be >= 1"),
    (["--poll-interval", "0"], "--poll-interval must be > 0"),
])
def test_bad_arguments(bad, message, capsys):
    with loaded_script("server_tokenize_stall.py") as script, pytest.raises(SystemExit):
        script.main(bad)
    assert message in capsys.readouterr().err
