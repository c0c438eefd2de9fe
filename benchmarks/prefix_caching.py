#!/usr/bin/env python
"""Prefix caching on and off, side by side: prompts that share a prefix, and multi-turn chats.

Two engines in one process (same model, dtype and KV cache dtype), one with
`enable_prefix_caching`, run each workload in interleaved rounds; each run starts from an empty
prefix cache (`reset_prefix_cache`). Workloads (fixed seed; prompt tokens are windows of the
built-in calibration text, or random ids with --tokens random):

- shared-prefix: --num-prompts requests of one --prefix-len-token prefix (a system prompt, few-shot
  examples) and a --suffix-len-token question of their own, all submitted at once, --output-len
  tokens each (greedy, ignore_eos). The first request admitted computes the prefix; the others
  of the same step and later read it from the cache.
- multi-turn: --num-conversations chats of --turns turns; turn t's prompt is the chat so far
  (every earlier prompt and answer) plus --turn-len new tokens; all chats' turn t go together,
  --output-len tokens per answer. Each turn can reuse the chat so far.

Reported per run: wall seconds, seconds in prefill steps, prompt tokens prefilled, the prefix
cache hit rate (tokens found / tokens looked up), mean time to first token, output tok/s; per
round the off / on ratio of wall time; and how many requests generated the same tokens with and
without the cache (the prefill kernels round bf16 and FP8 differently, as do different batch
compositions without the cache, so a near-tie can flip a greedy token; the tests check equality
where it is exact: float32, one request at a time).

    .venv/bin/python benchmarks/prefix_caching.py                     # default model, bf16, FP8 KV
    .venv/bin/python benchmarks/prefix_caching.py --workloads multi-turn --rounds 1
    .venv/bin/python benchmarks/prefix_caching.py --check-accuracy     # + first tokens against float32
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
from bench_common import add_model_args, print_header, record_as_a_warm_engine, require_positive, token_source

WORKLOADS = ("shared-prefix", "multi-turn")


def run_batch(engine, prompts: list[list[int]], output_len: int) -> dict:
    """Submit `prompts` at once and step to the end; outputs, time to first token and step times."""
    from fp8serve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(None, {"prompt_token_ids": p}, sp).request_id for p in prompts]
    first_token, outputs = {}, {}
    prefill_s = 0.0
    while engine.has_unfinished_requests():
        prefill = bool(engine.scheduler.waiting)
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if prefill:
            prefill_s += dt
        now = time.perf_counter()
        for out in outs:
            first_token.setdefault(out.request_id, now - start)
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return {"outputs": [outputs[i] for i in ids], "ttft": [first_token[i] for i in ids], "prefill_s": prefill_s}


def run_workload(engine, workload: str, args, rng_seed: int) -> dict:
    engine.reset_prefix_cache()
    bm, stats = engine.block_manager, engine.stats
    q0, h0 = bm.prefix_cache_queries, bm.prefix_cache_hits
    p0, g0 = stats.prefill_tokens_total, stats.generation_tokens_total
    draw = token_source(engine, args.tokens)
    rng = random.Random(rng_seed)
    t = time.perf_counter()
    outputs, ttft, prefill_s = [], [], 0.0
    if workload == "shared-prefix":
        prefix = draw(args.prefix_len, rng)
        prompts = [prefix + draw(args.suffix_len, rng) for _ in range(args.num_prompts)]
        r = run_batch(engine, prompts, args.output_len)
        outputs, ttft, prefill_s = r["outputs"], r["ttft"], r["prefill_s"]
    else:
        chats = [[] for _ in range(args.num_conversations)]
        for _ in range(args.turns):
            prompts = [chat + draw(args.turn_len, rng) for chat in chats]
            r = run_batch(engine, prompts, args.output_len)
            chats = [p + o for p, o in zip(prompts, r["outputs"])]
            outputs += r["outputs"]
            ttft += r["ttft"]
            prefill_s += r["prefill_s"]
    wall = time.perf_counter() - t
    queries, hits = bm.prefix_cache_queries - q0, bm.prefix_cache_hits - h0
    generated = stats.generation_tokens_total - g0
    return {"wall_s": wall, "prefill_s": prefill_s, "prefilled": stats.prefill_tokens_total - p0,
            "hit_rate": hits / queries if queries else 0.0, "ttft_s": statistics.mean(ttft),
            "tok_s": generated / wall, "outputs": outputs}


def first_token_accuracy(engines: dict, args) -> list[str]:
    """The shared-prefix prompts' next-token distributions (top 20 logprobs) from each engine
    against a float32 engine without the cache: how far each is from the float32 answer."""
    from fp8serve import LLM, SamplingParams

    reference = LLM(model=args.model, dtype="float32", kv_cache_dtype="auto", kv_cache_memory=args.kv_cache_memory,
                    seed=args.seed)
    rng = random.Random(args.seed)
    draw = token_source(reference.llm_engine, args.tokens)
    prefix = draw(args.prefix_len, rng)
    prompts = [prefix + draw(args.suffix_len, rng) for _ in range(args.num_prompts)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)

    def top_logprobs(engine) -> list[dict]:
        ids = [engine.add_request(None, {"prompt_token_ids": p}, sp).request_id for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].logprobs[0] for o in engine.step() if o.finished})
        return [done[i] for i in ids]

    ref = top_logprobs(reference.llm_engine)
    lines = []
    for label, engine in engines.items():
        engine.reset_prefix_cache()
        hits0 = engine.block_manager.prefix_cache_hits
        ours = top_logprobs(engine)
        hits = engine.block_manager.prefix_cache_hits - hits0
        errs = [max(abs(r[t].logprob - o[t].logprob) for t in r if t in o) for r, o in zip(ref, ours)]
        top1 = sum(max(r, key=lambda t: r[t].logprob) == max(o, key=lambda t: o[t].logprob) for r, o in zip(ref, ours))
        lines.append(f"| {label} | {hits} | {statistics.mean(errs):.4f} | "
                     f"{max(errs):.4f} | {top1}/{len(prompts)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    ap.add_argument("--num-prompts", type=int, default=32, help="shared-prefix: requests")
    ap.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: shared prompt tokens")
    ap.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: each request's own tokens")
    ap.add_argument("--num-conversations", type=int, default=8, help="multi-turn: chats")
    ap.add_argument("--turns", type=int, default=4, help="multi-turn: turns per chat")
    ap.add_argument("--turn-len", type=int, default=64, help="multi-turn: new prompt tokens per turn")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--tokens", choices=["text", "random"], default="text",
                    help="prompt tokens: windows of the built-in calibration text, or random ids")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-accuracy", action="store_true",
                    help="also compare the shared-prefix prompts' first-token top-20 logprobs, off and on, with a "
                         "float32 engine's")
    args = ap.parse_args(argv)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not workloads or any(w not in WORKLOADS for w in workloads):
        ap.error(f"--workloads takes {' and/or '.join(WORKLOADS)}, got {args.workloads!r}")
    require_positive(ap, args, "num_prompts", "prefix_len", "suffix_len", "num_conversations", "turns", "turn_len",
                     "output_len", "rounds")

    from fp8serve import LLM

    print_header("Prefix caching: off vs on", argv)
    engines = {}
    for label, on in (("off", False), ("on", True)):
        llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, seed=args.seed,
                  kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=on)
        engines[label] = llm.llm_engine
        record_as_a_warm_engine(llm.llm_engine)
    print(f"- shared-prefix: {args.num_prompts} requests x ({args.prefix_len} shared + {args.suffix_len} own) prompt "
          f"tokens; multi-turn: {args.num_conversations} chats x {args.turns} turns of {args.turn_len} new tokens; "
          f"{args.output_len} output tokens per request; torch threads {torch.get_num_threads()}\n")
    vocab = engines["off"].model_runner.config.model_config.arch.vocab_size
    for e in engines.values():  # warm-up: kernel builds, decode recordings, first allocations
        run_batch(e, [[11 + i % (vocab - 11) for i in range(40)]] * 2, 8)  # 8 tokens: recorded after 4 eager steps
        run_batch(e, [[17 + i % (vocab - 17) for i in range(args.suffix_len + 8)] for _ in range(3)], 8)

    head = ["workload", "round", "prefix caching", "wall s", "prefill s", "prompt tokens prefilled", "hit rate",
            "mean TTFT s", "output tok/s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    summary = []
    for workload in workloads:
        for rnd in range(1, args.rounds + 1):
            res = {}
            order = ("off", "on") if rnd % 2 else ("on", "off")
            for label in order:
                r = res[label] = run_workload(engines[label], workload, args, args.seed + rnd)
                print(f"| {workload} | {rnd} | {label} | {r['wall_s']:.2f} | {r['prefill_s']:.2f} | {r['prefilled']} | "
                      f"{100 * r['hit_rate']:.1f}% | {r['ttft_s']:.3f} | {r['tok_s']:.1f} |", flush=True)
            same = sum(a == b for a, b in zip(res["off"]["outputs"], res["on"]["outputs"]))
            summary.append(f"{workload} round {rnd}: off / on wall {res['off']['wall_s'] / res['on']['wall_s']:.2f}x, "
                           f"TTFT {res['off']['ttft_s'] / res['on']['ttft_s']:.2f}x; "
                           f"{same}/{len(res['on']['outputs'])} requests generated the same tokens")
    print()
    for line in summary:
        print("- " + line)
    if args.check_accuracy:
        print(f"\nFirst-token accuracy against float32 without the cache ({args.num_prompts} shared-prefix prompts, "
              "top-20 logprobs; hits: prompt tokens read from the cache):\n")
        print("| prefix caching | hits | mean of max abs dlogprob | max abs dlogprob | top-1 = float32's |")
        print("|---|---|---|---|---|")
        for line in first_token_accuracy(engines, args):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
