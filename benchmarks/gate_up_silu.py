#!/usr/bin/env python
"""The MLP's gate_up projection and SiLU-and-mul as one kernel against the two steps, where the
engine runs a tiled GEMM under float32 compute or the packed GEMV under bf16 compute:
  --weights bf16 (default): a bf16 checkpoint, 3 or more rows: `bf16_tiled_gemm_silu_and_mul`
    against `bf16_tiled_gemm`, then `silu_and_mul`;
  --weights bf16-compute: a bf16 checkpoint under bf16 compute (AVX512-BF16 CPUs), 13-256 rows:
    `dense_gemv_packed_silu_and_mul` against `dense_gemv_packed`, then `silu_and_mul`;
  --weights fp8: an FP8 checkpoint (e4m3 weights, one scale per output row), 25 or more rows:
    `fp8_tiled_gemm_silu_and_mul` against `fp8_tiled_gemm`, then `silu_and_mul`.

1. Ops: --layers gate_up weights of --shape (default: the default model's 30, 576 -> 2 x 1536;
   bf16 packed as the engine packs them, or e4m3 codes; each distinct, so every call reads its
   weight from memory as a step does) at each --rows, the fused kernel and the two steps alternating (ABBA), medians of --rounds; and
   whether both give the same bits.
2. Engine steps: two engines on the default model (--weights fp8: its FP8 checkpoint, written once
   as single_stream.py writes it), one with the gated form, one with every MLP
   sent through the two steps (its gate_up layers' `apply_silu_and_mul` answering None), in
   alternating rounds: prefill steps of one --prefill-len prompt (the module tree: recorded
   prefill forwards off in both), and greedy decode steps at each --batch-sizes (recorded decode
   forwards on, as served). Both must produce the same tokens.

    .venv/bin/python benchmarks/gate_up_silu.py
    .venv/bin/python benchmarks/gate_up_silu.py --rows 16,512 --batch-sizes 16 --rounds 4
    .venv/bin/python benchmarks/gate_up_silu.py --weights fp8 --rows 32,64,512 --batch-sizes 32,64
    .venv/bin/python benchmarks/gate_up_silu.py --weights bf16-compute --rows 16,64,256 --prefill-len 0
    .venv/bin/python benchmarks/gate_up_silu.py --weights fp8 --shape 2048x5632 --layers 4 \\
        --batch-sizes '' --prefill-len 0   # TinyLlama-1.1B's MLP (K = 2048: K blocks), ops only
"""

from __future__ import annotations

import argparse
import datetime as _dt
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    alternate, command_line, describe_machine, emit_table, machine_info, model_and_vocab, parse_sizes,
    record_as_a_warm_engine, time_greedy_decode, token_source,
)

HIDDEN, INTERMEDIATE, LAYERS = 576, 1536, 30  # SmolLM2-135M


