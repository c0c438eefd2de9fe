#!/usr/bin/env python
"""The LM head of an FP8 checkpoint under float32 compute: its 16-bit (bf16)
head as the engine runs it against the upcast path it took before (F.linear
on float32 copies of 8192-row vocabulary slices), at every row count a decode
batch or a prompt-logprobs prefill gives it.

  1. The head alone, cold (a 128 MiB read before every call), on rows of a
     greedy generation from text, at --rows: the upcast path against
     `LMHead.forward`, alternating (ABBA), medians of --rounds; the "engine
     path" column says what forward runs there, and both paths' largest
     error against float64 logits of the same weights is reported.
  2. Engine decode steps at --decode-batch with the head switched between
     the two paths in the same engine (ABBA rounds), and whether both
     produced the same tokens (they may differ where two logits tie to
     within float32 rounding: the paths sum in different orders).

    python benchmarks/lm_head.py                               # the default model's FP8 checkpoint
    python benchmarks/lm_head.py --rows 16,32,64 --decode-batch 16,64 --output benchmarks/results/x.md
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    add_decode_sample_args, alternate, command_line, describe_machine, emit_table, greedy_head_rows, machine_info,
    median_time, parse_decode_sample_args, parse_sizes, record_as_a_warm_engine, time_greedy_decode, token_source)

from fp8serve.kernels import cpu_ops  # noqa: E402
from fp8serve.layers import vocab_embedding  # noqa: E402

UPCAST_ROWS = 8192  # the vocabulary slice the upcast path converts per F.linear call


def upcast_logits(head, x: torch.Tensor) -> torch.Tensor:
    """The path a narrower head took above dense_gemv's rows before
    dense_gemv_max_rows gave bf16 heads float32 rows and row slices."""
    w = head.weight
    return torch.cat([F.linear(x, w[i:i + UPCAST_ROWS].to(x.dtype)).float() for i in range(0, w.shape[0], UPCAST_ROWS)],
                     dim=1)


def engine_path(head, m: int) -> str:
    rows = cpu_ops.dense_gemv_max_rows(torch.float32, head.weight.dtype)
    if 1 <= m <= rows:
        return "dense_gemv"
    if rows and m <= vocab_embedding._GEMV_SLICES_MAX_ROWS:
        return f"dense_gemv x {-(-m // rows)} row slices"
    return "upcast"


def time_head(head, x: torch.Tensor, flush: torch.Tensor, calls: int, rounds: int) -> dict[str, float]:
    """Median seconds of each path on x, cold (a read of `flush` before every call), ABBA."""
    return alternate({"upcast": lambda: median_time(lambda: upcast_logits(head, x), calls, lambda: flush.add_(1)),
                      "engine": lambda: median_time(lambda: head(x), calls, lambda: flush.add_(1))}, rounds)


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want).abs().max() / want.abs().max()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="16-bit checkpoint the FP8 one is written from (default: the "
                   "built-in default model)")
    p.add_argument("--fp8-model", default=None, help="an FP8 checkpoint directory to use as it is")
    p.add_argument("--rows", default="12,16,24,32,48,64,128,256,512",
                   help="comma-separated head rows to time (the engine ran dense_gemv up to 8 before)")
    p.add_argument("--decode-batch", default="16,32,64", help="comma-separated batch sizes of engine decode steps")
    add_decode_sample_args(p, "cold head calls")
    args = parse_decode_sample_args(p)
    rows = parse_sizes(p, "--rows", args.rows)
    batches = parse_sizes(p, "--decode-batch", args.decode_batch, allow_empty=True)
    if cpu_ops.load_cpu_ops() is None:
        sys.exit("the C++ CPU kernels are not available: the engine's head path under test is dense_gemv")
    from single_stream import fp8_checkpoint

    from fp8serve import LLM

    fp8_dir = fp8_checkpoint(args.model, args.fp8_model)
    max_batch = max(batches, default=1)
    llm = LLM(model=str(fp8_dir), dtype="float32", max_model_len=args.decode_context + args.decode_steps + 64,
              max_num_seqs=max(64, max_batch), device="cpu", seed=args.seed)
    engine = llm.llm_engine
    record_as_a_warm_engine(engine)
    head = engine.model_runner.model.lm_head
    w = head.weight
    if w.dtype == torch.float32:
        sys.exit(f"{fp8_dir}: the engine keeps this head in float32: no narrower head to measure")
    rng = random.Random(args.seed)
    draw = token_source(engine, "text")
    sample = greedy_head_rows(engine, draw, rng, args.decode_context, args.sample_steps)
    lines = [f"Command: `{command_line()}`", "", *(f"- {x}" for x in describe_machine(machine_info())),
             f"- checkpoint {fp8_dir}: head {tuple(w.shape)} {w.dtype} ({w.numel() * w.element_size() / 2**20:.1f} "
             f"MiB), float32 activations; {len(sample)} head rows recorded from a greedy generation from text; "
             f"medians of {args.rounds} ABBA rounds",
             "", "| cell | rows | engine path | upcast ms | engine ms | upcast / engine | max rel err upcast | "
             "max rel err engine | same tokens |", "|---|---|---|---|---|---|---|---|---|"]
    flush = torch.ones((128 << 20) // 4)
    with torch.inference_mode():
        for m in rows:
            x = sample[torch.arange(m) % len(sample)].contiguous()
            t = time_head(head, x, flush, args.calls, args.rounds)
            want = F.linear(x.double(), w.double())
            lines.append(f"| head alone, cold | {m} | {engine_path(head, m)} | {1e3 * t['upcast']:.2f} | "
                         f"{1e3 * t['engine']:.2f} | {t['upcast'] / t['engine']:.2f}x | "
                         f"{rel_err(upcast_logits(head, x), want):.1e} | {rel_err(head(x), want):.1e} | - |")
            print(lines[-1], file=sys.stderr, flush=True)
    for batch in batches:
        prompts = [draw(args.decode_context, rng) for _ in range(batch)]
        toks: dict[str, list] = {}

        def decode(side: str) -> float:
            if side == "upcast":
                head.forward = lambda x: upcast_logits(head, x)
            try:
                t, toks[side] = time_greedy_decode(engine, prompts, args.decode_steps)
            finally:
                head.__dict__.pop("forward", None)
            return t

        med = alternate({"upcast": lambda: decode("upcast"), "engine": lambda: decode("engine")}, args.rounds)
        up, en = med["upcast"], med["engine"]
        lines.append(f"| engine decode step, batch {batch} x ~{args.decode_context} | {batch} | "
                     f"{engine_path(head, batch)} | {1e3 * up:.2f} | {1e3 * en:.2f} | {up / en:.2f}x | - | - | "
                     f"{'yes' if toks['upcast'] == toks['engine'] else 'no'} |")
        print(lines[-1], file=sys.stderr, flush=True)
    emit_table(lines, args.output)


if __name__ == "__main__":
    main()
