#!/usr/bin/env python
"""`amx_fp8_linear` (FP8 e4m3 decode linears on AMX tiles, bf16 activations)
against the path FP8 checkpoints took before it on AMX CPUs, side by side.

1. Ops (--rows): one pass = the default model's 120 decode linears (30 layers x
   qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576), each
   layer's codes distinct (106 MB per pass, read from memory or the last-level
   cache as a decode step reads them), at each row count:
   - before: `fp8_linear_ops` as it routed bf16 x on AMX before this kernel:
     the fused FP8 kernel (fp8_gemm.cpp, float32 FMAs) up to 12 rows, then the
     whole weight dequantized to a bf16 buffer and `amx_linear` over it;
   - amx_fp8_linear: this tree's kernel (each AMX weight tile decoded to bf16
     right before it is multiplied);
   - with --baseline-rev REV, also amx_fp8_linear.cpp as of git revision REV.
   A round runs each variant's pass once, ABBA order; medians of --rounds.
2. Engine (--engine-batches): two engines on an FP8 checkpoint (--fp8-model, or
   the default model's, written once as single_stream.py writes it), dtype
   auto, one routing bf16 x as before and one with amx_fp8_linear (the routing
   is switched around each engine's own steps, so each records its forwards on
   its own path); decode steps of each batch over ~--decode-context tokens,
   greedy, alternating (ABBA), medians of --rounds rounds of the median of
   --decode-steps steps. The two paths round differently (amx_fp8_linear scales
   a float32 sum once; before, each weight was rounded to bf16 first), so
   greedy near-ties may pick other tokens: "same tokens" counts requests whose
   tokens all agree.

    python benchmarks/amx_fp8_linear.py
    python benchmarks/amx_fp8_linear.py --rows 8,16 --engine-batches '' --baseline-rev HEAD
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
    alternate, build_kernel_at_rev, command_line, describe_machine, emit_table, machine_info, parse_sizes,
    record_as_a_warm_engine, require_positive, time_greedy_decode, token_source,
)

from fp8serve.kernels import amx_linear_ops, fp8_linear_ops  # noqa: E402
from fp8serve.kernels.cpu_ops import load_cpu_ops  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of SmolLM2-135M's projections
LAYERS = 30
BEFORE_FUSED_ROWS = 12  # fp8_linear_ops._MAX_FUSED_ROWS_AMX_BF16: the fused kernel's rows before


def codes(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in SHAPES * LAYERS:
        w = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
        w = torch.where((w & 0x7F) == 0x7F, w ^ 0x01, w)  # no NaN codes
        out.append((w, torch.rand(n, generator=g) * 1e-2 + 1e-4))
    return out


def before_path(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What fp8_linear_ops ran for bf16 x on AMX before amx_fp8_linear."""
    ops = load_cpu_ops()
    if x.shape[0] <= BEFORE_FUSED_ROWS:
        return ops.fp8_linear(x, w, scale, None)
    return fp8_linear_ops._dequantize_and_matmul(ops, x, w, scale, None)


class Routing:
    """Switches fp8_linear_ops between the path before (False) and amx_fp8_linear (True)."""

    def __init__(self) -> None:
        self.real = amx_linear_ops.fp8_is_available

    def use(self, on: bool) -> None:
        amx_linear_ops.fp8_is_available = self.real if on else (lambda: False)
        fp8_linear_ops._fused_rows_by_dtype.cache_clear()


def ops_table(args, lines: list[str]) -> None:
    ops = load_cpu_ops()
    fns = {"before": before_path, "amx_fp8_linear": lambda x, w, s: ops.amx_fp8_linear(x, w, s, None)}
    if args.baseline_rev:
        base = build_kernel_at_rev(args.baseline_rev, "amx_fp8_linear.cpp", "fp8serve_base")
        fns[f"amx_fp8_linear at {args.baseline_rev}"] = lambda x, w, s: base.amx_fp8_linear(x, w, s, None)
    layers = codes(seed=0)
    nbytes = sum(w.numel() for w, _ in layers)
    names = list(fns)
    lines += ["Ops: 120 decode linears, distinct e4m3 codes (bf16 x); ms per pass (GB/s of codes)", "",
              "| rows | " + " | ".join(names) + " | amx_fp8_linear vs before |"
              + (" vs baseline |" if args.baseline_rev else ""),
              "|---|" + "---|" * (len(names) + 1 + bool(args.baseline_rev))]
    g = torch.Generator().manual_seed(1)
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for _, k in SHAPES}

        def one_pass(f) -> float:
            t = time.perf_counter()
            for w, s in layers:
                f(xs[w.shape[1]], w, s)
            return time.perf_counter() - t

        for f in fns.values():
            one_pass(f)  # warm-up
        t = alternate({k: (lambda f=f: one_pass(f)) for k, f in fns.items()}, args.rounds)
        row = [str(m)] + [f"{1e3 * t[k]:.2f} ({nbytes / t[k] / 1e9:.1f})" for k in names]
        row.append(f"{t['before'] / t['amx_fp8_linear']:.2f}x")
        if args.baseline_rev:
            row.append(f"{t[names[2]] / t['amx_fp8_linear']:.2f}x")
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], file=sys.stderr, flush=True)


