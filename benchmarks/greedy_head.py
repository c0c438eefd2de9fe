#!/usr/bin/env python
"""The exact greedy LM head (fp8serve/kernels/screened_argmax.py) against
the full head, inside one engine per checkpoint, float32 activations
(--dtype bfloat16: bf16 compute, a bf16 head and bf16 activations, whose full
head rounds its logits to bf16).

Per config (`base`: the model as it is; `fp8`: its FP8 checkpoint, whose
16-bit head stays bf16) it
  1. records the LM head's input rows of a greedy generation from text and
     reports how many vocabulary rows the screen keeps for them;
  2. times the head alone, cold (a 64 MiB read before every call), on those
     rows at M = 1, 2, 4, 8: the full path (logits, then the sampler's argmax)
     against the screened one, alternating (ABBA), medians of --rounds, and
     checks that both give the same tokens (the "engine screens" column says
     whether the engine takes the screen at that many rows:
     screened_argmax.engine_rows, chosen from this table);
  3. times batch-1 (and --decode-batch) engine decode steps with the screen
     on and off, switched between rounds in the same engine (ABBA), and
     checks that both produce the same tokens.

--baseline-rev REV also builds the screen's kernel (cpu/screened_argmax.cpp)
as of git revision REV under another op namespace and times it in step 2 as
a third side of the same rounds, on the same rows and screen, with the same
exact logits of its candidates (columns "baseline screened ms", "baseline /
screened" and whether its tokens are the full head's).

    python benchmarks/greedy_head.py                           # default model and its FP8 checkpoint
    python benchmarks/greedy_head.py --configs base --rounds 8 --output benchmarks/results/x.md
    python benchmarks/greedy_head.py --configs fp8 --baseline-rev HEAD~1   # the kernel before a change
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    alternate, build_kernel_at_rev, command_line, describe_machine, greedy_head_rows, machine_info, narrow_weights,
    record_as_a_warm_engine, require_positive, time_greedy_decode, token_source)

from fp8serve.kernels import cpu_ops, screened_argmax  # noqa: E402

ROWS = (1, 2, 4, 8)


def baseline_tokens(op, x: torch.Tensor, screen, logits_of_rows) -> torch.Tensor | None:
    """greedy_tokens with the candidates of a baseline build of the kernel
    (`op`: its screened_candidates, with or without the x_levels argument of
    the integer screen)."""
    gap, flushed = screened_argmax._full_head_terms(x, screen)
    args = [x.float(), screen.codes, screen.scale, screen.slack, gap, flushed]
    if len(op.default._schema.arguments) == 7:
        args.append(screen.x_levels)
    candidates = op(*args)
    if candidates.numel() == 0:
        return None
    return candidates[cpu_ops.greedy_argmax(logits_of_rows(candidates))]


def time_head(head, screen, x: torch.Tensor, flush: torch.Tensor, calls: int, rounds: int, baseline=None):
    """Median seconds of the full head (logits, then the sampler's argmax)
    and of the screen's tokens on x, cold, at any row count (the engine
    screens only `engine_rows`); and whether their tokens agree. None where
    the head's path for these rows has no form for a few rows alone (AMX
    tiles at 8-64 bf16 rows: LMHead.logits_of_rows), so no screen serves them.
    With `baseline` (a baseline build's screened_candidates) also its median
    seconds and whether its tokens are the full head's (else both None)."""
    def timed(fn) -> float:
        times = []
        for _ in range(calls):
            flush.sum()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    logits_of_rows = head.logits_of_rows(x)
    if logits_of_rows is None:
        return None
    full = lambda: cpu_ops.greedy_argmax(head(x))
    screened = lambda: screened_argmax.greedy_tokens(x, head.weight, screen, logits_of_rows)
    sides = {"full": lambda: timed(full), "screened": lambda: timed(screened)}
    if baseline is not None:
        sides["baseline"] = lambda: timed(lambda: baseline_tokens(baseline, x, screen, logits_of_rows))
    med = alternate(sides, rounds)
    want = full()
    tokens = screened()
    base_ms = base_same = None
    if baseline is not None:
        base_tokens = baseline_tokens(baseline, x, screen, logits_of_rows)
        base_ms, base_same = med["baseline"], base_tokens is not None and torch.equal(base_tokens, want)
    return med["full"], med["screened"], tokens is not None and torch.equal(tokens, want), base_ms, base_same


def run_config(name: str, model_dir: Path, args, lines: list[str], baseline=None) -> None:
    from fp8serve import LLM

    with narrow_weights(keep=False):  # "base" under float32: the 16-bit checkpoint's head upcast to float32
        llm = LLM(model=str(model_dir), dtype=args.dtype, max_model_len=args.decode_context + args.decode_steps + 64,
                  max_num_seqs=max(8, max(args.decode_batch)), device="cpu", seed=args.seed,
                  kv_cache_memory=args.kv_cache_memory)
    engine = llm.llm_engine
    record_as_a_warm_engine(engine)
    head = engine.model_runner.model.lm_head
    screen = head.greedy_screen
    if screen is None:
        sys.exit(f"{name}: the engine built no screen for its LM head (FP8SERVE_SCREENED_ARGMAX=0, no C++ "
                 f"kernels, or a compute dtype and head the screen does not serve)")
    rng = random.Random(args.seed)
    draw = token_source(engine, args.prompts)
    compute_dtype = engine.model_runner.dtype
    rows = greedy_head_rows(engine, draw, rng, args.decode_context, args.sample_steps).to(compute_dtype)
    counts = [screened_argmax.screened_candidates(r.unsqueeze(0), screen).numel() for r in rows]
    w = head.weight
    lines.append(f"- {name}: {model_dir}; head {tuple(w.shape)} {w.dtype}, {w.numel() * w.element_size() / 2**20:.1f} "
                 f"MiB; screen {screen.nbytes / 2**20:.1f} MiB; candidates per row over {len(counts)} decode rows: "
                 f"median {statistics.median(counts):.0f}, mean {statistics.mean(counts):.1f}, max {max(counts)}")
    flush = torch.ones((64 << 20) // 4)
    for m in ROWS:
        x = rows[torch.arange(m) % len(rows)].contiguous()
        timed = time_head(head, screen, x, flush, args.calls, args.rounds, baseline)
        extra = " - | - | - |" if baseline is not None else ""
        if timed is None:
            lines.append(f"| {name} | head alone, cold | {m} | no | - | - | - | - (no per-row path at {m} rows) |"
                         f"{extra}")
            print(lines[-1], file=sys.stderr, flush=True)
            continue
        full, screened, same, base_ms, base_same = timed
        if baseline is not None:
            extra = f" {1e3 * base_ms:.2f} | {base_ms / screened:.2f}x | {'yes' if base_same else 'NO'} |"
        screens = "yes" if m <= screened_argmax.engine_rows(w.dtype, compute_dtype) else "no"
        lines.append(f"| {name} | head alone, cold | {m} | {screens} | {1e3 * full:.2f} | {1e3 * screened:.2f} | "
                     f"{full / screened:.2f}x | {'yes' if same else 'NO'} |{extra}")
        print(lines[-1], file=sys.stderr, flush=True)
    for batch in args.decode_batch:
        prompts = [draw(args.decode_context, rng) for _ in range(batch)]
        res: dict[str, list[float]] = {"full": [], "screened": []}
        toks: dict[str, list] = {}
        for r in range(args.rounds):
            for side in (("full", "screened") if r % 2 == 0 else ("screened", "full")):
                head.greedy_screen = screen if side == "screened" else None
                t, toks[side] = time_greedy_decode(engine, prompts, args.decode_steps)
                res[side].append(t)
        head.greedy_screen = screen
        full, screened = statistics.median(res["full"]), statistics.median(res["screened"])
        screens = "yes" if batch <= screened_argmax.engine_rows(w.dtype, compute_dtype) else "no"
        lines.append(f"| {name} | engine decode step, batch {batch} x ~{args.decode_context} | {batch} | {screens} | "
                     f"{1e3 * full:.2f} | {1e3 * screened:.2f} | {full / screened:.2f}x | "
                     f"{'yes' if toks['full'] == toks['screened'] else 'NO'} |"
                     f"{' - | - | - |' if baseline is not None else ''}")
        print(lines[-1], file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in default model)")
    p.add_argument("--fp8-model", default=None, help="FP8 checkpoint for the fp8 config (default: written once "
                   "from --model, as single_stream.py does)")
    p.add_argument("--configs", default="base,fp8", help="comma-separated: base, fp8")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype (bfloat16: the default model's head stays bf16)")
    p.add_argument("--decode-batch", default="1", help="comma-separated batch sizes of the engine decode steps")
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--sample-steps", type=int, default=64, help="decode steps whose head rows are recorded")
    p.add_argument("--calls", type=int, default=5, help="cold head calls per round (median)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--prompts", choices=("text", "random"), default="text")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, help="also write the table (markdown) here")
    p.add_argument("--baseline-rev", default=None,
                   help="also time cpu/screened_argmax.cpp as of this git revision (see above)")
    args = p.parse_args()
    require_positive(p, args, "decode_context", "decode_steps", "sample_steps", "calls", "rounds")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in ("base", "fp8")]
    if bad or not configs:
        p.error(f"--configs: expected a list of base, fp8; got {args.configs!r}")
    try:
        args.decode_batch = [int(b) for b in args.decode_batch.split(",")]
    except ValueError:
        p.error(f"--decode-batch: expected comma-separated integers, got {args.decode_batch!r}")
    if any(b < 1 for b in args.decode_batch):
        p.error(f"--decode-batch: batch sizes must be >= 1, got {args.decode_batch}")
    if cpu_ops.load_cpu_ops() is None:
        sys.exit("the C++ CPU kernels are not available: the screen needs them")
    from single_stream import ensure_fp8_checkpoint, fp8_checkpoint_dir

    from fp8serve.default_model import ensure_default_model

    src = Path(args.model) if args.model else ensure_default_model()
    lines = [f"Command: `{command_line()}`", "", *(f"- {x}" for x in describe_machine(machine_info())),
             f"- {args.dtype} activations; medians of {args.rounds} ABBA rounds; head rows recorded from a greedy "
             f"generation ({args.prompts} prompts)"]
    table = ["", "| config | cell | rows | engine screens | full ms | screened ms | full / screened | same tokens |",
             "|---|---|---|---|---|---|---|---|"]
    baseline = None
    if args.baseline_rev is not None:
        baseline = build_kernel_at_rev(args.baseline_rev, "screened_argmax.cpp",
                                       "fp8serve_baseline_screen").screened_candidates
        lines.append(f"- baseline: cpu/screened_argmax.cpp as of {args.baseline_rev}, timed on the same rows and "
                     f"screen in the same rounds")
        table[1] += " baseline screened ms | baseline / screened | baseline same tokens |"
        table[2] += "---|---|---|"
    for name in configs:
        if name == "base":
            model_dir = src
        else:
            model_dir = Path(args.fp8_model) if args.fp8_model else ensure_fp8_checkpoint(
                src, fp8_checkpoint_dir(src, args.model is None))
        config_lines: list[str] = []
        run_config(name, model_dir, args, config_lines, baseline)
        lines += [x for x in config_lines if x.startswith("- ")]
        table += [x for x in config_lines if x.startswith("| ")]
        gc.collect()
    print("\n".join(lines + table), flush=True)
    if args.output:
        args.output.write_text("\n".join(lines + table) + "\n")


if __name__ == "__main__":
    main()
