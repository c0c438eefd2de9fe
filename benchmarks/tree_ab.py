#!/usr/bin/env python
"""This tree against a git revision, whole: engine decode steps of each, in
processes that alternate.

kernel_ab_engine.py swaps one op inside one process; a change of Python, of
several kernels, of the scheduler or of how the engine loads its weights
needs the whole tree of each side. This script unpacks --baseline-rev's files
(`git archive`; the repository itself is not touched) into the fp8serve cache
directory, tree_ab/COMMIT, kept for the next run, so that snapshot's kernels
(the engine's own build, keyed by their sources and where they are) are built
once per commit, and then runs --rounds processes per side, in the order AB BA
AB ..., each importing fp8serve from its side's tree. A process builds one engine per
--batch-sizes entry, generates once untimed (the engine records its decode
forward for that batch), then times --repeats generations of --tokens + 2
greedy tokens for a batch of --prompt-len-token prompts (windows of the
built-in calibration text); a generation's time is the median of its steps
that decode the whole batch. The table gives, per batch size, the median
over each side's processes of their medians, the ratio, in how many process
pairs this tree was faster, whether both sides generated the same tokens
(a numerics change may alter them; not required; if not, the first request
and token where they part), and whether each side's own processes did (if
not, the comparison of tokens means nothing; '-' with one process a side).
Directories that killed runs left half unpacked in tree_ab/ are removed once
an hour old.

A process per measurement, not two engines in one: each side imports its own
fp8serve. The processes run one after the other, never at once.

    .venv/bin/python benchmarks/tree_ab.py --baseline-rev HEAD~3
    .venv/bin/python benchmarks/tree_ab.py --baseline-rev HEAD~1 --kv-cache-dtype fp8 --batch-sizes 16,64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    check_engine_args, command_line, describe_machine, emit_table, machine_info, parse_sizes, require_positive,
)

REPO = Path(__file__).resolve().parent.parent
CHILD_FLAG = "--child"
STALE_UNPACKING_S = 3600.0  # a snapshot unpacks in seconds; one this old was left by a killed run


def child(args, batch_sizes: list[int]) -> None:
    """One process's measurements, printed as one JSON line: {batch: [median ms, tokens]}."""
    import random

    import torch

    from bench_common import record_as_a_warm_engine, time_greedy_decode, token_source
    from fp8serve import LLM

    torch.set_grad_enabled(False)
    kwargs = {"kv_cache_memory": args.kv_cache_memory, "kv_cache_dtype": args.kv_cache_dtype, "dtype": args.dtype}
    if args.model:
        kwargs["model"] = args.model
    result = {}
    for batch in batch_sizes:
        llm = LLM(**kwargs)
        engine = llm.llm_engine
        record_as_a_warm_engine(engine)
        draw, rng = token_source(engine, "text"), random.Random(batch)
        prompts = [draw(args.prompt_len, rng) for _ in range(batch)]
        time_greedy_decode(engine, prompts, args.tokens)  # untimed: records this batch size's decode forward
        runs = [time_greedy_decode(engine, prompts, args.tokens) for _ in range(args.repeats)]
        result[batch] = [statistics.median(s for s, _ in runs) * 1e3, runs[-1][1]]
        del llm, engine
    print(json.dumps({"fp8serve": __import__("fp8serve").__file__, "steps": result}))


