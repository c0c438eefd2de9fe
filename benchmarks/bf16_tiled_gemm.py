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
   - with --baseline-rev REV, also bf16_tiled_gemm.cpp as of git revision
     REV (built beside this tree's, bench_common.build_kernel_at_rev), and
     whether the two give the same bits.
   A round runs each variant's pass once, in ABBA order; medians of --rounds.
   Also bf16_tiled_gemm's largest error against float64 on the same weights,
   relative to sum |x| |w|.
2. LM head (--head-rows): the default model's tied 49152 x 576 bf16 head,
   read from memory (a fresh copy per call, as a decode step's head comes cold),
   on oneDNN's packed float32 copy (the bf16 checkpoint's path before
   bf16_tiled_gemm took its head), dense_gemv over slices of 32 rows (an FP8
   checkpoint's bf16 head before) and bf16_tiled_gemm.
3. Large K (--llama-rows): the same three paths (no dense_gemv) on one
   weight of each Llama-3-8B linear shape (qkv 4096 -> 6144, o 4096 -> 4096,
   gate_up 4096 -> 28672, down 14336 -> 4096), where bf16_tiled_gemm splits K
   into blocks of at most 4096.
4. Engine (--engine-batches, --engine-prefills): two engines on the model, one
   loaded with FP8SERVE_GEMV_PACKED_WEIGHTS=0 (no packed bf16 copies:
   dense_gemv, and oneDNN on a packed float32 copy above its rows), one with
   the setting as given (auto: bf16_tiled_gemm where
   gemv_packing.float32_packing_applies, from 3 rows on AVX2 AMD CPUs, decode
   batches and prefills, and for gemv_packing.float32_rows_beside_onednn
   beside oneDNN's float32 copy on AVX-512 CPUs), alternating
   (ABBA): decode steps of each batch over ~--decode-context tokens (greedy,
   or sampled at --engine-temperature, which reads the whole LM head),
   and prefill steps of each cell (sequences x prompt tokens in one step,
   max_tokens=1), with their tokens compared. With --engine-head-only both
   engines have the packed copies and differ in the LM head alone: the first
   engine's head has oneDNN's packed float32 copy instead of its bf16 one (the
   head's paths before bf16_tiled_gemm took it).

    .venv/bin/python benchmarks/bf16_tiled_gemm.py
    .venv/bin/python benchmarks/bf16_tiled_gemm.py --rows 16,24,32 --rounds 10 --engine-batches "" --engine-prefills ""
    .venv/bin/python benchmarks/bf16_tiled_gemm.py --rows 16,64,512 --baseline-rev HEAD~1 --engine-batches "" \
        --engine-prefills ""
    .venv/bin/python benchmarks/bf16_tiled_gemm.py --rows 512,2048 --llama-rows 512 --engine-batches "" \
        --engine-prefills 1x512,4x512
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
    alternate, build_kernel_at_rev, command_line, describe_machine, emit_table, machine_info, parse_cells, parse_sizes,
    record_as_a_warm_engine,
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
    base = build_kernel_at_rev(args.baseline_rev, "bf16_tiled_gemm.cpp", "fp8serve_base") if args.baseline_rev else None
    flop_per_row = 2 * LAYERS * sum(k * n for _, k, n in SHAPES)
    rev = f"bf16_tiled_gemm at {args.baseline_rev}"
    lines += ["", "Ops: 120 decode linears read from memory (bf16 weights, float32 x); ms per pass (GFLOP/s)", "",
              "| rows | dense_gemv (plain bf16) | oneDNN (packed float32) | bf16_tiled_gemm | tiled vs dense_gemv | "
              "tiled vs oneDNN | tiled max error / sum abs(x) abs(w) |"
              + (f" {rev} | tiled vs {args.baseline_rev} | same bits as {args.baseline_rev} |" if base else ""),
              "|---|---|---|---|---|---|---|" + ("---|---|---|" if base else "")]
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
                    elif kind == "base":
                        base.bf16_tiled_gemm(x, packed_bf16, n, None)
                    else:
                        ops.bf16_tiled_gemm(x, packed_bf16, n, None)
                return time.perf_counter() - t
            return run

        kinds = (["gemv"] if m <= DENSE_GEMV_MAX_ROWS else []) + ["onednn", "tiled"] + (["base"] if base else [])
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
        row = (f"| {m} | {cell('gemv')} | {cell('onednn')} | {cell('tiled')} | {vs_gemv} | "
               f"{med['onednn'] / med['tiled']:.2f}x | {worst:.1e} |")
        if base:
            same = all(torch.equal(ops.bf16_tiled_gemm(xs[w.shape[1]], pk, n, None),
                                   base.bf16_tiled_gemm(xs[w.shape[1]], pk, n, None))
                       for n, w, _, pk in weights[:len(SHAPES)])
            row += f" {cell('base')} | {med['base'] / med['tiled']:.3f}x | {'yes' if same else 'no'} |"
        lines.append(row)
        print(lines[-1], file=sys.stderr, flush=True)


HEAD_SHAPE = (49152, 576)
HEAD_COPIES = 6  # > L3: every call reads its head from memory


def head_table(args, lines: list[str]) -> None:
    ops = cpu_ops.load_cpu_ops()
    g = torch.Generator().manual_seed(args.seed + 3)
    n, k = HEAD_SHAPE
    heads = []
    for _ in range(HEAD_COPIES):
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        heads.append((w, onednn_linear.pack_weight(w.float()), gemv_packing.pack_gemv_weight(w)))
    lines += ["", f"LM head {n} x {k} (bf16 weights, float32 x), read from memory; ms per call (GFLOP/s)", "",
              "| rows | oneDNN (packed float32) | dense_gemv, slices of 32 rows | bf16_tiled_gemm | tiled vs oneDNN | "
              "tiled vs slices |", "|---|---|---|---|---|---|"]
    for m in args.head_rows:
        x = torch.randn(m, k, generator=g)
        turn = [0]

        def call(kind: str):
            def run() -> float:
                w, packed_f32, packed_bf16 = heads[turn[0] % HEAD_COPIES]
                turn[0] += 1
                t = time.perf_counter()
                if kind == "onednn":
                    torch.ops.mkldnn._linear_pointwise(x, packed_f32, None, "none", [], "")
                elif kind == "slices":
                    torch.cat([ops.dense_gemv(x[i:i + DENSE_GEMV_MAX_ROWS], w, None)
                               for i in range(0, m, DENSE_GEMV_MAX_ROWS)])
                else:
                    ops.bf16_tiled_gemm(x, packed_bf16, n, None)
                return time.perf_counter() - t
            return run

        kinds = ("onednn", "slices", "tiled")
        for kind in kinds:
            call(kind)()
        med = alternate({kind: call(kind) for kind in kinds}, args.rounds * 2)

        def cell(kind: str) -> str:
            return f"{1e3 * med[kind]:.2f} ({2 * m * n * k / med[kind] / 1e9:.0f})"

        lines.append(f"| {m} | {cell('onednn')} | {cell('slices')} | {cell('tiled')} | "
                     f"{med['onednn'] / med['tiled']:.2f}x | {med['slices'] / med['tiled']:.2f}x |")
        print(lines[-1], file=sys.stderr, flush=True)


LLAMA_SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]


def llama_table(args, lines: list[str]) -> None:
    ops = cpu_ops.load_cpu_ops()
    g = torch.Generator().manual_seed(args.seed + 2)
    lines += ["", "Large K: one weight of each Llama-3-8B linear shape (bf16, float32 x); ms per call (GFLOP/s)", "",
              "| shape (K -> N) | rows | oneDNN (packed float32) | bf16_tiled_gemm | tiled vs oneDNN |",
              "|---|---|---|---|---|"]
    for name, k, n in LLAMA_SHAPES:
        w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
        packed_f32, packed_bf16 = onednn_linear.pack_weight(w.float()), gemv_packing.pack_gemv_weight(w)
        for m in args.llama_rows:
            x = torch.randn(m, k, generator=g)

            def call(kind: str):
                def run() -> float:
                    t = time.perf_counter()
                    if kind == "onednn":
                        torch.ops.mkldnn._linear_pointwise(x, packed_f32, None, "none", [], "")
                    else:
                        ops.bf16_tiled_gemm(x, packed_bf16, n, None)
                    return time.perf_counter() - t
                return run

            for kind in ("onednn", "tiled"):
                call(kind)()
            med = alternate({kind: call(kind) for kind in ("onednn", "tiled")}, args.rounds)
            gf = {kind: 2 * m * k * n / med[kind] / 1e9 for kind in med}
            lines.append(f"| {name} ({k} -> {n}) | {m} | {1e3 * med['onednn']:.1f} ({gf['onednn']:.0f}) | "
                         f"{1e3 * med['tiled']:.1f} ({gf['tiled']:.0f}) | {med['onednn'] / med['tiled']:.2f}x |")
            print(lines[-1], file=sys.stderr, flush=True)
        del w, packed_f32, packed_bf16


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


def time_prefill(engine, prompts: list[list[int]]) -> tuple[float, list[int]]:
    """Seconds of one engine step that prefills every prompt (max_tokens=1), and the first tokens."""
    from fp8serve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, sp).request_id for p in prompts]
    t = time.perf_counter()
    outs = {o.request_id: o for o in engine.step()}
    dt = time.perf_counter() - t
    if set(outs) != set(ids) or engine.has_unfinished_requests():
        raise RuntimeError("a prefill step did not finish its requests in one step: raise --kv-cache-memory")
    return dt, [outs[i].outputs[0].token_ids[0] for i in ids]


def engine_table(args, lines: list[str]) -> None:
    setting = os.environ.get(gemv_packing.PACKED_WEIGHTS_ENV, "auto")
    if args.engine_head_only:
        sides = {"head on a float32 copy": setting, "head on its bf16 copy": setting}
    else:
        sides = {"without packed bf16 copies": "0", f"{gemv_packing.PACKED_WEIGHTS_ENV}={setting}": setting}
    longest = max([n for _, n in args.engine_prefills], default=0)
    max_len = max(args.decode_context + args.decode_steps + 16, longest + 1)
    max_seqs = max([*args.engine_batches, *(s for s, _ in args.engine_prefills)])
    engines = {name: build_engine(args.model, value, max_len, max_seqs, args) for name, value in sides.items()}
    names = list(engines)
    if args.engine_head_only:
        head = engines[names[0]].model_runner.model.lm_head
        if head.weight_gemv_packed is None:
            sys.exit("--engine-head-only: the LM head has no packed bf16 copy here (gemv_packing.float32_packing_applies)")
        # Before the first step, so the recorded decode forwards record this head's paths.
        head.weight_gemv_packed = None
        head.weight_packed = onednn_linear.pack_weight(head.weight.float())
    gate_up = engines[names[1]].model_runner.model.model.layers[0].mlp.gate_up_proj
    tiled = gate_up.weight_gemv_packed is not None
    f32_copy = engines[names[1]].model_runner.model.model.layers[0].mlp.gate_up_proj.weight_packed is not None
    lines += ["", f"Engine: second engine's linears have packed bf16 copies: {'yes' if tiled else 'NO'}; "
              f"float32 copies for oneDNN: {'yes' if f32_copy else 'no'}"]
    rng = random.Random(args.seed)
    draw = token_source(engines[names[0]], "text")
    if args.engine_prefills:
        lines += ["", f"Prefill steps (sequences x prompt tokens in one step, max_tokens=1); medians of "
                  f"{args.rounds} ABBA rounds", "",
                  f"| cell | {names[0]} ms | {names[1]} ms | speedup | same first tokens |", "|---|---|---|---|---|"]
    for seqs, length in args.engine_prefills:
        prompts = [draw(length, rng) for _ in range(seqs)]
        firsts: dict[str, list] = {}

        def prefill(name: str) -> float:
            t, firsts[name] = time_prefill(engines[name], prompts)
            return t

        for name in names:
            prefill(name)  # warm-up: the recorded forward of this size, page faults
        med = alternate({name: (lambda s=name: prefill(s)) for name in names}, args.rounds)
        a, b = med[names[0]], med[names[1]]
        lines.append(f"| {seqs}x{length} | {1e3 * a:.1f} | {1e3 * b:.1f} | {a / b:.2f}x | "
                     f"{'yes' if firsts[names[0]] == firsts[names[1]] else 'no'} |")
        print(lines[-1], file=sys.stderr, flush=True)
    # Sampled steps draw from a seeded generator per request, so both engines draw alike.
    sampling = {"temperature": args.engine_temperature, "seed": args.seed} if args.engine_temperature else None
    kind = f"sampled at temperature {args.engine_temperature}" if sampling else "greedy"
    if args.engine_batches:
        lines += ["", f"Decode steps, {kind}, ~{args.decode_context} tokens of context, KV "
                  f"{args.kv_cache_dtype}; medians of {args.rounds} ABBA rounds of the median of {args.decode_steps} "
                  "steps", "", f"| batch | {names[0]} ms | {names[1]} ms | speedup | same tokens |",
                  "|---|---|---|---|---|"]
    for batch in args.engine_batches:
        prompts = [draw(args.decode_context, rng) for _ in range(batch)]
        toks: dict[str, list] = {}

        def decode(name: str) -> float:
            t, toks[name] = time_greedy_decode(engines[name], prompts, args.decode_steps, sampling)
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
    p.add_argument("--baseline-rev", help="the ops table also times bf16_tiled_gemm.cpp as of this git revision")
    p.add_argument("--head-rows", default="", help="activation rows of the LM head table (empty: none)")
    p.add_argument("--llama-rows", default="", help="activation rows of the Llama-3-8B shapes table (empty: none)")
    p.add_argument("--engine-head-only", action="store_true",
                   help="the engine table's two engines differ in the LM head alone (see 4. above)")
    p.add_argument("--engine-temperature", type=float, default=0.0,
                   help="sample the engine table's decode steps at this temperature (0: greedy)")
    p.add_argument("--engine-batches", default="24,64,128", help="decode batches of the engine table (empty: none)")
    p.add_argument("--engine-prefills", default="1x512",
                   help="prefill cells of the engine table, sequences x prompt tokens (empty: none)")
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
    args.llama_rows = parse_sizes(p, "--llama-rows", args.llama_rows, allow_empty=True)
    args.head_rows = parse_sizes(p, "--head-rows", args.head_rows, allow_empty=True)
    if args.engine_temperature < 0:
        p.error(f"--engine-temperature must be >= 0, got {args.engine_temperature}")
    args.engine_prefills = parse_cells(p, "--engine-prefills", args.engine_prefills)
    if args.baseline_rev and not args.rows:
        p.error("--baseline-rev adds columns to the ops table: give it --rows")
    if not cpu_ops.bf16_tiled_gemm_built():
        sys.exit("bf16_tiled_gemm is not built here (the C++ kernels need AVX2 and FMA): nothing to compare")
    lines = [f"Command: `{command_line()}`", "", *(f"- {x}" for x in describe_machine(machine_info()))]
    with torch.inference_mode():
        if args.rows:
            ops_table(args, lines)
        if args.head_rows:
            head_table(args, lines)
        if args.llama_rows:
            llama_table(args, lines)
        if args.engine_batches or args.engine_prefills:
            engine_table(args, lines)
    emit_table(lines, args.output)


if __name__ == "__main__":
    main()