def engine_table(args, lines: list[str]) -> None:
    routing = Routing()
    try:
        engine_rows(args, lines, routing)
    finally:
        routing.use(True)  # this process's routing as it was


def engine_rows(args, lines: list[str], routing: Routing) -> None:
    from fp8serve import LLM

    if args.fp8_model:
        fp8_dir = Path(args.fp8_model)
    else:
        from single_stream import fp8_checkpoint
        fp8_dir = fp8_checkpoint(None, None)
    engines = {}
    for name, on in (("before", False), ("amx_fp8_linear", True)):
        routing.use(on)
        llm = LLM(model=str(fp8_dir), dtype="auto", max_model_len=args.decode_context + args.decode_steps + 16,
                  max_num_seqs=max(args.engine_batches), device="cpu", seed=0, kv_cache_memory=args.kv_cache_memory,
                  kv_cache_dtype=args.kv_cache_dtype)
        record_as_a_warm_engine(llm.llm_engine)
        engines[name] = (llm.llm_engine, on)
    lines += ["", f"Engine decode steps, {fp8_dir.name}, dtype auto, KV {args.kv_cache_dtype}, greedy, "
              f"~{args.decode_context} tokens of context; ms per step, medians of {args.rounds} ABBA rounds", "",
              "| batch | before ms | amx_fp8_linear ms | speedup | requests with the same tokens |",
              "|---|---|---|---|---|"]
    rng = random.Random(args.seed)
    draw = token_source(engines["before"][0], "text")
    for batch in args.engine_batches:
        prompts = [draw(args.decode_context, rng) for _ in range(batch)]
        toks: dict[str, list] = {}

        def decode(name: str) -> float:
            engine, on = engines[name]
            routing.use(on)
            t, toks[name] = time_greedy_decode(engine, prompts, args.decode_steps)
            return t

        for name in engines:
            decode(name)  # warm-up: records this batch size's forward
        med = alternate({name: (lambda s=name: decode(s)) for name in engines}, args.rounds)
        same = sum(a == b for a, b in zip(toks["before"], toks["amx_fp8_linear"]))
        lines.append(f"| {batch} | {1e3 * med['before']:.2f} | {1e3 * med['amx_fp8_linear']:.2f} | "
                     f"{med['before'] / med['amx_fp8_linear']:.2f}x | {same}/{batch} |")
        print(lines[-1], file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,5,8,12,16,32,48,64", help="activation rows of the ops table (empty: none)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--baseline-rev", help="the ops table also times amx_fp8_linear.cpp as of this git revision")
    p.add_argument("--engine-batches", default="1,4,5,8,12,16,32,64", help="decode batches (empty: no engine table)")
    p.add_argument("--fp8-model", help="FP8 checkpoint directory (default: the default model's, written once)")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--decode-context", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, help="also write the tables (markdown) here")
    args = p.parse_args()
    require_positive(p, args, "rounds", "decode_context", "decode_steps")
    args.rows = parse_sizes(p, "--rows", args.rows, allow_empty=True)
    args.engine_batches = parse_sizes(p, "--engine-batches", args.engine_batches, allow_empty=True)
    for m in args.rows:
        if not 1 <= m <= amx_linear_ops.MAX_ROWS:
            p.error(f"--rows: {m} is outside the kernel's 1-{amx_linear_ops.MAX_ROWS}")
    if any(b > amx_linear_ops.MAX_ROWS for b in args.engine_batches):
        p.error(f"--engine-batches: at most {amx_linear_ops.MAX_ROWS} (the kernel's rows)")
    if load_cpu_ops() is None or not amx_linear_ops.fp8_is_available():
        sys.exit("amx_fp8_linear is unavailable here (no C++ kernels, no AMX or AVX512-VBMI in this CPU or build, "
                 "or tiles refused)")
    lines = [f"Command: `{command_line()}`", "", *(f"- {x}" for x in describe_machine(machine_info())), ""]
    if args.rows:
        ops_table(args, lines)
    if args.engine_batches:
        engine_table(args, lines)
    emit_table(lines, args.output)


if __name__ == "__main__":
    main()
