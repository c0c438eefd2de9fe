#!/usr/bin/env python
"""An FP8-weight checkpoint in the engine, float32 activations: the large-M
linear path switched between `fp8_tiled_gemm` and dequantize + oneDNN
(FP8SERVE_FP8_TILED_GEMM) inside one process, in alternating (ABBA) rounds.

Per round and path it times
  - prefill: one engine step that prefills one --prompt-len-token prompt
    (median of --prefills steps);
  - decode: the decode steps of --decode-batch requests of
    --decode-context-token prompts (median over --decode-steps steps), the
    batch past the fused GEMV's rows, where the large-M path runs every
    linear of every step.
and reports medians over the rounds and the ratio of the two paths.

    python benchmarks/fp8_weight_paths.py                # the default model's FP8 checkpoint (written once)
    python benchmarks/fp8_weight_paths.py --fp8-model DIR --decode-batch 32
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    command_line, describe_machine, emit_table, machine_info, record_as_a_warm_engine, require_positive,
    time_greedy_decode)

from fp8serve.kernels import fp8_linear_ops  # noqa: E402

PATHS = {"dequant + oneDNN": "0", "tiled": "1"}


def use_path(engine, name: str) -> None:
    """Switch the large-M FP8 path for the steps that follow: the choice is
    cached per process, and recorded decode and prefill forwards replay the
    ops of the path they were recorded on, so they are dropped (and recorded
    again)."""
    os.environ[fp8_linear_ops.TILED_GEMM_ENV] = PATHS[name]
    fp8_linear_ops.tiled_gemm_enabled.cache_clear()
    fp8_linear_ops._fused_rows_by_dtype.cache_clear()
    engine.model_runner.decode_captures.reset()
    engine.model_runner.prefill_captures.reset()


def time_prefill(engine, prompt: list[int], n: int) -> float:
    from fp8serve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(n):
        engine.add_request(None, {"prompt_token_ids": prompt}, sp)
        gc.collect()
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        if len(outs) != 1 or not outs[0].finished or engine.has_unfinished_requests():
            raise RuntimeError("a prefill step did not finish the one-token request")
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="16-bit checkpoint the FP8 one is written from (default: the "
                   "built-in default model)")
    p.add_argument("--fp8-model", default=None, help="an FP8 checkpoint directory to use as it is")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--prefills", type=int, default=3)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-context", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, help="also write the table (markdown) here")
    args = p.parse_args()
    require_positive(p, args, "prompt_len", "prefills", "decode_batch", "decode_context", "decode_steps", "rounds")
    if fp8_linear_ops.TILED_GEMM_ENV in os.environ:
        p.error(f"unset {fp8_linear_ops.TILED_GEMM_ENV}: this script switches it itself")
    from single_stream import fp8_checkpoint

    from fp8serve import LLM
    from fp8serve.kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None or not hasattr(ops, "fp8_tiled_gemm_available") or not ops.fp8_tiled_gemm_available():
        sys.exit("fp8_tiled_gemm is not built on this machine (it needs AVX2, FMA and F16C and the C++ kernels)")
    fp8_dir = fp8_checkpoint(args.model, args.fp8_model)
    max_len = max(args.prompt_len, args.decode_context + args.decode_steps + 2) + 1
    llm = LLM(model=str(fp8_dir), dtype="float32", max_model_len=max_len, max_num_seqs=max(128, args.decode_batch),
              device="cpu", seed=args.seed)
    engine = llm.llm_engine
    record_as_a_warm_engine(engine)
    rng = random.Random(args.seed)
    vocab = int(json.loads((fp8_dir / "config.json").read_text())["vocab_size"])
    prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
    prompts = [[rng.randrange(100, vocab) for _ in range(args.decode_context)] for _ in range(args.decode_batch)]
    res: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in PATHS}
    names = list(PATHS)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            use_path(engine, name)
            res[name]["prefill"].append(time_prefill(engine, prompt, args.prefills))
            res[name]["decode"].append(time_greedy_decode(engine, prompts, args.decode_steps)[0])
            print(f"round {r + 1} {name}: prefill {1e3 * res[name]['prefill'][-1]:.1f} ms, decode step "
                  f"{1e3 * res[name]['decode'][-1]:.1f} ms", file=sys.stderr, flush=True)
    med = {k: {ph: statistics.median(v) for ph, v in d.items()} for k, d in res.items()}
    base, new = med["dequant + oneDNN"], med["tiled"]
    lines = [f"Command: `{command_line()}`", "", *(f"- {x}" for x in describe_machine(machine_info())),
             f"- checkpoint {fp8_dir}; float32 activations, auto KV cache; medians of {args.rounds} ABBA rounds",
             "", "| phase | cell | dequant + oneDNN ms | tiled ms | dequant + oneDNN / tiled |", "|---|---|---|---|---|",
             f"| prefill | 1 x {args.prompt_len} tokens | {1e3 * base['prefill']:.1f} | {1e3 * new['prefill']:.1f} | "
             f"{base['prefill'] / new['prefill']:.2f}x |",
             f"| decode step | batch {args.decode_batch} x ~{args.decode_context} tokens | {1e3 * base['decode']:.1f} | "
             f"{1e3 * new['decode']:.1f} | {base['decode'] / new['decode']:.2f}x |"]
    emit_table(lines, args.output)


if __name__ == "__main__":
    main()
