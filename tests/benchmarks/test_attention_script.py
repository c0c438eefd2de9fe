"""benchmarks/attention.py: the baseline options."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest
import torch

from benchmark_scripts import loaded_script

from fp8serve.kernels.cpu_ops import decode_amx_available, decode_bf16_dot_available


def test_baseline_lib_and_rev_are_exclusive(ops, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["attention.py", "--baseline-lib", "/tmp/x.so", "--baseline-rev", "HEAD",
                                      "--no-save"])
    with loaded_script("attention.py") as script, pytest.raises(SystemExit):
        script.main()
    assert "not both" in capsys.readouterr().err


def test_no_save_with_an_output_file_is_a_clear_error(ops, monkeypatch, capsys):
    """--no-save used to drop --output silently: a run meant for a results file wrote none."""
    monkeypatch.setattr(sys, "argv", ["attention.py", "--no-save", "--output", "/tmp/attention_table.md"])
    with loaded_script("attention.py") as script, pytest.raises(SystemExit):
        script.main()
    assert "--no-save writes no file but --output names one (/tmp/attention_table.md)" in capsys.readouterr().err


def test_unknown_revision_is_a_clear_error(ops, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["attention.py", "--baseline-rev", "no-such-revision-xyz", "--no-save"])
    with loaded_script("attention.py") as script, pytest.raises(SystemExit) as excinfo:
        script.main()
    assert "--baseline-rev no-such-revision-xyz: git cannot list fp8serve/kernels/cpu" in str(excinfo.value)


def test_cold_columns_and_ratio_table(ops, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["attention.py", "--batch-sizes", "2", "--context-lens", "40",
                                      "--kv-dtypes", "bfloat16,fp8_e4m3", "--min-time", "0.01", "--repeats", "1",
                                      "--skip-reference", "--no-avx2-column", "--cold-flush-mib", "4",
                                      "--cold-rounds", "2", "--no-save"])
    with loaded_script("attention.py") as script:
        script.main()
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if ln.startswith("| kv dtype | batch"))
    assert "| cold ms | cold GB/s | cold % copy |" in header
    rows = [ln for ln in out.splitlines() if ln.startswith("| bfloat16 | 2 | 40 |") or ln.startswith("| fp8_e4m3 | 2 |")]
    assert len(rows) == 2 and all(float(r.split("|")[9]) > 0 for r in rows)  # cold ms
    lines = out.splitlines()
    for label, rounds in (("kernel time / 16-bit kernel time", 8), ("cold kernel time / 16-bit cold kernel time", 2)):
        title = next(i for i, ln in enumerate(lines) if ln.startswith(f"FP8 {label} (target <= 1)"))
        assert f"({rounds} alternating rounds, medians; ms in brackets)" in lines[title]
        # The paired table's own times, not the per-format rows': ratio == fp8 ms / bf16 ms.
        cell = next(ln for ln in lines[title:] if ln.startswith("| 2 | 40 |")).split("|")[3].strip()
        ratio, fp8_ms, bf16_ms = re.fullmatch(r"([\d.]+) \(([\d.]+) / ([\d.]+)\)", cell).groups()
        assert float(fp8_ms) > 0 and float(bf16_ms) > 0
        assert float(ratio) == pytest.approx(float(fp8_ms) / float(bf16_ms), abs=0.01, rel=0.002 / float(bf16_ms))


def test_paired_format_times_alternate_the_formats(ops, monkeypatch):
    """Each format of a cell is timed in every round, the order reversed every
    other round (a slow stretch weighs on both formats)."""
    with loaded_script("attention.py") as script:
        calls = []
        monkeypatch.setattr(script, "best_time", lambda fn, *a: calls.append(("hot", fn.__self__.kv_dtype)) or 1e-3)
        monkeypatch.setattr(script, "time_cold",
                            lambda cases, flush, rounds: calls.append(("cold", cases[0].kv_dtype)) or 2e-3)
        args = SimpleNamespace(block_size=16, num_kv_heads=1, head_size=64, num_heads=2,
                               query_dtype=torch.float32, min_time=0.01, baseline_rounds=3, cold_rounds=2)
        hot, cold = script.paired_format_times(args, ["fp8_e4m3", "bfloat16"], 2, 40, torch.ones(16))
    assert hot == {"fp8_e4m3": 1e-3, "bfloat16": 1e-3} and cold == {"fp8_e4m3": 2e-3, "bfloat16": 2e-3}
    assert calls == [("hot", "fp8_e4m3"), ("hot", "bfloat16"), ("hot", "bfloat16"), ("hot", "fp8_e4m3"),
                     ("hot", "fp8_e4m3"), ("hot", "bfloat16"), ("cold", "fp8_e4m3"), ("cold", "bfloat16"),
                     ("cold", "bfloat16"), ("cold", "fp8_e4m3")]


@pytest.mark.parametrize("bad, message", [(["--cold-flush-mib", "-1"], "--cold-flush-mib must be >= 0, got -1"),
                                          (["--cold-rounds", "0"], "--cold-rounds must be >= 1, got 0"),
                                          (["--baseline-rounds", "0"], "--baseline-rounds must be >= 1, got 0")])
def test_rejects_bad_cold_arguments(bad, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["attention.py", *bad, "--no-save"])
    with loaded_script("attention.py") as script, pytest.raises(SystemExit):
        script.main()
    assert message in capsys.readouterr().err


def test_bf16_query_times_the_bf16_tiles_against_the_float32_tiles(ops, monkeypatch, capsys):
    """--query-dtype bfloat16: the engine's bf16-compute decode (a bf16 query;
    FP8 caches on the AMX tiles, else the bf16 dot-product tiles, where built)
    with the float32 tiles as the baseline column."""
    monkeypatch.setattr(sys, "argv", ["attention.py", "--batch-sizes", "2", "--context-lens", "40",
                                      "--kv-dtypes", "bfloat16,fp8_e4m3", "--min-time", "0.01", "--repeats", "1",
                                      "--skip-reference", "--cold-flush-mib", "0", "--query-dtype", "bfloat16",
                                      "--no-save"])
    with loaded_script("attention.py") as script:
        script.main()
        op_name = script.bf16_query_op_name()
    out = capsys.readouterr().out
    assert "bf16 query" in out
    tiles = ("the AMX tiles" if decode_amx_available() else "the bf16 dot-product tiles"
             if decode_bf16_dot_available() else "the float32 tiles")
    assert f"FP8 caches take {tiles}" in out
    assert op_name == ("paged_attention_decode_amx" if decode_amx_available() else
                                          "paged_attention_decode_bf16dot" if decode_bf16_dot_available() else
                                          "paged_attention_decode")
    header = next(ln for ln in out.splitlines() if ln.startswith("| kv dtype | batch"))
    assert "| float32 tiles ms | speedup |" in header
    rows = [ln for ln in out.splitlines() if ln.startswith(("| bfloat16 | 2 | 40 |", "| fp8_e4m3 | 2 | 40 |"))]
    assert len(rows) == 2 and all(float(r.split("|")[5]) > 0 and float(r.split("|")[9]) > 0 for r in rows)


def test_a_baseline_gets_cold_columns_timed_alternately(ops, monkeypatch, capsys):
    """With a baseline and cold passes, the baseline's cold time and the cold
    speedup get their own columns (the float32-tiles baseline of a bf16 query
    stands in for --baseline-rev, which would build a kernel)."""
    monkeypatch.setattr(sys, "argv", ["attention.py", "--batch-sizes", "2", "--context-lens", "40",
                                      "--kv-dtypes", "fp8_e4m3", "--min-time", "0.01", "--repeats", "1",
                                      "--skip-reference", "--cold-flush-mib", "4", "--cold-rounds", "2",
                                      "--query-dtype", "bfloat16", "--no-save"])
    with loaded_script("attention.py") as script:
        script.main()
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if ln.startswith("| kv dtype | batch"))
    assert "| cold ms | cold GB/s | cold % copy | float32 tiles ms | speedup | cold float32 tiles ms | cold speedup |" \
        in header
    row = next(ln for ln in out.splitlines() if ln.startswith("| fp8_e4m3 | 2 | 40 |")).split("|")
    cold, cold_base, cold_speedup = float(row[9]), float(row[14]), row[15].strip()
    assert cold > 0 and cold_base > 0
    # The ratio of the unrounded times; the ms columns are rounded to 1 us.
    assert cold_speedup.endswith("x") and float(cold_speedup[:-1]) == pytest.approx(cold_base / cold, abs=0.01,
                                                                                    rel=0.002 / cold)


def test_rejects_an_unknown_query_dtype(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["attention.py", "--query-dtype", "float16", "--no-save"])
    with loaded_script("attention.py") as script, pytest.raises(SystemExit):
        script.main()
    assert "--query-dtype: invalid choice: 'float16'" in capsys.readouterr().err


def test_plan_columns_time_the_engine_call_path(ops, monkeypatch, capsys):
    """The plan columns: the op called from a decode plan (C++, the fused
    entry), hot and cold, after their output was checked against the Python
    call's; --plan-steps 0 leaves them out."""
    argv = ["attention.py", "--batch-sizes", "2", "--context-lens", "40", "--kv-dtypes", "fp8_e4m3",
            "--min-time", "0.01", "--repeats", "1", "--skip-reference", "--no-avx2-column",
            "--cold-flush-mib", "4", "--cold-rounds", "2", "--plan-steps", "3", "--no-save"]
    monkeypatch.setattr(sys, "argv", argv)
    with loaded_script("attention.py") as script:
        script.main()
    out = capsys.readouterr().out
    assert "3 calls per plan run" in out
    header = next(ln for ln in out.splitlines() if ln.startswith("| kv dtype | batch")).split("|")
    row = next(ln for ln in out.splitlines() if ln.startswith("| fp8_e4m3 | 2 | 40 |")).split("|")
    assert len(row) == len(header)
    cells = {h.strip(): v.strip() for h, v in zip(header, row)}
    assert float(cells["plan ms"]) > 0 and float(cells["plan GB/s"]) > 0 and float(cells["cold plan ms"]) > 0
    assert cells["plan % copy"].endswith("%") and cells["cold plan % copy"].endswith("%")

    monkeypatch.setattr(sys, "argv", [*argv[:-2], "0", "--no-save"])
    with loaded_script("attention.py") as script:
        script.main()
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if ln.startswith("| kv dtype | batch"))
    assert "plan" not in header and "calls per plan run" not in out


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "bfloat16"])
def test_plan_output_matches_the_op_and_a_miswired_plan_fails(ops, kv_dtype, query_dtype):
    """check_plan_output passes for the plan as built and stops the script when
    the plan's step gets K and V swapped (what a wrong argument order would do;
    the Python call keeps reading them right)."""
    with loaded_script("attention.py") as script:
        args = SimpleNamespace(block_size=16, num_kv_heads=3, head_size=64, num_heads=9, query_dtype=query_dtype)
        case = script.DecodeCase(args, kv_dtype, 3, 75, seed=7)
        script.check_plan_output(case)
        assert script.attention_plan([case], repeat=2).num_steps() == 2
        case.k_cache, case.v_cache = case.v_cache, case.k_cache
        with pytest.raises(SystemExit, match="decode plan's attention output differs from the op's"):
            script.check_plan_output(case)


def test_rejects_negative_plan_steps(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["attention.py", "--plan-steps", "-1", "--no-save"])
    with loaded_script("attention.py") as script, pytest.raises(SystemExit):
        script.main()
    assert "--plan-steps must be >= 0, got -1" in capsys.readouterr().err
