#!/usr/bin/env python
"""`amx_linear` (bf16 decode linears on AMX tiles, 8-64 rows) on the default
model's decode shapes, optionally side by side with the kernel as built from
another git revision.

One pass = the 120 decode linears of SmolLM2-135M (30 layers x qkv, o,
gate_up, down) plus the tied LM head (49152 x 576), weights packed on 2 MiB
pages as the engine packs them, so every call reads its weight from memory
(270 MB of bf16 per pass). `--hot` instead repeats one layer's four linears
(7.6 MB), the case of the FP8 checkpoint's decoded tile buffer. Times are
medians over rounds in ABBA order of each build's pass time; with
--baseline-rev both builds must give bit-identical outputs first.

    python benchmarks/amx_linear.py --baseline-rev HEAD~1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import alternate, command_line, describe_machine, machine_info, ops_side_by_side  # noqa: E402

from fp8serve.kernels import amx_linear_ops  # noqa: E402
from fp8serve.kernels.cpu_ops import load_cpu_ops  # noqa: E402
from fp8serve.utils.huge_pages import pack_parameters_on_huge_pages  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of SmolLM2-135M's projections
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def weights(hot: bool, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = SHAPES if hot else SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    holder = torch.nn.Module()
    holder.ws = torch.nn.ParameterList(
        [torch.nn.Parameter((torch.randn(n, k, generator=g) * 0.05).bfloat16(), requires_grad=False)
         for n, k in shapes])
    pack_parameters_on_huge_pages(holder)
    return [p.data for p in holder.ws]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[8, 12, 16, 17, 24, 32, 48, 64])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--hot", action="store_true", help="one layer's linears, repeated (weights stay in cache)")
    p.add_argument("--baseline-rev", help="also time amx_linear as built from this git revision")
    p.add_argument("--output", type=Path, help="also write the table (markdown) here")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    for m in args.rows:
        if not amx_linear_ops.MIN_ROWS <= m <= amx_linear_ops.MAX_ROWS:
            p.error(f"--rows: {m} is outside the kernel's {amx_linear_ops.MIN_ROWS}-{amx_linear_ops.MAX_ROWS}")
    if load_cpu_ops() is None or not amx_linear_ops.is_available():
        sys.exit("amx_linear is unavailable here (no C++ kernels, no AMX in this CPU or build, or tiles refused)")

    fns = ops_side_by_side(load_cpu_ops(), "amx_linear", "amx_linear.cpp", args.baseline_rev)
    ws = weights(args.hot, seed=0)
    passes = 8 if args.hot else 1  # a hot pass is short: several per timing
    nbytes = passes * sum(w.numel() * 2 for w in ws)
    lines = [f"Command: `{command_line()}`", "", *(f"- {x}" for x in describe_machine(machine_info())),
             f"- one pass: {len(ws)} linears, {nbytes / 1e6:.0f} MB of bf16 weights"
             + (" (one layer's, hot, x8)" if args.hot else " (read from memory)"), ""]
    head = ["rows"] + [f"{k} ms" for k in fns] + [f"{k} GB/s" for k in fns]
    if len(fns) == 2:
        head.append("baseline / this tree")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    print("\n".join(lines), flush=True)
    g = torch.Generator().manual_seed(1)
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {w.shape[1] for w in ws}}
        if len(fns) == 2:
            for w in ws[:5]:
                a, b = (f(xs[w.shape[1]], w, None) for f in fns.values())
                if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                    sys.exit(f"the two builds disagree at {m} rows, weight {tuple(w.shape)}")

        def one_pass(f):
            t = time.perf_counter()
            for _ in range(passes):
                for w in ws:
                    f(xs[w.shape[1]], w, None)
            return time.perf_counter() - t

        for f in fns.values():
            one_pass(f)  # warm-up
        t = alternate({k: (lambda f=f: one_pass(f)) for k, f in fns.items()}, args.rounds)
        row = [str(m)] + [f"{1e3 * t[k]:.2f}" for k in fns] + [f"{nbytes / t[k] / 1e9:.1f}" for k in fns]
        if len(fns) == 2:
            row.append(f"{t['baseline'] / t['this tree']:.2f}x")
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    if args.output:
        args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
