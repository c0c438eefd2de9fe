#!/usr/bin/env python
"""`--quantization fp8` (weights quantized at load) against the FP8 checkpoint `fp8serve quantize`
writes and the 16-bit model: load time, decode step time at batch 1 and 16, and that all FP8 runs
give the same tokens.

Everything in ONE process: the three engines are loaded one after another (each load timed), then
decode is timed in --rounds alternating rounds (ABBA order, `bench_common.alternate`), each round
one greedy generation per engine and batch size (`time_greedy_decode`: median step time of the
steps that decode the whole batch). The FP8 checkpoint is written once into
FP8SERVE_CACHE_DIR/bench/ (single_stream.fp8_checkpoint).

Example:
  .venv/bin/python benchmarks/fp8_online.py --output benchmarks/results/fp8_online.md
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

from bench_common import (add_side_by_side_args, command_line, decode_side_by_side, describe_machine,
                          emit_table, machine_info, parse_side_by_side_args, record_as_a_warm_engine, token_source)
from single_stream import fp8_checkpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="16-bit checkpoint (default: the built-in default model)")
    p.add_argument("--fp8-model", default=None,
                   help="the FP8 checkpoint of --model (default: written once into FP8SERVE_CACHE_DIR/bench/)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    add_side_by_side_args(p, batch_sizes="1,16")
    args, batches = parse_side_by_side_args(p, argv)

    from fp8serve.default_model import ensure_default_model
    from fp8serve.engine.llm_engine import LLMEngine

    model_dir = Path(args.model) if args.model else ensure_default_model()
    fp8_dir = fp8_checkpoint(args.model, args.fp8_model)
    common = dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory="512MiB",
                  max_model_len=args.prompt_len + args.steps + 8)
    specs = {"16-bit weights": (model_dir, {}), "FP8 checkpoint": (fp8_dir, {}),
             "--quantization fp8": (model_dir, {"quantization": "fp8"})}
    engines, load_s = {}, {}
    for name, (path, extra) in specs.items():
        gc.collect()
        t = time.perf_counter()
        engines[name] = LLMEngine.from_args(str(path), **common, **extra)
        load_s[name] = time.perf_counter() - t
        record_as_a_warm_engine(engines[name])

    rng = random.Random(args.seed)
    draw = token_source(engines["16-bit weights"], "text")
    prompts = {b: [draw(args.prompt_len, rng) for _ in range(b)] for b in batches}
    step, tokens = decode_side_by_side(engines, prompts, args.steps, args.rounds)

    lines = [f"# --quantization fp8 against the FP8 checkpoint and 16-bit weights", "",
             f"command: {command_line(argv)}", *describe_machine(machine_info()),
             f"model: {model_dir} (FP8 checkpoint: {fp8_dir})",
             f"dtype {engines['16-bit weights'].config.model_config.dtype_name}, KV cache {args.kv_cache_dtype}, "
             f"prompt {args.prompt_len} tokens of the built-in text, {args.steps} greedy decode steps, "
             f"{args.rounds} rounds (median)", "",
             "| weights | load s | " + " | ".join(f"step ms @ {b} | tok/s @ {b}" for b in batches) + " |",
             "|---|---|" + "---|---|" * len(batches)]
    for name in engines:
        cells = [name, f"{load_s[name]:.2f}"]
        for b in batches:
            cells += [f"{1e3 * step[b][name]:.2f}", f"{b / step[b][name]:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for b in batches:
        base = step[b]["16-bit weights"]
        same = tokens[("FP8 checkpoint", b)] == tokens[("--quantization fp8", b)]
        lines.append(f"- batch {b}: --quantization fp8 / FP8 checkpoint step time "
                     f"{step[b]['--quantization fp8'] / step[b]['FP8 checkpoint']:.3f}x; 16-bit / --quantization "
                     f"fp8 {base / step[b]['--quantization fp8']:.2f}x; the two FP8 runs' tokens identical: {same}")
    emit_table(lines, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
