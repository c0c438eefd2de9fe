#!/usr/bin/env python
"""What a new decode batch size costs: recorded decode forwards compiled per size, or shared.

The engine replays recorded decode forwards (fp8serve/engine/decode_capture.py). A batch size's
first decode step records the forward and, unless an earlier size's compiled replay fits it
(`DecodeCaptures.share_compiled`, the default), compiles its own (TorchScript, ~0.13-0.2 s on the
default model). A serving batch changes size with every admission, finish and preemption, and a
run's drain walks down through every size.

Workload: --num-prompts requests of --input-len random token ids added at once, greedy, ignore_eos,
the i-th with max_tokens = --first-output + i * --steps-per-size, so the batch drains from
--num-prompts to 1 and each size lives --steps-per-size decode steps. Two engines in one process
(same model and KV cache dtype), one sharing compiled replays and one compiling every size,
run the drain in interleaved rounds; before every run the engine forgets its recordings, as a
fresh server would start. Reported per run: the decode seconds of the drain, the median first step
at a new size and the median of the other decode steps, compiles, the growth of the process's
resident memory over the run, and the shared / per-size ratio of drain time in each round. For a
clean memory figure run one engine per process (`--engines shared`, then `--engines per-size`):
with both in one process, memory freed by one engine's reset may be reused by the other.

    .venv/bin/python benchmarks/decode_capture.py                 # default model, bf16, FP8 KV
    .venv/bin/python benchmarks/decode_capture.py --num-prompts 4 --rounds 1   # smoke
    .venv/bin/python benchmarks/decode_capture.py --engines per-size --num-prompts 48 --steps-per-size 2 --rounds 1
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time

import torch
from bench_common import print_header, require_positive


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def drain(engine, prompts: list[list[int]], first_output: int, steps_per_size: int) -> dict:
    from fp8serve import SamplingParams

    captures = engine.model_runner.decode_captures
    captures.reset()
    gc.collect()
    rss0 = resident_mib()
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0.0, max_tokens=first_output + i * steps_per_size, ignore_eos=True)
        engine.add_request(None, {"prompt_token_ids": p}, sp)
    first, other, decode_s = [], [], 0.0
    seen: set[int] = set()
    while engine.has_unfinished_requests():
        prefill = bool(engine.scheduler.waiting)
        n = len(engine.scheduler.running)
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if prefill:
            continue
        decode_s += dt
        (other if n in seen else first).append(dt)
        seen.add(n)
    gc.collect()
    return {"rss_mib": resident_mib() - rss0, "decode_s": decode_s, "first_ms": 1e3 * statistics.median(first), "other_ms": 1e3 * statistics.median(other),
            "sizes": len(first), "compiled": captures.num_compiled, "replays": captures.num_replays}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--first-output", type=int, default=8)
    ap.add_argument("--steps-per-size", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", default="shared,per-size", help="comma-separated: shared, per-size")
    args = ap.parse_args(argv)
    labels = [x.strip() for x in args.engines.split(",") if x.strip()]
    if not labels or any(x not in ("shared", "per-size") for x in labels):
        ap.error(f"--engines takes shared and/or per-size, got {args.engines!r}")
    require_positive(ap, args, "num_prompts", "input_len", "first_output", "steps_per_size", "rounds")

    from fp8serve import LLM

    print_header("New decode batch sizes: compiled per size vs shared", argv)
    engines = {}
    for label in labels:
        share = label == "shared"
        llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, seed=args.seed,
                  max_num_seqs=max(args.num_prompts, 1))
        llm.llm_engine.model_runner.decode_captures.share_compiled = share
        engines[label] = llm.llm_engine
    vocab = engines[labels[0]].model_runner.config.model_config.arch.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    print(f"- {args.num_prompts} requests x {args.input_len} prompt tokens, max_tokens {args.first_output} + "
          f"i x {args.steps_per_size}: the batch drains {args.num_prompts} -> 1; torch threads {torch.get_num_threads()}\n")
    for e in engines.values():  # warm-up: kernel builds, first allocations
        drain(e, prompts[:2], 2, 2)

    head = ["round", "engine", "decode s", "first step at a new size ms (median)", "other decode steps ms (median)",
            "sizes", "compiled", "RSS growth MiB"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    ratios = []
    for rnd in range(1, args.rounds + 1):
        res = {}
        for label, e in engines.items():
            r = res[label] = drain(e, prompts, args.first_output, args.steps_per_size)
            print(f"| {rnd} | {label} | {r['decode_s']:.2f} | {r['first_ms']:.1f} | {r['other_ms']:.1f} | {r['sizes']} | "
                  f"{r['compiled']} | {r['rss_mib']:.0f} |", flush=True)
        if len(res) == 2:
            ratios.append(res["per-size"]["decode_s"] / res["shared"]["decode_s"])
    if ratios:
        print("\nper-size / shared decode seconds by round: " + ", ".join(f"{x:.2f}x" for x in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
