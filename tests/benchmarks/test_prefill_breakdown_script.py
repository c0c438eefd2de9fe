"""benchmarks/prefill_breakdown.py on a tiny checkpoint: each cell prefills in one step, the GEMMs
timed inside the step are the model's own linear calls (4 per layer, shapes from the checkpoint),
the linear FLOPs count the checkpoint's linear weights, the C++ ops timed in the step are the
model's own (one activation and one cache write per layer) and add up to their column, and bad
arguments are rejected."""

from __future__ import annotations

import pytest
import torch

from benchmark_scripts import loaded_script
from checkpoints import write_tiny_llama


def _table_rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines()
            if ln.startswith("| ") and "x" in ln.split("|")[1] and not ln.startswith("| cell")]


def _rows(out: str) -> dict[str, list[str]]:
    """The main table's rows (13 columns) by cell."""
    return {r[0]: r for r in _table_rows(out) if len(r) == 13}


def _op_rows(out: str) -> dict[str, dict[str, tuple[float, int]]]:
    """The per-op table: cell -> op -> (ms, calls)."""
    ops: dict[str, dict[str, tuple[float, int]]] = {}
    for r in _table_rows(out):
        if len(r) == 4:
            ops.setdefault(r[0], {})[r[1]] = (float(r[2]), int(r[3]))
    return ops


def test_tiny_run(ops, tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny")
    out_file = tmp_path / "table.md"
    with loaded_script("prefill_breakdown.py") as script:
        assert script.main(["--model", str(model), "--dtype", "float32", "--cells", "1x40,3x24",
                            "--warmup", "1", "--repeats", "2", "--output", str(out_file)]) == 0
        # build_tiny_llama: 2 layers, hidden 64, 4 heads / 2 KV heads of 16, intermediate 128.
        per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 2 * 128 + 128 * 64
        from fp8serve import LLM

        llm = LLM(model=str(model), dtype="float32", max_model_len=64, device="cpu", seed=0)
        assert script.linear_params(llm.llm_engine.model_runner.model) == 2 * per_layer
    out = capsys.readouterr().out
    assert out_file.read_text().strip() == out.strip()
    rows = _rows(out)
    assert set(rows) == {"1x40", "3x24"}
    for cell, tokens in (("1x40", 40), ("3x24", 72)):
        r = rows[cell]
        assert int(r[1]) == tokens
        step_ms, gflops = float(r[2]), float(r[4])
        assert step_ms > 0
        # linear GFLOP/s is 2 x tokens x linear weights over the step time, as printed.
        assert gflops == pytest.approx(2 * tokens * 2 * per_layer / (step_ms / 1e3) / 1e9, rel=0.05, abs=1)
        assert int(r[5]) == 2 * 4  # qkv, o, gate_up, down per layer, all through the GEMM path here
        gemm_ms, alone_ms = float(r[6]), float(r[8])
        assert 0 < gemm_ms < step_ms and alone_ms > 0
        assert float(r[10]) == pytest.approx(step_ms - gemm_ms, abs=0.15)
        ops_ms, outside_ms = float(r[11]), float(r[12])
        assert 0 < ops_ms < step_ms - gemm_ms
        assert outside_ms == pytest.approx(step_ms - gemm_ms - ops_ms, abs=0.15)
        per_op = _op_rows(out)[cell]
        # Two layers: one SiLU-and-mul and one cache write each, per step.
        assert per_op["silu_and_mul"][1] == 2 and per_op["reshape_and_cache"][1] == 2
        assert all(ms >= 0 for ms, _ in per_op.values())
        # With 2 timed steps a median is a mean, so the per-op medians add up to the column's.
        assert sum(ms for ms, _ in per_op.values()) == pytest.approx(ops_ms, abs=0.05 + 0.005 * len(per_op))


def test_replay_alone_runs_the_recorded_calls(ops, monkeypatch):
    with loaded_script("prefill_breakdown.py") as script:
        from fp8serve.kernels import onednn_linear

        w1, w2 = torch.randn(8, 4), torch.randn(3, 8)
        seen = []
        inner = onednn_linear.linear
        monkeypatch.setattr(onednn_linear, "linear",
                            lambda x, w, b=None, packed=None: seen.append((tuple(x.shape), w)) or inner(x, w, b))
        calls = [((5, 4), torch.float32, w1, None, None), ((5, 8), torch.float32, w2, None, None)]
        assert script.replay_alone(calls, repeats=3) > 0
        # one warm-up and three timed passes, each the calls in order on their own weights
        assert [(s, w is w1) for s, w in seen] == [((5, 4), True), ((5, 8), False)] * 4


@pytest.mark.parametrize("bad, message", [
    (["--cells", "1x0"], "--cells: sequences and tokens must be >= 1"),
    (["--cells", "512"], "--cells takes comma-separated SEQSxTOKENS"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--output", "/nonexistent-dir/table.md"], "--output: directory /nonexistent-dir does not exist"),
])
def test_bad_arguments(bad, message, capsys):
    with loaded_script("prefill_breakdown.py") as script, pytest.raises(SystemExit):
        script.main(bad)
    assert message in capsys.readouterr().err
