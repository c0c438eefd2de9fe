#!/usr/bin/env python
"""Decode attention over the paged KV cache on CPU: the C++ kernel against the
machine's measured memory bandwidth and against the PyTorch reference path.

For every KV storage format and (batch, context) cell it reports
  - kernel time per call (`paged_attention_decode`, one query token per sequence),
  - achieved read bandwidth: bytes of K+V the kernel actually reads (every
    sequence's context, in the storage format) divided by that time,
  - that bandwidth as a fraction of this run's measured copy bandwidth
    (`Tensor.copy_` of a 256 MiB buffer, read + write bytes counted) and of the
    read-only bandwidth (`Tensor.sum` of the same buffer),
  - one decode step of each backend (`CpuPagedBackend.forward`, which also writes
    the new token and folds the scales; `TorchSDPABackend.forward`, gather +
    dequantize + SDPA),
and separately the cache write (quantize + scatter) of a decode batch and of a
16 x 512-token prefill.

Each kernel time comes from two call paths. `kernel`: the op called from Python, as the
engine's backend calls it where no decode plan runs (each call also pays ~4-5
us of Python, a tensor allocation and boxed dispatch: a third of a batch-1 x
512 call on a Zen 4 EPYC). `plan` (--plan-steps): the op as the engine's
decode plans call it for small batches (engine/static_plan.py: a C++ loop over
the forward's kernels, no Python between them, the output preallocated): the
fused entry `paged_attention_decode_fused_out` (the query in its compute dtype,
the scales folded in, the output converted back), --plan-steps calls of it per
plan run, as a decode step calls it once per layer. Both are reported; the
plan's output is checked against the Python call's.

Kernel times come twice. Hot: the same call repeated, so a cell whose K+V fits
in the last-level cache (up to 32 MiB on some CPUs) is read from cache, not
memory. Cold (`--cold-flush-mib`, default 128): before each timed pass a buffer
larger than the cache is read, then the pass calls the kernel on several
copies of the cell (different caches and block tables), so every call reads
K+V that no recent call touched, as in an engine step, where the weights and
the other layers' caches stream between two calls of one layer. Cold times are
medians of --cold-rounds passes. With a baseline (--baseline-rev, --baseline-lib,
or the columns the script adds by itself) the cold passes of the kernel and of
the baseline alternate too, and the cold speedup gets its own column: changes
to prefetching show there, not in the hot cells.

Timings are the best of several repeats after warm-up (the CPU may be shared:
the best repeat is the least disturbed one); every ratio comes from the same
run. Fixed seeds. Targets (issue "Fast on CPU"): FP8 reads >= 50% of the copy
bandwidth, FP8 attention time <= 16-bit attention time. The FP8 / 16-bit
tables time each cell's formats again side by side (alternating rounds, hot
and cold), not from the per-format rows: those run one format after another,
and a shared machine's memory bandwidth can change 2x between them.

Examples:
  python benchmarks/attention.py                         # SmolLM2 shapes, full grid, saves results
  python benchmarks/attention.py --batch-sizes 1 --context-lens 2048 --kv-dtypes fp8_e4m3 --no-save
  python benchmarks/attention.py --num-heads 32 --num-kv-heads 8 --head-size 128
  # compare against another build of the kernel (its ops registered under another namespace):
  python benchmarks/attention.py --baseline-lib /tmp/old.so --baseline-namespace fp8serve_base
  # or against the kernel as it was at a git revision (built by the script):
  python benchmarks/attention.py --baseline-rev HEAD~1
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_common import alternate, best_time, build_kernel_at_rev, describe_machine, machine_info, require_positive

from fp8serve.attention.backends.cpu_paged import CpuPagedBackend
from fp8serve.attention.backends.torch_sdpa import TorchSDPABackend
from fp8serve.attention.kv_cache_spec import KVCacheSpec, storage_rows
from fp8serve.attention.metadata import AttentionMetadata
from fp8serve.kernels.cpu_ops import (
    E4M3_DECODE_MULTIPLIER,
    KV_FORMATS,
    decode_amx_available,
    decode_bf16_dot_available,
    load_cpu_ops,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BANDWIDTH_BUFFER_BYTES = 256 << 20
K_SCALE, V_SCALE = 0.05, 0.03  # != 1, so the scale folding is part of what is timed


def measure_bandwidth(min_time: float, repeats: int) -> tuple[float, float]:
    """(copy GB/s counting read + write bytes, read-only GB/s) of a 256 MiB float32 buffer."""
    src = torch.ones(BANDWIDTH_BUFFER_BYTES // 4)
    dst = torch.empty_like(src)
    copy_s = best_time(lambda: dst.copy_(src), min_time, repeats)
    sum_s = best_time(lambda: src.sum(), min_time, repeats)
    return 2 * BANDWIDTH_BUFFER_BYTES / copy_s / 1e9, BANDWIDTH_BUFFER_BYTES / sum_s / 1e9


class DecodeCase:
    """One layer's paged cache holding `batch` sequences of `context` tokens in
    scattered blocks, plus one decode step's inputs (the last token of each)."""

    def __init__(self, args, kv_dtype: str, batch: int, context: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        bs, hkv, hs = args.block_size, args.num_kv_heads, args.head_size
        blocks_per_seq = math.ceil(context / bs)
        num_blocks = batch * blocks_per_seq
        self.spec = KVCacheSpec(kv_dtype, bs, hkv, hs, num_layers=1)
        self.query_dtype = args.query_dtype
        self.paged = CpuPagedBackend(self.spec, self.query_dtype)
        self.reference = TorchSDPABackend(self.spec, self.query_dtype)
        self.kv_cache = self.paged.allocate_kv_cache(num_blocks, torch.device("cpu"))
        # Fill every usable block the way the engine does (quantize-on-write), in slices
        # to bound the float32 temporaries.
        rows = storage_rows(self.kv_cache[0]).shape[0] // hkv - bs  # all but the null block
        for kv, scale in ((0, K_SCALE), (1, V_SCALE)):
            flat = storage_rows(self.kv_cache[kv]).view(-1, hkv, hs)  # memory order: every row gets random codes
            for start in range(0, rows, 1 << 15):
                n = min(1 << 15, rows - start)
                x = torch.randn(n, hkv, hs, generator=g) * (scale * 8)
                flat[start:start + n] = self.paged._store(x, scale)
        ids = torch.randperm(num_blocks, generator=g)
        self.block_tables = ids.view(batch, blocks_per_seq).contiguous()
        self.seq_lens = torch.full((batch,), context, dtype=torch.int64)
        last = self.seq_lens - 1
        slot_mapping = self.block_tables[torch.arange(batch), last // bs] * bs + last % bs
        self.md = AttentionMetadata(
            slot_mapping=slot_mapping, block_tables=self.block_tables, seq_lens=self.seq_lens,
            query_start_loc=torch.arange(batch + 1), max_query_len=1, max_seq_len=context,
            num_seqs=batch, num_tokens=batch, null_block_id=num_blocks,
        )
        self.query = torch.randn(batch, args.num_heads, hs, generator=g).to(self.query_dtype)
        self.key = (torch.randn(batch, hkv, hs, generator=g) * (K_SCALE * 8)).to(self.query_dtype)
        self.value = (torch.randn(batch, hkv, hs, generator=g) * (V_SCALE * 8)).to(self.query_dtype)
        self.softmax_scale = hs ** -0.5
        decode_mult = E4M3_DECODE_MULTIPLIER if kv_dtype == "fp8_e4m3" else 1.0
        self.kernel_query = self.query.float() * (self.softmax_scale * K_SCALE * decode_mult)
        self.out_scale = V_SCALE * decode_mult
        self.bytes_read = 2 * batch * context * hkv * hs * self.spec.element_size
        self.kv_dtype = kv_dtype
        # What a decode plan's attention step takes (attention_plan).
        self.q_scale = self.softmax_scale * K_SCALE * decode_mult
        self.k_cache, self.v_cache = self.kv_cache.unbind(0)
        self.plan_out = torch.empty_like(self.query)
        # The op itself, as the engine's backend calls it: the Python wrapper's
        # argument checks cost ~10 us, a quarter of a batch-1 call, and the
        # baseline column calls its op directly too. Looked up once: finding it
        # on every call (the CPU checks behind bf16_query_op_name, the ops
        # object's attribute) added ~3.5 us of Python to each timed call, a
        # sixth of a batch-1 x 512 call (20 us against 17 us for the op alone,
        # Zen 4). A bf16 query: the tiles the engine's fused entry takes for it
        # (for FP8 caches the AMX tiles, else the bf16 dot-product tiles, where
        # built; "best" otherwise).
        name = bf16_query_op_name() if self.query_dtype == torch.bfloat16 else "paged_attention_decode"
        self.op = getattr(load_cpu_ops(), name)

    def kernel(self, op=None):
        op = op or self.op
        out = torch.empty_like(self.kernel_query)
        op(out, self.kernel_query, self.kv_cache[0], self.kv_cache[1], self.block_tables, self.seq_lens,
           KV_FORMATS[self.kv_dtype], self.out_scale)
        return out

    def backend_step(self, backend):
        return backend.forward(self.query, self.key, self.value, self.kv_cache, self.md,
                               softmax_scale=self.softmax_scale, k_scale=K_SCALE, v_scale=V_SCALE)


def attention_plan(cases: list[DecodeCase], repeat: int = 1):
    """A `fp8serve::DecodePlan` (kernels/cpu/decode_plan.cpp) of attention
    steps, what the engine's decode plans run once per layer: each case's
    query, caches and tables `repeat` times in order, into the case's
    preallocated `plan_out`."""
    plan = torch.classes.fp8serve.DecodePlan()
    for _ in range(repeat):
        for c in cases:
            plan.add("attention", [c.plan_out, c.query, c.k_cache, c.v_cache, c.block_tables, c.seq_lens],
                     [KV_FORMATS[c.kv_dtype]], [c.q_scale, c.out_scale], [])
    plan.set_output(cases[-1].plan_out)
    return plan


def check_plan_output(case: DecodeCase) -> None:
    """The plan's result (query dtype) against the Python call's (float32):
    both read the same codes with the same scales folded, so a float32 query
    gives the same values and a bf16 one differs by the output's rounding to
    bf16 (2^-9 relative; 2-3e-3 of the largest output measured) and the
    query's scaling before its rounding. A plan wired to other arguments (K
    and V swapped, a scale) is off by far more."""
    attention_plan([case]).run([])
    want = case.kernel()
    got = case.plan_out.float()
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    if not err <= (1e-5 if case.query_dtype == torch.float32 else 1e-2):
        sys.exit(f"the decode plan's attention output differs from the op's: max error {err:.3g} of the largest "
                 f"output ({case.kv_dtype}, batch {case.block_tables.shape[0]})")


def time_plan_hot(case: DecodeCase, steps: int, min_time: float, repeats: int) -> float:
    """Seconds per attention call in a plan of `steps` calls on the same cell."""
    plan = attention_plan([case], steps)
    return best_time(lambda: plan.run([]), min_time, repeats) / steps


def time_plan_cold(cases: list[DecodeCase], flush: torch.Tensor, rounds: int) -> float:
    """time_cold's passes with the calls in one plan: median seconds per call."""
    plan = attention_plan(cases)
    times = []
    for _ in range(rounds):
        flush.sum()
        t = time.perf_counter()
        plan.run([])
        times.append((time.perf_counter() - t) / len(cases))
    return statistics.median(times)


def bf16_query_op_name() -> str:
    """The op whose tiles a bf16 query takes in the engine (see DecodeCase.kernel)."""
    if decode_amx_available():
        return "paged_attention_decode_amx"
    return "paged_attention_decode_bf16dot" if decode_bf16_dot_available() else "paged_attention_decode"


def time_cold(cases: list[DecodeCase], flush: torch.Tensor, rounds: int, op=None) -> float:
    """Median seconds per kernel call (`op`, default the kernel) over `rounds`
    passes, each after reading `flush` (larger than the last-level cache) and
    calling every case once."""
    times = []
    for _ in range(rounds):
        flush.sum()
        t = time.perf_counter()
        for case in cases:
            case.kernel(op)
        times.append((time.perf_counter() - t) / len(cases))
    return statistics.median(times)


def cold_cases(args, kv_dtype: str, batch: int, context: int) -> list[DecodeCase]:
    """The cell and a few copies of it (at least ~8 MiB of K+V per pass, at most
    8 cases), each with its own cache and block table: a cold pass calls every
    one once, so no call reads K+V that a recent call touched."""
    seed = batch * 100003 + context
    first = DecodeCase(args, kv_dtype, batch, context, seed=seed)
    n = max(1, min(8, math.ceil((8 << 20) / first.bytes_read)))
    return [first, *(DecodeCase(args, kv_dtype, batch, context, seed=seed + i) for i in range(1, n))]


def paired_format_times(args, dtypes: list[str], batch: int, context: int,
                        flush: torch.Tensor | None) -> tuple[dict[str, float], dict[str, float]]:
    """(hot, cold) seconds per call of each KV format of one cell, timed side by
    side: the formats alternate (order reversed every other round) for
    --baseline-rounds hot rounds and --cold-rounds cold passes, medians. The
    per-format rows above are timed one format after another, minutes apart,
    and this machine's memory bandwidth can change by 2x within minutes: a
    ratio of those rows can say more about the minute than about the format."""
    cases = {d: cold_cases(args, d, batch, context) if flush is not None
             else [DecodeCase(args, d, batch, context, seed=batch * 100003 + context)] for d in dtypes}
    per = args.min_time / args.baseline_rounds
    hot = alternate({d: (lambda d=d: best_time(cases[d][0].kernel, per, 2)) for d in dtypes}, args.baseline_rounds)
    cold = {} if flush is None else alternate({d: (lambda d=d: time_cold(cases[d], flush, 1)) for d in dtypes},
                                              args.cold_rounds)
    return hot, cold


def time_cache_write(args, kv_dtype: str, num_tokens: int, min_time: float, repeats: int) -> tuple[float, float]:
    """(seconds, GB/s counting float32 K+V read and cache bytes written) of one write."""
    g = torch.Generator().manual_seed(1)
    bs, hkv, hs = args.block_size, args.num_kv_heads, args.head_size
    spec = KVCacheSpec(kv_dtype, bs, hkv, hs, num_layers=1)
    backend = CpuPagedBackend(spec, torch.float32)
    num_blocks = math.ceil(num_tokens / bs) * 2
    kv_cache = backend.allocate_kv_cache(num_blocks, torch.device("cpu"))
    slots = torch.randperm(num_blocks * bs, generator=g)[:num_tokens]
    key = torch.randn(num_tokens, hkv, hs, generator=g)
    value = torch.randn(num_tokens, hkv, hs, generator=g)
    s = best_time(lambda: backend.write_kv_cache(key, value, kv_cache, slots, K_SCALE, V_SCALE), min_time, repeats)
    nbytes = 2 * num_tokens * hkv * hs * (4 + spec.element_size)
    return s, nbytes / s / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--batch-sizes", type=ints, default=[1, 16, 64])
    p.add_argument("--context-lens", type=ints, default=[512, 2048])
    p.add_argument("--kv-dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--num-heads", type=int, default=9)  # SmolLM2-135M
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--query-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the model's compute dtype: bfloat16 times what a bf16 model runs (FP8 caches take the "
                        "bf16 dot-product tiles where the CPU has AVX512-BF16), with the float32 tiles as "
                        "the baseline column")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timed calls per measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-reference", action="store_true", help="do not time the TorchSDPABackend step")
    p.add_argument("--cold-flush-mib", type=int, default=128,
                   help="MiB read before each cold pass (more than the last-level cache); 0: no cold columns")
    p.add_argument("--cold-rounds", type=int, default=9, help="cold passes per cell (median)")
    p.add_argument("--plan-steps", type=int, default=30,
                   help="attention calls per decode-plan run for the plan columns (a decode step of the default "
                        "model calls it 30 times, once per layer); 0: no plan columns")
    p.add_argument("--baseline-lib", help="another build of the kernel library to time side by side")
    p.add_argument("--baseline-namespace", default="fp8serve_base", help="its torch.ops namespace")
    p.add_argument("--baseline-rev", help="time paged_attention.cpp as of this git revision side by side")
    p.add_argument("--baseline-rounds", type=int, default=8,
                   help="with a baseline column: alternating (ABBA) rounds of kernel and baseline, medians")
    p.add_argument("--no-avx2-column", action="store_true",
                   help="on an AVX-512 build, do not also time the AVX2 tiles")
    p.add_argument("--output", type=Path, default=None,
                   help="markdown results file (default benchmarks/results/attention_<date>.md)")
    p.add_argument("--no-save", action="store_true", help="print the tables only; write no results file")
    args = p.parse_args()
    args.query_dtype = getattr(torch, args.query_dtype)

    if args.no_save and args.output is not None:
        p.error(f"--no-save writes no file but --output names one ({args.output}): give one of them")

    if args.cold_flush_mib < 0:
        p.error(f"--cold-flush-mib must be >= 0, got {args.cold_flush_mib}")
    if args.cold_rounds < 1:
        p.error(f"--cold-rounds must be >= 1, got {args.cold_rounds}")
    if args.plan_steps < 0:
        p.error(f"--plan-steps must be >= 0, got {args.plan_steps}")
    require_positive(p, args, "baseline_rounds")
    if args.threads:
        torch.set_num_threads(args.threads)
    if load_cpu_ops() is None:
        sys.exit("the C++ CPU kernels are unavailable on this machine (see the warning above)")
    baseline, base_label = None, ""
    if args.baseline_lib and args.baseline_rev:
        p.error("give --baseline-lib or --baseline-rev, not both")
    # The baseline build's op of the same name as the kernel column's (DecodeCase.kernel), so both
    # columns time what the engine runs; a build from before the AMX tiles times its bf16 dot-product
    # tiles instead (what the engine ran there).
    op_name = bf16_query_op_name() if args.query_dtype == torch.bfloat16 else "paged_attention_decode"

    def baseline_op(ns_ops):
        if op_name == "paged_attention_decode_amx" and not hasattr(ns_ops, op_name):
            return ns_ops.paged_attention_decode_bf16dot
        return getattr(ns_ops, op_name)

    if args.baseline_rev:
        ops_at_rev = build_kernel_at_rev(args.baseline_rev, "paged_attention.cpp", args.baseline_namespace)
        baseline, base_label = baseline_op(ops_at_rev), f"baseline ({args.baseline_rev})"
    elif args.baseline_lib:
        torch.ops.load_library(args.baseline_lib)
        baseline = baseline_op(getattr(torch.ops, args.baseline_namespace))
        base_label = "baseline"
    elif args.query_dtype == torch.bfloat16:
        # What a float32 query (model) runs on the same data: the speedup column
        # is then that of the bf16 dot-product tiles.
        baseline, base_label = load_cpu_ops().paged_attention_decode, "float32 tiles"
    elif load_cpu_ops().has_avx512() and not args.no_avx2_column:
        # The kernel runs its AVX-512 tiles here; time the AVX2 tiles too (what
        # AVX2-only CPUs run) so both show in one run.
        baseline, base_label = load_cpu_ops().paged_attention_decode_avx2, "AVX2 tiles"
    torch.manual_seed(0)

    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    emit(f"# Paged decode attention on CPU ({datetime.date.today().isoformat()})")
    emit()
    emit("Command: `python " + " ".join(shlex.quote(a) for a in sys.argv) + "`")
    emit()
    for line in describe_machine(machine_info()):
        emit(f"- {line}")
    emit(f"- shapes: {args.num_heads} heads, {args.num_kv_heads} kv heads, head size {args.head_size}, "
         f"block size {args.block_size}; "
         + ("float32 query and compute" if args.query_dtype == torch.float32 else
            "bf16 query (the kernel converts it to float32; FP8 caches take "
            + ("the AMX tiles" if decode_amx_available() else "the bf16 dot-product tiles" if
               decode_bf16_dot_available() else "the float32 tiles (no bf16 dot-product tiles built here)") + ")"))
    # Bandwidth is measured before and after the attention cells; the
    # percentages use the best of the two (a shared CPU disturbs one or the
    # other; the better one is closer to the machine's limit).
    copy_start, read_start = measure_bandwidth(args.min_time, args.repeats)
    print(f"(bandwidth at start: copy {copy_start:.1f} GB/s, read {read_start:.1f} GB/s)", flush=True)
    rows: list[dict] = []
    flush = torch.ones((args.cold_flush_mib << 20) // 4) if args.cold_flush_mib else None
    for kv_dtype in args.kv_dtypes:
        for batch in args.batch_sizes:
            for context in args.context_lens:
                case = DecodeCase(args, kv_dtype, batch, context, seed=batch * 100003 + context)
                r = dict(kv_dtype=kv_dtype, batch=batch, context=context, mib=case.bytes_read / 2**20)
                if baseline:
                    # Side by side: short best-of-2 loops of each, alternating in ABBA rounds
                    # (medians), so a slow stretch of a shared machine weighs on both columns.
                    per = args.min_time / args.baseline_rounds
                    both = alternate({"kernel": lambda: best_time(case.kernel, per, 2),
                                      "base": lambda: best_time(lambda: case.kernel(baseline), per, 2)},
                                     args.baseline_rounds)
                    r["kernel"], r["base"] = both["kernel"], both["base"]
                else:
                    r["kernel"] = best_time(case.kernel, args.min_time, args.repeats)
                r["gbs"] = case.bytes_read / r["kernel"] / 1e9
                if args.plan_steps:
                    check_plan_output(case)
                    r["plan"] = time_plan_hot(case, args.plan_steps, args.min_time, args.repeats)
                if flush is not None:
                    # A few copies per pass (at least ~8 MiB of K+V, at most 8) amortize the timer.
                    cases = [case, *cold_cases(args, kv_dtype, batch, context)[1:]]
                    if baseline:
                        both = alternate({"kernel": lambda: time_cold(cases, flush, 1),
                                          "base": lambda: time_cold(cases, flush, 1, baseline)}, args.cold_rounds)
                        r["cold"], r["cold_base"] = both["kernel"], both["base"]
                    else:
                        r["cold"] = time_cold(cases, flush, args.cold_rounds)
                    r["cold_gbs"] = case.bytes_read / r["cold"] / 1e9
                    if args.plan_steps:
                        r["cold_plan"] = time_plan_cold(cases, flush, args.cold_rounds)
                    del cases
                r["paged"] = best_time(lambda: case.backend_step(case.paged), args.min_time, args.repeats)
                if not args.skip_reference:
                    case.reference.build_metadata(case.md)
                    r["ref"] = best_time(lambda: case.backend_step(case.reference), args.min_time, args.repeats)
                print(f"  {kv_dtype} batch {batch} context {context}: kernel {r['kernel'] * 1e3:.3f} ms "
                      f"({r['gbs']:.1f} GB/s)", flush=True)
                rows.append(r)
                del case
    copy_end, read_end = measure_bandwidth(args.min_time, args.repeats)
    copy_bw, read_bw = max(copy_start, copy_end), max(read_start, read_end)
    emit(f"- measured bandwidth (256 MiB float32 buffer, best of before/after the attention cells): "
         f"copy {copy_bw:.1f} GB/s (read + write; {copy_start:.1f} before, {copy_end:.1f} after), "
         f"read-only sum {read_bw:.1f} GB/s ({read_start:.1f} before, {read_end:.1f} after)")
    emit()
    emit("Kernel: the `paged_attention_decode` op alone, called directly as the engine does, hot (the same call "
         "repeated: small cells read from cache) and cold (after reading a "
         f"{args.cold_flush_mib} MiB buffer, on copies of the cell no recent call touched). "
         "GB/s: K+V bytes read / kernel time. "
         "Steps: one decode step of a backend (cache write of the new token included).")
    if args.plan_steps:
        emit(f"Plan: the same cells, the op called as the engine's decode plans call it (from C++, "
             f"`paged_attention_decode_fused_out`, {args.plan_steps} calls per plan run, time per call; cold: one "
             "call per copy of the cell, after the same flush); these columns leave out the ~4-5 us of Python, "
             "allocation and boxed dispatch per call that `kernel ms` includes.")
    if base_label == "float32 tiles":
        emit("`float32 tiles ms` times `paged_attention_decode` (what a float32 query runs) on the same data; "
             "speedup = float32 tiles / kernel.")
    if base_label == "AVX2 tiles":
        emit("The kernel runs its AVX-512 tiles on this CPU; `AVX2 tiles ms` times the AVX2 tiles "
             "(`paged_attention_decode_avx2`, what AVX2-only CPUs run) on the same data; "
             "speedup = AVX2 tiles / kernel.")
    emit()
    cold_base = baseline is not None and flush is not None
    base_cols = (f" {base_label} ms | speedup |" if baseline else "") + (
        f" cold {base_label} ms | cold speedup |" if cold_base else "")
    base_sep = ("---|---|" if baseline else "") + ("---|---|" if cold_base else "")
    cold_cols = " cold ms | cold GB/s | cold % copy |" if flush is not None else ""
    cold_sep = "---|---|---|" if flush is not None else ""
    plan_cols = " plan ms | plan GB/s | plan % copy |" if args.plan_steps else ""
    plan_cols += " cold plan ms | cold plan % copy |" if args.plan_steps and flush is not None else ""
    plan_sep = "---|" * plan_cols.count("|")
    emit(f"| kv dtype | batch | context | K+V MiB | kernel ms | GB/s | % copy | % read |{cold_cols}{base_cols}"
         f" cpu_paged step ms | torch_sdpa step ms | step speedup |{plan_cols}")
    emit(f"|---|---|---|---|---|---|---|---|{cold_sep}{base_sep}---|---|---|{plan_sep}")
    for r in rows:
        line = (f"| {r['kv_dtype']} | {r['batch']} | {r['context']} | {r['mib']:.1f} | {r['kernel'] * 1e3:.3f} "
                f"| {r['gbs']:.1f} | {100 * r['gbs'] / copy_bw:.0f}% | {100 * r['gbs'] / read_bw:.0f}% |")
        if "cold" in r:
            line += f" {r['cold'] * 1e3:.3f} | {r['cold_gbs']:.1f} | {100 * r['cold_gbs'] / copy_bw:.0f}% |"
        if baseline:
            line += f" {r['base'] * 1e3:.3f} | {r['base'] / r['kernel']:.2f}x |"
        if cold_base:
            line += f" {r['cold_base'] * 1e3:.3f} | {r['cold_base'] / r['cold']:.2f}x |"
        if "ref" in r:
            line += f" {r['paged'] * 1e3:.3f} | {r['ref'] * 1e3:.3f} | {r['ref'] / r['paged']:.1f}x |"
        else:
            line += f" {r['paged'] * 1e3:.3f} | - | - |"
        if "plan" in r:
            plan_gbs = r["mib"] * 2**20 / r["plan"] / 1e9
            line += f" {r['plan'] * 1e3:.3f} | {plan_gbs:.1f} | {100 * plan_gbs / copy_bw:.0f}% |"
        if "cold_plan" in r:
            cold_plan_gbs = r["mib"] * 2**20 / r["cold_plan"] / 1e9
            line += f" {r['cold_plan'] * 1e3:.3f} | {100 * cold_plan_gbs / copy_bw:.0f}% |"
        emit(line)

    fp8 = [d for d in args.kv_dtypes if d.startswith("fp8")]
    sixteen = [d for d in args.kv_dtypes if d in ("bfloat16", "float16")]
    if fp8 and sixteen:
        # The ratios are timed again with the formats side by side (see paired_format_times).
        paired_hot: dict[tuple[str, int, int], float] = {}
        paired_cold: dict[tuple[str, int, int], float] = {}
        for batch in args.batch_sizes:
            for context in args.context_lens:
                hot, cold = paired_format_times(args, fp8 + sixteen, batch, context, flush)
                for d in hot:
                    paired_hot[d, batch, context] = hot[d] * 1e3
                for d in cold:
                    paired_cold[d, batch, context] = cold[d] * 1e3
        for label, times, rounds in (("", paired_hot, args.baseline_rounds), ("cold ", paired_cold, args.cold_rounds)):
            if not times:
                continue
            emit()
            emit(f"FP8 {label}kernel time / 16-bit {label}kernel time (target <= 1), the formats of each cell "
                 f"timed side by side ({rounds} alternating rounds, medians; ms in brackets):")
            emit()
            emit("| batch | context | " + " | ".join(f"{f} / {s}" for f in fp8 for s in sixteen) + " |")
            emit("|---|---|" + "---|" * (len(fp8) * len(sixteen)))
            for batch in args.batch_sizes:
                for context in args.context_lens:
                    cells = [f"{times[f, batch, context] / times[s, batch, context]:.2f} "
                             f"({times[f, batch, context]:.3f} / {times[s, batch, context]:.3f})"
                             for f in fp8 for s in sixteen]
                    emit(f"| {batch} | {context} | " + " | ".join(cells) + " |")

    emit()
    emit("Cache write (`CpuPagedBackend.write_kv_cache`: quantize/convert + scatter of K and V into "
         "random slots). GB/s: float32 K+V read + cache bytes written.")
    emit()
    write_shapes = [(f"decode batch {b}", b) for b in args.batch_sizes] + [("prefill 16 x 512", 16 * 512)]
    emit("| kv dtype | " + " | ".join(name for name, _ in write_shapes) + " |")
    emit("|---|" + "---|" * len(write_shapes))
    for kv_dtype in args.kv_dtypes:
        cells = []
        for _, n in write_shapes:
            s, gbs = time_cache_write(args, kv_dtype, n, args.min_time, args.repeats)
            cells.append(f"{s * 1e6:.0f} us ({gbs:.2f} GB/s)")
        emit(f"| {kv_dtype} | " + " | ".join(cells) + " |")

    emit()
    emit(f"Load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    if not args.no_save:
        out = args.output or RESULTS_DIR / f"attention_{datetime.date.today().isoformat()}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        print(f"\nsaved {out}")


if __name__ == "__main__":
    main()
