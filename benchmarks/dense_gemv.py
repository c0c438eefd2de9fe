#!/usr/bin/env python
"""dense_gemv (the C++ float32/bf16-weight GEMV for decode at small batch) and,
on AMX machines, amx_linear (bf16, 1-64 rows) vs torch's F.linear, on the default model's decode shapes: 30 layers x (qkv_proj,
o_proj, gate_up_proj, down_proj), weights packed on 2 MiB pages as the engine
packs them, every call reading its weight from memory (270 MB bf16 / 540 MB
float32 per pass). Both variants side by side, best of 3 passes; GB/s =
weight bytes / time. Also the max relative error against float64.

    .venv/bin/python benchmarks/dense_gemv.py
    .venv/bin/python benchmarks/dense_gemv.py --walks    # the two row walks at M = 1-2, side by side
    .venv/bin/python benchmarks/dense_gemv.py --baseline-rev HEAD~1   # this tree vs dense_gemv.cpp at a revision
    .venv/bin/python benchmarks/dense_gemv.py --packed   # bf16: plain rows vs the packed layout (gemv_packing.py)

--walks times dense_gemv's interleaved and sequential row walks (dense_gemv.cpp
`Walk`) on the same 120 decode linears and on the tied lm_head (49152 x 576),
alternating in ABBA rounds, next to a plain read (`Tensor.sum`) of as many
bytes in the same rounds; medians of --rounds.

--baseline-rev REV builds dense_gemv.cpp as of git revision REV beside this
tree's and times both on the 120 decode linears at M = 1-32, float32 and bf16
weights, in ABBA rounds (medians of --rounds); --model-shapes times another
model's projections instead (llama-3.2-1b, llama-3.1-8b: longer rows, K up to
14336), --layers of them per pass; --rows and --weight-dtypes narrow or widen
the table (e.g. --rows 1,2 --weight-dtypes bfloat16,float16,float32), and
--x-float32 gives every weight dtype float32 activations (the engine's 16-bit
weights under float32 compute).

--packed times bf16 x bf16 on the plain [N, K] weights (dense_gemv, M <= 32),
on oneDNN's packed weight (the engine's path above 32 rows), and on the
layout of dense_gemv_packed (gemv_packing.pack_gemv_weight), on the 120 decode
linears and on the tied lm_head at M = 1-512, ABBA rounds (medians of
--rounds), with the packed kernel's max relative error against float64; then
FP8 (e4m3) codes of the same shapes: the engine's FP8 path without packed
codes against fp8_gemv_packed.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fp8serve.kernels import amx_linear_ops
from fp8serve.kernels.cpu_ops import load_cpu_ops
from fp8serve.utils.huge_pages import pack_parameters_on_huge_pages

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N) of SmolLM2-135M's projections
# --baseline-rev --model-shapes: (K, N) of other models' decode projections (qkv, o, gate_up, down).
MODEL_SHAPES = {
    "smollm2-135m": SHAPES,
    "llama-3.2-1b": [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)],
    "llama-3.1-8b": [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)],
}
LAYERS = 30
LM_HEAD = (576, 49152)  # (K, N) of the tied lm_head
BASELINE_ROWS = (1, 2, 4, 8, 12, 16, 24, 32)  # M of --baseline-rev: every tile shape up to kMaxRows


def packed_weights(dt: torch.dtype, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    holder = torch.nn.Module()
    holder.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n, k).to(dt) * 0.05, requires_grad=False)
                                        for k, n in shapes])
    pack_parameters_on_huge_pages(holder)
    return list(holder.ws)


def walks(rounds: int, layers: int) -> None:
    """Interleaved vs sequential row walks at M = 1-2, ABBA rounds, against a plain read."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import alternate, command_line, describe_machine, machine_info

    from fp8serve.kernels import cpu_ops

    print("# dense_gemv row walks\n")
    print(f"Command: `{command_line()}`\n")
    for line in describe_machine(machine_info()):
        print(line)
    print(f"- this CPU's auto walk: M = 1 {cpu_ops.dense_gemv_auto_walk(1)}, M = 2 {cpu_ops.dense_gemv_auto_walk(2)}")
    print(f"- medians of {rounds} ABBA rounds; GB/s = weight bytes / time; read = `Tensor.sum` over as many bytes\n")
    print("| weights | calls | M | path | interleaved ms | GB/s | sequential ms | GB/s | sequential speedup | read GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dt in (torch.float32, torch.bfloat16):
        for calls, shapes in ((f"{4 * layers} decode linears", [s for _ in range(layers) for s in SHAPES]), ("lm_head", [LM_HEAD])):
            ws = packed_weights(dt, shapes)
            nbytes = sum(w.numel() * w.element_size() for w in ws)
            flat = torch.ones(nbytes // 4)
            paths = ["best"] + (["fma"] if dt == torch.bfloat16 and cpu_ops.load_cpu_ops().dense_gemv_has_bf16_dot() else [])
            for m in (1, 2):
                xs = {k: torch.randn(m, k).to(dt) for k, _ in shapes}
                for path in paths:
                    def run(walk, path=path, xs=xs, ws=ws):
                        t = time.perf_counter()
                        for w in ws:
                            cpu_ops.dense_gemv(xs[w.shape[1]], w, None, path=path, walk=walk)
                        return time.perf_counter() - t

                    def read():
                        t = time.perf_counter()
                        flat.sum()
                        return time.perf_counter() - t

                    med = alternate({"interleaved": lambda: run("interleaved"), "sequential": lambda: run("sequential"),
                                     "read": read}, rounds)
                    i, q = med["interleaved"], med["sequential"]
                    print(f"| {str(dt).removeprefix('torch.')} | {calls} | {m} | {path} | {i * 1e3:.2f} | "
                          f"{nbytes / i / 1e9:.1f} | {q * 1e3:.2f} | {nbytes / q / 1e9:.1f} | {i / q:.2f}x | "
                          f"{nbytes / med['read'] / 1e9:.1f} |", flush=True)


WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def versus_revision(rev: str, rounds: int, layers: int, model_shapes: str = "smollm2-135m",
                    rows: tuple[int, ...] = BASELINE_ROWS, weight_dtypes: tuple[str, ...] = ("float32", "bfloat16"),
                    x_float32: bool = False) -> None:
    """This tree's dense_gemv against dense_gemv.cpp at git revision `rev`, ABBA rounds."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import alternate, build_kernel_at_rev, command_line, describe_machine, machine_info

    ours = load_cpu_ops()
    base = build_kernel_at_rev(rev, "dense_gemv.cpp", "fp8serve_base_gemv")
    print(f"# dense_gemv: this tree vs {rev}\n")
    print(f"Command: `{command_line()}`\n")
    for line in describe_machine(machine_info()):
        print(line)
    print(f"- {4 * layers} decode linears of {model_shapes} per pass ((K, N): {MODEL_SHAPES[model_shapes]}); medians "
          f"of {rounds} ABBA rounds; GB/s = weight bytes / time\n")
    print(f"| weights | activations | M | {rev} ms | GB/s | this tree ms | GB/s | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    shapes = [s for _ in range(layers) for s in MODEL_SHAPES[model_shapes]]
    for dt in (WEIGHT_DTYPES[name] for name in weight_dtypes):
        ws = packed_weights(dt, shapes)
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        for m in rows:
            # Activations in the weights' dtype, or float32 (16-bit weights under float32 compute: the
            # default model's engine on CPUs without native bf16). fp16 weights only come with float32.
            x_dt = torch.float32 if x_float32 or dt == torch.float16 else dt
            xs = {k: torch.randn(m, k).to(x_dt) for k, _ in shapes}

            def run(op, xs=xs, ws=ws):
                t = time.perf_counter()
                for w in ws:
                    op(xs[w.shape[1]], w, None)
                return time.perf_counter() - t

            med = alternate({"base": lambda: run(base.dense_gemv), "ours": lambda: run(ours.dense_gemv)}, rounds)
            b, o = med["base"], med["ours"]
            print(f"| {str(dt).removeprefix('torch.')} | {str(x_dt).removeprefix('torch.')} | {m} | {b * 1e3:.2f} | "
                  f"{nbytes / b / 1e9:.1f} | {o * 1e3:.2f} | {nbytes / o / 1e9:.1f} | {b / o:.2f}x |", flush=True)


PACKED_ROWS = (1, 2, 4, 8, 12, 13, 16, 24, 32, 48, 64, 128, 256, 512)  # M of --packed


def versus_packed(rounds: int, layers: int) -> None:
    """bf16 x bf16: dense_gemv on plain rows (M <= 32), oneDNN on its packed
    weight, and dense_gemv_packed on the packed layout, ABBA rounds."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import alternate, command_line, describe_machine, machine_info

    from fp8serve.kernels import cpu_ops, onednn_linear
    from fp8serve.kernels.gemv_packing import pack_gemv_weight

    ops = load_cpu_ops()
    if not ops.dense_gemv_has_packed() or not ops.dense_gemv_has_bf16_dot():
        raise SystemExit("--packed needs a build with AVX512-BF16 (dense_gemv_has_packed)")
    onednn = onednn_linear.packing_available(torch.bfloat16)
    print("# bf16 decode linears: plain rows, oneDNN packed, and the packed layout of dense_gemv_packed\n")
    print(f"Command: `{command_line()}`\n")
    for line in describe_machine(machine_info()):
        print(line)
    print(f"- medians of {rounds} ABBA rounds; GB/s = weight bytes / time; all three copies on 2 MiB pages "
          "(oneDNN's where its allocator puts them)")
    print("- `before` = what the engine ran before the packed layout: dense_gemv at M <= 32, oneDNN on its packed "
          "weight above; `now` = cpu_ops' choice (dense_gemv up to GEMV_PACKED_MIN_ROWS - 1 = "
          f"{cpu_ops.GEMV_PACKED_MIN_ROWS - 1} rows, dense_gemv_packed up to {cpu_ops.GEMV_PACKED_MAX_ROWS})")
    print("- rel err = max |out - ref| / max |ref| against float64 on the first weight of the set\n")
    print("| calls | M | dense_gemv ms | oneDNN packed ms | packed ms | packed GB/s | packed vs before | "
          "now vs before | rel err packed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for calls, shapes in ((f"{4 * layers} decode linears", [s for _ in range(layers) for s in SHAPES]),
                          ("lm_head", [LM_HEAD])):
        ws = packed_weights(torch.bfloat16, shapes)
        pws = [pack_gemv_weight(w) for w in ws]
        ows = [onednn_linear.pack_weight(w) for w in ws] if onednn else None
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        for m in PACKED_ROWS:
            xs = {k: torch.randn(m, k).bfloat16() for k, _ in shapes}

            def plain(xs=xs, ws=ws):
                t = time.perf_counter()
                for w in ws:
                    ops.dense_gemv(xs[w.shape[1]], w, None)
                return time.perf_counter() - t

            def one(xs=xs, ws=ws, ows=ows):
                t = time.perf_counter()
                for w, ow in zip(ws, ows):
                    onednn_linear.linear(xs[w.shape[1]], w, None, packed=ow)
                return time.perf_counter() - t

            def packed(xs=xs, ws=ws, pws=pws):
                t = time.perf_counter()
                for w, pw in zip(ws, pws):
                    ops.dense_gemv_packed(xs[w.shape[1]], pw, w.shape[0], None)
                return time.perf_counter() - t

            sides = {"packed": packed}
            if m <= 32:
                sides["plain"] = plain
            if onednn:
                sides["onednn"] = one
            x, w = xs[ws[0].shape[1]], ws[0]
            ref = x.double() @ w.double().t()
            err = ((ops.dense_gemv_packed(x, pws[0], w.shape[0], None).double() - ref).abs().max()
                   / ref.abs().max()).item()
            med = alternate(sides, rounds)
            before = med.get("plain") if m <= 32 else med.get("onednn")
            now = med["packed"] if m >= cpu_ops.GEMV_PACKED_MIN_ROWS else med.get("plain")
            cell = lambda key: f"{med[key] * 1e3:.2f}" if key in med else "-"  # noqa: E731
            ratio = lambda a: f"{before / a:.2f}x" if before and a else "-"  # noqa: E731
            print(f"| {calls} | {m} | {cell('plain')} | {cell('onednn')} | {cell('packed')} | "
                  f"{nbytes / med['packed'] / 1e9:.1f} | {ratio(med['packed'])} | {ratio(now)} | {err:.1e} |",
                  flush=True)


def versus_packed_fp8(rounds: int, layers: int) -> None:
    """FP8 (e4m3) weights, bf16 x: the engine's FP8 path without packed codes
    (fp8_linear_loaded: the fused kernel up to its rows, dequantize + GEMM
    above) against fp8_gemv_packed, ABBA rounds."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import alternate

    from fp8serve.kernels import fp8_linear_ops
    from fp8serve.kernels.gemv_packing import pack_fp8_gemv_weight
    from fp8serve.quantization.fp8 import FP8_E4M3, dequantize_fp8

    ops = load_cpu_ops()
    if not ops.fp8_gemv_has_packed():
        print("\n(FP8 section skipped: this build has no fp8_gemv_packed)")
        return
    print("\n### FP8 (e4m3) weights, bf16 activations\n")
    print(f"- `before` = the engine's FP8 path without packed codes (`fp8_linear_loaded`: the fused kernel up to "
          f"{fp8_linear_ops.max_fused_rows(torch.bfloat16)} rows, dequantize + GEMM above); GB/s = code bytes / time\n")
    print("| calls | M | before ms | packed ms | packed GB/s | speedup | rel err packed |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(layers) for s in SHAPES]
    codes, scales, packed = [], [], []
    for k, n in shapes:
        c = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int64).to(torch.uint8)
        c[(c & 0x7F) == 0x7F] = 0  # no NaN codes
        s = torch.rand(n, generator=g) * 0.01 + 1e-3
        codes.append(c)
        scales.append(s)
        packed.append(pack_fp8_gemv_weight(c, s))
    nbytes = sum(c.numel() for c in codes)
    for m in PACKED_ROWS:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k, _ in shapes}

        def before(xs=xs):
            t = time.perf_counter()
            for c, s in zip(codes, scales):
                fp8_linear_ops.fp8_linear_loaded(xs[c.shape[1]], c, s)
            return time.perf_counter() - t

        def pk(xs=xs):
            t = time.perf_counter()
            for c, (p, ps) in zip(codes, packed):
                ops.fp8_gemv_packed(xs[c.shape[1]], p, ps, c.shape[0], None)
            return time.perf_counter() - t

        x, c = xs[codes[0].shape[1]], codes[0]
        ref = x.double() @ (dequantize_fp8(c, 1.0, FP8_E4M3, torch.float64) * scales[0].double()[:, None]).t()
        err = ((ops.fp8_gemv_packed(x, *packed[0], c.shape[0], None).double() - ref).abs().max()
               / ref.abs().max()).item()
        med = alternate({"before": before, "packed": pk}, rounds)
        b, p = med["before"], med["packed"]
        print(f"| {4 * layers} decode linears | {m} | {b * 1e3:.2f} | {p * 1e3:.2f} | {nbytes / p / 1e9:.1f} | "
              f"{b / p:.2f}x | {err:.1e} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--walks", action="store_true", help="compare the interleaved and sequential row walks at M = 1-2")
    p.add_argument("--rounds", type=int, default=12, help="ABBA rounds for --walks, --baseline-rev and --packed (median)")
    p.add_argument("--layers", type=int, default=LAYERS,
                   help="decoder layers' linears per pass for --walks, --baseline-rev and --packed")
    p.add_argument("--baseline-rev", help="time dense_gemv.cpp as of this git revision beside this tree's")
    p.add_argument("--model-shapes", choices=sorted(MODEL_SHAPES), default="smollm2-135m",
                   help="--baseline-rev: whose decode projections to time (default: the default model's)")
    p.add_argument("--packed", action="store_true", help="bf16: plain rows, oneDNN packed and the packed layout at M = 1-512")
    p.add_argument("--rows", default=",".join(map(str, BASELINE_ROWS)),
                   help="--baseline-rev: comma-separated activation rows (1-32)")
    p.add_argument("--weight-dtypes", default="float32,bfloat16",
                   help=f"--baseline-rev: comma-separated weight dtypes of {', '.join(WEIGHT_DTYPES)}")
    p.add_argument("--x-float32", action="store_true",
                   help="--baseline-rev: float32 activations for every weight dtype (16-bit weights under float32 "
                        "compute, as the engine runs the default model here); default: the weights' dtype (fp16: float32)")
    args = p.parse_args()
    if sum(map(bool, (args.walks, args.baseline_rev, args.packed))) > 1:
        p.error("give one of --walks, --baseline-rev and --packed")
    for name in ("rounds", "layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    try:
        rows = tuple(int(r) for r in args.rows.split(","))
    except ValueError:
        rows = ()
    if not rows or not all(1 <= r <= 32 for r in rows):
        p.error(f"--rows takes comma-separated activation rows from 1 to 32, got {args.rows!r}")
    weight_dtypes = tuple(args.weight_dtypes.split(","))
    if not all(d in WEIGHT_DTYPES for d in weight_dtypes):
        p.error(f"--weight-dtypes takes comma-separated names of {', '.join(WEIGHT_DTYPES)}, got {args.weight_dtypes!r}")
    ops = load_cpu_ops()
    if ops is None:
        raise SystemExit("C++ CPU kernels unavailable")
    if args.walks:
        walks(args.rounds, args.layers)
        return
    if args.baseline_rev:
        versus_revision(args.baseline_rev, args.rounds, args.layers, args.model_shapes, rows, weight_dtypes,
                        args.x_float32)
        return
    if args.packed:
        versus_packed(args.rounds, args.layers)
        versus_packed_fp8(args.rounds, args.layers)
        return
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
        for m in (1, 2, 4, 8, 12, 16, 24, 32) + ((48, 64) if use_amx else ()):
            xs = {k: torch.randn(m, k).to(dt) for k, _ in SHAPES}
            w, x = ws[2], xs[ws[2].shape[1]]
            ref = x.double() @ w.double().t()
            gemv = m <= 32  # all dense_gemv takes
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
