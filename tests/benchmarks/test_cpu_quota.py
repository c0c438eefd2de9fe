"""benchmarks/cpu_quota.py: the child that times decode steps (the cgroup part needs root and is run by hand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmark_scripts import BENCHMARKS_DIR
from checkpoints import write_tiny_llama


def test_child_times_decode_steps_of_a_real_engine(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny")
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS_DIR / "cpu_quota.py"), "--child", "--model", str(model), "--batch", "2",
         "--prompt-len", "12", "--steps", "3", "--warmup", "1", "--dtype", "float32"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["threads"] == 1  # OMP_NUM_THREADS wins over the engine's own choice
    assert len(res["step_s"]) == 3 and all(t > 0 for t in res["step_s"])


def test_counts_must_be_positive():
    for args, message in ((["--rounds", "0"], "--rounds must be > 0"), (["--quota", "-1"], "--quota must be > 0"),
                          (["--warmup", "-1"], "--warmup must be >= 0")):
        out = subprocess.run([sys.executable, str(BENCHMARKS_DIR / "cpu_quota.py"), *args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr[-500:])
