#!/usr/bin/env python
"""Where a prefill step's time goes: for each cell (sequences x prompt tokens, all prefilled in one
engine step, max_tokens=1) the step's median time, its linear-layer GFLOP/s, and the part spent in
the prefill GEMMs (the calls that reach `fp8serve.kernels.onednn_linear.linear`: oneDNN or
F.linear, what prefills of 16/32-bit checkpoints run above the decode kernels' row counts)
against the same GEMMs run back to back outside the engine.

Why: single_stream.py says how far a prefill is from the matmul peak, not why. Timing the GEMMs
inside the step (a wrapper on `onednn_linear.linear`, ~1 us a call) and then alone (the step's own
calls replayed in order on its own weights, each layer's distinct, inputs of the same shapes)
splits the gap into "the GEMMs run slower inside a step" and "the rest of the step" (attention,
norms, activation, RoPE, cache writes, sampling, Python). The rest is split once more: every call
of a C++ op (torch.ops.fp8serve, reached through `load_cpu_ops`, which the engine calls at each
use) is timed by a stand-in for the ops object (~1 us a call), per op; what is left ("outside the
ops") is Python, torch's own small ops (views, allocations) and the dispatch between them. A second
table lists each cell's ops by time. The steps run the module tree (the engine's recorded prefill
forwards are off here: they would call the ops past the timers; benchmarks/prefill_capture.py
measures what they save), every token through the whole last layer (the engine's pruning of it to
each prompt's last token is off: benchmarks/last_layer_pruning.py measures it).

Linear GFLOP/s counts 2 x tokens x the weights of the model's linear layers (no LM head, no
attention), as single_stream.py's "linear" FLOPs do. Cells whose prompts are too short for the GEMM
path (decode kernels take them) show "-" in the GEMM columns.

    .venv/bin/python benchmarks/prefill_breakdown.py
    .venv/bin/python benchmarks/prefill_breakdown.py --cells 1x32,1x512,4x512 --dtype float32
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_common import command_line, cpu_ops_served_by, describe_machine, emit_table, machine_info, model_and_vocab

FIRST_ORDINARY_TOKEN_ID = 17  # SmolLM2's special tokens are 0-16


@dataclass
class Cell:
    num_seqs: int
    prompt_len: int

    @property
    def tokens(self) -> int:
        return self.num_seqs * self.prompt_len

    def __str__(self) -> str:
        return f"{self.num_seqs}x{self.prompt_len}"


def parse_cells(parser, text: str) -> list[Cell]:
    cells = []
    for part in text.split(","):
        try:
            n, length = (int(x) for x in part.strip().lower().split("x"))
        except ValueError:
            parser.error(f"--cells takes comma-separated SEQSxTOKENS like 1x512,4x256, got {part!r}")
        if n < 1 or length < 1:
            parser.error(f"--cells: sequences and tokens must be >= 1, got {part!r}")
        cells.append(Cell(n, length))
    return cells


class GemmTimer:
    """Wraps `onednn_linear.linear` (the module attribute the linear layers call): while `active`,
    every call's wall time, its shapes and its weights are kept for the current step."""

    def __init__(self) -> None:
        from fp8serve.kernels import onednn_linear

        self.module = onednn_linear
        self.inner = onednn_linear.linear
        self.active = False
        self.calls: list[tuple] = []  # (x shape, x dtype, weight, bias, packed)
        self.seconds = 0.0

    def __enter__(self) -> GemmTimer:
        inner = self.inner

        def timed(x, weight, bias=None, packed=None):
            if not self.active:
                return inner(x, weight, bias, packed=packed)
            t = time.perf_counter()
            out = inner(x, weight, bias, packed=packed)
            self.seconds += time.perf_counter() - t
            self.calls.append((tuple(x.shape), x.dtype, weight, bias, packed))
            return out

        self.module.linear = timed
        return self

    def __exit__(self, *exc) -> None:
        self.module.linear = self.inner

    def reset(self) -> None:
        self.calls, self.seconds = [], 0.0


