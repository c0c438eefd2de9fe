"""benchmarks/kv_saturation_engine.py on a tiny checkpoint: every output token is counted once,
prefill and decode steps are told apart by the engine's prompt-token counter (re-prefills after a
preemption included), and the ratios compare each round with its own baseline."""

from __future__ import annotations

import json

import pytest

from benchmark_scripts import loaded_script
from checkpoints import write_tiny_llama


@pytest.fixture(scope="module")
def kse():
    with loaded_script("kv_saturation_engine.py") as module:
        yield module


def test_tiny_run_accounts_for_every_token_and_step(kse, tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "r.json"
    # 6 prompts of 16 tokens (one block each) -> 20 tokens: 48 KiB holds 6 float32 blocks, so the
    # float32 cache admits 5 requests that then need 3 blocks each and preempts; FP8 holds 24 blocks.
    rc = kse.main(["--model", str(model), "--dtype", "float32", "--kv-cache-dtypes", "auto,fp8",
                   "--kv-cache-memory", "48KiB", "--max-model-len", "48", "--num-prompts", "6",
                   "--input-len", "16", "--output-len", "20", "--rounds", "2", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert [(r["round"], r["kv_cache_dtype"]) for r in runs] == [(1, "auto"), (1, "fp8"), (2, "auto"), (2, "fp8")]
    for r in runs:
        assert r["output_tokens"] == 6 * 20
        # Each request's first token comes from a prefill step; every other token from a decode step,
        # unless a preemption re-prefilled the sequence (that step's token counts as a prefill token).
        assert r["decode_seqs"] <= 6 * 19
        assert r["decode_seqs"] + r["prefill_steps"] * 6 >= 6 * 20
        assert r["decode_steps"] == len(r["decode_step_ms"]) > 0
        assert r["total_s"] >= r["decode_s"] + r["prefill_s"] - 1e-6
        assert 0 < r["saturated_s"] <= r["total_s"] and 6 <= r["saturated_tokens"] <= r["output_tokens"]
    auto1, fp81 = runs[0], runs[1]
    assert auto1["preemptions"] > 0 and fp81["preemptions"] == 0
    # Re-prefills after preemption are prefill steps: more of them than the admissions alone need.
    assert auto1["prefill_steps"] > fp81["prefill_steps"]
    assert fp81["mean_running"] >= auto1["mean_running"]  # twice the blocks, at least as many running
    assert [x["round"] for x in data["ratios"]] == [1, 2]
    assert data["ratios"][0]["output"] == pytest.approx(fp81["output_tok_s"] / auto1["output_tok_s"])
    # The workload's bound: the FP8 run's prefill as measured, its decode steps at the baseline's mean cost.
    base_step_s = auto1["decode_s"] / auto1["decode_steps"]
    assert data["ratios"][0]["free_batching_bound"] == pytest.approx(
        auto1["total_s"] / (fp81["prefill_s"] + fp81["decode_steps"] * base_step_s))
    table = capsys.readouterr().out
    assert "| round | KV dtype | total s | output tok/s |" in table
    assert f"- round 1: fp8: this workload's bound {data['ratios'][0]['free_batching_bound']:.2f}x: were its " \
           f"{fp81['decode_steps']} decode steps" in table


def test_free_batching_bound_keeps_the_prefill_and_prices_steps_at_the_baseline(kse):
    """Stop 77's Zen 4 round 1, in numbers: 8.9 s of prefill stays, 765 steps at the bf16 run's
    25.8 s / 1530 steps: 21.8 s, against its 34.0 s total."""
    base = kse.RunStats("bfloat16", 1, total_s=34.0, output_tokens=12288, saturated_s=30.0, saturated_tokens=10000,
                        decode_s=25.8, decode_steps=1530, decode_seqs=12240, prefill_s=8.2, prefill_steps=6,
                        preemptions=0)
    fp8 = kse.RunStats("fp8", 1, total_s=23.9, output_tokens=12288, saturated_s=20.0, saturated_tokens=10000,
                       decode_s=15.0, decode_steps=765, decode_seqs=12240, prefill_s=8.9, prefill_steps=3,
                       preemptions=0)
    assert kse.free_batching_seconds(fp8, base) == pytest.approx(8.9 + 765 * 25.8 / 1530)
    assert base.total_s / kse.free_batching_seconds(fp8, base) == pytest.approx(1.5596, abs=1e-4)
    # Against itself, a run's bound is its own total less the time outside steps.
    assert kse.free_batching_seconds(base, base) == pytest.approx(base.prefill_s + base.decode_s)
    empty = kse.RunStats("auto", 1, 1.0, 0, 0.0, 0, 0.0, 0, 0, 1.0, 1, 0)
    assert kse.free_batching_seconds(fp8, empty) != kse.free_batching_seconds(fp8, empty)  # nan


@pytest.mark.parametrize("bad", [["--rounds", "0"], ["--num-prompts", "0"], ["--output-len", "-1"],
                                 ["--kv-cache-dtypes", "fp8"], ["--device", "tpu"], ["--admission", "fifo"]])
def test_rejects_bad_arguments(kse, bad, capsys):
    with pytest.raises(SystemExit) as e:
        kse.main(bad)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert ("must be at least 1" in err) or ("needs a baseline" in err) or ("--device must be cpu or cuda" in err) \
        or ("--admission: invalid choice: 'fifo'" in err), err


def test_both_admission_policies_side_by_side(kse, tmp_path, capsys):
    """--admission both: every KV dtype under the engine's growth reservation and under the
    watermark alone; ratios compare KV dtypes under the same policy, and the reservation
    preempts no more than the watermark does."""
    model = write_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "r.json"
    rc = kse.main(["--model", str(model), "--dtype", "float32", "--kv-cache-dtypes", "auto,fp8",
                   "--kv-cache-memory", "48KiB", "--max-model-len", "48", "--num-prompts", "6",
                   "--input-len", "16", "--output-len", "20", "--rounds", "1", "--admission", "both",
                   "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    labels = [r["kv_cache_dtype"] for r in data["runs"]]
    assert labels == ["auto (reserve)", "fp8 (reserve)", "auto (watermark)", "fp8 (watermark)"]
    runs = {r["kv_cache_dtype"]: r for r in data["runs"]}
    assert all(r["output_tokens"] == 6 * 20 for r in runs.values())
    assert runs["auto (reserve)"]["preemptions"] <= runs["auto (watermark)"]["preemptions"]
    assert [(x["round"], x["kv_cache_dtype"]) for x in data["ratios"]] == [(1, "fp8 (reserve)"), (1, "fp8 (watermark)")]
    assert data["ratios"][1]["output"] == pytest.approx(runs["fp8 (watermark)"]["output_tok_s"]
                                                        / runs["auto (watermark)"]["output_tok_s"])
    text = capsys.readouterr().out
    assert "- round 1: auto: reserve / watermark admission: output" in text
