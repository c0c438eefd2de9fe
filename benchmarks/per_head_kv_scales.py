#!/usr/bin/env python
"""What per-KV-head scales (kv_cache_scheme strategy attn_head) cost in decode step time against
one scale per layer, on the same weights with an FP8 KV cache.

Why: the Attention layer folds per-head scales around a backend that takes one scale per layer
(four elementwise passes per layer over q, k, v and the output: fp8serve/layers/attention.py);
per-layer checkpoints skip them. This measures that cost. Accuracy is `fp8serve eval-kv` on each
checkpoint (the result file next to this script's output says how).

Both checkpoints are written by `fp8serve calibrate` from the same model and text, once per
strategy:
  fp8serve calibrate --text T --out-checkpoint per-layer
  fp8serve calibrate --text T --kv-scale-strategy attn_head --out-checkpoint per-head

Everything in ONE process: both engines loaded, then --rounds alternating rounds (ABBA,
`bench_common.alternate`), each one greedy generation per engine and batch size
(`time_greedy_decode`: median step time of the steps that decode the whole batch).

  .venv/bin/python benchmarks/per_head_kv_scales.py --per-layer DIR --per-head DIR
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from bench_common import (add_side_by_side_args, command_line, decode_side_by_side, describe_machine,
                          emit_table, machine_info, parse_side_by_side_args, record_as_a_warm_engine, token_source)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-layer", required=True, type=Path, help="checkpoint with one K and V scale per layer")
    p.add_argument("--per-head", required=True, type=Path, help="the same weights with per-KV-head scales")
    p.add_argument("--dtype", default="auto")
    add_side_by_side_args(p, batch_sizes="1,16,64")
    args, batches = parse_side_by_side_args(p, argv)

    from fp8serve.engine.llm_engine import LLMEngine

    common = dict(dtype=args.dtype, kv_cache_dtype="fp8_e4m3", kv_cache_memory="512MiB",
                  max_model_len=args.prompt_len + args.steps + 8)
    engines = {name: LLMEngine.from_args(str(path), **common)
               for name, path in (("per layer", args.per_layer), ("per KV head", args.per_head))}
    layers = engines["per KV head"].model_runner.attn_layers
    if any(a.k_head_scales is None for a in layers):
        p.error(f"--per-head {args.per_head}: its layers have no per-KV-head scales "
                "(expected kv_cache_scheme strategy attn_head)")
    if any(a.k_head_scales is not None for a in engines["per layer"].model_runner.attn_layers):
        p.error(f"--per-layer {args.per_layer}: it has per-KV-head scales")
    for engine in engines.values():
        record_as_a_warm_engine(engine)

    rng = random.Random(args.seed)
    draw = token_source(engines["per layer"], "text")
    prompts = {b: [draw(args.prompt_len, rng) for _ in range(b)] for b in batches}
    step, tokens = decode_side_by_side(engines, prompts, args.steps, args.rounds)

    mc = engines["per layer"].config.model_config
    lines = ["# Per-KV-head KV scales against per-layer scales: decode step time", "",
             f"command: {command_line(argv)}", *describe_machine(machine_info()),
             f"checkpoints: per layer {args.per_layer}, per KV head {args.per_head}",
             f"dtype {mc.dtype_name}, KV cache fp8_e4m3, prompt {args.prompt_len} tokens of the built-in text, "
             f"{args.steps} greedy decode steps, {args.rounds} rounds (median)", "",
             "| scales | " + " | ".join(f"step ms @ {b}" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for name in engines:
        lines.append(f"| {name} | " + " | ".join(f"{1e3 * step[b][name]:.2f}" for b in batches) + " |")
    lines.append("| per KV head / per layer | " + " | ".join(
        f"{step[b]['per KV head'] / step[b]['per layer']:.3f}x" for b in batches) + " |")
    lines.append("")
    for b in batches:
        a, h = tokens[("per layer", b)], tokens[("per KV head", b)]
        same = sum(x == y for x, y in zip(a, h))
        lines.append(f"- batch {b}: {same} of {len(a)} requests' greedy tokens identical between the two")
    emit_table(lines, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
