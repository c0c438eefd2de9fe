#!/usr/bin/env python
"""dense_gemv (the C++ float32/bf16-weight GEMV for decode at small batch) and,
on AMX machines, amx_linear (bf16, 1-64 rows) vs torch's F.linear, on the default model's decode shapes: 30 layers x (qkv_proj,
o_proj, gate_up_proj, down_proj), weights packed on 2 MiB pages as the engine
packs them, every call reading its weight from memory (270 MB bf16 / 540 MB
float32 per pass). Both variants side by side, best of 3 passes; GB/s =
weight bytes / time. Also the max relative error against float64.

    .venv/bin/python benchmarks/dense_gemv.py
"""

from __future__ import annotations

import os
import platform
import time

import torch
import torch.nn.functional as F

from fp8serve.kernels import amx_linear_ops
from fp8serve.kernels.cpu_ops import load_cpu_ops
from fp8serve.utils.huge_pages import pack_parameters_on_huge_pages

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N) of SmolLM2-135M's projections
LAYERS = 30


def main() -> None:
    ops = load_cpu_ops()
    if ops is None:
        raise SystemExit("C++ CPU kernels unavailable")
    print(f"# dense_gemv vs F.linear\n\nmachine: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"loadavg {os.getloadavg()}\n")
    bf16_dot = bool(ops.dense_gemv_has_bf16_dot())
    if bf16_dot:
        print("This build multiplies bf16 x bf16 with AVX512-BF16 dot products; `FMA loop ms` times the float32-FMA "
              "loop (`dense_gemv_fma`, what CPUs without AVX512-BF16 run) on the same calls.\n")
    amx = amx_linear_ops.is_available()
    if amx:
        print("This CPU and build have AMX: `AMX ms` times amx_linear (bf16 only) on the same calls.\n")
    print("| weights | M | F.linear ms | GB/s | dense_gemv ms | GB/s | speedup | FMA loop ms | AMX ms | AMX GB/s | "
          "rel err (torch) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dt in (torch.bfloat16, torch.float32):
        holder = torch.nn.Module()
        holder.ws = torch.nn.ParameterList([
            torch.nn.Parameter(torch.randn(n, k).to(dt) * 0.05, requires_grad=False)
            for _ in range(LAYERS) for k, n in SHAPES])
        pack_parameters_on_huge_pages(holder)
        ws = list(holder.ws)
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        use_amx = amx and dt == torch.bfloat16
        for m in (1, 2, 4, 8, 12, 16) + ((24, 32, 48, 64) if use_amx else ()):
            xs = {k: torch.randn(m, k).to(dt) for k, _ in SHAPES}
            w, x = ws[2], xs[ws[2].shape[1]]
            ref = x.double() @ w.double().t()
            gemv = m <= 16
            err = ((ops.dense_gemv(x, w, None).double() - ref).abs().max() / ref.abs().max()).item() if gemv else None
            err_t = ((F.linear(x, w).double() - ref).abs().max() / ref.abs().max()).item()
            best = {}
            variants = [("torch", lambda x, w: F.linear(x, w))]
            if gemv:
                variants.append(("ours", lambda x, w: ops.dense_gemv(x, w, None)))
            if bf16_dot and dt == torch.bfloat16 and gemv:
                variants.append(("fma", lambda x, w: ops.dense_gemv_fma(x, w, None)))
            if use_amx:
                variants.append(("amx", lambda x, w: amx_linear_ops.amx_linear(x, w)))
            for _ in range(3):
                for name, fn in variants:
                    t = time.perf_counter()
                    for w in ws:
                        fn(xs[w.shape[1]], w)
                    best[name] = min(best.get(name, 1e9), time.perf_counter() - t)
            fma = f"{best['fma'] * 1e3:.1f}" if "fma" in best else "-"
            amx_ms = f"{best['amx'] * 1e3:.1f} | {nbytes / best['amx'] / 1e9:.1f}" if "amx" in best else "- | -"
            ours = (f"{best['ours'] * 1e3:.1f} | {nbytes / best['ours'] / 1e9:.1f} | {best['torch'] / best['ours']:.2f}x"
                    if "ours" in best else "- | - | -")
            err_s = f"{err:.1e}" if err is not None else "-"
            print(f"| {str(dt).removeprefix('torch.')} | {m} | {best['torch'] * 1e3:.1f} | {nbytes / best['torch'] / 1e9:.1f} | "
                  f"{ours} | {fma} | {amx_ms} | {err_s} ({err_t:.1e}) |", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
