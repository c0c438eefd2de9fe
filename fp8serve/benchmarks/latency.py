"""`fp8serve bench latency`: the end-to-end latency of one batch, as vLLM's `vllm bench latency`.

One batch of `--batch-size` prompts of `--input-len` random ordinary token ids generates
`--output-len` tokens each (temperature 1, `ignore_eos`, `--n` samples), `--num-iters-warmup`
times untimed, then `--num-iters` times timed; the same prompts every iteration. Prints the mean
and the 10/25/50/75/90/99th percentiles in seconds, as vLLM does.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tqdm.auto import tqdm

from fp8serve.benchmarks.datasets import random_requests
from fp8serve.benchmarks.offline import (
    check_fits,
    describe_run,
    engine_config,
    random_pool,
    write_json,
)
from fp8serve.benchmarks.serve import non_negative_int, output_path_arg, positive_int
from fp8serve.entrypoints.engine_args import add_engine_args

PERCENTILES = (10, 25, 50, 75, 90, 99)


def register(subparsers) -> None:
    p = subparsers.add_parser("latency", help="end-to-end latency of one batch of requests",
                              description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    g = p.add_argument_group("workload (vLLM's defaults)")
    g.add_argument("--input-len", type=positive_int, default=32, help="prompt tokens per request (default 32)")
    g.add_argument("--output-len", type=positive_int, default=128, help="tokens to generate (default 128)")
    g.add_argument("--batch-size", type=positive_int, default=8, help="requests in the batch (default 8)")
    g.add_argument("--n", type=positive_int, default=1, help="samples per request")
    g.add_argument("--disable-detokenize", action="store_true",
                   help="token ids only: leave the detokenizer out of the timed run")
    g.add_argument("--num-iters-warmup", type=non_negative_int, default=10,
                   help="untimed iterations first (default 10)")
    g.add_argument("--num-iters", type=positive_int, default=30, help="timed iterations (default 30)")
    p.add_argument("--output-json", type=output_path_arg, default=None, metavar="FILE",
                   help="write the latencies here (vLLM's fields, and the engine's configuration)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fp8serve import LLM, SamplingParams

    config = engine_config(args)
    check_fits(config, args.input_len + args.output_len, "--input-len + --output-len", args.max_model_len)
    llm = LLM.from_engine_config(config)
    requests = random_requests(random_pool(llm), args.batch_size, args.input_len, args.output_len, seed=args.seed)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len,
                            detokenize=not args.disable_detokenize)

    def run_once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
        run_once()
    latencies = [run_once() for _ in tqdm(range(args.num_iters), desc="Profiling iterations")]
    result = summarize(latencies)
    print(format_result(result))
    if args.output_json:
        write_json(args.output_json, {**result, "input_len": args.input_len, "output_len": args.output_len,
                                      "batch_size": args.batch_size, "n": args.n,
                                      "disable_detokenize": args.disable_detokenize,
                                      "config": describe_run(llm, args)})
    return 0


def summarize(latencies: list[float]) -> dict:
    """vLLM's fields: avg_latency, latencies, percentiles (keys "10" ... "99"), in seconds."""
    values = np.percentile(latencies, PERCENTILES)
    return {"avg_latency": float(np.mean(latencies)), "latencies": list(latencies),
            "percentiles": {str(p): float(v) for p, v in zip(PERCENTILES, values)}}


def format_result(r: dict) -> str:
    lines = [f"Avg latency: {r['avg_latency']} seconds"]
    lines += [f"{p}% percentile latency: {v} seconds" for p, v in r["percentiles"].items()]
    return "\n".join(lines)
