#!/usr/bin/env python
"""FP8-weight linear layers at many activation rows, float32 activations:
the three ways fp8serve can run one, side by side, and a float32 GEMM on a
float32 copy of the same (decoded) weight for reference.

- fused GEMV: `fp8_linear`'s kernel (decode in registers, up to 8 rows per
  register tile), what decode batches up to `max_fused_rows` run;
- dequant + oneDNN: decode the weight to a float32 buffer, then oneDNN on
  that plain weight (`fp8_linear_ops._dequantize_and_matmul`), the large-M
  path before the tiled GEMM and still the path on AVX-512 builds;
- tiled: `fp8_tiled_gemm` (cpu/fp8_tiled_gemm.cpp), 16 weight rows decoded
  at a time into a panel the register tiles run over;
- float32 packed: oneDNN on a float32 weight packed once (what a float32
  checkpoint runs), four times the weight memory.

Shapes: the default model's (SmolLM2-135M: qkv 576 -> 832, o 576 -> 576,
gate_up 576 -> 3072, down 1536 -> 576), or --shapes llama8b (4096 -> 6144,
4096 -> 4096, 4096 -> 28672, 14336 -> 4096). Weights hot (a prefill reads
each weight once per call and reuses it across rows). Medians over rounds in
ABBA order of each variant's best of 3 calls; the tiled GEMM's result is
checked against float64 every cell (the script stops past 1e-5 of the sum of
|x| |w|).

    python benchmarks/fp8_tiled_gemm.py
    python benchmarks/fp8_tiled_gemm.py --rows 16,24,32 --rounds 12
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import alternate, command_line, describe_machine, machine_info, require_positive  # noqa: E402

from fp8serve.kernels import fp8_linear_ops, onednn_linear  # noqa: E402
from fp8serve.kernels.cpu_ops import load_cpu_ops  # noqa: E402

SHAPES = {
    "smollm2": [("qkv", 576, 832), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)],
    "llama8b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)],
}


def e4m3_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight quantized per output row as a checkpoint's would be: (codes, scale)."""
    w = torch.randn(n, k, generator=gen) * 0.05
    scale = (w.abs().amax(1) / 448.0).clamp_min(1e-12).float()
    codes = (w / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.contiguous(), scale.contiguous()


def best_of_3(f) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[16, 24, 32, 64, 128, 512])
    p.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--output", type=Path, help="also write the table (markdown) here")
    args = p.parse_args()
    require_positive(p, args, "rounds")
    if min(args.rows) < 1:
        p.error(f"--rows must all be >= 1, got {args.rows}")
    ops = load_cpu_ops()
    if ops is None or not hasattr(ops, "fp8_tiled_gemm_available") or not ops.fp8_tiled_gemm_available():
        sys.exit("fp8_tiled_gemm is not built on this machine (it needs AVX2, FMA and F16C and the C++ kernels)")
    packing = onednn_linear.packing_available(torch.float32)
    g = torch.Generator().manual_seed(0)
    lines = [f"Command: `{command_line()}`", "", *(f"- {x}" for x in describe_machine(machine_info())),
             f"- torch threads {torch.get_num_threads()}; weights hot; medians of {args.rounds} ABBA rounds of the "
             "best of 3 calls; tiled result checked against float64 in every cell",
             f"- engine path for float32 x here: fused GEMV up to {fp8_linear_ops.max_fused_rows(torch.float32)} "
             f"rows, then {'the tiled GEMM' if fp8_linear_ops.tiled_gemm_enabled() else 'dequant + oneDNN'}"
             + ("" if packing else "; no packed float32 oneDNN weights in this torch: float32 column is F.linear"), ""]
    head = ["shape", "K -> N", "rows", "fused GEMV us", "dequant + oneDNN us", "tiled us", "float32 packed us",
            "tiled vs dequant + oneDNN", "tiled vs fused GEMV", "tiled vs float32 packed", "tiled GFLOP/s"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    print("\n".join(lines), flush=True)
    for name, k, n in SHAPES[args.shapes]:
        codes, scale = e4m3_weight(n, k, g)
        w32 = (codes.view(torch.float8_e4m3fn).float() * scale[:, None]).contiguous()
        packed = onednn_linear.pack_weight(w32) if packing else None
        for rows in args.rows:
            x = torch.randn(rows, k, generator=g)
            fns = {
                "fused": lambda: ops.fp8_linear(x, codes, scale, None),
                "dequant": lambda: fp8_linear_ops._dequantize_and_matmul(ops, x, codes, scale, None),
                "tiled": lambda: ops.fp8_tiled_gemm(x, codes, scale, None),
                "f32": (lambda: onednn_linear.linear(x, w32, packed=packed)),
            }
            got = fns["tiled"]().double()
            ref = x.double() @ w32.double().t()
            bound = 1e-5 * (x.double().abs() @ w32.double().abs().t()) + 1e-30
            if not bool(((got - ref).abs() <= bound).all()):
                sys.exit(f"{name} {k} -> {n}, {rows} rows: the tiled GEMM is off the float64 result by "
                         f"{float(((got - ref).abs() / bound).max()):.3g} x its bound")
            for f in fns.values():
                f()
            t = alternate({key: (lambda f=f: best_of_3(f)) for key, f in fns.items()}, args.rounds)
            us = {key: 1e6 * v for key, v in t.items()}
            row = [name, f"{k} -> {n}", str(rows), *(f"{us[key]:.0f}" for key in ("fused", "dequant", "tiled", "f32")),
                   f"{t['dequant'] / t['tiled']:.2f}x", f"{t['fused'] / t['tiled']:.2f}x", f"{t['f32'] / t['tiled']:.2f}x",
                   f"{2 * rows * k * n / t['tiled'] / 1e9:.0f}"]
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
    if args.output:
        args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
