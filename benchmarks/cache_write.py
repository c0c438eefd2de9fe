#!/usr/bin/env python
"""The KV cache write (`fp8serve::reshape_and_cache`: quantize to FP8 and scatter
into random slots), FP8 formats by default (--formats adds 16-bit / float32
storage for comparison), optionally side by side with the same op built from
another git revision.

Cells: input dtype (float32, bfloat16) x FP8 format x tokens per call (decode
batches and prefills) x with / without the decoded read-back (`key_out` /
`value_out`, what a fresh FP8 prefill attends to). Shapes of the default
model's layer: 3 kv heads x head size 64. Times are medians of per-call
medians over rounds in ABBA order; with --baseline-rev both builds must write
bit-identical caches and read-backs, or the script stops.

    python benchmarks/cache_write.py                       # this tree only
    python benchmarks/cache_write.py --baseline-rev HEAD~1 # and the op as of HEAD~1, side by side
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import alternate, command_line, describe_machine, machine_info, ops_side_by_side  # noqa: E402

from fp8serve.kernels.cpu_ops import KV_FORMATS, KV_STORAGE_DTYPES, load_cpu_ops  # noqa: E402

def time_calls(fns: dict, calls: int, rounds: int) -> dict[str, float]:
    """Median over rounds (ABBA order) of each function's median call time."""
    def median_call(f) -> float:
        for _ in range(3):
            f()
        ts = []
        for _ in range(calls):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    return alternate({k: (lambda f=f: median_call(f)) for k, f in fns.items()}, rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 512, 8192])
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--formats", type=lambda x: x.split(","), default=["fp8_e4m3", "fp8_e5m2"],
                   help=f"cache formats, of {', '.join(KV_FORMATS)} (16-bit and float32 ones for comparison)")
    p.add_argument("--baseline-rev", help="also time the op as built from this git revision")
    p.add_argument("--output", type=Path, help="also write the table (markdown) here")
    args = p.parse_args()
    for flag, value in (("--num-kv-heads", args.num_kv_heads), ("--head-size", args.head_size),
                        ("--rounds", args.rounds), *((f"--tokens ({t})", t) for t in args.tokens)):
        if value < 1:
            p.error(f"{flag} must be at least 1, got {value}")

    for fmt in args.formats:
        if fmt not in KV_FORMATS:
            p.error(f"--formats: unknown format {fmt!r}, expected one of {', '.join(KV_FORMATS)}")
    ops = load_cpu_ops()
    if ops is None:
        sys.exit("the C++ CPU kernels are unavailable on this machine (see the warning above)")
    fns = ops_side_by_side(ops, "reshape_and_cache", "cache_ops.cpp", args.baseline_rev)
    g = torch.Generator().manual_seed(0)
    H, D = args.num_kv_heads, args.head_size
    lines = [f"Command: `{command_line()}`", "", *(f"- {x}" for x in describe_machine(machine_info())),
             f"- shapes: {H} kv heads x head size {D}; random slots; FP8 k_scale 0.5, v_scale 0.25", ""]
    head = ["input", "format", "tokens", "read-back"] + [f"{k} us" for k in fns]
    if len(fns) == 2:
        head.append("baseline / this tree")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    print("\n".join(lines), flush=True)
    for in_dtype in (torch.float32, torch.bfloat16):
        for num_tokens in args.tokens:
            num_blocks = 2 * (num_tokens // 16 + 1)
            k = (torch.randn(num_tokens, H, D, generator=g) * 4).to(in_dtype)
            v = (torch.randn(num_tokens, H, D, generator=g) * 4).to(in_dtype)
            slots = torch.randperm(num_blocks * 16, generator=g)[:num_tokens].contiguous()
            for fmt in args.formats:
                fp8 = fmt.startswith("fp8")
                k_scale, v_scale = (0.5, 0.25) if fp8 else (1.0, 1.0)  # only FP8 storage takes scales
                for read_back in (False, True):
                    state = {}
                    for name in fns:
                        cache = torch.zeros(2, num_blocks, 16, H, D, dtype=KV_STORAGE_DTYPES[fmt])
                        outs = (torch.empty_like(k), torch.empty_like(v)) if read_back else (None, None)
                        state[name] = (cache, outs)
                    calls = {name: (lambda f=f, c=state[name][0], o=state[name][1]: f(
                        k, v, c[0], c[1], slots, KV_FORMATS[fmt], k_scale, v_scale, o[0], o[1]))
                        for name, f in fns.items()}
                    for f in calls.values():
                        f()
                    if len(fns) == 2:
                        (c0, o0), (c1, o1) = state.values()
                        same = torch.equal(c0.view(torch.uint8), c1.view(torch.uint8)) and all(
                            a is None or torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                                                     b.view(torch.int16 if b.element_size() == 2 else torch.int32))
                            for a, b in zip(o0, o1))
                        if not same:
                            sys.exit(f"the two builds wrote different bytes ({in_dtype}, {fmt}, {num_tokens} tokens)")
                    t = time_calls(calls, max(20, min(2000, 200_000 // num_tokens)), args.rounds)
                    row = [str(in_dtype).removeprefix("torch."), fmt, str(num_tokens), "yes" if read_back else "no"]
                    row += [f"{1e6 * t[name]:.1f}" for name in fns]
                    if len(fns) == 2:
                        row.append(f"{t['baseline'] / t['this tree']:.2f}x")
                    lines.append("| " + " | ".join(row) + " |")
                    print(lines[-1], flush=True)
    if args.output:
        args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
