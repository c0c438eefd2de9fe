"""benchmarks/last_layer_pruning.py on a tiny checkpoint: one row per count, the pruned engine
pruned every timed step and the full engine none (the script checks it and would stop), the same
first tokens; the FLOP share from config.json by hand; bad arguments are rejected."""

from __future__ import annotations

import pytest

from benchmark_scripts import loaded_script
from checkpoints import write_tiny_llama

SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("llp") / "tiny", num_layers=3, hidden_size=128, num_heads=4,
                            num_kv_heads=2, intermediate_size=192, max_position_embeddings=512)


def _rows(out: str) -> dict[int, list[str]]:
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines()
            if ln.startswith("| ") and ln.split("|")[1].strip().isdigit()]
    return {int(r[0]): r for r in rows}


def test_skipped_flops_share():
    with loaded_script("last_layer_pruning.py") as script:
        # 512 fresh tokens: a row through a layer's projections 2 * (576 * 960 + 576 * 576 + 3 * 576 * 1536)
        # = 7077888 FLOPs; attention 4 * 576 * (512 * 513 / 2) per layer; 30 layers and one row of logits
        # (2 * 576 * 49152): 117850374144. Skipped: 511 rows of q, o_proj and MLP (2 * 3317760 each) and
        # the last layer's attention but the last row's 512 keys: 4 * 576 * (131328 - 512).
        assert script.skipped_flops_share(SMOLLM2, 512, 0) == pytest.approx(
            (511 * 6635520 + 4 * 576 * (131328 - 512)) / 117850374144)
        # 32 new tokens after 512 cached ones attend to 32 * 512 + 528 = 16912 keys in all.
        assert script.skipped_flops_share(SMOLLM2, 32, 512) == pytest.approx(
            (31 * 6635520 + 4 * 576 * (16912 - 544)) / (30 * (32 * 7077888 + 4 * 576 * 16912) + 56623104))


def test_tiny_run(ops, tiny, tmp_path, capsys):
    out_file = tmp_path / "table.md"
    with loaded_script("last_layer_pruning.py") as script:
        assert script.main(["--model", str(tiny), "--dtype", "float32", "--lengths", "20,90", "--batch", "3",
                            "--rounds", "2", "--output", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert out_file.read_text().strip() == out.strip()
    rows = _rows(out)
    assert set(rows) == {20, 90}
    for n, r in rows.items():
        assert r[1] == "3" and float(r[2]) > 0 and float(r[3]) > 0
        full_best, pruned_best = (float(x) for x in r[6].split("/"))
        # the best steps: no slower than the median rounds (printed to 0.1 ms)
        assert 0 < full_best <= float(r[2]) + 0.05 and 0 < pruned_best <= float(r[3]) + 0.05
        # the ratio of the unrounded times, within the rounding of the two printed ones
        lo, hi = (full_best - 0.05) / (pruned_best + 0.05), (full_best + 0.05) / max(pruned_best - 0.05, 1e-9)
        assert lo - 0.0005 <= float(r[7].rstrip("x")) <= hi + 0.0005
        assert 0 < float(r[8].rstrip("%")) < 100
        # float32: rows through the head alone round differently (~1e-6), no near-tie at random weights.
        assert r[9] == "True"
    assert "recorded prefill forwards replayed in" in out


def test_tiny_run_over_a_cached_prefix(ops, tiny, capsys):
    with loaded_script("last_layer_pruning.py") as script:
        assert script.main(["--model", str(tiny), "--dtype", "float32", "--context", "64", "--lengths", "10",
                            "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "continues a cached 64-token prefix" in out and "| new tokens |" in out
    assert _rows(out)[10][9] == "True"


@pytest.mark.parametrize("argv,message", [
    (["--context", "100"], "--context"),
    (["--lengths", "2"], "--lengths"),
    (["--lengths", "a"], "--lengths"),
    (["--batch", "0"], "--batch"),
    (["--rounds", "0"], "--rounds"),
    (["--repeats", "0"], "--repeats"),
    (["--output", "/nonexistent/dir/t.md"], "--output"),
])
def test_bad_arguments(argv, message, capsys):
    with loaded_script("last_layer_pruning.py") as script, pytest.raises(SystemExit):
        script.main(argv)
    assert message in capsys.readouterr().err
