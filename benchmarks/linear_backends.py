#!/usr/bin/env python
"""The GEMMs a float32 or bf16 linear layer can run on CPU, side by side on the
default model's projection shapes: torch's `F.linear` (MKL sgemm for float32,
oneDNN for bf16), oneDNN's pointwise linear (`fp8serve.kernels.onednn_linear`),
the same on weights packed once ("oneDNN packed", as the engine keeps them on
AMD CPUs without AMX) and, at up to 32 rows, our dense_gemv.

1. Hot: each shape (K -> N of qkv_proj, o_proj, gate_up_proj, down_proj) at
   --rows activation rows, the same weight every call (prefill: arithmetic
   bound). GFLOP/s = 2 M K N / time.
2. Cold: the 120 decode linears of 30 layers, every call reading its weight
   from memory (weights on 2 MiB pages as the engine packs them), at
   --decode-rows rows. ms per pass.

Every variant of a cell runs in the same ABBA rounds (`bench_common.alternate`,
medians of --rounds). Also the max relative error of each variant against
float64 at 512 rows.

    .venv/bin/python benchmarks/linear_backends.py
    .venv/bin/python benchmarks/linear_backends.py --rows 512 --decode-rows 32,64 --rounds 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import alternate, command_line, describe_machine, machine_info  # noqa: E402
from dense_gemv import SHAPES, packed_weights  # noqa: E402

from fp8serve.kernels import cpu_ops, onednn_linear  # noqa: E402

NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
DTYPES = (torch.float32, torch.bfloat16)
GEMV_MAX_ROWS = 32


_PACKED: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _packed(w: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of `w`, made once per weight (before timing: see `prepack`)."""
    hit = _PACKED.get(id(w))
    if hit is None or hit[0] is not w:
        hit = _PACKED[id(w)] = (w, onednn_linear.pack_weight(w))
    return hit[1]


def prepack(ws) -> None:
    for w in ws:
        if onednn_linear.packing_available(w.dtype):
            _packed(w)


def variants(m: int, dtype: torch.dtype = torch.float32) -> dict:
    out = {"F.linear": lambda x, w: F.linear(x, w)}
    if onednn_linear.is_available(dtype):
        out["oneDNN"] = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    if onednn_linear.packing_available(dtype):
        out["oneDNN packed"] = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, _packed(w), None, "none", [], "")
    if m <= GEMV_MAX_ROWS and cpu_ops.load_cpu_ops() is not None:
        out["dense_gemv"] = lambda x, w: cpu_ops.dense_gemv(x, w)
    return out


def _timed(fn, calls: int):
    def run():
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) / calls
    return run


def hot(rows: list[int], rounds: int, min_time: float) -> None:
    print("## Hot: one shape, same weight every call (GFLOP/s; ratio = variant / F.linear)\n")
    for dt in DTYPES:
        print(f"### {str(dt).removeprefix('torch.')}\n")
        names = list(variants(max(rows), dt))
        print("| M | shape | " + " | ".join(f"{v} GFLOP/s" for v in names) + " | oneDNN / F.linear |")
        print("|---|---|" + "---|" * (len(names) + 1))
        g = torch.Generator().manual_seed(0)
        for m in rows:
            for name, (k, n) in zip(NAMES, SHAPES):
                x = torch.randn(m, k, generator=g).to(dt)
                w = (torch.randn(n, k, generator=g) * 0.05).to(dt)
                fns = variants(m, dt)
                prepack([w])
                t0 = time.perf_counter()
                fns["F.linear"](x, w)
                calls = max(1, int(min_time / max(time.perf_counter() - t0, 1e-6)))
                med = alternate({v: _timed(lambda f=f: f(x, w), calls) for v, f in fns.items()}, rounds)
                gf = {v: 2 * m * k * n / s / 1e9 for v, s in med.items()}
                ratio = f"{med['F.linear'] / med['oneDNN']:.2f}x" if "oneDNN" in med else "-"
                print(f"| {m} | {name} {k}->{n} | " + " | ".join(f"{gf[v]:.0f}" if v in gf else "-" for v in names)
                      + f" | {ratio} |", flush=True)
        print()


