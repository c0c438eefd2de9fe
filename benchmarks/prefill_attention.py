#!/usr/bin/env python
"""Causal prefill attention on CPU: fp8serve's C++ kernel against torch's
scaled_dot_product_attention (what the reference backend runs), and both
against the matmul peak measured in the same run.

For every compute dtype and (sequences x tokens) cell it reports the time per
call of
  - SDPA as the reference backend calls it (GQA, is_causal, q a strided view
    of a fused qkv row, sequences padded to one length),
  - the kernel's best path (`prefill_attention`, packed varlen: for bf16 on
    AMX CPUs the AMX kernel, cpu/prefill_attention_amx.cpp; on AVX512-BF16
    CPUs without AMX its bf16 dot products), and on an AVX-512 build also the
    vector kernel's AVX2 tiles (what AVX2-only CPUs run) and, where "best"
    runs bf16 dot products, its float32 AVX-512 tiles,
with GFLOP/s counting the causal half (4 * heads * head_size * len^2 / 2 per
sequence, as benchmarks/single_stream.py counts prefill attention) and that
rate as a fraction of the best F.linear GFLOP/s of the same dtype measured in
this run on the default model's largest prefill shape (512 x 576 -> 3072).

Timings are the best of several repeats after warm-up; every ratio comes
from one run. Fixed seeds.

--baseline-rev REV builds cpu/prefill_attention.cpp as of git revision REV
beside this tree's and times the kernel's "best" path of both on every cell
instead, in --rounds ABBA rounds (medians), with whether the outputs are
bit-identical. With --context N there, every sequence's new tokens continue N
cached keys (`prefill_attention_with_context`: the keys are N + TOKENS per
sequence, the queries its last TOKENS positions), as a prefix-cache hit or a
later chunk of a chunked prefill runs.

Examples:
  python benchmarks/prefill_attention.py                  # SmolLM2 shapes, saves results
  python benchmarks/prefill_attention.py --cells 1x512 --dtypes float32 --no-save
  python benchmarks/prefill_attention.py --num-heads 32 --num-kv-heads 8 --head-size 128
  python benchmarks/prefill_attention.py --dtypes bfloat16 --cells 16x512,4x512,1x2048,3x333 --baseline-rev HEAD~1
  python benchmarks/prefill_attention.py --dtypes bfloat16 --cells 1x32,1x128,4x32 --context 4096 --baseline-rev HEAD
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_common import alternate, best_time, build_kernel_at_rev, command_line, describe_machine, machine_info

from fp8serve.kernels.cpu_ops import load_cpu_ops
from fp8serve.kernels.prefill_attention_ops import (_PATHS, MIN_MEAN_PROMPT_TOKENS, MIN_MEAN_PROMPT_TOKENS_AMX,
                                                    MIN_MEAN_PROMPT_TOKENS_BF16_VECTOR, amx_available, applies,
                                                    bf16_dot_available,
                                                    prefill_attention)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_cells(text: str) -> list[tuple[int, int]]:
    cells = []
    for part in text.split(","):
        try:
            b, n = part.lower().split("x")
            cells.append((int(b), int(n)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"cell {part!r} is not SEQSxTOKENS (e.g. 8x256)") from None
    return cells


def causal_flops(num_seqs: int, seq_len: int, num_heads: int, head_size: int) -> float:
    return num_seqs * 4.0 * num_heads * head_size * seq_len * seq_len / 2


def matmul_peak(dtype: torch.dtype, min_time: float, repeats: int) -> float:
    x = torch.randn(512, 576).to(dtype)
    w = torch.randn(3072, 576).to(dtype)
    return 2 * 512 * 576 * 3072 / best_time(lambda: F.linear(x, w), min_time, repeats) / 1e9


def make_inputs(g: torch.Generator, num_seqs: int, seq_len: int, h: int, kvh: int, d: int, dtype: torch.dtype):
    """q, k, v as strided views of one fused qkv row per token (as the engine passes them), and cu_seqlens."""
    total = num_seqs * seq_len
    qkv = torch.randn(total, (h + 2 * kvh) * d, generator=g).to(dtype)
    q = qkv[:, :h * d].view(total, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(total, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(total, kvh, d)
    return q, k, v, torch.arange(0, total + 1, seq_len, dtype=torch.int64)


def compare_with_revision(args, ops, argv, emit, lines) -> int:
    """--baseline-rev: the kernel's "best" path, this tree against REV's build, ABBA rounds."""
    base = build_kernel_at_rev(args.baseline_rev, "prefill_attention.cpp", "fp8serve_pf_base")
    h, kvh, d = args.num_heads, args.num_kv_heads, args.head_size
    emit(f"# Causal prefill attention: this tree vs {args.baseline_rev} ({datetime.date.today().isoformat()})")
    emit()
    emit(f"Command: `{command_line(argv)}`")
    emit()
    for line in describe_machine(machine_info()):
        emit(f"- {line}")
    ctx = args.context
    emit(f"- shapes: {h} heads, {kvh} kv heads, head size {d}; the vector kernel's \"best\" path of both builds; "
         f"medians of {args.rounds} ABBA rounds"
         + (f"; every sequence's new tokens continue {ctx} cached keys (the context form)" if ctx else ""))
    emit()
    emit(f"| dtype | cells | {args.baseline_rev} ms | this tree ms | speedup | bit-identical |")
    emit("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        for num_seqs, seq_len in args.cells:
            if ctx:
                # Keys of whole sequences (context + new); the queries are the new tokens' rows.
                _, k, v, cu_k = make_inputs(g, num_seqs, ctx + seq_len, h, kvh, d, DTYPES[name])
                q = make_inputs(g, num_seqs, seq_len, h, kvh, d, DTYPES[name])[0]
                cu = torch.arange(0, num_seqs * seq_len + 1, seq_len, dtype=torch.int64)
                fns = {"base": lambda: base.prefill_attention_with_context(q, k, v, cu, cu_k, d**-0.5, 1.0,
                                                                           _PATHS["best"]),
                       "this": lambda: ops.prefill_attention_with_context(q, k, v, cu, cu_k, d**-0.5, 1.0,
                                                                          _PATHS["best"])}
            else:
                q, k, v, cu = make_inputs(g, num_seqs, seq_len, h, kvh, d, DTYPES[name])
                fns = {"base": lambda: base.prefill_attention(q, k, v, cu, d**-0.5, 1.0, _PATHS["best"]),
                       "this": lambda: ops.prefill_attention(q, k, v, cu, d**-0.5, 1.0, _PATHS["best"])}
            same = torch.equal(fns["base"](), fns["this"]())
            t = alternate({k_: (lambda f=f: best_time(f, args.min_time, 1)) for k_, f in fns.items()}, args.rounds)
            emit(f"| {name} | {num_seqs}x{seq_len} | {t['base'] * 1e3:.2f} | {t['this'] * 1e3:.2f} | "
                 f"{t['base'] / t['this']:.2f}x | {'yes' if same else 'no'} |")
    if args.output and not args.no_save:
        args.output.write_text("\n".join(lines) + "\n")
        print(f"wrote {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", type=parse_cells, default=parse_cells("1x512,1x2048,8x256,4x1024"),
                   help="SEQSxTOKENS list: that many sequences of that many new tokens each")
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    p.add_argument("--num-heads", type=int, default=9)  # SmolLM2-135M
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timed calls per measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", type=Path, default=None,
                   help="markdown results file (default benchmarks/results/prefill_attention_<date>.md)")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--context", type=int, default=0,
                   help="with --baseline-rev: cached keys before every sequence's new tokens (default: 0, fresh)")
    p.add_argument("--baseline-rev", default=None,
                   help="time cpu/prefill_attention.cpp as of this git revision beside this tree's (see above)")
    p.add_argument("--rounds", type=int, default=8, help="ABBA rounds for --baseline-rev (median)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    for name in args.dtypes:
        if name not in DTYPES:
            p.error(f"--dtypes: unknown dtype {name!r}; expected some of {list(DTYPES)}")
    if args.num_heads % args.num_kv_heads:
        p.error(f"--num-heads {args.num_heads} must be a multiple of --num-kv-heads {args.num_kv_heads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = load_cpu_ops()
    if ops is None:
        sys.exit("the C++ CPU kernels are unavailable on this machine (see the warning above)")
    paths = ["best"] + (["avx2"] if ops.has_avx512() and ops.has_avx2() and args.head_size % 32 == 0 else [])
    # Where "best" runs bf16 through vdpbf16ps, also the float32 AVX-512 tiles it replaced.
    if bf16_dot_available() and not amx_available() and "bfloat16" in args.dtypes and args.head_size % 64 == 0:
        paths.append("avx512")

    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    h, kvh, d = args.num_heads, args.num_kv_heads, args.head_size
    if args.context < 0 or (args.context and not args.baseline_rev):
        p.error(f"--context takes a count of cached keys >= 0 and works with --baseline-rev; got {args.context}"
                + ("" if args.baseline_rev else " without --baseline-rev"))
    if args.baseline_rev:
        return compare_with_revision(args, ops, argv, emit, lines)
    emit(f"# Causal prefill attention on CPU ({datetime.date.today().isoformat()})")
    emit()
    emit(f"Command: `{command_line(argv)}`")
    emit()
    for line in describe_machine(machine_info()):
        emit(f"- {line}")
    emit(f"- shapes: {h} heads, {kvh} kv heads, head size {d}; GFLOP/s count the causal half")
    peaks = {name: matmul_peak(DTYPES[name], args.min_time, args.repeats) for name in args.dtypes}
    emit("- matmul peak (F.linear 512 x 576 -> 3072, this run): "
         + ", ".join(f"{name} {v:.0f} GFLOP/s" for name, v in peaks.items()))
    emit()
    head = ["dtype", "cells", "SDPA ms", "SDPA GFLOP/s", "SDPA % peak"]
    for path in paths:
        head += [f"kernel {path} ms", f"kernel {path} GFLOP/s", f"kernel {path} % peak", f"SDPA / kernel {path}"]
    emit("| " + " | ".join(head) + " |")
    emit("|" + "---|" * len(head))
    g = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = DTYPES[name]
        for num_seqs, seq_len in args.cells:
            q, k, v, cu = make_inputs(g, num_seqs, seq_len, h, kvh, d, dtype)

            def sdpa():
                return F.scaled_dot_product_attention(
                    q.view(num_seqs, seq_len, h, d).transpose(1, 2), k.view(num_seqs, seq_len, kvh, d).transpose(1, 2),
                    v.view(num_seqs, seq_len, kvh, d).transpose(1, 2), is_causal=True, scale=d**-0.5,
                    enable_gqa=True)

            flops = causal_flops(num_seqs, seq_len, h, d)
            t_sdpa = best_time(sdpa, args.min_time, args.repeats)
            row = [name, f"{num_seqs}x{seq_len}", f"{t_sdpa * 1e3:.2f}", f"{flops / t_sdpa / 1e9:.0f}",
                   f"{100 * flops / t_sdpa / 1e9 / peaks[name]:.0f}%"]
            for path in paths:
                t = best_time(lambda: prefill_attention(q, k, v, cu, d**-0.5, path=path), args.min_time, args.repeats)
                row += [f"{t * 1e3:.2f}", f"{flops / t / 1e9:.0f}", f"{100 * flops / t / 1e9 / peaks[name]:.0f}%",
                        f"{t_sdpa / t:.2f}x"]
            emit("| " + " | ".join(row) + " |")
    emit()
    def prompts(tokens: int) -> str:
        return "every prompt" if tokens <= 1 else f"prompts averaging >= {tokens} tokens"

    def min_tokens(n: str) -> str:
        if n != "bfloat16":
            return prompts(MIN_MEAN_PROMPT_TOKENS)
        if amx_available():
            return f"{prompts(MIN_MEAN_PROMPT_TOKENS_AMX)}, the AMX kernel"
        return f"{prompts(MIN_MEAN_PROMPT_TOKENS_BF16_VECTOR)}, the vector kernel: no AMX here"

    where = [f"{n} ({min_tokens(n)})" for n in args.dtypes if applies(DTYPES[n], 1 << 20, 1)]
    emit("The engine runs a kernel for fresh prefills in: " + (", ".join(where) or "none of these dtypes")
         + " (fp8serve/kernels/prefill_attention_ops.py `applies`); SDPA otherwise.")
    if not args.no_save:
        out = args.output or Path(__file__).resolve().parent / "results" / \
            f"prefill_attention_{datetime.date.today().isoformat()}.md"
        out.write_text("\n".join(lines) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
