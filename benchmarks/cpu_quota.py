#!/usr/bin/env python
"""Decode steps inside a CPU-quota cgroup (what `docker run --cpus N` or a
Kubernetes CPU limit sets): fp8serve's thread choice against one torch thread
per CPU of the affinity mask (torch's own default, which counts the host).

The parent creates a cgroup with the quota (v1 `cpu.cfs_quota_us`, or v2
`cpu.max`), runs each configuration in a child process placed in that group,
alternating configurations round by round, and removes the group at the end.
Each child loads the default model, adds --batch requests of --prompt-len
random tokens, and times --steps decode steps after a warm-up. Needs root and
a writable cpu controller; says so and exits otherwise.

Example:
  sudo .venv/bin/python benchmarks/cpu_quota.py --quota 1 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import command_line, describe_machine, machine_info, record_as_a_warm_engine

CGROUP_ROOT = Path("/sys/fs/cgroup")


class QuotaGroup:
    """A cgroup with a CPU quota; `add(pid)` moves a process into it."""

    def __init__(self, quota_cpus: float, period_us: int = 100_000) -> None:
        name = f"fp8serve-bench-{os.getpid()}"
        quota_us = int(round(quota_cpus * period_us))
        if (CGROUP_ROOT / "cgroup.controllers").is_file():  # v2
            self.dir = CGROUP_ROOT / name
            self.procs = self.dir / "cgroup.procs"
            self._make()
            self._write(self.dir / "cpu.max", f"{quota_us} {period_us}")
        else:  # v1
            mount = next((CGROUP_ROOT / n for n in ("cpu", "cpu,cpuacct") if (CGROUP_ROOT / n).is_dir()), None)
            if mount is None:
                sys.exit(f"no cgroup cpu controller under {CGROUP_ROOT}: cannot set a CPU quota here")
            self.dir = mount / name
            self.procs = self.dir / "tasks"
            self._make()
            self._write(self.dir / "cpu.cfs_period_us", str(period_us))
            self._write(self.dir / "cpu.cfs_quota_us", str(quota_us))

    def _make(self) -> None:
        try:
            self.dir.mkdir()
        except OSError as e:
            sys.exit(f"cannot create the cgroup {self.dir} ({e.strerror}): this benchmark needs root and a "
                     "writable cgroup cpu controller")

    def _write(self, path: Path, text: str) -> None:
        try:
            path.write_text(text)
        except OSError as e:
            self.remove()
            sys.exit(f"cannot write {text!r} to {path} ({e.strerror})")

    def add(self, pid: int) -> None:
        self.procs.write_text(str(pid))

    def remove(self) -> None:
        try:
            self.dir.rmdir()
        except OSError:
            pass


def child(args) -> None:
    import torch

    from fp8serve import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=256 << 20,
              max_model_len=args.prompt_len + args.warmup + args.steps + 8, seed=0)
    engine = llm.llm_engine
    record_as_a_warm_engine(engine)
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_runner.config.model_config.arch.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=args.warmup + args.steps + 1, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request(None, {"prompt_token_ids": torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()}, sp)
    while engine.scheduler.waiting:
        engine.step()  # prefills
    for _ in range(args.warmup):
        engine.step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    print(json.dumps({"threads": torch.get_num_threads(), "step_s": times}))


def run_child(group: QuotaGroup, args, env_threads: int | None) -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if env_threads is not None:
        env["OMP_NUM_THREADS"] = str(env_threads)
    cmd = [sys.executable, __file__, "--child", "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--dtype", args.dtype,
           *(["--model", args.model] if args.model else []),
           "--kv-cache-dtype", args.kv_cache_dtype]
    # The child joins the group before exec, so torch sees the quota from its first import.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=lambda: group.add(os.getpid()))
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"child exited with {proc.returncode}: {shlex.join(cmd)}")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quota", type=float, default=1.0, help="CPUs' worth of time per period (default 1)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--output", type=Path, help="also write the results (markdown) here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    for name in ("quota", "rounds", "batch", "prompt_len", "steps"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    affinity = len(os.sched_getaffinity(0))
    configs = [("fp8serve default", None), (f"OMP_NUM_THREADS={affinity} (one per CPU of the mask)", affinity)]
    group = QuotaGroup(args.quota)
    results: dict[str, list[dict]] = {c: [] for c, _ in configs}
    try:
        for _ in range(args.rounds):
            for label, env_threads in configs:
                results[label].append(run_child(group, args, env_threads))
    finally:
        group.remove()

    lines = [f"# Decode steps under a {args.quota:g}-CPU quota", "",
             f"Command: `{command_line()}` (cgroup {group.dir}, removed after the run)", ""]
    lines += [f"- {x}" for x in describe_machine(machine_info())]
    lines += [f"- {affinity} CPUs in the affinity mask; the children run inside the cgroup, the parent does not",
              f"- workload: {args.model or 'default model'}, --dtype {args.dtype}, --kv-cache-dtype {args.kv_cache_dtype}, "
              f"{args.batch} requests of {args.prompt_len} tokens, {args.steps} timed decode steps per run "
              f"after {args.warmup}; {args.rounds} rounds, configurations alternating", "",
              "| round | threads | configuration | median step ms | p10 step ms | mean step ms | output tok/s |",
              "|---|---|---|---|---|---|---|"]
    for r in range(args.rounds):
        for label, _ in configs:
            res = results[label][r]
            ts = sorted(res["step_s"])
            mean = statistics.fmean(ts)
            lines.append(f"| {r + 1} | {res['threads']} | {label} | {1e3 * ts[len(ts) // 2]:.2f} | "
                         f"{1e3 * ts[len(ts) // 10]:.2f} | {1e3 * mean:.2f} | {args.batch / mean:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.output:
        args.output.write_text(text)

if __name__ == "__main__":
    main()