def parse_shape(p: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    """--shape HIDDENxINTERMEDIATE -> (hidden, intermediate), both >= 1."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.strip().isdigit() and int(part) >= 1 for part in parts):
        p.error(f"--shape: expected HIDDENxINTERMEDIATE with two integers >= 1 (e.g. 576x1536), got {text!r}")
    return int(parts[0]), int(parts[1])


def gate_up_calls(weights: str, seed: int, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE,
                  layers: int = LAYERS):
    """(fused(x, i), unfused(x, i)) of the i-th of `layers` distinct gate_up weights of `weights`,
    each [2 * intermediate, hidden]."""
    from fp8serve.kernels import cpu_ops, gemv_packing
    from fp8serve.quantization.fp8 import FP8_E4M3, quantize_fp8

    ops = cpu_ops.load_cpu_ops()
    g = torch.Generator().manual_seed(seed)
    n = 2 * intermediate
    if weights in ("bf16", "bf16-compute"):
        packed = [gemv_packing.pack_gemv_weight((torch.randn(n, hidden, generator=g) * 0.05).bfloat16())
                  for _ in range(layers)]
        if weights == "bf16-compute":
            return (lambda x, i: ops.dense_gemv_packed_silu_and_mul(x, packed[i], n, None),
                    lambda x, i: cpu_ops.silu_and_mul(ops.dense_gemv_packed(x, packed[i], n, None)))
        return (lambda x, i: ops.bf16_tiled_gemm_silu_and_mul(x, packed[i], n, None),
                lambda x, i: cpu_ops.silu_and_mul(ops.bf16_tiled_gemm(x, packed[i], n, None)))
    codes, scales = [], []
    for _ in range(layers):
        w = torch.randn(n, hidden, generator=g) * 0.05
        scale = (w.abs().amax(dim=1) / FP8_E4M3.max_finite).float()
        codes.append(quantize_fp8(w / scale[:, None], 1.0, FP8_E4M3))
        scales.append(scale)
    return (lambda x, i: ops.fp8_tiled_gemm_silu_and_mul(x, codes[i], scales[i], None),
            lambda x, i: cpu_ops.silu_and_mul(ops.fp8_tiled_gemm(x, codes[i], scales[i], None)))


def ops_table(weights: str, rows: list[int], rounds: int, seed: int, hidden: int = HIDDEN,
              intermediate: int = INTERMEDIATE, layers: int = LAYERS) -> list[str]:
    fused_op, two_step_op = gate_up_calls(weights, seed, hidden, intermediate, layers)
    g = torch.Generator().manual_seed(seed + 1)
    lines = ["| rows | two steps ms | fused ms | speedup | same bits |", "|---|---|---|---|---|"]
    for m in rows:
        x = torch.randn(m, hidden, generator=g)
        if weights == "bf16-compute":
            x = x.bfloat16()

        def two_steps():
            t = time.perf_counter()
            for i in range(layers):
                two_step_op(x, i)
            return time.perf_counter() - t

        def fused():
            t = time.perf_counter()
            for i in range(layers):
                fused_op(x, i)
            return time.perf_counter() - t

        two_steps(), fused()  # warm-up
        res = alternate({"two": two_steps, "fused": fused}, rounds)
        same = all(torch.equal(fused_op(x, i), two_step_op(x, i)) for i in range(min(3, layers)))
        lines.append(f"| {m} | {1e3 * res['two']:.2f} | {1e3 * res['fused']:.2f} | {res['two'] / res['fused']:.3f}x "
                     f"| {'yes' if same else 'NO'} |")
    return lines


def unfuse(engine) -> int:
    """Sends every gate_up layer of `engine` through the two steps; returns how many."""
    count = 0
    for name, module in engine.model_runner.model.named_modules():
        if name.endswith("gate_up_proj"):
            module.quant_method = _TwoSteps(module.quant_method)
            count += 1
    return count


class _TwoSteps:
    """A linear method as given, but without its gated form."""

    def __init__(self, method) -> None:
        self._method = method

    def apply_silu_and_mul(self, layer, x, bias):
        return None

    def __getattr__(self, name: str):
        return getattr(self._method, name)


def time_prefill(engine, prompt: list[int], steps: int) -> tuple[float, int]:
    from fp8serve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times, token = [], -1
    for _ in range(steps + 1):  # the first untimed
        rid = engine.new_request_id()
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        if engine.has_unfinished_requests() or len(outs) != 1:
            raise RuntimeError("the prompt did not prefill in one step")
        token = outs[0].outputs[0].token_ids[0]
    return statistics.median(times[1:]), token


def side_by_side(engines: dict, label: str, rounds: int, time_one) -> str:
    """The table row of `time_one(engine) -> (seconds, tokens)` on both engines, alternating."""
    tokens = {}

    def side(name):
        def run():
            seconds, tokens[name] = time_one(engines[name])
            return seconds
        return run

    res = alternate({name: side(name) for name in engines}, rounds)
    two, fused = res["two steps"], res["fused"]
    same = tokens["two steps"] == tokens["fused"]
    return f"| {label} | {1e3 * two:.2f} | {1e3 * fused:.2f} | {two / fused:.3f}x | {'yes' if same else 'NO'} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="12,16,64,512", help="activation rows of the ops table ('' to skip it)")
    p.add_argument("--batch-sizes", default="16,64", help="decode batch sizes of the engine table ('' to skip)")
    p.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill row (0 to skip)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of each decode request")
    p.add_argument("--steps", type=int, default=24, help="decode steps per generation")
    p.add_argument("--prefills", type=int, default=3, help="timed prefill steps per round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", choices=("bf16", "fp8", "bf16-compute"), default="bf16",
                   help="the weights of the fused kernel: a bf16 checkpoint's (float32 compute: the tiled GEMM; "
                        "bf16-compute: the packed GEMV), or an FP8 checkpoint's e4m3 codes")
    p.add_argument("--model", default=None,
                   help="a bf16 checkpoint directory (default: the built-in model; --weights fp8: its FP8 "
                        "checkpoint is written once and run)")
    p.add_argument("--shape", default=f"{HIDDEN}x{INTERMEDIATE}",
                   help="HIDDENxINTERMEDIATE of the ops table's weights (default: the default model's)")
    p.add_argument("--layers", type=int, default=LAYERS, help="distinct gate_up weights of the ops table")
    p.add_argument("--output", type=Path, help="also write the report (markdown) here")
    args = p.parse_args(argv)
    hidden, intermediate = parse_shape(p, args.shape)
    rows = parse_sizes(p, "--rows", args.rows, allow_empty=True)
    batches = parse_sizes(p, "--batch-sizes", args.batch_sizes, allow_empty=True)
    for flag in ("prompt_len", "steps", "prefills", "rounds", "layers"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.prefill_len < 0:
        p.error(f"--prefill-len must be >= 0, got {args.prefill_len}")
    if args.output is not None and not args.output.parent.is_dir():
        p.error(f"--output: directory {args.output.parent} does not exist")

    from fp8serve.kernels import cpu_ops, fp8_linear_ops

    if args.weights == "bf16" and not cpu_ops.bf16_tiled_gemm_built():
        p.error("bf16_tiled_gemm is not built here (it needs the C++ kernels with AVX2 and FMA)")
    ops = cpu_ops.load_cpu_ops()
    if args.weights == "bf16-compute" and (ops is None or not bool(ops.dense_gemv_has_packed())):
        p.error("dense_gemv_packed is not built here (it needs the C++ kernels with AVX512-BF16)")
    if args.weights == "fp8" and not fp8_linear_ops.tiled_gemm_enabled():
        p.error(f"fp8_tiled_gemm does not run here (it needs the C++ kernels with AVX2, FMA and F16C and no "
                f"AVX-512, or {fp8_linear_ops.TILED_GEMM_ENV}=1): nothing takes its gated form")
    lines = [f"# fp8serve gate_up + SiLU fused — {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}",
             f"command: {command_line(argv)}"]
    lines += describe_machine(machine_info())
    if rows:
        lines += ["", f"## Ops: {args.layers} {args.weights} gate_up weights {hidden} -> 2 x {intermediate} from "
                  f"memory, medians of {args.rounds} ABBA rounds (ms per pass of all {args.layers})", ""]
        lines += ops_table(args.weights, rows, args.rounds, args.seed, hidden, intermediate, args.layers)
    if batches or args.prefill_len:
        from fp8serve import LLM
        from fp8serve.kernels import gemv_packing

        model, _ = model_and_vocab(args.model)
        if args.weights == "fp8":
            from single_stream import fp8_checkpoint

            model = fp8_checkpoint(args.model, None)  # the one single_stream.py writes for the same --model
        longest = max([args.prefill_len, args.prompt_len + args.steps + 2])
        compute = "bfloat16" if args.weights == "bf16-compute" else "float32"
        engines = {}
        for name in ("two steps", "fused"):
            llm = LLM(model=str(model), dtype=compute, max_model_len=longest + 8, device="cpu", seed=0,
                      max_num_batched_tokens=max(2048, longest + 8), max_num_seqs=max([64, *batches]))
            engine = llm.llm_engine
            record_as_a_warm_engine(engine)
            gate_up = [m for n, m in engine.model_runner.model.named_modules() if n.endswith("gate_up_proj")]
            if args.weights != "fp8" and (not gate_up or getattr(gate_up[0], "weight_gemv_packed", None) is None):
                p.error(f"the engine made no packed bf16 copies here ({gemv_packing.PACKED_WEIGHTS_ENV}=1 forces "
                        "them): nothing takes the gated form")
            if args.weights == "fp8" and (not gate_up or getattr(gate_up[0], "fp8_backend", None) != "cpu_kernel"):
                p.error(f"{model}'s gate_up layers do not run the FP8 CPU kernels: nothing takes the gated form")
            if name == "two steps":
                unfuse(engine)
            engines[name] = engine
        lines += ["", f"## Engine steps ({model}, {compute} compute on the {args.weights.split('-')[0]} weights), "
                  f"medians of {args.rounds} alternating rounds", "", "| step | two steps ms | fused ms | speedup | same tokens |",
                  "|---|---|---|---|---|"]
        if args.prefill_len:
            prompt = token_source(engines["fused"], "text")(args.prefill_len, random.Random(args.seed))
            for e in engines.values():
                e.model_runner.prefill_captures.enabled = False
            lines.append(side_by_side(engines, f"prefill 1 x {args.prefill_len}", args.rounds,
                                      lambda e: time_prefill(e, prompt, args.prefills)))
        for b in batches:
            rng = random.Random(args.seed + b)
            draw = token_source(engines["fused"], "text")
            prompts = [draw(args.prompt_len, rng) for _ in range(b)]
            lines.append(side_by_side(engines, f"decode batch {b}", args.rounds,
                                      lambda e, prompts=prompts: time_greedy_decode(e, prompts, args.steps)))
    emit_table(lines, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
