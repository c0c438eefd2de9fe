#!/usr/bin/env python
"""A 16-bit (bf16 / fp16) checkpoint under float32 compute: weights kept at 16
bits (fp8serve/quantization/narrow_weights.py) against weights upcast to
float32 at load (FP8SERVE_16BIT_WEIGHTS=0, what the engine did before), side
by side.

Two engines on the same checkpoint in one process, one per setting; every
cell alternates them (ABBA rounds, medians of --rounds):
  1. decode steps at each --decode-batch (greedy, and with --sampled also
     temperature 0.7 / top_p 0.9, which reads the whole LM head), contexts of
     ~--decode-context tokens, and whether both engines produced the same tokens;
  2. one prefill step of --prefill-len tokens (one prompt, max_tokens 1).
Also each engine's weight bytes: the plain weights dense_gemv reads and the
packed copies oneDNN reads.

    python benchmarks/narrow_weights.py                    # the built-in default model (bf16)
    python benchmarks/narrow_weights.py --decode-batch 1,16 --rounds 4 --output benchmarks/results/x.md
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    alternate, command_line, describe_machine, emit_table, machine_info, narrow_weights, parse_sizes,
    record_as_a_warm_engine, require_positive, time_greedy_decode, token_source)

SIDES = ("float32 weights", "16-bit weights")
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "seed": 0}


def build_engine(model: str | None, keep_16bit: bool, max_len: int, max_seqs: int, seed: int, kv_memory: str):
    from fp8serve import LLM

    with narrow_weights(keep=keep_16bit):
        llm = LLM(model=model, dtype="float32", max_model_len=max_len, max_num_seqs=max_seqs, device="cpu",
                  seed=seed, kv_cache_memory=kv_memory)
    engine = llm.llm_engine
    record_as_a_warm_engine(engine)
    return engine


def weight_bytes(engine) -> tuple[float, float]:
    """MiB of (plain weights of linears and the LM head/embedding, oneDNN's packed copies), each counted once."""
    plain, packed = {}, {}
    for m in engine.model_runner.model.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2:
            plain[id(w)] = w.numel() * w.element_size()
        p = getattr(m, "weight_packed", None)
        if isinstance(p, torch.Tensor) and isinstance(w, torch.Tensor):
            packed[id(w)] = w.numel() * p.element_size()
    return sum(plain.values()) / 2**20, sum(packed.values()) / 2**20


def time_prefill(engine, prompt: list[int]) -> float:
    from fp8serve import SamplingParams

    engine.add_request(engine.new_request_id(), {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=1, temperature=0.0))
    t = time.perf_counter()
    engine.step()
    dt = time.perf_counter() - t
    while engine.has_unfinished_requests():
        engine.step()
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a bf16 or fp16 checkpoint (default: the built-in default model)")
    p.add_argument("--decode-batch", default="1,4,8,16,32,64", help="comma-separated decode batch sizes")
    p.add_argument("--sampled", action="store_true", help="also time sampled decode (temperature 0.7, top_p 0.9)")
    p.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill cell (0: none)")
    p.add_argument("--decode-context", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=12, help="timed decode steps per cell and round (median)")
    p.add_argument("--kv-cache-memory", default="1GiB", help="each engine's")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, help="also write the table (markdown) here")
    args = p.parse_args()
    require_positive(p, args, "decode_context", "decode_steps", "rounds")
    batches = parse_sizes(p, "--decode-batch", args.decode_batch, allow_empty=True)
    if args.prefill_len < 0:
        p.error(f"--prefill-len must be >= 0, got {args.prefill_len}")
    max_len = max(args.decode_context + args.decode_steps + 64, args.prefill_len + 8)
    max_seqs = max(64, *batches) if batches else 64
    engines = {side: build_engine(args.model, side == SIDES[1], max_len, max_seqs, args.seed,
                                       args.kv_cache_memory) for side in SIDES}
    runner = engines[SIDES[1]].model_runner
    kept = runner.model.model.layers[0].mlp.gate_up_proj.weight.dtype
    if kept == torch.float32:
        sys.exit(f"{runner.config.model_config.model}: the engine does not keep this checkpoint's weights at 16 bits "
                 "here (not a bf16 / fp16 checkpoint, no C++ kernels, or FP8SERVE_16BIT_WEIGHTS=0): nothing to compare")
    rng = random.Random(args.seed)
    draw = token_source(engines[SIDES[0]], "text")
    lines = [f"Command: `{command_line()}`", "", *(f"- {x}" for x in describe_machine(machine_info())),
             f"- model {runner.config.model_config.model}, float32 compute, 16-bit weights kept as {kept}; medians of "
             f"{args.rounds} ABBA rounds"]
    for side, engine in engines.items():
        plain, packed = weight_bytes(engine)
        lines.append(f"- {side}: plain weights {plain:.0f} MiB, oneDNN packed copies {packed:.0f} MiB")
    lines += ["", f"| cell | {SIDES[0]} ms | {SIDES[1]} ms | speedup | same tokens |", "|---|---|---|---|---|"]
    cells = [(b, None) for b in batches] + ([(b, SAMPLED) for b in batches] if args.sampled else [])
    with torch.inference_mode():
        for batch, sampling in cells:
            prompts = [draw(args.decode_context, rng) for _ in range(batch)]
            toks: dict[str, list] = {}

            def decode(side: str) -> float:
                t, toks[side] = time_greedy_decode(engines[side], prompts, args.decode_steps, sampling=sampling)
                return t

            med = alternate({side: (lambda s=side: decode(s)) for side in SIDES}, args.rounds)
            a, b = med[SIDES[0]], med[SIDES[1]]
            kind = "greedy" if sampling is None else "t 0.7 / top_p 0.9"
            lines.append(f"| decode step, batch {batch} x ~{args.decode_context}, {kind} | {1e3 * a:.2f} | "
                         f"{1e3 * b:.2f} | {a / b:.2f}x | {'yes' if toks[SIDES[0]] == toks[SIDES[1]] else 'no'} |")
            print(lines[-1], file=sys.stderr, flush=True)
        if args.prefill_len:
            prompt = draw(args.prefill_len, rng)
            med = alternate({side: (lambda s=side: time_prefill(engines[s], prompt)) for side in SIDES}, args.rounds)
            a, b = med[SIDES[0]], med[SIDES[1]]
            lines.append(f"| prefill step, 1 x {args.prefill_len} | {1e3 * a:.1f} | {1e3 * b:.1f} | {a / b:.2f}x | - |")
            print(lines[-1], file=sys.stderr, flush=True)
    emit_table(lines, args.output)


if __name__ == "__main__":
    main()
