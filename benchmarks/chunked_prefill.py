#!/usr/bin/env python
"""Chunked prefill off and on, side by side, under requests that arrive while others decode.

One engine per configuration in one process (same model, dtype, KV cache dtype and memory):
`off` prefills every admitted prompt whole in a step of its own (the running requests wait);
`chunked:N` runs `--enable-chunked-prefill` with `--max-num-batched-tokens N`. Each run replays
the same arrivals (fixed seed): --num-prompts requests of --input-len prompt tokens (windows of
the built-in calibration text, or random ids with --tokens random) and --output-len output tokens
(greedy, ignore_eos), arriving as a Poisson process of --request-rate per second, like
`fp8serve bench serve` but in-process, so the numbers are the engine's and not HTTP's. Rounds
alternate the order of the configurations (ABBA).

Reported per run, vLLM's serving metrics: time to first token (from arrival), inter-token latency
(between consecutive tokens of one request: mean, p99 and the longest stall), end-to-end latency,
output tok/s over the run; per round each configuration's ratio to `off`.

    .venv/bin/python benchmarks/chunked_prefill.py                       # default model, bf16, FP8 KV
    .venv/bin/python benchmarks/chunked_prefill.py --budgets 256,512,1024 --rounds 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
from bench_common import add_model_args, print_header, record_as_a_warm_engine, require_positive, token_source


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def workload(engine, args, seed: int) -> list[tuple[float, list[int]]]:
    """(arrival offset in seconds, prompt) per request."""
    rng = random.Random(seed)
    draw = token_source(engine, args.tokens)
    t, requests = 0.0, []
    for _ in range(args.num_prompts):
        requests.append((t, draw(args.input_len, rng)))
        t += rng.expovariate(args.request_rate)
    return requests


def replay(engine, requests: list[tuple[float, list[int]]], output_len: int) -> dict:
    """Add each request at its arrival time, step until all finish; per-token timestamps."""
    from fp8serve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    arrival: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    outputs: dict[str, list[int]] = {}
    order: list[str] = []
    i = 0
    steps = 0
    while i < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while i < len(requests) and requests[i][0] <= now:
            rid = engine.add_request(None, {"prompt_token_ids": requests[i][1]}, sp).request_id
            arrival[rid], times[rid] = requests[i][0], []
            order.append(rid)
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[i][0] - now))
            continue
        outs = engine.step()
        steps += 1
        t = time.perf_counter() - start
        for out in outs:
            n = len(out.outputs[0].token_ids)
            times[out.request_id] += [t] * (n - len(times[out.request_id]))
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    end = max(ts[-1] for ts in times.values())
    ttft = [times[r][0] - arrival[r] for r in order]
    itl = [b - a for r in order for a, b in zip(times[r], times[r][1:])]
    e2e = [times[r][-1] - arrival[r] for r in order]
    return {"ttft": ttft, "itl": itl, "e2e": e2e, "tok_s": sum(len(times[r]) for r in order) / end,
            "outputs": [outputs[r] for r in order], "steps": steps, "wall_s": end}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--budgets", default="512,256",
                    help="comma-separated --max-num-batched-tokens values to run with chunked prefill")
    ap.add_argument("--max-num-seqs", type=int, default=128, help="at most the smallest budget")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--request-rate", type=float, default=1.5, help="requests per second (Poisson arrivals)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--tokens", choices=["text", "random"], default="text")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    require_positive(ap, args, "max_num_seqs", "num_prompts", "input_len", "output_len", "rounds")
    if not args.request_rate > 0:
        ap.error(f"--request-rate must be > 0, got {args.request_rate}")
    try:
        budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--budgets takes comma-separated integers, got {args.budgets!r}")
    if not budgets or min(budgets) < 1:
        ap.error(f"--budgets takes positive integers, got {args.budgets!r}")

    from fp8serve import LLM

    print_header("Chunked prefill: off vs on, requests arriving while others decode", argv)
    engines = {}
    for label, budget in [("off", None)] + [(f"chunked:{b}", b) for b in budgets]:
        llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, seed=args.seed,
                  kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                  enable_chunked_prefill=budget is not None,
                  max_num_batched_tokens=budget)
        engines[label] = llm.llm_engine
        record_as_a_warm_engine(llm.llm_engine)
    print(f"- {args.num_prompts} requests x {args.input_len} prompt tokens ({args.tokens}) -> {args.output_len} "
          f"output tokens, Poisson arrivals at {args.request_rate}/s; torch threads {torch.get_num_threads()}\n")
    for e in engines.values():  # warm-up: kernel builds, decode recordings, first allocations
        replay(e, workload(e, argparse.Namespace(**{**vars(args), "num_prompts": 3, "output_len": 8}), 99), 8)

    head = ["round", "config", "wall s", "steps", "output tok/s", "mean TTFT s", "p99 TTFT s", "mean ITL ms",
            "p99 ITL ms", "max ITL ms", "mean e2e s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    labels = list(engines)
    summary = []
    for rnd in range(1, args.rounds + 1):
        res = {}
        for label in (labels if rnd % 2 else labels[::-1]):
            e = engines[label]
            r = res[label] = replay(e, workload(e, args, args.seed + rnd), args.output_len)
            print(f"| {rnd} | {label} | {r['wall_s']:.1f} | {r['steps']} | {r['tok_s']:.1f} | "
                  f"{statistics.mean(r['ttft']):.3f} | {percentile(r['ttft'], 99):.3f} | "
                  f"{1000 * statistics.mean(r['itl']):.1f} | {1000 * percentile(r['itl'], 99):.1f} | "
                  f"{1000 * max(r['itl']):.1f} | {statistics.mean(r['e2e']):.2f} |", flush=True)
        off = res["off"]
        for label in labels[1:]:
            r = res[label]
            same = sum(a == b for a, b in zip(off["outputs"], r["outputs"]))
            summary.append(
                f"round {rnd}, {label} / off: output tok/s {r['tok_s'] / off['tok_s']:.2f}x, "
                f"p99 ITL {percentile(r['itl'], 99) / percentile(off['itl'], 99):.2f}x, "
                f"max ITL {max(r['itl']) / max(off['itl']):.2f}x, "
                f"mean TTFT {statistics.mean(r['ttft']) / statistics.mean(off['ttft']):.2f}x; "
                f"{same}/{len(r['outputs'])} requests generated the same tokens")
    print()
    for line in summary:
        print("- " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
