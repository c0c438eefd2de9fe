"""benchmarks/spec_decode.py on a tiny checkpoint: every configuration runs every workload in both
modes, speculation checks drafts and generates float32 greedy outputs equal to plain decoding's,
and bad arguments are rejected."""

from __future__ import annotations

import pytest

from benchmark_scripts import loaded_script
from checkpoints import write_tiny_llama


def test_tiny_run(ops, tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny")
    with loaded_script("spec_decode.py") as script:
        assert script.main(["--model", str(model), "--dtype", "float32", "--kv-cache-dtype", "auto",
                            "--kv-cache-memory", "4MiB", "--configs", "ngram:3:1-3,ngram:3:1-3:fixed",
                            "--workloads", "free", "--num-prompts", "3", "--output-len", "12",
                            "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines()
            if ln.startswith(("| 1 |", "| 2 |"))]
    # (The quoting workloads' paragraphs are longer than the tiny model's 256 positions in its tokenizer.)
    labels = ["off", "ngram:3:1-3", "ngram:3:1-3:fixed"]
    assert len(rows) == 2 * 2 * 3
    assert [r[3] for r in rows[:3]] == labels
    assert [r[3] for r in rows[-3:]] == labels[::-1]  # ABBA
    for r in rows:
        assert int(r[4]) > 0 and float(r[6]) > 0
        proposed, verified, kept = int(r[8]), int(r[9]), int(r[10])
        if r[3] == "off":
            assert (proposed, verified, kept) == (0, 0, 0) and r[11] == "-"
        assert kept <= verified <= proposed
        if r[3].endswith(":fixed"):  # no trimming: every proposed draft verified
            assert verified == proposed
    assert sum(int(r[9]) for r in rows if r[3] != "off") > 0, "no drafts were checked"
    # Float32: speculation generates what plain decoding does.
    assert out.count("3/3 requests generated the same tokens") == 2 * 2 * 2


def test_record_after_suffix_and_fresh_recordings(ops, tmp_path, capsys, monkeypatch):
    """':r0:f0' sets the engine's DecodeCaptures.record_after and first_record_after for the measured runs (the warm-up records
    at first use); --fresh-recordings forgets every recording before each measured run (2 rounds x
    2 modes x 2 configurations)."""
    from fp8serve.engine.decode_capture import DecodeCaptures

    seen, resets = {}, []  # engine -> (record_after, first_record_after) at each decode forward
    forward, reset = DecodeCaptures.forward, DecodeCaptures.reset

    def spy_forward(self, *args):
        seen.setdefault(id(self), []).append((self.record_after, self.first_record_after))
        return forward(self, *args)

    def spy_reset(self):
        resets.append(id(self))
        reset(self)

    monkeypatch.setattr(DecodeCaptures, "forward", spy_forward)
    monkeypatch.setattr(DecodeCaptures, "reset", spy_reset)
    model = write_tiny_llama(tmp_path / "tiny")
    with loaded_script("spec_decode.py") as script:
        assert script.main(["--model", str(model), "--dtype", "float32", "--kv-cache-dtype", "auto",
                            "--kv-cache-memory", "4MiB", "--configs", "ngram:3:1-3:r0:f0", "--workloads", "free",
                            "--num-prompts", "2", "--output-len", "8", "--rounds", "2", "--fresh-recordings"]) == 0
    out = capsys.readouterr().out
    # The warm-up records every shape at first use; the measured runs use :r0:f0, and `off` the defaults.
    assert sorted(r[0] for r in seen.values()) == [(0, 0), (0, 0)], seen
    assert sorted(r[-1] for r in seen.values()) == [(0, 0), (4, 64)], seen
    assert len(resets) == 2 * 2 * 2 and len(set(resets)) == 2
    assert out.count("2/2 requests generated the same tokens") == 2 * 2


@pytest.mark.parametrize("bad, message", [
    (["--configs", "ngram:4"], "a configuration is 'off' or 'ngram:K:MIN-MAX[:fixed]'"),
    (["--configs", "off:r"], "optionally with ':rN' and ':fM' (e.g. ngram:4:2-4, off:r0:f0), got 'off:r'"),
    (["--workloads", "poems"], "--workloads takes quote, rewrite, free"),
    (["--modes", "both"], "--modes takes single and/or batch"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
])
def test_bad_arguments(bad, message, capsys):
    with loaded_script("spec_decode.py") as script, pytest.raises(SystemExit):
        script.main(bad)
    assert message in capsys.readouterr().err


def test_verify_cost_table(ops, tmp_path, capsys):
    """--verify-cost's table: one row per batch size x drafts, verify rows = batch x (drafts + 1),
    both times measured; the cache is left empty."""
    from fp8serve import LLM

    model = write_tiny_llama(tmp_path / "tiny")
    llm = LLM(str(model), dtype="float32", kv_cache_memory="4MiB")
    with loaded_script("spec_decode.py") as script:
        script.verify_cost(llm, [1, 3], [1, 4], context=20, repeats=2)
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("| ") and ln[2].isdigit()]
    assert [(r[0], r[1], r[2]) for r in rows] == [("1", "1", "2"), ("1", "4", "5"), ("3", "1", "6"), ("3", "4", "15")]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
