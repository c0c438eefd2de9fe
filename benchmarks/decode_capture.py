#!/usr/bin/env python
"""What a new decode batch size costs: recorded decode forwards compiled per size, or shared.

The engine replays recorded decode forwards (fp8serve/engine/decode_capture.py). One decode step of
each batch size (its fifth, and none of a fresh engine's first 64: DecodeCaptures.record_after and
first_record_after) records the forward and, unless an earlier size's compiled replay fits it
(`DecodeCaptures.share_compiled`, the default), compiles its own (TorchScript, ~0.13-0.2 s on the
default model). A serving batch changes size with every admission, finish and preemption, and a
run's drain walks down through every size. The engine replays batches of up to 8 as static plans
(no compile: fp8serve/engine/static_plan.py); the engines here take the compiled replay at every
size, since compiling is what this script measures.

Workload: --num-prompts requests of --input-len random token ids added at once, greedy, ignore_eos,
the i-th with max_tokens = --first-output + i * --steps-per-size, so the batch drains from
--num-prompts to 1 and each size lives --steps-per-size decode steps. The engines of --engines (by
default two: one sharing compiled replays, one compiling every size) live in one process (same
model and KV cache dtype) and run the drain in interleaved rounds; before every run an engine
forgets its recordings, as a fresh server would start. Reported per run: the decode seconds of the
drain, the median first and second step at a new size (a size is recorded after record_after eager
steps, and nothing before the engine's first_record_after: the engine's defaults, or --engines'
:rN and :fM), the median of the other decode steps, sizes recorded and compiled, the growth of the
process's resident memory over the run, and each engine's ratio of drain time to the first one's
in each round (the order of the engines alternates between rounds). For a clean memory figure run
one engine per process (`--engines shared`, then `--engines per-size`): with both in one process,
memory freed by one engine's reset may be reused by the other.

    .venv/bin/python benchmarks/decode_capture.py                 # default model, bf16, FP8 KV, engine defaults
    .venv/bin/python benchmarks/decode_capture.py --num-prompts 4 --rounds 1   # smoke
    .venv/bin/python benchmarks/decode_capture.py --engines per-size --num-prompts 48 --steps-per-size 2 --rounds 1
    .venv/bin/python benchmarks/decode_capture.py --engines shared:r0:f0,shared --steps-per-size 1   # first use / defaults
"""

from __future__ import annotations

import argparse
import gc
import random
import re
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
    first, second, other, decode_s = [], [], [], 0.0
    seen: dict[int, int] = {}
    while engine.has_unfinished_requests():
        prefill = bool(engine.scheduler.waiting)
        n = len(engine.scheduler.running)
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if prefill:
            continue
        decode_s += dt
        (first, second, other)[min(seen.get(n, 0), 2)].append(dt)
        seen[n] = seen.get(n, 0) + 1
    gc.collect()

    def median_ms(xs: list[float]) -> float:
        return 1e3 * statistics.median(xs) if xs else float("nan")

    return {"rss_mib": resident_mib() - rss0, "decode_s": decode_s, "first_ms": median_ms(first),
            "second_ms": median_ms(second), "other_ms": median_ms(other), "sizes": len(first),
            "recorded": len(captures.recorded_batch_sizes), "compiled": captures.num_compiled,
            "replays": captures.num_replays}


def parse_engine(spec: str) -> tuple[bool, int | None, int | None]:
    """'shared' | 'per-size', optionally ':rN' (N eager steps before a size is recorded) and ':fM' (M eager
    steps before the engine's first recording); the engine's defaults where not given -> (share compiled
    forwards, record_after, first_record_after)."""
    m = re.fullmatch(r"(shared|per-size)(?::r(\d+))?(?::f(\d+))?", spec)
    if not m:
        raise ValueError("an engine is shared or per-size, optionally with :rN and :fM (e.g. shared:r0:f0), "
                         f"got {spec!r}")
    return m.group(1) == "shared", *(int(g) if g is not None else None for g in m.groups()[1:])


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
    ap.add_argument("--engines", default="shared,per-size",
                    help="comma-separated: shared | per-size, each optionally :rN, the eager steps a batch size "
                         "runs before it is recorded (DecodeCaptures.record_after), and :fM, the eager steps "
                         "before the engine's first recording (first_record_after); shared:r0:f0 records "
                         "every size at first use")
    args = ap.parse_args(argv)
    labels = [x.strip() for x in args.engines.split(",") if x.strip()]
    try:
        variants = {label: parse_engine(label) for label in labels}
    except ValueError as e:
        ap.error(str(e))
    if not labels or len(variants) != len(labels):
        ap.error(f"--engines takes distinct engines, got {args.engines!r}")
    require_positive(ap, args, "num_prompts", "input_len", "first_output", "steps_per_size", "rounds")

    from fp8serve import LLM

    print_header("New decode batch sizes: compiled per size vs shared", argv)
    engines = {}
    for label, (share, record_after, first_record_after) in variants.items():
        llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, seed=args.seed,
                  max_num_seqs=max(args.num_prompts, 1))
        captures = llm.llm_engine.model_runner.decode_captures
        captures.share_compiled = share
        # What this script measures is compiling: every size takes the compiled replay, not the
        # static plans the engine uses for batches of up to 8 (benchmarks/static_plan.py).
        captures.static_plans = False
        if record_after is not None:
            captures.record_after = record_after
        if first_record_after is not None:
            captures.first_record_after = first_record_after
        engines[label] = llm.llm_engine
    vocab = engines[labels[0]].model_runner.config.model_config.arch.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    print(f"- {args.num_prompts} requests x {args.input_len} prompt tokens, max_tokens {args.first_output} + "
          f"i x {args.steps_per_size}: the batch drains {args.num_prompts} -> 1; torch threads {torch.get_num_threads()}\n")
    for e in engines.values():  # warm-up: kernel builds, first allocations
        drain(e, prompts[:2], 2, 2)

    head = ["round", "engine", "decode s", "first step at a new size ms (median)", "second ms (median)",
            "other decode steps ms (median)", "sizes", "recorded", "compiled", "RSS growth MiB"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    ratios = []
    for rnd in range(1, args.rounds + 1):
        res = {}
        for label, e in engines.items():
            r = res[label] = drain(e, prompts, args.first_output, args.steps_per_size)
            print(f"| {rnd} | {label} | {r['decode_s']:.2f} | {r['first_ms']:.1f} | {r['second_ms']:.1f} | "
                  f"{r['other_ms']:.1f} | {r['sizes']} | {r['recorded']} | {r['compiled']} | {r['rss_mib']:.0f} |",
                  flush=True)
        if len(res) > 1:
            ratios.append({label: r["decode_s"] / res[labels[0]]["decode_s"] for label, r in res.items()})
        engines = dict(reversed(engines.items()))  # ABBA: the other order next round
    for label in labels[1:] if ratios else ():
        print(f"\n{label} / {labels[0]} decode seconds by round: " + ", ".join(f"{r[label]:.2f}x" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