def run_side(tree: Path, argv: list[str]) -> dict:
    """Runs this script's child mode with `tree`'s fp8serve; its JSON result."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), CHILD_FLAG, *argv], cwd=tree, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise SystemExit(f"the measuring process for {tree} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if Path(result["fp8serve"]).resolve().parent.parent != tree.resolve():
        raise SystemExit(f"the measuring process for {tree} imported {result['fp8serve']}, not that tree's fp8serve")
    return result["steps"]


def snapshot(commit: str) -> Path:
    """The files of `commit` under the fp8serve cache directory (tree_ab/COMMIT), unpacked once:
    a later run finds them, and the kernels built there, as they were."""
    from fp8serve.default_model import cache_dir

    root = cache_dir() / "tree_ab"
    tree = root / commit
    if root.is_dir():
        remove_stale_unpacking(root)
    if (tree / ".complete").is_file():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{commit[:12]}_", dir=root))
    try:
        archive = tmp / "tree.tar"
        with open(archive, "wb") as f:
            done = subprocess.run(["git", "archive", "--format=tar", commit], cwd=REPO, stdout=f,
                                  stderr=subprocess.PIPE, text=False)
        if done.returncode != 0:
            raise SystemExit(f"git archive {commit} failed: {done.stderr.decode().strip()}")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp / "tree", filter="data")
        (tmp / "tree" / ".complete").touch()
        shutil.rmtree(tree, ignore_errors=True)  # one without its marker: damaged or emptied by hand
        (tmp / "tree").rename(tree)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tree


def remove_stale_unpacking(root: Path, max_age_s: float = STALE_UNPACKING_S) -> list[Path]:
    """Removes what killed runs left half unpacked under `root` (`.COMMIT_*` directories older than
    `max_age_s`); younger ones may belong to a run unpacking now. Returns what it removed."""
    now, removed = time.time(), []
    for leftover in root.glob(".*_*"):
        try:
            old = leftover.is_dir() and now - leftover.stat().st_mtime > max_age_s
        except FileNotFoundError:  # another run finished with it just now
            continue
        if old:
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    return removed


def first_difference(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """Whether two sides' tokens agree, and if not where they part: 'False (request R, token T)'
    for the first request that differs and the first token of it that does."""
    for r, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"False (request {r}, token {t})"
    return "True" if len(ours) == len(theirs) else f"False ({len(ours)} requests against {len(theirs)})"


def processes_agree(tokens_by_side: list[list[list[list[int]]]]) -> str:
    """Whether each side's processes generated the same tokens as that side's first: what makes
    "same tokens" mean anything (a side whose own runs disagree is not deterministic). With one
    process a side there is nothing to compare: '-'."""
    if all(len(runs) < 2 for runs in tokens_by_side):
        return "- (one process a side)"
    return str(all(run == runs[0] for runs in tokens_by_side for run in runs))


def build_kernels(tree: Path) -> None:
    """Builds (or finds) `tree`'s C++ kernels before anything is timed."""
    if os.environ.get("FP8SERVE_DISABLE_CPU_KERNELS"):
        return  # both sides run the PyTorch reference path; the table says so
    env = dict(os.environ, PYTHONPATH=str(tree))
    code = "from fp8serve.kernels import cpu_ops; import sys; sys.exit(0 if cpu_ops.load_cpu_ops() else 3)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout or "").strip().splitlines()
        raise SystemExit(f"{tree}: its C++ kernels did not build or load (exit {proc.returncode})"
                         + (f": {last[-1]}" if last else ""))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-rev", help="git revision of the baseline tree (required)")
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in default model)")
    p.add_argument("--dtype", default="auto", help="compute dtype of both sides (as the engine's --dtype)")
    p.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype of both sides (auto, fp8, ...)")
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV cache of each engine (e.g. 256MiB)")
    p.add_argument("--batch-sizes", default="1,16", help="comma-separated decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--tokens", type=int, default=64, help="decode steps per generation")
    p.add_argument("--repeats", type=int, default=3, help="timed generations per process and batch size (median)")
    p.add_argument("--rounds", type=int, default=3, help="processes per side, alternating AB BA AB ...")
    p.add_argument("--output", type=Path, default=None, help="also write the table (markdown) here")
    p.add_argument(CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    require_positive(p, args, "prompt_len", "tokens", "repeats", "rounds")
    batch_sizes = parse_sizes(p, "--batch-sizes", args.batch_sizes)
    check_engine_args(p, args)
    if args.child:
        child(args, batch_sizes)
        return
    if not args.baseline_rev:
        p.error("--baseline-rev is required (the git revision to compare this tree with)")
    resolved = subprocess.run(["git", "rev-parse", "--verify", f"{args.baseline_rev}^{{commit}}"], cwd=REPO,
                              capture_output=True, text=True)
    if resolved.returncode != 0:
        p.error(f"--baseline-rev {args.baseline_rev}: not a commit of {REPO} ({resolved.stderr.strip()})")
    commit = resolved.stdout.strip()
    # What each measuring process is told: the workload, not where to write the table.
    child_argv = ["--dtype", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype, "--kv-cache-memory",
                  args.kv_cache_memory, "--batch-sizes", args.batch_sizes, "--prompt-len", str(args.prompt_len),
                  "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
    if args.model:
        child_argv += ["--model", str(Path(args.model).resolve())]  # the processes run in the trees' directories

    sides = {"this tree": REPO, args.baseline_rev: snapshot(commit)}
    for name, tree in sides.items():
        print(f"building (or finding) the C++ kernels of {name} ({tree}) ...", file=sys.stderr, flush=True)
        build_kernels(tree)
    results: dict[str, list[dict]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            print(f"round {r + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
            results[name].append(run_side(sides[name], child_argv))

    base = args.baseline_rev
    lines = [
        f"# This tree vs {base} ({commit[:12]}): engine decode steps, whole trees",
        "",
        f"Command: `{command_line()}`",
        "",
        *describe_machine(machine_info()),
        f"- model: {args.model or 'the built-in default model'}; --dtype {args.dtype}; KV cache {args.kv_cache_dtype}; "
        f"prompts of {args.prompt_len} tokens, {args.tokens + 2} greedy tokens per generation; per process and batch "
        f"size the median of {args.repeats} generations' medians of the steps that decode the whole batch; "
        f"{args.rounds} processes per side, alternating; baseline files: {sides[base]}"
        + ("; C++ kernels off (FP8SERVE_DISABLE_CPU_KERNELS): both sides run the PyTorch reference path"
           if os.environ.get("FP8SERVE_DISABLE_CPU_KERNELS") else ""),
        "",
        f"| batch | this tree ms / step | {base} ms / step | speedup ({base} / this tree) | this tree faster | "
        "same tokens | each side's processes agree |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in batch_sizes:
        ours = [res[str(b)][0] for res in results["this tree"]]
        theirs = [res[str(b)][0] for res in results[base]]
        # The first pair of processes stands for all: "agree" below says whether the others match it.
        same = first_difference(results["this tree"][0][str(b)][1], results[base][0][str(b)][1])
        mine, other = statistics.median(ours), statistics.median(theirs)
        wins = sum(o < t for o, t in zip(ours, theirs))
        agree = processes_agree([[res[str(b)][1] for res in runs] for runs in results.values()])
        lines.append(f"| {b} | {mine:.2f} | {other:.2f} | {other / mine:.3f}x | {wins} of {args.rounds} | {same} | "
                     f"{agree} |")
    emit_table(lines, args.output)


if __name__ == "__main__":
    main()
