#!/usr/bin/env python
"""The KV cache's two memory orders side by side: HND (a kv head's rows of a block consecutive, the
engine's default) and NHD (a token's kv heads consecutive), FP8SERVE_KV_CACHE_LAYOUT /
attention/kv_cache_spec.py.

Two parts, each alternating the two layouts in one process (ABBA rounds, medians):

- kernel: `paged_attention_decode` (the tiles the engine takes for --query-dtype) over the same
  cache contents stored both ways (one random cache, copied into the other order), for each
  attention shape of --shapes (heads/kv heads/head size: the default model 9/3/64, Llama-3-8B
  32/8/128), batch x context cell and KV dtype; hot (the same call repeated) and cold (after
  reading a buffer larger than the last-level cache). The two outputs must be bit for bit the same
  (the same arithmetic on the same values; only addresses differ), or the script stops.
- engine: two engines on the default model (--model), one per layout. First --prefill-rounds steps
  each that prefill --prefill-seqs fresh prompts of --prompt-len random tokens (ABBA, one untimed
  round first), then --batch such requests decoding greedily: once all run, decode steps alternate
  between the engines, --steps each; median ms per step, and whether the tokens agree.

    .venv/bin/python benchmarks/kv_cache_layout.py
    .venv/bin/python benchmarks/kv_cache_layout.py --parts kernel --shapes 32/8/128 --batches 64
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time

import torch
from bench_common import add_model_args, alternate, median_time, parse_sizes, print_header, record_as_a_warm_engine

LAYOUTS = ("NHD", "HND")


def parse_shapes(parser, text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            h, kvh, hs = (int(x) for x in part.split("/"))
        except ValueError:
            parser.error(f"--shapes: expected heads/kv_heads/head_size items like 9/3/64, got {part!r}")
        if min(h, kvh, hs) < 1 or h % kvh:
            parser.error(f"--shapes: {part!r} needs heads a multiple of kv heads, all >= 1")
        shapes.append((h, kvh, hs))
    return shapes


def engine_cache(contents: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """`contents` ([blocks, block_size, kv heads, head_size]) in a cache allocated as the engine
    allocates one (memory in `kv_layout`'s order, 2 MiB pages asked for before the first write:
    attention/backends/base.py), seen as the same view."""
    from fp8serve.attention.kv_cache_spec import as_layer_view
    from fp8serve.utils.huge_pages import advise_huge_pages

    shape = contents.transpose(1, 2).shape if kv_layout == "HND" else contents.shape
    storage = torch.empty(shape, dtype=contents.dtype)
    advise_huge_pages(storage)
    cache = as_layer_view(storage, kv_layout)
    cache.copy_(contents)
    return cache


def kernel_part(ops, args) -> None:
    from fp8serve.kernels.cpu_ops import E4M3_DECODE_MULTIPLIER, KV_FORMATS, decode_bf16_dot_available

    qdt = torch.bfloat16 if args.query_dtype == "bfloat16" else torch.float32
    op = (ops.paged_attention_decode_bf16dot if qdt == torch.bfloat16 and decode_bf16_dot_available()
          else ops.paged_attention_decode)
    flush = torch.ones(args.flush_mib << 18)  # float32: 4 bytes each
    print(f"\n## Kernel: paged_attention_decode, {args.query_dtype} query, block size 16\n")
    print("| heads / kv heads / head size | kv dtype | batch | context | K+V MiB | NHD ms | HND ms | NHD / HND "
          "| cold NHD ms | cold HND ms | cold NHD / HND | same output |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(args.seed)
    for nh, nkv, hs in args.shapes:
        for kv_dtype in args.kv_dtypes:
            fmt = KV_FORMATS[kv_dtype]
            fp8 = kv_dtype.startswith("fp8")
            storage = torch.uint8 if fp8 else {"bfloat16": torch.bfloat16, "float32": torch.float32}[kv_dtype]
            for batch in args.batches:
                for ctx in args.contexts:
                    blocks = batch * math.ceil(ctx / 16)
                    shape = (blocks, 16, nkv, hs)
                    if fp8:  # finite codes of either format, both signs
                        nhd = torch.randint(0, 0x70, shape, generator=g, dtype=torch.uint8) | \
                            (torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7)
                    else:
                        nhd = torch.randn(shape, generator=g).to(storage)
                    caches = {name: (engine_cache(nhd, name), engine_cache(nhd, name)) for name in LAYOUTS}
                    bt = torch.randperm(blocks, generator=g).view(batch, -1).contiguous()
                    sl = torch.full((batch,), ctx, dtype=torch.int64)
                    mult = E4M3_DECODE_MULTIPLIER if kv_dtype == "fp8_e4m3" else 1.0
                    q = (torch.randn(batch, nh, hs, generator=g) * hs ** -0.5 * 0.05 * mult).float()
                    if qdt == torch.bfloat16:
                        q = q.bfloat16().float()
                    outs = {name: torch.empty_like(q) for name in LAYOUTS}

                    def call(name):
                        k, v = caches[name]
                        return lambda: op(outs[name], q, k, v, bt, sl, fmt, 0.05 * mult)

                    hot = alternate({name: lambda name=name: median_time(call(name), args.calls) for name in LAYOUTS},
                                    args.rounds)
                    cold = alternate({name: lambda name=name: median_time(call(name), max(3, args.calls // 4),
                                                                          setup=flush.sum) for name in LAYOUTS},
                                     args.rounds)
                    same = torch.equal(outs["NHD"], outs["HND"])
                    mib = 2 * nhd.numel() * nhd.element_size() / 2**20
                    print(f"| {nh} / {nkv} / {hs} | {kv_dtype} | {batch} | {ctx} | {mib:.1f} | {hot['NHD'] * 1e3:.3f} "
                          f"| {hot['HND'] * 1e3:.3f} | {hot['NHD'] / hot['HND']:.2f}x | {cold['NHD'] * 1e3:.3f} "
                          f"| {cold['HND'] * 1e3:.3f} | {cold['NHD'] / cold['HND']:.2f}x | {same} |", flush=True)
                    if not same:
                        raise SystemExit("the two layouts gave different outputs: the comparison is not what it claims")


def engine_part(args) -> None:
    from fp8serve import LLM, SamplingParams

    engines = {}
    previous = os.environ.get("FP8SERVE_KV_CACHE_LAYOUT")
    try:
        for name in LAYOUTS:
            os.environ["FP8SERVE_KV_CACHE_LAYOUT"] = name  # read when the engine allocates its cache
            llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                      kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.batch, args.prefill_seqs),
                      max_num_batched_tokens=max(8192, args.prefill_seqs * args.prompt_len))
            engines[name] = llm.llm_engine
            assert engines[name].model_runner.kv_cache_spec.kv_layout == name
            record_as_a_warm_engine(engines[name])
    finally:
        if previous is None:
            os.environ.pop("FP8SERVE_KV_CACHE_LAYOUT", None)
        else:
            os.environ["FP8SERVE_KV_CACHE_LAYOUT"] = previous
    rng = random.Random(args.seed)
    tok = engines["HND"].tokenizer
    vocab = tok.vocab_size if hasattr(tok, "vocab_size") else 32000

    def draw(n: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)] for _ in range(n)]

    # Prefill steps: the cache write (and, under HND, one row per kv head) in every layer.
    print(f"\n## Engine: steps that prefill {args.prefill_seqs} fresh prompts x {args.prompt_len} tokens "
          f"(max_tokens=1), dtype {args.dtype}, kv {args.kv_cache_dtype}, {args.prefill_rounds} ABBA rounds "
          "after one untimed\n")
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefill_times = {name: [] for name in LAYOUTS}
    prefill_same = True
    for r in range(args.prefill_rounds + 1):
        batch, first = draw(args.prefill_seqs), {}
        for name in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]):
            engine = engines[name]
            for p in batch:
                engine.add_request(None, {"prompt_token_ids": p}, one)
            t = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t
            if len(outs) != len(batch) or engine.has_unfinished_requests():
                raise SystemExit(f"a step did not prefill all {len(batch)} prompts: the comparison is not what it "
                                 "claims")
            first[name] = sorted(o.outputs[0].token_ids[0] for o in outs)
            if r:
                prefill_times[name].append(dt)
        prefill_same &= first["NHD"] == first["HND"]
    pn, ph = statistics.median(prefill_times["NHD"]), statistics.median(prefill_times["HND"])
    print("| layout | prefill steps | median ms / step |")
    print("|---|---|---|")
    print(f"| NHD | {args.prefill_rounds} | {pn * 1e3:.1f} |")
    print(f"| HND | {args.prefill_rounds} | {ph * 1e3:.1f} |")
    print(f"\nprefill NHD / HND: {pn / ph:.3f}x; first tokens the same: {prefill_same}")

    prompts = draw(args.batch)
    sp = SamplingParams(temperature=0.0, max_tokens=args.steps + 40, ignore_eos=True)
    print(f"\n## Engine: {args.batch} requests x {args.prompt_len} prompt tokens, dtype {args.dtype}, "
          f"kv {args.kv_cache_dtype}: decode steps\n")
    for engine in engines.values():
        for p in prompts:
            engine.add_request(None, {"prompt_token_ids": p}, sp)
        while engine.scheduler.waiting:
            engine.step()
        for _ in range(20):  # past the recordings of this batch size
            engine.step()
    times = {name: [] for name in LAYOUTS}
    for i in range(2 * args.steps):
        name = LAYOUTS[(i + i // 2) % 2]  # NHD HND HND NHD ...: ABBA
        t = time.perf_counter()
        engines[name].step()
        times[name].append(time.perf_counter() - t)
    finished = {}
    for name, engine in engines.items():
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        finished[name] = {o.request_id: list(o.outputs[0].token_ids) for o in outs}
    same = sorted(finished["NHD"].values()) == sorted(finished["HND"].values())
    nhd, hnd = statistics.median(times["NHD"]), statistics.median(times["HND"])
    print("| layout | decode steps | median ms / step |")
    print("|---|---|---|")
    print(f"| NHD | {len(times['NHD'])} | {nhd * 1e3:.2f} |")
    print(f"| HND | {len(times['HND'])} | {hnd * 1e3:.2f} |")
    print(f"\nNHD / HND: {nhd / hnd:.3f}x; greedy tokens of all {args.batch} requests the same: {same}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="kernel,engine")
    parser.add_argument("--shapes", default="9/3/64,32/8/128", help="heads/kv_heads/head_size, comma-separated")
    parser.add_argument("--kv-dtypes", default="fp8_e4m3,bfloat16")
    parser.add_argument("--query-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--calls", type=int, default=20, help="hot calls per round (median)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--flush-mib", type=int, default=256, help="MiB read before each cold call")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40, help="decode steps per layout")
    parser.add_argument("--prefill-seqs", type=int, default=8, help="prompts per timed prefill step")
    parser.add_argument("--prefill-rounds", type=int, default=6, help="timed prefill steps per layout")
    parser.add_argument("--seed", type=int, default=0)
    add_model_args(parser, dtype="auto")
    parser.set_defaults(kv_cache_dtype="fp8", kv_cache_memory="2GiB")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    if not set(args.parts) <= {"kernel", "engine"} or not args.parts:
        parser.error(f"--parts takes kernel and/or engine, got {','.join(args.parts)!r}")
    args.shapes = parse_shapes(parser, args.shapes)
    args.kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
    bad = [d for d in args.kv_dtypes if d not in ("fp8_e4m3", "fp8_e5m2", "bfloat16", "float32")]
    if bad or not args.kv_dtypes:
        parser.error(f"--kv-dtypes takes fp8_e4m3, fp8_e5m2, bfloat16, float32; got {args.kv_dtypes}")
    args.batches = parse_sizes(parser, "--batches", args.batches)
    args.contexts = parse_sizes(parser, "--contexts", args.contexts)
    for name in ("calls", "rounds", "flush_mib", "batch", "prompt_len", "steps", "prefill_seqs", "prefill_rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    from fp8serve.kernels.cpu_ops import load_cpu_ops
    from fp8serve.utils.malloc_tuning import tune_malloc

    ops = load_cpu_ops()
    if ops is None:
        raise SystemExit("the C++ kernels are not available: nothing to compare")
    tune_malloc()  # as the engine runs
    print_header("fp8serve KV cache layouts: NHD against HND", argv)
    if "kernel" in args.parts:
        kernel_part(ops, args)
    if "engine" in args.parts:
        engine_part(args)


if __name__ == "__main__":
    sys.exit(main())
