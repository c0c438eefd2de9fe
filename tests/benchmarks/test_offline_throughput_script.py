"""benchmarks/offline_throughput.py on a tiny checkpoint: fp8serve and transformers (in the
--hf-dtype asked for) get the same prompts and produce exactly --output-len tokens each; a dtype
transformers is not offered in is rejected."""

from __future__ import annotations

import json

import pytest

from benchmark_scripts import loaded_script
from checkpoints import write_tiny_llama


@pytest.mark.parametrize("hf_dtype", ["float32", "bfloat16"])
def test_tiny_run_against_transformers(hf_dtype, tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "r.json"
    with loaded_script("offline_throughput.py") as script:
        assert script.main(["--model", str(model), "--num-prompts", "3", "--input-len", "8", "--output-len", "5",
                            "--configs", "float32:auto", "--hf-batch-size", "2", "--warmup-prompts", "1",
                            "--hf-dtype", hf_dtype, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert f"| transformers | {hf_dtype} | {hf_dtype} | {hf_dtype} | sdpa | 3 | 8 | 5 |" in table, table
    data = json.loads(out.read_text())
    systems = {(r["system"], r["dtype"]) for r in data["results"]}
    assert systems == {("transformers", hf_dtype), ("fp8serve", "float32")}, systems
    for r in data["results"]:
        assert r["output_tok_s"] > 0 and not r["extrapolated"]


def test_unknown_hf_dtype_is_rejected(capsys):
    with loaded_script("offline_throughput.py") as script, pytest.raises(SystemExit):
        script.main(["--hf-dtype", "int8"])
    assert "--hf-dtype: invalid choice: 'int8'" in capsys.readouterr().err


def test_quantization_field_runs_fp8_weights(tmp_path, capsys):
    """DTYPE:KV_DTYPE:QUANTIZATION: the third field is --quantization, and the table says the weights
    were FP8 (the engine's layers hold one-byte codes), beside the same run without it."""
    model = write_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "r.json"
    with loaded_script("offline_throughput.py") as script:
        assert script.main(["--model", str(model), "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
                            "--configs", "float32:fp8,float32:fp8:fp8", "--warmup-prompts", "1", "--skip-hf",
                            "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| fp8serve | float32 | float32 | fp8_e4m3 | cpu_paged | 2 | 8 | 4 |" in table, table
    assert "| fp8serve | float32 | fp8 (-q fp8) | fp8_e4m3 | cpu_paged | 2 | 8 | 4 |" in table, table
    runs = json.loads(out.read_text())["results"]
    assert [(r["weights"], r["quantization"]) for r in runs] == [("float32", None), ("fp8", "fp8")]


def test_a_config_with_too_many_fields_is_refused():
    with loaded_script("offline_throughput.py") as script, pytest.raises(SystemExit, match="expected DTYPE:KV_DTYPE"):
        script.main(["--configs", "float32:fp8:fp8:x", "--skip-hf"])


def test_weights_column_says_how_the_weights_are_held(tmp_path, capsys, monkeypatch):
    """A bf16 checkpoint under float32 compute keeps its linear weights at 16 bits
    (narrow_weights.py): the weights column says bfloat16, not the compute dtype."""
    import torch

    from fp8serve.quantization import narrow_weights

    monkeypatch.setenv(narrow_weights.ENV, "1")
    model = write_tiny_llama(tmp_path / "tiny", dtype=torch.bfloat16)
    out = tmp_path / "r.json"
    with loaded_script("offline_throughput.py") as script:
        assert script.main(["--model", str(model), "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
                            "--configs", "float32:auto", "--warmup-prompts", "1", "--skip-hf",
                            "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| fp8serve | float32 | bfloat16 | float32 | cpu_paged | 2 | 8 | 4 |" in table, table
    assert [r["weights"] for r in json.loads(out.read_text())["results"]] == ["bfloat16"]


def test_rounds_reverse_the_order_and_report_median_ratios(tmp_path, capsys):
    """--rounds 2: round 1 in the asked order (fp8serve first), round 2 reversed; every result says its
    round and order, the summary table has one row per round, and the JSON's ratios are the medians of
    the rounds' ratios, each computed against transformers in its own round."""
    model = write_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "r.json"
    with loaded_script("offline_throughput.py") as script:
        assert script.main(["--model", str(model), "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
                            "--configs", "float32:auto", "--hf-batch-size", "2", "--warmup-prompts", "1",
                            "--rounds", "2", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    runs = [line.split(" ")[1] for line in captured.err.splitlines() if line.startswith("running ")]
    assert runs == ["fp8serve", "transformers", "transformers", "fp8serve"], runs
    assert "Round 1 of 2 (fp8serve first):" in captured.out, captured.out
    assert "Round 2 of 2 (transformers first):" in captured.out, captured.out
    assert "| 1 | fp8serve first |" in captured.out and "| 2 | transformers first |" in captured.out
    data = json.loads(out.read_text())
    assert [(r["round"], r["order"], r["system"]) for r in data["results"]] == [
        (1, "fp8serve first", "transformers"), (1, "fp8serve first", "fp8serve"),
        (2, "transformers first", "transformers"), (2, "transformers first", "fp8serve")]
    key = "fp8serve:float32:float32"
    per_round = []
    for rnd in (1, 2):
        rows = {r["system"]: r["output_tok_s"] for r in data["results"] if r["round"] == rnd}
        per_round.append(rows["fp8serve"] / rows["transformers"])
    assert [r[key] for r in data["ratios_by_round"]] == pytest.approx(per_round)
    assert data["ratios_output_tok_s"][key] == pytest.approx(sum(per_round) / 2)
    tok_s = {s: [r["output_tok_s"] for r in data["results"] if r["system"] == s] for s in ("transformers", "fp8serve")}
    median_row = (f"| median | — | {sum(tok_s['transformers']) / 2:.1f} | {sum(tok_s['fp8serve']) / 2:.1f} | "
                  f"{sum(per_round) / 2:.2f}x |")
    assert median_row in captured.out, captured.out


def test_hf_first_with_rounds_starts_with_transformers(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny")
    with loaded_script("offline_throughput.py") as script:
        assert script.main(["--model", str(model), "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                            "--configs", "float32:auto", "--hf-batch-size", "2", "--warmup-prompts", "1",
                            "--rounds", "3", "--hf-first"]) == 0
    err = capsys.readouterr().err
    runs = [line.split(" ")[1] for line in err.splitlines() if line.startswith("running ")]
    assert runs == ["transformers", "fp8serve", "fp8serve", "transformers", "transformers", "fp8serve"], runs


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--rounds", "2", "--skip-hf"], "--rounds > 1 alternates fp8serve and transformers"),
])
def test_bad_rounds_are_refused(argv, message, capsys):
    with loaded_script("offline_throughput.py") as script, pytest.raises(SystemExit):
        script.main(argv)
    assert message in capsys.readouterr().err
