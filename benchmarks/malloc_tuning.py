#!/usr/bin/env python
"""Engine steps with glibc's default malloc thresholds against the engine's
(fp8serve/utils/malloc_tuning.py): step time and minor page faults.

The setting is process-wide and cannot be undone in place, so every round
runs two child processes, FP8SERVE_MALLOC_TUNING=0 and =1, in alternating
order (ABBA over rounds). Each child builds the engine (default model unless
--model), runs one untimed prefill step and --steps timed ones of
--prefill-batch x --prefill-len random tokens (max_tokens 1; with --mixed an
untimed single-prompt prefill before each, since which blocks glibc maps or
trims depends on the history of shapes), then a batch of
--decode-batch requests with --decode-steps timed decode steps, and reports
median step times and the minor page faults of the timed steps (getrusage).

    .venv/bin/python benchmarks/malloc_tuning.py                 # 16 x 512 prefills, batch-64 decode
    .venv/bin/python benchmarks/malloc_tuning.py --mixed         # the same with 1 x 512 prefills between
    .venv/bin/python benchmarks/malloc_tuning.py --rounds 1 --steps 1 --prefill-batch 2 --decode-steps 2  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

from bench_common import add_model_args, print_header, record_as_a_warm_engine, require_positive


def child(args) -> dict:
    import torch

    from fp8serve import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, seed=args.seed,
              kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=max(args.prefill_batch, args.decode_batch),
              max_num_batched_tokens=max(8192, args.prefill_batch * args.prefill_len))
    engine = llm.llm_engine
    record_as_a_warm_engine(engine)
    vocab = engine.model_runner.config.model_config.arch.vocab_size
    rng = random.Random(args.seed)

    def add(n: int, length: int, max_tokens: int) -> None:
        for _ in range(n):
            engine.add_request(None, {"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(length)]},
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    prefill_ms, prefill_faults = [], 0
    for i in range(args.steps + 1):
        if args.mixed:  # an untimed single-prompt prefill between the big ones, as a server's mix would
            add(1, args.prefill_len, 1)
            while engine.has_unfinished_requests():
                engine.step()
        add(args.prefill_batch, args.prefill_len, 1)
        f0, t = faults(), time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if i:  # the first is a warm-up
            prefill_ms.append(1e3 * (time.perf_counter() - t))
            prefill_faults += faults() - f0
    add(args.decode_batch, 128, args.decode_steps + 4)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    decode_ms, f0 = [], faults()
    for _ in range(args.decode_steps):
        t = time.perf_counter()
        engine.step()
        decode_ms.append(1e3 * (time.perf_counter() - t))
    decode_faults = faults() - f0
    return {"threads": torch.get_num_threads(), "prefill_ms": statistics.median(prefill_ms),
            "prefill_faults_per_step": prefill_faults / args.steps, "decode_ms": statistics.median(decode_ms),
            "decode_faults_per_step": decode_faults / args.decode_steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, dtype="auto")
    ap.add_argument("--prefill-batch", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="timed prefill steps per child")
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mixed", action="store_true",
                    help="an untimed 1 x --prefill-len prefill before every timed one (shapes that vary, as served)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    require_positive(ap, args, "prefill_batch", "prefill_len", "steps", "decode_batch", "decode_steps", "rounds")
    if args.child:
        print(json.dumps(child(args)))
        return 0

    print_header("Engine steps: glibc's malloc thresholds vs the engine's", argv)
    print(f"- prefill steps of {args.prefill_batch} x {args.prefill_len} tokens (median of {args.steps}"
          f"{'; a 1-prompt prefill before each' if args.mixed else ''}), "
          f"decode steps at batch {args.decode_batch} (median of {args.decode_steps}); one child process per "
          f"setting and round, alternating\n")
    head = ["round", "FP8SERVE_MALLOC_TUNING", "prefill step ms", "minor faults / prefill step", "decode step ms",
            "minor faults / decode step"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    passthrough = list(argv if argv is not None else sys.argv[1:])  # the child gets the same options
    results: dict[str, list[dict]] = {"0": [], "1": []}
    for rnd in range(1, args.rounds + 1):
        for setting in (("0", "1") if rnd % 2 else ("1", "0")):
            env = dict(os.environ, FP8SERVE_MALLOC_TUNING=setting)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), *passthrough, "--child"], env=env,
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"child (FP8SERVE_MALLOC_TUNING={setting}) failed:\n{out.stderr[-2000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[setting].append(r)
            print(f"| {rnd} | {setting} | {r['prefill_ms']:.0f} | {r['prefill_faults_per_step']:.0f} | "
                  f"{r['decode_ms']:.1f} | {r['decode_faults_per_step']:.0f} |", flush=True)
    off = statistics.median(r["prefill_ms"] for r in results["0"])
    on = statistics.median(r["prefill_ms"] for r in results["1"])
    doff = statistics.median(r["decode_ms"] for r in results["0"])
    don = statistics.median(r["decode_ms"] for r in results["1"])
    print(f"\nmedians over rounds: prefill step {off:.0f} -> {on:.0f} ms ({off / on:.2f}x), "
          f"decode step {doff:.1f} -> {don:.1f} ms ({doff / don:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
