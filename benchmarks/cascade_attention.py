#!/usr/bin/env python
"""Cascade attention on and off, side by side: decode attention when many running sequences share
the first blocks of their KV cache (a system prompt under prefix caching, the n samples of a prompt).

Two parts, each alternating the two sides in one process (paged_attention.cpp's mode, switched
per call by `set_cascade_attention`):

- kernel: `paged_attention_decode_fused` (the engine's entry) over --members sequences sharing
  --shared tokens, each with --own tokens of its own, FP8 e4m3 cache, for each --query-dtype;
  hot calls, median of --calls, ABBA over --rounds. Columns: off / always ms and their ratio, and
  whether the engine's rule ("auto") runs the prefix phase there.
- engine: --batch requests whose prompts share a --prefix-len-token prefix (prefix caching on) plus
  16 tokens each, decoding greedily; once every request is running, consecutive decode steps
  alternate off / auto, --steps of each, median ms per step. The calls counter shows the prefix
  phase ran.

    .venv/bin/python benchmarks/cascade_attention.py                    # both parts, defaults
    .venv/bin/python benchmarks/cascade_attention.py --parts engine --batch 64 --prefix-len 2048
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
from bench_common import add_model_args, alternate, median_time, parse_sizes, print_header, record_as_a_warm_engine

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16  # the default model's attention


def kernel_part(ops, args) -> None:
    from fp8serve.kernels.cpu_ops import KV_FORMATS

    fmt = KV_FORMATS["fp8_e4m3"]
    print("\n## Kernel: paged_attention_decode_fused, fp8_e4m3 cache, 9 heads / 3 kv heads, head size 64\n")
    print("| query | members | shared | own | off ms | always ms | off / always | auto runs it |")
    print("|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for qname in args.query_dtype:
        qdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[qname]
        for m in args.members:
            for shared in args.shared:
                nshared, nown = shared // BLOCK_SIZE, -(-args.own // BLOCK_SIZE)
                num_blocks = nshared + m * nown + 1
                shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
                # Codes of finite values with both signs (e4m3 0x7f/0xff are NaN).
                kc = torch.randint(0, 0x7f, shape, generator=g, dtype=torch.uint8) | \
                    (torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7)
                vc = torch.randint(0, 0x7f, shape, generator=g, dtype=torch.uint8) | \
                    (torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7)
                bt = torch.empty(m, nshared + nown, dtype=torch.int64)
                for b in range(m):
                    bt[b, :nshared] = torch.arange(nshared)
                    bt[b, nshared:] = nshared + b * nown + torch.arange(nown)
                sl = torch.full((m,), shared + args.own, dtype=torch.int64)
                q = torch.randn(m, NUM_HEADS, HEAD_SIZE, generator=g).to(qdt)
                q_scale = HEAD_SIZE ** -0.5 * 0.02 * 256  # softmax scale, a k_scale, e4m3's 2^8

                def call(mode):
                    return lambda: ops.paged_attention_decode_fused_cascade(q, kc, vc, bt, sl, fmt, q_scale, 0.02 * 256,
                                                                            mode)
                times = alternate({"off": lambda: median_time(call(0), args.calls),
                                   "always": lambda: median_time(call(2), args.calls)}, args.rounds)
                off, on = times["off"], times["always"]
                before = ops.cascade_attention_stats()[0]
                call(1)()
                runs = ops.cascade_attention_stats()[0] > before
                print(f"| {qname} | {m} | {shared} | {args.own} | {off * 1e3:.3f} | {on * 1e3:.3f} | "
                      f"{off / on:.2f}x | {'yes' if runs else 'no'} |", flush=True)


def engine_part(ops, args) -> None:
    from fp8serve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=args.kv_cache_memory,
              enable_prefix_caching=True, max_num_seqs=max(args.batch, 1))
    engine = llm.llm_engine
    record_as_a_warm_engine(engine)
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size if hasattr(engine.tokenizer, "vocab_size") else 32000
    prefix = [rng.randrange(100, vocab - 100) for _ in range(args.prefix_len)]
    print(f"\n## Engine: {args.batch} requests, a {args.prefix_len}-token shared prefix + 16 tokens each, "
          f"dtype {args.dtype}, kv {args.kv_cache_dtype}\n")
    sp = SamplingParams(temperature=0.0, max_tokens=2 * args.steps + 40, ignore_eos=True)
    # The prefix enters the cache first, so every request of the batch finds it there.
    engine.add_request(None, {"prompt_token_ids": prefix + [7]}, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    for _ in range(args.batch):
        engine.add_request(None, {"prompt_token_ids": prefix + [rng.randrange(100, vocab - 100) for _ in range(16)]},
                           sp)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(20):  # past the recordings of this batch size
        engine.step()
    times = {0: [], 1: []}
    calls0 = ops.cascade_attention_stats()[0]
    calls = {0: 0, 1: 0}
    previous = ops.set_cascade_attention(1)
    try:
        for i in range(2 * args.steps):
            mode = (i + i // 2) % 2  # 0 1 1 0 0 1 1 0 ...: ABBA
            ops.set_cascade_attention(mode)
            before = ops.cascade_attention_stats()[0]
            t = time.perf_counter()
            engine.step()
            times[mode].append(time.perf_counter() - t)
            calls[mode] += ops.cascade_attention_stats()[0] - before
    finally:
        ops.set_cascade_attention(previous)
    off, on = statistics.median(times[0]), statistics.median(times[1])
    print("| side | decode steps | median ms / step | calls with a prefix phase |")
    print("|---|---|---|---|")
    print(f"| off | {len(times[0])} | {off * 1e3:.2f} | {calls[0]} |")
    print(f"| auto | {len(times[1])} | {on * 1e3:.2f} | {calls[1]} |")
    print(f"\noff / auto: {off / on:.3f}x (prefix phases in all: {ops.cascade_attention_stats()[0] - calls0})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="kernel,engine")
    parser.add_argument("--query-dtype", default="bfloat16,float32")
    parser.add_argument("--members", default="2,8,16,32,64")
    parser.add_argument("--shared", default="256,512,1024,2048")
    parser.add_argument("--own", type=int, default=32)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60, help="decode steps per side")
    add_model_args(parser, dtype="auto")
    parser.set_defaults(kv_cache_memory="4GiB")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    if not set(args.parts) <= {"kernel", "engine"} or not args.parts:
        parser.error(f"--parts takes kernel and/or engine, got {','.join(args.parts)!r}")
    args.query_dtype = [d for d in args.query_dtype.split(",") if d]
    if not set(args.query_dtype) <= {"float32", "bfloat16"} or not args.query_dtype:
        parser.error("--query-dtype takes float32 and/or bfloat16")
    args.members = parse_sizes(parser, "--members", args.members)
    args.shared = parse_sizes(parser, "--shared", args.shared)
    for name in ("own", "calls", "rounds", "batch", "prefix_len", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(s % BLOCK_SIZE for s in args.shared):
        parser.error(f"--shared lengths must be multiples of the block size {BLOCK_SIZE}")

    from fp8serve.kernels.cpu_ops import load_cpu_ops
    from fp8serve.utils.malloc_tuning import tune_malloc

    # The engine's malloc settings (model_runner): with glibc's defaults the prefix phase's
    # buffers of a few hundred KiB were mapped and faulted in on some calls and not others,
    # depending on what the process freed before (0.84x to 1.41x for one cell).
    tune_malloc()
    ops = load_cpu_ops()
    if ops is None:
        sys.exit("the C++ CPU kernels are not available")
    print_header("Cascade attention: shared KV blocks attended once per group", argv)
    print(f"torch threads: {torch.get_num_threads()}")
    if "kernel" in args.parts:
        kernel_part(ops, args)
    if "engine" in args.parts:
        engine_part(ops, args)


if __name__ == "__main__":
    main()
