#!/usr/bin/env python
"""The MLP activation (`fp8serve::silu_and_mul`: silu(gate) * up over the
gate_up projection's output), optionally side by side with the same op built
from another git revision.

Cells: dtype (float32, bfloat16) x rows per call (decode batches and prefill
chunks) at the default model's intermediate size (1536: the input is 3072
wide). Times are medians over rounds in ABBA order of per-round median call
times (the op on a preallocated output, hot input). Each cell also gives the
largest relative error against float64 of each build, and with
--baseline-rev the largest relative difference between the two builds
(float32 results need not be bit-identical: its fast path is not
torch's arithmetic; bf16 must be, and the script stops if it is not).

    python benchmarks/silu_and_mul.py                       # this tree only
    python benchmarks/silu_and_mul.py --baseline-rev HEAD~1 # and the op as of HEAD~1, side by side
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    alternate, command_line, describe_machine, machine_info, ops_side_by_side, require_positive)

from fp8serve.kernels.cpu_ops import load_cpu_ops  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def median_call(f, calls: int) -> float:
    for _ in range(3):
        f()
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max(|ref|, 1e-30) over elements whose reference is a normal float32."""
    ref = ref.double()
    keep = ref.abs() > 1e-30
    return float(((got.double() - ref).abs()[keep] / ref.abs()[keep]).max()) if bool(keep.any()) else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 512, 2048])
    p.add_argument("--intermediate-size", type=int, default=1536)
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=list(DTYPES))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--baseline-rev", help="also time the op as built from this git revision")
    p.add_argument("--output", type=Path, help="also write the table (markdown) here")
    args = p.parse_args()
    require_positive(p, args, "intermediate_size", "rounds")
    if min(args.rows) < 1:
        p.error(f"--rows must all be >= 1, got {args.rows}")
    for name in args.dtypes:
        if name not in DTYPES:
            p.error(f"--dtypes: unknown dtype {name!r}, expected one of {', '.join(DTYPES)}")

    ops = load_cpu_ops()
    if ops is None:
        sys.exit("the C++ CPU kernels are unavailable on this machine (see the warning above)")
    fns = ops_side_by_side(ops, "silu_and_mul", "layer_ops.cpp", args.baseline_rev)
    g = torch.Generator().manual_seed(0)
    d = args.intermediate_size
    lines = [f"Command: `{command_line()}`", "", *(f"- {x}" for x in describe_machine(machine_info())),
             f"- shapes: rows x {2 * d} in, rows x {d} out; gate and up ~ N(0, 3^2); torch threads "
             f"{torch.get_num_threads()}", ""]
    head = ["dtype", "rows"] + [f"{k} us" for k in fns]
    if len(fns) == 2:
        head.append("baseline / this tree")
    head += [f"{k} max rel err vs float64" for k in fns]
    if len(fns) == 2:
        head.append("max rel diff between builds")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    print("\n".join(lines), flush=True)
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for rows in args.rows:
            x = (torch.randn(rows, 2 * d, generator=g) * 3).to(dtype)
            gate, up = x[:, :d].double(), x[:, d:].double()
            ref = gate / (1 + torch.exp(-gate)) * up
            outs = {name: torch.empty(rows, d, dtype=dtype) for name in fns}
            calls = {name: (lambda f=f, o=outs[name]: f(o, x)) for name, f in fns.items()}
            for f in calls.values():
                f()
            errs = {name: relative_error(o, ref) for name, o in outs.items()}
            diff = None
            if len(fns) == 2:
                a, b = outs.values()
                if dtype != torch.float32 and not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                    sys.exit(f"the two builds gave different {dname} bits at {rows} rows")
                diff = relative_error(b, a)
            n = max(20, min(2000, 400_000 // rows))
            t = alternate({k: (lambda f=f: median_call(f, n)) for k, f in calls.items()}, args.rounds)
            row = [dname, str(rows)] + [f"{1e6 * t[name]:.1f}" for name in fns]
            if len(fns) == 2:
                row.append(f"{t['baseline'] / t['this tree']:.2f}x")
            row += [f"{errs[name]:.2e}" for name in fns]
            if diff is not None:
                row.append(f"{diff:.2e}")
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
    if args.output:
        args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
