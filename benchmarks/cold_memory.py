#!/usr/bin/env python
"""Warm versus cold: what a small read costs after the caches have been
flushed by a large stream, as in a decode step, where every layer's weights
and KV blocks were last touched a whole step (hundreds of MB) ago.

Micro-benchmarks call the same kernel on the same data back to back, so the
data sits in L2/L3 and the kernels look 1.2-5x faster than they run inside
the engine. This script measures that gap directly, in one run:

  - `Tensor.sum` of 0.4 / 3 / 12 MiB buffers: plain sequential reads;
  - the paged decode-attention op (`paged_attention_decode`, the default
    model's shapes) at batch 1 x 512, 16 x 384 and 64 x 384 tokens;

each timed warm (called again right away) and cold (right after summing a
256 MiB buffer that evicts everything), median of 21 calls.

    .venv/bin/python benchmarks/cold_memory.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from attention import DecodeCase
from bench_common import command_line, describe_machine, machine_info

from fp8serve.kernels.cpu_ops import KV_FORMATS, load_cpu_ops

FLUSH_BYTES = 256 << 20


def warm_cold(fn, flush: torch.Tensor, calls: int) -> tuple[float, float]:
    """Median seconds of `fn` called right after itself, and right after a flush."""
    for _ in range(3):
        fn()
    warm, cold = [], []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - t)
    for _ in range(calls):
        flush.sum()
        t = time.perf_counter()
        fn()
        cold.append(time.perf_counter() - t)
    return statistics.median(warm), statistics.median(cold)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=21)
    args = p.parse_args()
    ops = load_cpu_ops()
    if ops is None:
        sys.exit("the C++ CPU kernels are unavailable on this machine")
    flush = torch.ones(FLUSH_BYTES // 4)
    print("# Warm vs cold reads\n")
    print(f"command: {command_line()}")
    for line in describe_machine(machine_info()):
        print(f"- {line}")
    print(f"- cold = right after `sum` of a {FLUSH_BYTES >> 20} MiB float32 buffer; "
          f"median of {args.calls} calls each\n")
    print("| what | MiB read | warm us | warm GB/s | cold us | cold GB/s | cold / warm |")
    print("|---|---:|---:|---:|---:|---:|---:|")

    def row(what: str, nbytes: int, warm: float, cold: float) -> None:
        print(f"| {what} | {nbytes / 2**20:.1f} | {warm * 1e6:.0f} | {nbytes / warm / 1e9:.1f} | "
              f"{cold * 1e6:.0f} | {nbytes / cold / 1e9:.1f} | {cold / warm:.2f} |", flush=True)

    for mib in (0.4, 3, 12):
        buf = torch.ones(int(mib * 2**20) // 4)
        row(f"sum of a {mib} MiB buffer", buf.numel() * 4, *warm_cold(buf.sum, flush, args.calls))
        del buf
    shapes = argparse.Namespace(block_size=16, num_kv_heads=3, head_size=64, num_heads=9)  # SmolLM2-135M
    for kv_dtype in ("bfloat16", "fp8_e4m3"):
        for batch, context in ((1, 512), (16, 384), (64, 384)):
            case = DecodeCase(shapes, kv_dtype, batch, context, seed=batch * 1009 + context)
            out = torch.empty_like(case.kernel_query)

            def call():
                ops.paged_attention_decode(out, case.kernel_query, case.kv_cache[0], case.kv_cache[1],
                                           case.block_tables, case.seq_lens, KV_FORMATS[kv_dtype], case.out_scale)

            row(f"attention {kv_dtype} {batch} x {context}", case.bytes_read, *warm_cold(call, flush, args.calls))
            del case


if __name__ == "__main__":
    with torch.inference_mode():
        main()