class OpTimer:
    """Stands in for torch.ops.fp8serve (see bench_common.cpu_ops_served_by): while `active`, each
    op call's wall time is added to `seconds[op]` and counted in `calls[op]`."""

    def __init__(self, ops) -> None:
        self._ops = ops
        self.active = False
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def reset(self) -> None:
        self.seconds, self.calls = {}, {}

    def __getattr__(self, name: str):
        target = getattr(self._ops, name)
        if not self.active or not callable(target):
            return target

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = target(*args, **kwargs)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
            self.calls[name] = self.calls.get(name, 0) + 1
            return out

        return timed


def replay_alone(calls: list[tuple], repeats: int) -> float:
    """Median seconds of the recorded GEMM calls run back to back, in order, on their own weights;
    one input tensor of random values per distinct shape (values do not change a GEMM's time)."""
    from fp8serve.kernels import onednn_linear

    g = torch.Generator().manual_seed(0)
    inputs = {}
    for shape, dtype, *_ in calls:
        if (shape, dtype) not in inputs:
            inputs[(shape, dtype)] = torch.randn(shape, generator=g).to(dtype)
    work = [(inputs[(shape, dtype)], w, b, p) for shape, dtype, w, b, p in calls]

    def run() -> None:
        for x, w, b, p in work:
            onednn_linear.linear(x, w, b, packed=p)

    run()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def linear_params(model: torch.nn.Module) -> int:
    """Weights of the decoder's linear layers (what a token's linear FLOPs multiply)."""
    from fp8serve.layers.linear import MergedLinear

    return sum(m.input_size * m.output_size for m in model.modules() if isinstance(m, MergedLinear))


