"""benchmarks/kv_cache_layout.py on small sizes and a tiny checkpoint: the kernel part prints every
cell with both layouts' outputs equal, the engine part runs one engine per layout (each allocating
the layout it was asked for) with the same greedy tokens, and bad arguments are rejected."""

from __future__ import annotations

import os

import pytest

from benchmark_scripts import loaded_script
from checkpoints import write_tiny_llama


def rows(out: str, first: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines() if ln.startswith(f"| {first}")]


@pytest.mark.parametrize("query_dtype", ["bfloat16", "float32"])
def test_kernel_part_prints_every_cell(ops, capsys, query_dtype):
    with loaded_script("kv_cache_layout.py") as script:
        script.main(["--parts", "kernel", "--shapes", "4/2/64,8/2/128", "--kv-dtypes", "fp8_e4m3,bfloat16",
                     "--batches", "1,3", "--contexts", "37", "--calls", "2", "--rounds", "2", "--flush-mib", "1",
                     "--query-dtype", query_dtype])
    out = capsys.readouterr().out
    table = rows(out, "4 /") + rows(out, "8 /")
    assert [(r[0], r[1], r[2]) for r in table] == [(s, d, b) for s in ("4 / 2 / 64", "8 / 2 / 128")
                                                   for d in ("fp8_e4m3", "bfloat16") for b in ("1", "3")]
    for r in table:
        assert r[3] == "37" and all(float(r[i]) > 0 for i in (5, 6, 8, 9)), r
        assert r[11] == "True", r  # the script stops otherwise; the column says so


def test_engine_part_runs_one_engine_per_layout(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FP8SERVE_KV_CACHE_LAYOUT", "NHD")  # the script restores what it found
    model = write_tiny_llama(tmp_path / "tiny")
    with loaded_script("kv_cache_layout.py") as script:
        script.main(["--parts", "engine", "--model", str(model), "--dtype", "float32", "--kv-cache-dtype", "fp8",
                     "--kv-cache-memory", "4MiB", "--batch", "3", "--prompt-len", "20", "--steps", "3",
                     "--prefill-seqs", "2", "--prefill-rounds", "2"])
    assert os.environ["FP8SERVE_KV_CACHE_LAYOUT"] == "NHD", "the script leaves the environment as it found it"
    out = capsys.readouterr().out
    (prefill_nhd, nhd), (prefill_hnd, hnd) = rows(out, "NHD"), rows(out, "HND")
    assert prefill_nhd[1] == prefill_hnd[1] == "2" and float(prefill_nhd[2]) > 0 and float(prefill_hnd[2]) > 0
    assert "prefill NHD / HND:" in out and "first tokens the same: True" in out
    assert nhd[1] == hnd[1] == "3" and float(nhd[2]) > 0 and float(hnd[2]) > 0
    assert "greedy tokens of all 3 requests the same: True" in out


@pytest.mark.parametrize("bad, message", [
    (["--parts", "gpu"], "--parts takes kernel and/or engine"),
    (["--shapes", "9/4/64"], "needs heads a multiple of kv heads"),
    (["--shapes", "9x3x64"], "expected heads/kv_heads/head_size items"),
    (["--kv-dtypes", "int8"], "--kv-dtypes takes"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--prefill-rounds", "0"], "--prefill-rounds must be >= 1"),
])
def test_bad_arguments_are_rejected(bad, message, capsys):
    with loaded_script("kv_cache_layout.py") as script, pytest.raises(SystemExit):
        script.main(bad)
    assert message in capsys.readouterr().err
