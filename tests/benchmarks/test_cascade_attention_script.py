"""benchmarks/cascade_attention.py on small sizes and a tiny checkpoint: both parts print their
tables, the rule's column follows the kernel's counter, the engine part alternates both sides and
leaves the mode as it found it, and bad arguments are rejected."""

from __future__ import annotations

import pytest

from benchmark_scripts import loaded_script
from checkpoints import write_tiny_llama


def rows(out: str, first: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines() if ln.startswith(f"| {first}")]


def test_kernel_part_prints_every_cell(ops, capsys):
    with loaded_script("cascade_attention.py") as script:
        script.main(["--parts", "kernel", "--members", "2,16", "--shared", "16,1024", "--own", "3", "--calls", "2",
                     "--rounds", "2"])
    out = capsys.readouterr().out
    table = rows(out, "bfloat16") + rows(out, "float32")
    assert [(r[0], r[1], r[2]) for r in table] == [(q, m, s) for q in ("bfloat16", "float32") for m in ("2", "16")
                                                   for s in ("16", "1024")]
    for r in table:
        assert float(r[4]) > 0 and float(r[5]) > 0 and r[6].endswith("x")
        # The engine's rule: bf16 on the bf16 dot-product tiles, 16+ sequences, 16384+ pairs.
        expected = r[0] == "bfloat16" and r[1] == "16" and r[2] == "1024" and ops.paged_attention_has_bf16_dot()
        assert r[7] == ("yes" if expected else "no"), r


def test_engine_part_alternates_the_sides(ops, tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny")
    before = ops.set_cascade_attention(2)
    try:
        with loaded_script("cascade_attention.py") as script:
            script.main(["--parts", "engine", "--model", str(model), "--dtype", "float32", "--kv-cache-dtype", "auto",
                         "--kv-cache-memory", "4MiB", "--batch", "3", "--prefix-len", "40", "--steps", "3"])
        assert ops.set_cascade_attention(before) == 2, "the mode it found is restored"
    finally:
        ops.set_cascade_attention(before)
    out = capsys.readouterr().out
    off, auto = rows(out, "off")[0], rows(out, "auto")[0]
    assert off[1] == auto[1] == "3" and float(off[2]) > 0 and float(auto[2]) > 0
    # Three float32 sequences: below the rule, no prefix phase on either side.
    assert off[3] == auto[3] == "0"
    assert "off / auto:" in out


@pytest.mark.parametrize("bad, message", [
    (["--parts", "gpu"], "--parts takes kernel and/or engine"),
    (["--shared", "20"], "--shared lengths must be multiples of the block size 16"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--query-dtype", "float16"], "--query-dtype takes float32 and/or bfloat16"),
])
def test_bad_arguments_are_rejected(bad, message, capsys):
    with loaded_script("cascade_attention.py") as script, pytest.raises(SystemExit):
        script.main(bad)
    assert message in capsys.readouterr().err
