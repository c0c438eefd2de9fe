"""FP8-weight linear on CPU against float32 and bf16 `F.linear`.

For SmolLM2-135M and Llama-3-8B projection shapes and M activation rows, times
- fp8 fused: `ops.fp8_linear` (decode in registers, one byte per weight),
- fp8 dequant+GEMM: decode 128-row blocks to x's dtype and run torch.mm,
- fp8 auto: what `fp8_linear_ops.fp8_linear` runs, the one of the two it picks by M,
- float32 and bf16 `F.linear` with weights in those dtypes,
and reports the weight bytes read per second (GB/s).

Decode reads every weight once per step and the whole model does not fit in
cache, so each case cycles through enough copies of the weight (>= 256 MB per
variant) that every call reads its weight from memory. Variants are timed in
rounds, side by side, and the best round is kept: on a shared machine the
ratios are more meaningful than the absolute numbers.

With --cpu-time (the default) each call is timed by the CPU time of the
calling thread, with one torch thread: time this process spends descheduled
by other processes on a shared machine does not count. --wall times with
--threads threads on the wall clock.

    .venv/bin/python benchmarks/fp8_linear.py [--quick] [--wall --threads 2]
    .venv/bin/python benchmarks/fp8_linear.py --walks   # the fused kernel's two row walks at M = 1-2
    .venv/bin/python benchmarks/fp8_linear.py --baseline-rev HEAD~1   # this tree vs fp8_gemm.cpp at a revision

--walks times `fp8_linear`'s interleaved and sequential row walks (fp8_gemm.cpp
`Walk`) on SmolLM2-135M's 120 decode linears (e4m3 codes on 2 MiB pages, as the
engine packs them), with torch's threads, alternating in ABBA rounds next to a
plain read (`Tensor.sum`) of as many bytes; medians of --rounds.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fp8serve.kernels import fp8_linear_ops
from fp8serve.kernels.cpu_ops import load_cpu_ops
from fp8serve.utils.platform import cpu_flags

SHAPES = [  # (model, projection, K in, N out)
    ("SmolLM2-135M", "qkv", 576, 1728),
    ("SmolLM2-135M", "o", 576, 576),
    ("SmolLM2-135M", "gate_up", 576, 3072),
    ("SmolLM2-135M", "down", 1536, 576),
    ("Llama-8B", "qkv", 4096, 6144),
    ("Llama-8B", "gate_up", 4096, 28672),
    ("Llama-8B", "down", 14336, 4096),
]
ROWS = [1, 4, 16, 64, 512]
COLD_BYTES = 256e6


def copies(make, bytes_each: int) -> list[torch.Tensor]:
    return [make() for _ in range(max(2, int(COLD_BYTES // bytes_each)))]


def time_rounds(variants: dict, rounds: int, clock, flops_per_call: float) -> dict[str, float]:
    """Best per-call seconds of each variant. One round calls every variant in
    turn, so slow phases of a shared machine hit all of them; a round makes
    about 2 GFLOP of calls (all weight copies when calls are small)."""
    best = {name: float("inf") for name in variants}
    for fn, ws in variants.values():
        fn(ws[0])  # warm-up: allocator, oneDNN primitives
    for _ in range(rounds):
        for name, (fn, ws) in variants.items():
            calls = ws[: max(1, min(len(ws), int(2e9 // flops_per_call)))]
            t = clock()
            for w in calls:
                fn(w)
            best[name] = min(best[name], (clock() - t) / len(calls))
    return best


DECODE_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N), SmolLM2-135M


def decode_linears(layers: int, gen: torch.Generator) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """`layers` decoder layers' worth of e4m3 codes (no NaN codes) on 2 MiB pages in call order, as the
    engine packs them, and a per-row scale per output size."""
    from fp8serve.utils.huge_pages import pack_parameters_on_huge_pages

    holder = torch.nn.Module()
    codes = []
    for _ in range(layers):
        for k, n in DECODE_SHAPES:
            c = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
            codes.append(torch.nn.Parameter(torch.where((c & 0x7F) == 0x7F, c ^ 1, c), requires_grad=False))
    holder.ws = torch.nn.ParameterList(codes)
    pack_parameters_on_huge_pages(holder)
    scales = {n: torch.rand(n, generator=gen) * 1e-2 + 1e-4 for _, n in DECODE_SHAPES}
    return list(holder.ws), scales


BASELINE_ROWS = (1, 2, 4, 8, 16)  # M of --baseline-rev


def versus_revision(rev: str, rounds: int, layers: int) -> None:
    """This tree's fp8_linear against fp8_gemm.cpp at git revision `rev` on the decode linears, ABBA rounds."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import alternate, build_kernel_at_rev, command_line, describe_machine, machine_info

    ours = load_cpu_ops()
    base = build_kernel_at_rev(rev, "fp8_gemm.cpp", "fp8serve_base_fp8_gemm")
    gen = torch.Generator().manual_seed(0)
    ws, scales = decode_linears(layers, gen)
    nbytes = sum(w.numel() for w in ws)
    print(f"# fp8_linear: this tree vs {rev}\n")
    print(f"Command: `{command_line()}`\n")
    for line in describe_machine(machine_info()):
        print(line)
    print(f"- {len(ws)} decode linears, {nbytes / 1e6:.0f} MB of codes; medians of {rounds} ABBA rounds; "
          "GB/s = code bytes / time\n")
    print(f"| x dtype | M | {rev} ms | GB/s | this tree ms | GB/s | speedup | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for dt in (torch.float32, torch.bfloat16):
        for m in BASELINE_ROWS:
            xs = {k: torch.randn(m, k, generator=gen).to(dt) for k, _ in DECODE_SHAPES}

            def run(op, xs=xs):
                t = time.perf_counter()
                for w in ws:
                    op(xs[w.shape[1]], w, scales[w.shape[0]], None)
                return time.perf_counter() - t

            med = alternate({"base": lambda: run(base.fp8_linear), "ours": lambda: run(ours.fp8_linear)}, rounds)
            b, o = med["base"], med["ours"]
            # The two builds' outputs on every shape: a change of schedule alone leaves them bit-identical.
            diff = max((ours.fp8_linear(xs[k], w, scales[n], None).float()
                        - base.fp8_linear(xs[k], w, scales[n], None).float()).abs().max().item()
                       for w, (k, n) in zip(ws, DECODE_SHAPES))
            print(f"| {str(dt).removeprefix('torch.')} | {m} | {b * 1e3:.2f} | {nbytes / b / 1e9:.1f} | {o * 1e3:.2f} | "
                  f"{nbytes / o / 1e9:.1f} | {b / o:.2f}x | {diff:.3g} |", flush=True)


def walks(rounds: int, layers: int) -> None:
    """Interleaved vs sequential row walks of the fused kernel at M = 1-2, ABBA rounds."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import alternate, command_line, describe_machine, machine_info

    ops = load_cpu_ops()
    shapes = DECODE_SHAPES
    gen = torch.Generator().manual_seed(0)
    ws, scales = decode_linears(layers, gen)
    nbytes = sum(w.numel() for w in ws)
    flat = torch.ones(nbytes // 4)
    print("# fp8_linear row walks\n")
    print(f"Command: `{command_line()}`\n")
    for line in describe_machine(machine_info()):
        print(line)
    print(f"- this CPU's auto walk: M = 1 {'sequential' if ops.fp8_linear_auto_walk(1) == 2 else 'interleaved'}, "
          f"M = 2 {'sequential' if ops.fp8_linear_auto_walk(2) == 2 else 'interleaved'}")
    print(f"- {len(ws)} decode linears, {nbytes / 1e6:.0f} MB of codes; medians of {rounds} ABBA rounds; "
          "GB/s = code bytes / time; read = `Tensor.sum` over as many bytes\n")
    print("| x dtype | M | loop | interleaved ms | GB/s | sequential ms | GB/s | sequential speedup | read GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dt in (torch.float32, torch.bfloat16):
        for m in (1, 2):
            xs = {k: torch.randn(m, k, generator=gen).to(dt) for k, _ in shapes}
            for wide in (True, False):
                def run(walk, wide=wide, xs=xs):
                    t = time.perf_counter()
                    for w in ws:
                        ops.fp8_linear_walk(xs[w.shape[1]], w, scales[w.shape[0]], None, wide, walk)
                    return time.perf_counter() - t

                def read():
                    t = time.perf_counter()
                    flat.sum()
                    return time.perf_counter() - t

                med = alternate({"interleaved": lambda: run(1), "sequential": lambda: run(2), "read": read}, rounds)
                i, q = med["interleaved"], med["sequential"]
                print(f"| {str(dt).removeprefix('torch.')} | {m} | {'32-code (AVX-512)' if wide else '16-code (AVX2)'} | "
                      f"{i * 1e3:.2f} | {nbytes / i / 1e9:.1f} | {q * 1e3:.2f} | {nbytes / q / 1e9:.1f} | {i / q:.2f}x | "
                      f"{nbytes / med['read'] / 1e9:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--walks", action="store_true", help="compare the fused kernel's two row walks at M = 1-2")
    ap.add_argument("--layers", type=int, default=30,
                    help="decoder layers' linears per pass for --walks and --baseline-rev")
    ap.add_argument("--baseline-rev", help="time fp8_gemm.cpp as of this git revision beside this tree's "
                    "(the decode linears at M = 1-16)")
    ap.add_argument("--wall", action="store_true", help="wall-clock time instead of thread CPU time")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="SmolLM2 shapes and M in {1, 16} only")
    ap.add_argument("--out", type=Path, default=None, help="markdown file (default benchmarks/results/fp8_linear_<date>.md)")
    args = ap.parse_args()
    for name in ("rounds", "layers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.walks and args.baseline_rev:
        ap.error("give one of --walks and --baseline-rev")
    if args.walks or args.baseline_rev:
        if load_cpu_ops() is None:
            sys.exit("C++ CPU kernels unavailable")
        if args.walks:
            walks(args.rounds, args.layers)
        else:
            versus_revision(args.baseline_rev, args.rounds, args.layers)
        return
    if args.wall:
        torch.set_num_threads(args.threads)
        clock = time.perf_counter
    else:
        torch.set_num_threads(1)
        clock = time.thread_time
    ops = load_cpu_ops()
    if ops is None or not hasattr(ops, "fp8_linear"):
        sys.exit("C++ CPU kernels unavailable")
    torch.manual_seed(0)

    shapes = SHAPES[:4] if args.quick else SHAPES
    rows = [1, 16] if args.quick else ROWS
    header = ("| model | proj | K→N | M | fp8 fused µs | fp8 dequant+GEMM µs | f32 µs | bf16 µs "
              "| fp8 fused GB/s | f32 GB/s | bf16 GB/s | f32 / fp8 auto | bf16 / fp8 auto |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    max_fused = fp8_linear_ops.max_fused_rows(torch.float32)
    print(header, flush=True)
    for model, proj, k, n in shapes:
        w8 = copies(lambda: torch.randint(0, 0x7f, (n, k), dtype=torch.uint8) | (torch.randint(0, 2, (n, k), dtype=torch.uint8) << 7), n * k)
        w32 = copies(lambda: torch.randn(n, k) * 0.02, 4 * n * k)
        wbf = copies(lambda: (torch.randn(n, k) * 0.02).bfloat16(), 2 * n * k)
        scale = torch.rand(n) * 1e-3 + 1e-4
        for m in rows:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            variants = {
                "fused": (lambda w: ops.fp8_linear(x, w, scale, None), w8),
                "dequant": (lambda w: fp8_linear_ops._dequantize_and_matmul(ops, x, w, scale, None), w8),
                "f32": (lambda w: F.linear(x, w), w32),
                "bf16": (lambda w: F.linear(xb, w), wbf),
            }
            t = time_rounds(variants, args.rounds, clock, 2.0 * m * n * k)
            auto = t["fused"] if m <= max_fused else t["dequant"]
            gbs = lambda nbytes, s: nbytes / s / 1e9  # noqa: E731
            line = (f"| {model} | {proj} | {k}→{n} | {m} | {t['fused']*1e6:.0f} | {t['dequant']*1e6:.0f} | "
                    f"{t['f32']*1e6:.0f} | {t['bf16']*1e6:.0f} | "
                    f"{gbs(n * k, t['fused']):.1f} | {gbs(4 * n * k, t['f32']):.1f} | {gbs(2 * n * k, t['bf16']):.1f} | "
                    f"{t['f32'] / auto:.2f} | {t['bf16'] / auto:.2f} |")
            print(line, flush=True)
            lines.append(line)
        del w8, w32, wbf

    flags = cpu_flags()
    isa = ", ".join(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    clock_name = "wall clock" if args.wall else "CPU time of the calling thread"
    meta = [
        f"# FP8-weight linear on CPU ({datetime.date.today().isoformat()})",
        "",
        f"- command: `{' '.join([Path(sys.executable).name] + sys.argv)}`",
        f"- machine: {cpu}, {torch.get_num_threads()} torch thread(s), ISA: {isa}; kernel AVX2 path: "
        f"{bool(ops.fp8_gemm_has_avx2())}; torch {torch.__version__}, Python {platform.python_version()}",
        f"- timing: best of {args.rounds} rounds, {clock_name}; weights cycled over >= 256 MB per variant (cold)",
        f"- fp8 auto (the engine's choice for float32 x) switches to dequant+GEMM above M = {max_fused}",
        "- GB/s: weight bytes read per second (fp8 1 B, f32 4 B, bf16 2 B per weight)",
        "",
    ]
    text = "\n".join(meta + lines) + "\n"
    print("\n".join(meta))
    out = args.out or Path(__file__).resolve().parent / "results" / f"fp8_linear_{datetime.date.today().isoformat()}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