def cold(rows: list[int], rounds: int, layers: int) -> None:
    print(f"## Cold: {4 * layers} decode linears per pass, weights read from memory (ms per pass)\n")
    shapes = [s for _ in range(layers) for s in SHAPES]
    for dt in DTYPES:
        ws = packed_weights(dt, shapes)
        prepack(ws)
        names = list(variants(1, dt))
        print(f"### {str(dt).removeprefix('torch.')} ({sum(w.nbytes for w in ws) / 1e6:.0f} MB of weights)\n")
        print("| M | " + " | ".join(f"{v} ms" for v in names)
              + " | oneDNN / F.linear | dense_gemv / oneDNN | dense_gemv / oneDNN packed |")
        print("|---|" + "---|" * (len(names) + 3))
        for m in rows:
            xs = {k: torch.randn(m, k).to(dt) for k, _ in shapes}

            def run(f):
                t = time.perf_counter()
                for w in ws:
                    f(xs[w.shape[1]], w)
                return time.perf_counter() - t

            med = alternate({v: lambda f=f: run(f) for v, f in variants(m, dt).items()}, rounds)
            r1 = f"{med['F.linear'] / med['oneDNN']:.2f}x" if "oneDNN" in med else "-"
            r2 = f"{med['oneDNN'] / med['dense_gemv']:.2f}x" if "oneDNN" in med and "dense_gemv" in med else "-"
            r3 = (f"{med['oneDNN packed'] / med['dense_gemv']:.2f}x"
                  if "oneDNN packed" in med and "dense_gemv" in med else "-")
            print(f"| {m} | " + " | ".join(f"{med[v] * 1e3:.1f}" if v in med else "-" for v in names)
                  + f" | {r1} | {r2} | {r3} |", flush=True)
        print()


def errors() -> None:
    print("## Max relative error against float64 (512 x 1536 -> 576, float32 inputs)\n")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 1536, generator=g, dtype=torch.float64)
    w = torch.randn(576, 1536, generator=g, dtype=torch.float64)
    ref = x @ w.t()
    for v, f in variants(512).items():
        err = ((f(x.float(), w.float()).double() - ref).abs().max() / ref.abs().max()).item()
        print(f"- {v}: {err:.2e}")
    print()


def _int_list(s: str) -> list[int]:
    try:
        vals = [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {s!r}")
    return vals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=_int_list, default=[24, 64, 128, 256, 512, 2048], help="M of the hot cells")
    p.add_argument("--decode-rows", type=_int_list, default=[16, 24, 32, 48, 64], help="M of the cold cells")
    p.add_argument("--rounds", type=int, default=6, help="ABBA rounds per cell (median)")
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per variant per round, hot cells")
    p.add_argument("--layers", type=int, default=30, help="decoder layers in the cold pass")
    p.add_argument("--skip-cold", action="store_true")
    args = p.parse_args()
    for flag in ("rounds", "layers"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.min_time <= 0:
        p.error(f"--min-time must be > 0, got {args.min_time}")
    print("# Linear backends on CPU\n")
    print(f"Command: `{command_line()}`\n")
    for line in describe_machine(machine_info()):
        print(line)
    print(f"- oneDNN linear available: {onednn_linear.is_available()}; the engine uses it for float32 on this CPU: "
          f"{onednn_linear.applies(torch.empty(64, 8), torch.empty(8, 8))}")
    print(f"- medians of {args.rounds} ABBA rounds per cell\n")
    errors()
    hot(args.rows, args.rounds, args.min_time)
    if not args.skip_cold:
        cold(args.decode_rows, args.rounds, args.layers)


if __name__ == "__main__":
    main()