def time_cell(engine, cell: Cell, vocab: int, warmup: int, repeats: int, timer: GemmTimer,
              op_timer: OpTimer | None = None) -> dict:
    from fp8serve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(cell.tokens)
    steps, gemm_s, calls, ops_s = [], [], [], []
    op_seconds: dict[str, list[float]] = {}
    op_calls: dict[str, int] = {}
    for i in range(warmup + repeats):
        for _ in range(cell.num_seqs):
            ids = torch.randint(FIRST_ORDINARY_TOKEN_ID, vocab, (cell.prompt_len,), generator=g).tolist()
            engine.add_request(None, {"prompt_token_ids": ids}, sp)
        gc.collect()
        timer.reset()
        timer.active = i >= warmup
        if op_timer is not None:
            op_timer.reset()
            op_timer.active = i >= warmup
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        timer.active = False
        if op_timer is not None:
            op_timer.active = False
        if len(outs) != cell.num_seqs or engine.has_unfinished_requests():
            raise RuntimeError(f"cell {cell}: the prompts did not all prefill in one step "
                               f"({len(outs)} of {cell.num_seqs} finished); raise --max-num-batched-tokens")
        if i >= warmup:
            steps.append(dt)
            gemm_s.append(timer.seconds)
            calls = timer.calls
            if op_timer is not None:
                ops_s.append(sum(op_timer.seconds.values()))
                for name, sec in op_timer.seconds.items():
                    op_seconds.setdefault(name, []).append(sec)
                op_calls = dict(op_timer.calls)
    return {"step_s": statistics.median(steps), "gemm_s": statistics.median(gemm_s), "calls": calls,
            "ops_s": statistics.median(ops_s) if ops_s else 0.0,
            # per op: the median over the timed steps (0 where a step did not call it)
            "ops": {name: statistics.median(v + [0.0] * (len(steps) - len(v))) for name, v in op_seconds.items()},
            "op_calls": op_calls}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--cells", default="1x1,1x8,1x32,1x128,1x512,2x256,8x256,1x1024,4x512",
                   help="SEQSxTOKENS cells, each prefilled in one step (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per cell (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per cell, median (default: %(default)s)")
    p.add_argument("--output", type=Path, default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    cells = parse_cells(p, args.cells)
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.output is not None and not args.output.parent.is_dir():
        p.error(f"--output: directory {args.output.parent} does not exist")

    from fp8serve import LLM

    model, vocab = model_and_vocab(args.model)
    longest = max(c.prompt_len for c in cells)
    budget = max(c.tokens for c in cells)
    llm = LLM(model=str(model), dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_model_len=longest + 1,
              max_num_batched_tokens=max(budget, 2048), max_num_seqs=max(128, max(c.num_seqs for c in cells)),
              device="cpu", seed=0)
    engine = llm.llm_engine
    # Eager prefills: a recorded prefill forward (engine/prefill_capture.py) calls its ops
    # directly, past the timers below; prefill_capture.py's own benchmark times that.
    engine.model_runner.prefill_captures.enabled = False
    # Every row through every layer, as the "linear" FLOPs count (with the last layer past attention
    # on the last rows only, those rows take the decode kernels: last_layer_pruning.py times that).
    engine.model_runner.prune_last_layer = False
    params = linear_params(engine.model_runner.model)

    lines = [f"# fp8serve prefill breakdown — {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}",
             f"command: {command_line(argv)}"]
    lines += describe_machine(machine_info())
    lines += [f"model: {model}, --dtype {args.dtype}, --kv-cache-dtype {args.kv_cache_dtype}; linear weights "
              f"{params / 1e6:.1f} M; medians of {args.repeats} steps after {args.warmup}",
              "",
              "| cell | tokens | step ms | us / token | linear GFLOP/s | GEMM calls | GEMM ms in step | GEMM GFLOP/s "
              "in step | GEMM ms alone | in step / alone | rest of step ms | C++ ops ms in step | outside GEMMs and "
              "ops ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    from fp8serve.kernels.cpu_ops import load_cpu_ops

    real_ops = load_cpu_ops()
    op_timer = OpTimer(real_ops) if real_ops is not None else None
    per_op: list[tuple[Cell, dict, dict]] = []
    # Without the C++ ops (no compiler) there is nothing to time: the engine runs torch's paths.
    serving = cpu_ops_served_by(op_timer) if op_timer is not None else contextlib.nullcontext()
    with GemmTimer() as timer, serving:
        for cell in cells:
            r = time_cell(engine, cell, vocab, args.warmup, args.repeats, timer, op_timer)
            step_ms = 1e3 * r["step_s"]
            gflops = 2.0 * params * cell.tokens / r["step_s"] / 1e9
            row = [str(cell), str(cell.tokens), f"{step_ms:.1f}", f"{1e6 * r['step_s'] / cell.tokens:.0f}",
                   f"{gflops:.0f}"]
            if r["calls"]:
                flops = sum(2.0 * math.prod(shape) * w.shape[0] for shape, _, w, _, _ in r["calls"])
                alone = replay_alone(r["calls"], args.repeats)
                row += [str(len(r["calls"])), f"{1e3 * r['gemm_s']:.1f}", f"{flops / r['gemm_s'] / 1e9:.0f}",
                        f"{1e3 * alone:.1f}", f"{r['gemm_s'] / alone:.2f}", f"{step_ms - 1e3 * r['gemm_s']:.1f}"]
            else:
                row += ["0", "-", "-", "-", "-", "-"]
            gemm_ms = 1e3 * r["gemm_s"] if r["calls"] else 0.0
            if op_timer is not None:
                row += [f"{1e3 * r['ops_s']:.1f}", f"{step_ms - gemm_ms - 1e3 * r['ops_s']:.1f}"]
                per_op.append((cell, r["ops"], r["op_calls"]))
            else:
                row += ["-", "-"]
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], file=sys.stderr, flush=True)
    lines += ["", "GEMM: calls through fp8serve.kernels.onednn_linear.linear (timed inside the step by a "
              "wrapper); alone: the same calls replayed back to back after the step (median of --repeats). "
              "C++ ops: calls of torch.ops.fp8serve ops in the step (each timed by a stand-in for the ops "
              "object); outside GEMMs and ops: the step less both (Python, torch's small ops, dispatch)."]
    if per_op:
        lines += ["", "C++ ops in each cell's step: ms (median over the timed steps) and calls per step, "
                  "largest first", "", "| cell | op | ms | calls |", "|---|---|---|---|"]
        for cell, ops, op_calls in per_op:
            for name, sec in sorted(ops.items(), key=lambda kv: -kv[1]):
                lines.append(f"| {cell} | {name} | {1e3 * sec:.2f} | {op_calls.get(name, 0)} |")
    emit_table(lines, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
