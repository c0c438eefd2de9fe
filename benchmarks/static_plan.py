#!/usr/bin/env python
"""Decode steps replayed as static plans against the compiled (TorchScript) replay, in one process.

The engine replays recorded decode forwards (fp8serve/engine/decode_capture.py). Batches of up to
STATIC_PLAN_MAX_BATCH sequences replay as a static plan (fp8serve/engine/static_plan.py, the C++
DecodePlan: the recorded kernels called on fixed tensors, no views, allocations or TorchScript);
larger ones, and every batch with FP8SERVE_STATIC_PLAN=0, as TorchScript. This script builds two
engines on one checkpoint, "static plan" and "TorchScript" (`DecodeCaptures.static_plans` off),
checks that each batch size is replayed the way its name says, and times greedy decode steps of
both in alternating rounds (ABBA): per batch size, the median decode step of each engine, the
ratio by round, the rounds the static plan won, and whether both produced the same tokens.

    .venv/bin/python benchmarks/static_plan.py                           # default model, batches 1, 2, 4, 8
    .venv/bin/python benchmarks/static_plan.py --model DIR --kv-cache-dtype fp8 --batches 1 --rounds 10
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (command_line, describe_machine, emit_table, machine_info, parse_sizes,  # noqa: E402
                          record_as_a_warm_engine, require_positive, time_greedy_decode, token_source)

ENGINES = ("static plan", "TorchScript")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--kv-cache-memory", default="512MiB", help="KV cache of each engine")
    p.add_argument("--batches", default="1,2,4,8", help="decode batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=64, help="decode steps per generation")
    p.add_argument("--rounds", type=int, default=6, help="ABBA rounds per batch size")
    p.add_argument("--output", type=Path, default=None, help="also write the table (markdown) here")
    args = p.parse_args()
    batches = parse_sizes(p, "--batches", args.batches)
    require_positive(p, args, "prompt_len", "steps", "rounds")

    from fp8serve import LLM
    from fp8serve.engine.decode_capture import STATIC_PLAN_MAX_BATCH
    from fp8serve.kernels import cpu_ops
    from fp8serve.utils.memory import parse_size

    try:
        parse_size(args.kv_cache_memory)
    except ValueError as e:
        p.error(f"--kv-cache-memory: {e}")
    if cpu_ops.load_cpu_ops() is None:
        raise SystemExit("C++ CPU kernels unavailable: no static plans to measure")
    too_big = [b for b in batches if b > STATIC_PLAN_MAX_BATCH]
    if too_big:
        p.error(f"--batches: static plans serve batches of up to {STATIC_PLAN_MAX_BATCH}, got {too_big}")

    kwargs = {"dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "kv_cache_memory": args.kv_cache_memory,
              "max_num_seqs": max(batches)}
    if args.model:
        kwargs["model"] = args.model
    engines = {}
    for name in ENGINES:
        engine = LLM(**kwargs).llm_engine
        record_as_a_warm_engine(engine)
        engine.model_runner.decode_captures.static_plans = name == "static plan"
        engines[name] = engine
    draw = token_source(engines[ENGINES[0]], "text")

    rows = []
    for b in batches:
        rng = random.Random(b)
        prompts = [draw(args.prompt_len, rng) for _ in range(b)]
        for engine in engines.values():  # records this batch size (after record_after eager steps)
            time_greedy_decode(engine, prompts, 8)
        static = engines["static plan"].model_runner.decode_captures
        script = engines["TorchScript"].model_runner.decode_captures
        if b not in static.static_batch_sizes or b in script.static_batch_sizes:
            raise SystemExit(f"batch {b}: static plans {static.static_batch_sizes} / {script.static_batch_sizes}: "
                             "the engines did not replay as named (see the engine log)")
        times = {name: [] for name in ENGINES}
        tokens = {}
        for r in range(args.rounds):
            for name in (ENGINES if r % 2 == 0 else ENGINES[::-1]):
                step, tokens[name] = time_greedy_decode(engines[name], prompts, args.steps)
                times[name].append(step)
        ratios = [t / s for s, t in zip(times["static plan"], times["TorchScript"])]
        rows.append((b, statistics.median(times["static plan"]) * 1e3, statistics.median(times["TorchScript"]) * 1e3,
                     min(ratios), max(ratios), sum(x > 1 for x in ratios),
                     tokens["static plan"] == tokens["TorchScript"]))

    lines = [
        "# Decode steps: static plans vs the TorchScript replay",
        "",
        f"Command: `{command_line()}`",
        "",
        *describe_machine(machine_info()),
        f"- model: {args.model or 'the built-in default model'}; dtype {args.dtype}, KV cache {args.kv_cache_dtype}; "
        f"prompts of {args.prompt_len} tokens (calibration text), {args.steps} greedy decode steps per generation, "
        f"{args.rounds} ABBA rounds per batch size; ms: median of the steps that decode the whole batch, median "
        "over rounds",
        "",
        "| batch | static plan ms / step | TorchScript ms / step | speedup (median) | by round min / max | "
        "rounds won | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, s, t, lo, hi, wins, same in rows:
        lines.append(f"| {b} | {s:.2f} | {t:.2f} | {t / s:.3f}x | {lo:.3f} / {hi:.3f} | {wins} of {args.rounds} | "
                     f"{same} |")
    emit_table(lines, args.output)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
