#!/usr/bin/env python
"""A bf16 checkpoint under float32 compute (the default model on a CPU
without fast bf16 arithmetic): its linears at decode batches, on the paths
the engine can take, side by side.

1. Ops: the default model's 120 decode linears (30 layers x qkv 576 -> 960,
   o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576), each layer's weight
   distinct, so every call reads its weight from memory as a decode step does
   (212 MB of bf16 per pass, 424 MB as float32). At each --rows:
   - dense_gemv on the plain bf16 rows (8 activation rows per register tile;
     the engine's path up to 32 rows on AMD CPUs before bf16_tiled_gemm);
   - oneDNN on its packed float32 copy (`onednn_linear.pack_weight`: the
     engine's path above those rows, and for prefills);
   - bf16_tiled_gemm on the pair-interleaved bf16 copy
     (gemv_packing.pack_gemv_weight, cpu/bf16_tiled_gemm.cpp).
   A round runs each variant's pass once, in ABBA order; medians of --rounds.
   Also bf16_tiled_gemm's largest error against float64 on the same weights,
   relative to sum |x| |w|.
2. Engine (--engine-batches): two engines on the model, one loaded with
   FP8SERVE_GEMV_PACKED_WEIGHTS=0 (no packed bf16 copies: dense_gemv and
   oneDNN as before), one with the setting as given (auto: bf16_tiled_gemm
   where gemv_packing.float32_packing_applies), greedy decode steps of each
   batch over ~--decode-context tokens alternating (ABBA), with their tokens
   compared.

    .venv/bin/python benchmarks/bf16_tiled_gemm.py
    .venv/bin/python benchmarks/bf16_tiled_gemm.py --rows 16,24,32 --rounds 10 --engine-batches ""
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    alternate, command_line, describe_machine, emit_table, machine_info, parse_sizes, record_as_a_warm_engine,
    require_positive, time_greedy_decode, token_source)

from fp8serve.kernels import cpu_ops, gemv_packing, onednn_linear  # noqa: E402

SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)]
LAYERS = 30
DENSE_GEMV_MAX_ROWS = 32  # what dense_gemv takes at most (cpu_ops.dense_gemv_max_rows on AMD CPUs)


def make_weights(seed: int) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(N, plain bf16 [N, K], oneDNN's packed float32 copy, the bf16_tiled_gemm copy) per linear."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        for _, k, n in SHAPES:
            w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
            out.append((n, w, onednn_linear.pack_weight(w.float()), gemv_packing.pack_gemv_weight(w)))
    return out


def ops_table(args, lines: list[str]) -> None:
    ops = cpu_ops.load_cpu_ops()
    weights = make_weights(args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    flop_per_row = 2 * LAYERS * sum(k * n for _, k, n in SHAPES)
    lines += ["", "Ops: 120 decode linears read from memory (bf16 weights, float32 x); ms per pass (GFLOP/s)", "",
              "| rows | dense_gemv (plain bf16) | oneDNN (packed float32) | bf16_tiled_gemm | tiled vs dense_gemv | "
              "tiled vs oneDNN | tiled max error / sum abs(x) abs(w) |",
              "|---|---|---|---|---|---|---|"]
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g) for _, k, _ in SHAPES}

        def pass_of(kind: str):
            def run() -> float:
                t = time.perf_counter()
                for n, w, packed_f32, packed_bf16 in weights:
                    x = xs[w.shape[1]]
                    if kind == "gemv":
                        ops.dense_gemv(x, w, None)
                    elif kind == "onednn":
                        torch.ops.mkldnn._linear_pointwise(x, packed_f32, None, "none", [], "")
                    else:
                        ops.bf16_tiled_gemm(x, packed_bf16, n, None)
                return time.perf_counter() - t
            return run

        kinds = (["gemv"] if m <= DENSE_GEMV_MAX_ROWS else []) + ["onednn", "tiled"]
        for k in kinds:
            pass_of(k)()  # warm-up: page faults, oneDNN's primitive cache
        med = alternate({k: pass_of(k) for k in kinds}, args.rounds)
        worst = 0.0
        for n, w, _, packed_bf16 in weights[:len(SHAPES)]:
            x = xs[w.shape[1]]
            ref = x.double() @ w.double().t()
            err = (ops.bf16_tiled_gemm(x, packed_bf16, n, None).double() - ref).abs()
            worst = max(worst, float((err / (x.double().abs() @ w.double().abs().t())).max()))

        def cell(k: str) -> str:
            return f"{1e3 * med[k]:.1f} ({m * flop_per_row / med[k] / 1e9:.0f})" if k in med else "-"

        vs_gemv = f"{med['gemv'] / med['tiled']:.2f}x" if "gemv" in med else "-"
        lines.append(f"| {m} | {cell('gemv')} | {cell('onednn')} | {cell('tiled')} | {vs_gemv} | "
                     f"{med['onednn'] / med['tiled']:.2f}x | {worst:.1e} |")
        print(lines[-1], file=sys.stderr, flush=True)


def build_engine(model: str | None, packed: str, max_len: int, max_seqs: int, args):
    from fp8serve import LLM

    before = os.environ.get(gemv_packing.PACKED_WEIGHTS_ENV)
    os.environ[gemv_packing.PACKED_WEIGHTS_ENV] = packed
    try:
        llm = LLM(model=model, dtype="float32", kv_cache_dtype=args.kv_cache_dtype, max_model_len=max_len,
                  max_num_seqs=max_seqs, device="cpu", seed=args.seed, kv_cache_memory=args.kv_cache_memory)
    finally:
        if before is None:
            os.environ.pop(gemv_packing.PACKED_WEIGHTS_ENV)
        else:
            os.environ[gemv_packing.PACKED_WEIGHTS_ENV] = before
    engine = llm.llm_engine
    record_as_a_warm_engine(engine)
    return engine


def engine_table(args, lines: list[str]) -> None:
    setting = os.environ.get(gemv_packing.PACKED_WEIGHTS_ENV, "auto")
    sides = {"without packed bf16 copies": "0", f"{gemv_packing.PACKED_WEIGHTS_ENV}={setting}": setting}
    max_len = args.decode_context + args.decode_steps + 16
    engines = {name: build_engine(args.model, value, max_len, max(args.engine_batches), args)
               for name, value in sides.items()}
    names = list(engines)
    tiled = engines[names[1]].model_runner.model.model.layers[0].mlp.gate_up_proj.weight_gemv_packed is not None
    lines += ["", f"Engine: decode steps, greedy, ~{args.decode_context} tokens of context, KV "
              f"{args.kv_cache_dtype}; medians of {args.rounds} ABBA rounds of the median of {args.decode_steps} "
              f"steps. Second engine's linears have packed bf16 copies: {'yes' if tiled else 'NO'}", "",
              f"| batch | {names[0]} ms | {names[1]} ms | speedup | same tokens |", "|---|---|---|---|---|"]
    rng = random.Random(args.seed)
    draw = token_source(engines[names[0]], "text")
    for batch in args.engine_batches:
        prompts = [draw(args.decode_context, rng) for _ in range(batch)]
        toks: dict[str, list] = {}

        def decode(name: str) -> float:
            t, toks[name] = time_greedy_decode(engines[name], prompts, args.decode_steps)
            return t

        med = alternate({name: (lambda s=name: decode(s)) for name in names}, args.rounds)
        a, b = med[names[0]], med[names[1]]
        lines.append(f"| {batch} | {1e3 * a:.1f} | {1e3 * b:.1f} | {a / b:.2f}x | "
                     f"{'yes' if toks[names[0]] == toks[names[1]] else 'no'} |")
        print(lines[-1], file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8,16,17,20,24,32,48,64,96,128,192,256,512",
                   help="activation rows of the ops table (empty: none)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--engine-batches", default="24,64,128", help="decode batches of the engine table (empty: none)")
    p.add_argument("--model", default=None, help="a bf16 checkpoint (default: the built-in default model)")
    p.add_argument("--kv-cache-dtype", default="fp8")
    p.add_argument("--kv-cache-memory", default="2GiB", help="each engine's")
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, help="also write the tables (markdown) here")
    args = p.parse_args()
    require_positive(p, args, "rounds", "decode_context", "decode_steps")
    args.rows = parse_sizes(p, "--rows", args.rows, allow_empty=True)
    args.engine_batches = parse_sizes(p, "--engine-batches", args.engine_batches, allow_empty=True)
    if not cpu_ops.bf16_tiled_gemm_built():
        sys.exit("bf16_tiled_gemm is not built here (the C++ kernels need AVX2 and FMA): nothing to compare")
    lines = [f"Command: `{command_line()}`", "", *(f"- {x}" for x in describe_machine(machine_info()))]
    with torch.inference_mode():
        if args.rows:
            ops_table(args, lines)
        if args.engine_batches:
            engine_table(args, lines)
    emit_table(lines, args.output)


if __name__ == "__main__":
    main()
